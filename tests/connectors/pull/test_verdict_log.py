"""Verdicts an outsider sends cost the log one burst and a summary, not a line each (issue 39,
"lesser": 2,000 unauthenticated ``verdict`` messages wrote 2,000 WARNING lines)."""

from __future__ import annotations

import logging

import pytest

from omnikv.connectors.counters import Counters
from omnikv.connectors.pull.verdicts import VERDICT_COUNTER_NAMES, SentVerdicts


def test_ignored_verdicts_are_counted_each_and_logged_a_few_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counters = Counters(VERDICT_COUNTER_NAMES)
    book = SentVerdicts(60.0, counters)
    caplog.set_level(logging.WARNING, logger="omnikv.connectors.pull.verdicts")
    for i in range(2000):
        assert not book.receive(f"k{i}", b"stranger", "refused", "forged")
    assert counters.snapshot()["acks_ignored"] == 2000
    lines = [r for r in caplog.records if r.name == "omnikv.connectors.pull.verdicts"]
    assert 1 <= len(lines) <= 10, len(lines)
