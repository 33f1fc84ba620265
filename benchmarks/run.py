"""Run omnikv's benchmarks from a checkout: ``python benchmarks/run.py {codec,shm,...,all} [opts]``.

The benchmarks themselves live in :mod:`omnikv.bench` so that the installed ``omnikv bench``
command runs the same code; this script is the entry point for people reading ``benchmarks/``.
Every benchmark measures, in one run, the machine's own ceiling (memcpy of the same bytes, the
raw engine call, gloo's own broadcast) and the reference-style path, discards warm-up, verifies
the data and prints medians with p10..p90 and p99.
"""

from __future__ import annotations

import sys

from omnikv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
