"""Where the repository's parts are, for tests that run its programs or read its files."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
SRC = REPO / "src"
EXAMPLES = REPO / "examples"
SCRIPTS = REPO / "scripts"
