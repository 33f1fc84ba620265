"""``omnikv.polling``: waits on one descriptor, numbered past ``select``'s ``FD_SETSIZE`` too."""

from __future__ import annotations

import socket
import time

import pytest

from omnikv.polling import wait_readable, wait_writable
from support.fds import FD_SETSIZE, descriptors_past


@pytest.mark.timeout(30)
def test_waits_on_descriptors_past_fd_setsize() -> None:
    with descriptors_past():
        a, b = socket.socketpair()
        try:
            assert a.fileno() >= FD_SETSIZE and b.fileno() >= FD_SETSIZE
            t0 = time.monotonic()
            assert not wait_readable(a.fileno(), 0.05)
            assert time.monotonic() - t0 >= 0.045  # waited its timeout, not a busy return
            assert not wait_readable(a.fileno(), 0.0)
            assert wait_writable(a.fileno(), 0.0)
            b.sendall(b"x")
            assert wait_readable(a.fileno(), 5.0) and wait_readable(a.fileno(), None)
            assert wait_readable(a.fileno(), 1e12)  # past poll's C int: cut, no OverflowError
            assert a.recv(1) == b"x"
            b.close()  # end of stream counts as readable: the read that follows reports it
            assert wait_readable(a.fileno(), 5.0) and a.recv(1) == b""
        finally:
            a.close()
            b.close()


def test_a_sub_millisecond_wait_still_waits() -> None:
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        for _ in range(20):
            assert not wait_readable(a.fileno(), 0.0001)
        assert time.monotonic() - t0 >= 0.019  # each rounded up to a millisecond
