"""Fixtures of the receive-path tests: ``senders``, the sending-stage processes a test starts
(:class:`support.stage_sender.SenderProc`), each killed by PID at teardown."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from support.stage_sender import SenderProc


@pytest.fixture
def senders() -> Iterator[list[SenderProc]]:
    started: list[SenderProc] = []
    try:
        yield started
    finally:
        for s in started:
            with contextlib.suppress(AssertionError):
                s.kill()
