"""The rate-limited log helper: at most ``burst`` lines per interval, then one summary line."""

from __future__ import annotations

import logging

import pytest

from omnikv._logging import DEFAULT_BURST, DEFAULT_INTERVAL_S, RateLimitedLog

pytestmark = pytest.mark.timeout(10)


def test_a_flood_writes_the_burst_then_one_summary_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("omnikv.test.flood"), burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="omnikv.test.flood"):
        for i in range(2000):
            log.warning("refused %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "refused 2"]
        assert log.suppressed == 1997
        now[0] = 10.0  # the next interval: one summary, then the line
        log.warning("refused %d", 2000)
    lines = [r.getMessage() for r in caplog.records[3:]]
    assert lines == [
        "1997 similar lines suppressed (at most 3 per 10 s are written)",
        "refused 2000",
    ]
    assert log.suppressed == 0


def test_a_disabled_level_costs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("omnikv.test.quiet"), burst=1)
    with caplog.at_level(logging.WARNING, logger="omnikv.test.quiet"):
        for _ in range(10):
            log.debug("nothing")
        log.warning("one")
    assert [r.getMessage() for r in caplog.records] == ["one"] and log.suppressed == 0


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("x"), burst=0)


_STRANGER = r"""
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
for _ in range(count):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"\xff" * 64)  # not a frame: rejected, the connection dropped
    try:
        s.recv(1)
    except OSError:
        pass
    s.close()
print("done", flush=True)
"""


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_flood_of_rejected_control_messages_writes_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stranger's process opens 2,000 connections to a Transfer Engine sender's control
    port and sends each a message that is not one: every one is rejected and counted, and the
    sender's log gets a few WARNING lines and a summary, not 2,000."""
    import subprocess
    import sys
    import time

    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector
    from support.pull_engine import free_base_port

    unavailable = _te_unavailable()
    if unavailable:
        pytest.skip(unavailable)
    base = free_base_port(1)
    cfg = {"host": "127.0.0.1", "zmq_port": base, "memory_pool_size": 16 << 20, "role": "sender"}
    sender = MooncakeTransferEngineConnector(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="omnikv"):
            proc = subprocess.run(
                [sys.executable, "-c", _STRANGER, str(base), "2000"],
                check=False,
                capture_output=True,
                text=True,
                timeout=150,
            )
            assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
            end = time.monotonic() + 20
            while sender.health().get("rejected_messages", 0) < 2000 and time.monotonic() < end:
                time.sleep(0.05)
        assert sender.health()["rejected_messages"] == 2000
        lines = [r for r in caplog.records if "rejected a control message" in r.getMessage()]
        assert lines
        for r in lines:  # at most the burst plus one summary line in any interval
            near = [o for o in lines if 0 <= o.created - r.created < DEFAULT_INTERVAL_S]
            assert len(near) <= DEFAULT_BURST + 1, [o.getMessage() for o in near]
    finally:
        sender.close()


def _te_unavailable() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"Mooncake Transfer Engine not installed: {exc}"
    return None
