"""Size limits for the library code (issue 11): small classes and functions stay easy to change.

No class over 400 lines and no function over 60 lines anywhere in ``src/omnikv`` except the
benchmarks under ``src/omnikv/bench/``. A size counts every line from the ``def``/``class`` line
to the last line of its body (docstrings and comments included, decorators not).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "omnikv"
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(source: str, name: str) -> list[str]:
    """Every class or function in ``source`` over its limit, as ``name:line what is N lines``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        size = (node.end_lineno or node.lineno) - node.lineno + 1
        if size > limit:
            found.append(f"{name}:{node.lineno} {node.name} is {size} lines (limit {limit})")
    return found


def _library_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "bench" not in p.relative_to(SRC).parts)


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_oversized_class_or_function(path: Path) -> None:
    assert oversized(path.read_text(encoding="utf-8"), str(path.relative_to(SRC))) == []


def test_the_library_is_scanned() -> None:
    names = {p.name for p in _library_files()}
    assert {"manager.py", "sender.py", "receiver.py", "payload.py"} <= names


def test_limits_are_enforced_at_the_boundary() -> None:
    def fn(lines: int) -> str:
        return "def f():\n" + "".join(f"    x = {i}\n" for i in range(lines - 1))

    assert oversized(fn(MAX_FUNCTION_LINES), "ok.py") == []
    assert oversized(fn(MAX_FUNCTION_LINES + 1), "big.py") == [
        f"big.py:1 f is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]
    cls = "class C:\n" + "".join(f"    a{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert oversized(cls, "c.py") == [
        f"c.py:1 C is {MAX_CLASS_LINES + 1} lines (limit {MAX_CLASS_LINES})"
    ]
