"""The child interpreter of a scenario (:func:`support.mooncake_peers.run_scenario` runs
``python tests/support/scenario_child.py <module file> <function> <json params>``).

It arms the stack dump (``OMNIKV_SCENARIO_STACKS_S`` seconds after start) before it imports
anything beyond the standard library: on a starved host importing torch, omnikv and the
scenario's module can take most of a scenario's bound, and a dump armed after them would never
come. An overrun then shows where the child was, imports included.
"""

from __future__ import annotations

import faulthandler
import os
import sys


def main(argv: list[str]) -> int:
    stacks_s = os.environ.get("OMNIKV_SCENARIO_STACKS_S")
    if stacks_s:
        faulthandler.dump_traceback_later(float(stacks_s))
    from support.mooncake_peers import scenario_main

    return scenario_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
