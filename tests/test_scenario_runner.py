"""The tests' scenario runner (``support.mooncake_peers.run_scenario``) keeps its own promises.

* A scenario whose bound does not fit in what is left of the test's pytest-timeout is refused
  before it starts (its bound would never fire; a slow run would end as a bare pytest timeout,
  without the scenario's output).
* A scenario that overruns its bound prints its threads' stacks before it is killed, and the
  failure carries them: the report says what it was waiting on, also when the child never got
  past its imports (the dump is armed before anything is imported).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from support.mooncake_peers import SCENARIO_REPORT_S, run_scenario


def scenario_waits_on_an_event() -> dict[str, bool]:
    """Waits on an event nobody sets (in a function whose name the stacks must show)."""
    never = threading.Event()
    return {"set": never.wait(timeout=600)}


def scenario_quick() -> dict[str, int]:
    return {"answer": 42}


@pytest.mark.timeout(60)
def test_a_scenario_within_the_tests_timeout_runs() -> None:
    res = run_scenario(__file__, "scenario_quick", timeout=60 - SCENARIO_REPORT_S - 5)
    assert res["answer"] == 42


@pytest.mark.timeout(60)
def test_a_scenario_bound_above_the_tests_timeout_is_refused_before_it_starts() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"does not fit .* pytest\.mark\.timeout\(") as err:
        run_scenario(__file__, "scenario_quick", timeout=60)
    assert "scenario_quick" in str(err.value)
    assert time.monotonic() - t0 < 1.0  # refused, not run


@pytest.mark.slow  # waits out a 40 s bound
@pytest.mark.timeout(90)
def test_an_overrunning_scenario_reports_its_stacks() -> None:
    # the bound leaves the child time to start (a fresh interpreter importing numpy and omnikv)
    # before the stacks come, 8 s before the bound
    with pytest.raises(AssertionError, match="overran") as err:
        run_scenario(__file__, "scenario_waits_on_an_event", timeout=40)
    report = str(err.value)
    assert "scenario_waits_on_an_event" in report, report
    assert "Thread 0x" in report or "Current thread 0x" in report, report


@pytest.mark.slow  # waits out a 30 s bound
@pytest.mark.timeout(80)
def test_a_scenario_stuck_in_its_imports_reports_its_stacks() -> None:
    module = Path(__file__).parent / "support" / "scenario_stuck_import.py"
    with pytest.raises(AssertionError, match="overran") as err:
        run_scenario(str(module), "scenario_never_reached", timeout=30)
    report = str(err.value)
    assert "Thread 0x" in report or "Current thread 0x" in report, report
    assert "scenario_stuck_import.py" in report, report  # the import that hung
