"""The connector choice page and the benchmarks' headline table: every figure comes with a
command that runs (a known benchmark, options it takes), and that command is the one
docs/benchmarks.md records the figure under; benchmarks/README.md lists every benchmark."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from omnikv.cli import BENCHES
from support import paths

DOCS = paths.REPO / "docs"
CHOICE = DOCS / "choosing-a-connector.md"
BENCH_DOC = DOCS / "benchmarks.md"
_COMMAND = re.compile(r"`((?:\.venv-vllm/bin/)?omnikv bench [^`]+)`")


def _table_commands(path: Path, heading: str) -> list[str]:
    """The commands in the last column of the table under ``heading`` in ``path``."""
    text = path.read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "omnikv" in line]
    assert rows, f"no table under {heading!r}"
    out = []
    for row in rows:
        found = _COMMAND.findall(row.rsplit("|", 2)[-2])
        assert found, row
        out.extend(found)
    return out


class _Parsed(Exception):
    pass


def _check_runs(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``command``'s benchmark exists and its options parse (the run itself stops there)."""
    argv = shlex.split(command)
    name, options = argv[argv.index("bench") + 1], argv[argv.index("bench") + 2 :]
    assert name in BENCHES, command
    try:
        module = importlib.import_module(f"omnikv.bench.{name}")
    except ImportError as exc:  # pragma: no cover - an engine missing here
        pytest.skip(f"{name}: {exc}")
    real_parse = argparse.ArgumentParser.parse_args

    def parse(self: argparse.ArgumentParser, args: object = None, ns: object = None) -> object:
        real_parse(self, options)  # exits 2 on an unknown option
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(_Parsed):
        module.main(options)


@pytest.mark.parametrize(
    "command", sorted(set(_table_commands(CHOICE, "## The figures to expect")))
)
def test_each_expected_figure_has_a_command_that_runs_and_is_recorded(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_runs(command, monkeypatch)
    recorded = BENCH_DOC.read_text(encoding="utf-8")
    assert command.split(" --only", maxsplit=1)[0] in recorded


@pytest.mark.parametrize("command", _table_commands(BENCH_DOC, "## Headline figures"))
def test_each_headline_command_runs(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_runs(command, monkeypatch)


def test_the_headline_table_has_one_row_per_benchmark() -> None:
    names = [
        shlex.split(c)[shlex.split(c).index("bench") + 1]
        for c in _table_commands(BENCH_DOC, "## Headline figures")
    ]
    assert sorted(set(names)) == sorted(BENCHES)


def test_benchmarks_readme_lists_every_benchmark_and_points_at_the_figures() -> None:
    text = (paths.REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(BENCHES)
    assert "docs/benchmarks.md#headline-figures" in text
    assert "README's benchmark table" not in text
