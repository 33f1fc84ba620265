"""A sending process that exits with unconsumed shared-memory payloads says so on stderr at the
default log level, once, with what it waits for, how long and how to skip the wait."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SENDER = textwrap.dedent(
    """
    import sys
    from omnikv.connectors.shm import SharedMemoryConnector

    ns = sys.argv[1]
    for i in range(2):  # two connectors linger: one line between them
        conf = {"namespace": ns, "linger_s": 0.3, "role": "sender", "pool_size_bytes": 1 << 20}
        c = SharedMemoryConnector(conf)
        ok, _size, _meta = c.put("0", "1", f"k{i}", {"kv": list(range(100))})
        assert ok
        globals()[f"c{i}"] = c  # kept alive until the exit
    """
)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_an_exit_that_lingers_says_so_once_on_stderr(namespace: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SENDER, namespace],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "linger_s" in line]
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert "the process exit waits up to 0.3s (linger_s)" in line
    assert "for receivers to take 1 unconsumed payload(s)" in line
    assert "set linger_s to 0" in line
