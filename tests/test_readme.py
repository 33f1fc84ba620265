"""README.md's quick start runs as written, and every relative link of the docs resolves.

The quick start is two files, the ``python`` blocks after the lines ``**sender.py**`` and
``**receiver.py**``. They run here as two real processes over shared memory, and what they print
must be the output README.md shows, so a change to the API or to the output that the README
does not follow fails here. The one change made to the code: its ``namespace`` gets a unique
suffix, so that two runs of this test on one machine never meet.

Links: every ``[text](target)`` outside code in README.md and docs/*.md whose target is a
relative path must name an existing file, and an ``#anchor`` must name a heading of the file it
points to (GitHub's heading anchors).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from support import paths

ROOT = paths.REPO
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NAMESPACE = '"namespace": "quickstart"'
#: Both processes together: on a busy two-core machine importing torch alone takes seconds.
RUN_TIMEOUT_S = 240.0


# --------------------------------------------------------------------------------------------
# Reading README.md
# --------------------------------------------------------------------------------------------
def fenced_block_after(text: str, label: str, lang: str = "") -> str:
    """The first fenced block opened by exactly ```` ```lang ```` after the first line that starts
    with ``label``; fails the test naming what is missing."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(label)]
    assert starts, f"README.md has no line starting with {label!r}"
    fence = "```" + lang
    i = starts[0] + 1
    while i < len(lines) and lines[i].strip() != fence:
        i += 1
    assert i < len(lines), f"README.md has no {fence} block after {label!r}"
    body: list[str] = []
    for line in lines[i + 1 :]:
        if line.strip() == "```":
            return "\n".join(body) + "\n"
        body.append(line)
    raise AssertionError(f"the {fence} block after {label!r} is not closed")


def with_namespace(code: str, namespace: str) -> str:
    """``code`` with the quick start's namespace replaced by ``namespace``."""
    assert code.count(NAMESPACE) == 1, f"expected {NAMESPACE} once in:\n{code}"
    return code.replace(NAMESPACE, f'"namespace": "{namespace}"')


# --------------------------------------------------------------------------------------------
# The quick start, as two processes
# --------------------------------------------------------------------------------------------
def _start(script: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, script.name],
        cwd=script.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], deadline: float) -> tuple[str, str]:
    """Wait for ``proc`` until ``deadline`` (monotonic); its stdout and stderr."""
    try:
        return proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL to this process's PID
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {RUN_TIMEOUT_S:.0f} s\n{out}\n{err}")


@pytest.mark.slow
@pytest.mark.timeout(int(RUN_TIMEOUT_S) + 60)
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    text = README.read_text(encoding="utf-8")
    namespace = f"quickstart-{uuid.uuid4().hex[:12]}"
    sender = tmp_path / "sender.py"
    receiver = tmp_path / "receiver.py"
    for script in (sender, receiver):
        code = fenced_block_after(text, f"**{script.name}**", "python")
        script.write_text(with_namespace(code, namespace))
    expected = fenced_block_after(text, "Run them in either order").splitlines()

    deadline = time.monotonic() + RUN_TIMEOUT_S
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_start(receiver))  # waits up to its recv_timeout for the sender
        procs.append(_start(sender))
        recv_out, recv_err = _finish(procs[0], deadline)
        send_out, send_err = _finish(procs[1], deadline)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert procs[1].returncode == 0, f"sender.py exited {procs[1].returncode}:\n{send_err}"
    assert procs[0].returncode == 0, f"receiver.py exited {procs[0].returncode}:\n{recv_err}"
    printed = send_out.splitlines() + recv_out.splitlines()
    assert printed == expected, (
        "the quick start prints something else than README.md shows:\n"
        + "\n".join(printed)
        + f"\nsender stderr:\n{send_err}\nreceiver stderr:\n{recv_err}"
    )


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"\n]*\")?\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (their brackets are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, outside code."""
    return _LINK.findall(_prose(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, punctuation other
    than ``-`` and ``_`` dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """Each relative link of ``doc`` whose file or heading does not exist, with the reason."""
    problems = []
    for target in links(doc.read_text(encoding="utf-8")):
        if _SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text("utf-8")):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    return problems


def test_the_link_checker_sees_links_and_anchors() -> None:
    text = "# A title\n\n## Serving with `vllm serve`\n\nSee [x](docs/a.md#b) and `[y](z)`.\n"
    assert links(text) == ["docs/a.md#b"]
    assert anchors(text) == {"a-title", "serving-with-vllm-serve"}
    assert links("```\n[in](code)\n```\n[out](side)\n") == ["side"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (README.parent / t.partition("#")[0]).resolve()
        for t in links(README.read_text(encoding="utf-8"))
        if not _SCHEME.match(t)
    }
    missing = [d.name for d in DOCS[1:] if d.resolve() not in linked]
    assert missing == [], f"docs pages README.md does not link: {missing}"
