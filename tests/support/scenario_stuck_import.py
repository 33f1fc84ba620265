"""A scenario module whose import never ends (``tests/test_scenario_runner.py``): it stands for
a child starved while importing, and its stacks must still come before the bound."""

from __future__ import annotations

import threading

threading.Event().wait(timeout=600)  # a module-level wait: the import itself hangs


def scenario_never_reached() -> dict[str, bool]:
    return {"reached": True}
