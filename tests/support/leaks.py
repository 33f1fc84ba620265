"""Where a served secret must not show: a process group's command lines and a server's log.

Used by the served tests (tests/integrations/vllm_connector/test_vllm_serve.py,
tests/test_readme_vllm_recipe.py) against real vLLM servers.
"""

from __future__ import annotations

import os

__all__ = ["assert_secret_hidden", "group_cmdlines"]

#: vLLM's INFO line with the server's arguments that differ from the defaults.
ARGS_LINE = b"non-default args"


def group_cmdlines(pgid: int) -> dict[int, bytes]:
    """The command line of every live process in process group ``pgid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read()
        except OSError:  # exited meanwhile
            continue
    return out


def assert_secret_hidden(secret: bytes, *, pgid: int, log: bytes, servers: int) -> None:
    """``secret`` is nowhere in ``log`` and on no command line of group ``pgid`` (which holds at
    least ``servers`` + 1 processes: the servers and their engine cores); ``log`` holds
    ``servers`` vLLM "non-default args" lines, each showing the connector settings
    (``auth_secret_file``), so that a secret given inline would be seen there."""
    assert len(secret) >= 16, "not a secret worth looking for"
    args_lines = [line for line in log.splitlines() if ARGS_LINE in line]
    assert len(args_lines) == servers, args_lines
    assert all(b"auth_secret_file" in line for line in args_lines), args_lines
    assert secret not in log, "the secret is in a server's log"
    cmdlines = group_cmdlines(pgid)
    assert len(cmdlines) > servers, cmdlines
    assert [pid for pid, cmd in cmdlines.items() if secret in cmd] == [], "on a command line"
