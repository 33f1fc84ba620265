"""Make the next descriptors a process opens be numbered past ``select``'s ``FD_SETSIZE``.

A process that holds many connections gets descriptor numbers of 1024 and more for its newest
sockets; code that waits with ``select.select`` fails on them. Tests open what they test inside
:func:`descriptors_past`, so its sockets get such numbers deterministically.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator

__all__ = ["FD_SETSIZE", "descriptors_past"]

FD_SETSIZE = 1024


@contextlib.contextmanager
def descriptors_past(number: int = FD_SETSIZE) -> Iterator[int]:
    """Fill every free descriptor below ``number`` (with ``/dev/null``, close-on-exec: spawned
    children inherit none), after raising the soft ``RLIMIT_NOFILE`` to room for ``number``
    plus 1,000 (``pytest.skip`` when the hard limit is lower); yields the next free number.
    On exit the filler descriptors are closed and the limit restored."""
    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = number + 1000
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {want}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fillers: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if fd >= number:
                os.close(fd)
                break
            fillers.append(fd)
        yield fd
    finally:
        for fd in fillers:
            os.close(fd)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
