"""Deadlines are absolute monotonic times made once from a timeout; bad timeouts name themselves."""

from __future__ import annotations

import math
import time

import pytest

from omnikv.deadline import deadline_after, remaining, validate_timeout


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, "soon", object()])
def test_a_bad_timeout_is_a_value_error_naming_the_parameter(bad: object) -> None:
    with pytest.raises(ValueError, match="recv_timeout"):
        deadline_after(bad, "recv_timeout")  # type: ignore[arg-type]


def test_none_means_no_deadline_and_zero_means_now() -> None:
    assert deadline_after(None) == math.inf and remaining(math.inf) == math.inf
    assert validate_timeout("2.5") == 2.5
    assert remaining(deadline_after(0)) == 0.0


def test_remaining_counts_down_and_never_goes_negative() -> None:
    deadline = deadline_after(10.0)
    assert 9.0 < remaining(deadline) <= 10.0
    assert remaining(time.monotonic() - 1.0) == 0.0
