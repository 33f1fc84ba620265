"""The rate-limited log helper: at most ``burst`` lines per interval, then one summary line."""

from __future__ import annotations

import logging

import pytest

from omnikv._logging import RateLimitedLog

pytestmark = pytest.mark.timeout(10)


def test_a_flood_writes_the_burst_then_one_summary_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("omnikv.test.flood"), burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="omnikv.test.flood"):
        for i in range(2000):
            log.warning("refused %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "refused 2"]
        assert log.suppressed == 1997
        now[0] = 10.0  # the next interval: one summary, then the line
        log.warning("refused %d", 2000)
    lines = [r.getMessage() for r in caplog.records[3:]]
    assert lines == [
        "1997 similar lines suppressed (at most 3 per 10 s are written)",
        "refused 2000",
    ]
    assert log.suppressed == 0


def test_a_disabled_level_costs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("omnikv.test.quiet"), burst=1)
    with caplog.at_level(logging.WARNING, logger="omnikv.test.quiet"):
        for _ in range(10):
            log.debug("nothing")
        log.warning("one")
    assert [r.getMessage() for r in caplog.records] == ["one"] and log.suppressed == 0


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("x"), burst=0)
