"""``omnikv`` command line: ``demo``, ``bench <name>``, ``inspect <file>``, ``doctor``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

BENCHES = ("codec", "shm", "manager", "dist", "prefetch", "mooncake", "nixl", "vllm")


def _bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: omnikv bench {{{','.join(BENCHES)},all}} [options]")
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    names = BENCHES if name == "all" else (name,)
    rc = 0
    for n in names:
        if n not in BENCHES:
            print(f"unknown benchmark {n!r}; known: {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        try:
            module = importlib.import_module(f"omnikv.bench.{n}")
        except ImportError as exc:
            print(f"benchmark {n!r} is unavailable: {exc}", file=sys.stderr)
            rc = rc or 1
            continue
        rc = module.main(rest) or rc
    return rc


def _inspect(path: str) -> int:
    from omnikv.payload import decode

    with open(path, "rb") as fh:
        raw = fh.read()
    data = decode(raw)
    blocks = data["layer_blocks"]
    summary = {
        "request_id": data["request_id"],
        "block_ids": data["block_ids"],
        "metadata": data["metadata"],
        "layers": [
            None if t is None else {"dtype": str(t.dtype), "shape": list(t.shape)}
            for t in blocks["key_cache"]
        ],
    }
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _doctor() -> int:
    import torch

    from omnikv.connectors.factory import OmniConnectorFactory

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"cuda available: {torch.cuda.is_available()}")
    for name in OmniConnectorFactory.list_connectors():
        try:
            OmniConnectorFactory.get_connector_class(name)
            status = "ok"
        except ImportError as exc:
            status = f"missing dependency: {exc}"
        print(f"connector {name}: {status}")
    try:
        from importlib.metadata import version

        hf = f"ok ({version('transformers')})"
    except ImportError:  # PackageNotFoundError is an ImportError
        hf = "not installed (pip install 'omnikv[transformers]')"
    print(f"integration transformers: {hf}")
    from omnikv.parallel import ParallelContext

    print(f"parallel state: {ParallelContext.default().source}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``omnikv`` script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="omnikv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="DEBUG logging")
    parser.add_argument("command", choices=["demo", "bench", "inspect", "doctor"])
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if ns.command == "bench":
        return _bench(ns.rest)
    if ns.command == "inspect":
        if len(ns.rest) != 1:
            parser.error("inspect takes one payload file")
        return _inspect(ns.rest[0])
    if ns.command == "doctor":
        return _doctor()
    from omnikv.demo.pipeline import main as demo_main

    return demo_main(ns.rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
