"""Which senders a shared-memory namespace has had: one record file per sending connector.

A connector that sends (its role is ``"sender"``, or it made its pool) keeps a record in
``<private dir>/senders/`` (:func:`omnikv.connectors.shm.wire.private_dir`: writable by our uid
only): an empty file named ``<namespace digest>.<instance>`` that it holds locked (``flock``) for
as long as it lives. The kernel drops the lock when the process dies, however it dies, so a
record whose lock can be taken belongs to a sender that went away without closing (killed,
crashed); ``close()`` removes the record first. A record's mtime is its owner's last sign of
life: its creation, or a put (refreshed at most every :data:`TOUCH_EVERY_S`).

Receivers read the records only to explain a receive that found nothing (:func:`scan`): which
senders of the namespace live, which died and how long ago they were last alive, including
senders that died before the receiver started. Nothing in a record is read: its name says whose
it is, its lock whether its owner lives, its mtime when it last did.

Bounded: a record of a dead sender last alive more than :data:`GONE_KEEP_S` ago is removed by
any scan that meets it, and every new record sweeps the whole directory first, so the directory
holds at most the senders that live plus those that died within that time; one scan looks at
:data:`MAX_SCAN` names at most. A record that cannot be made (no private directory, a full disk)
only makes the explanations poorer: the connector logs it at DEBUG and works on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass

from omnikv.connectors.shm.wire import private_dir

__all__ = [
    "GONE_KEEP_S",
    "MAX_SCAN",
    "TOUCH_EVERY_S",
    "SenderRecord",
    "SenderSeen",
    "record_path",
    "scan",
    "sweep",
]

#: A dead sender's record is kept this long after its last sign of life (then removed).
GONE_KEEP_S = 3600.0
#: A live sender refreshes its record's mtime at most this often (on a put).
TOUCH_EVERY_S = 60.0
#: Names one scan or sweep looks at, at most.
MAX_SCAN = 1024
#: A half-made record (``.<name>.tmp``) older than this belongs to a process that died making it.
_TMP_KEEP_S = 60.0
_DIR = "senders"


@dataclass(frozen=True)
class SenderSeen:
    """One record of a namespace: whose it is, whether its owner lives, and how long ago it was
    last alive (seconds; for a live one, since its last put or its start)."""

    instance: str
    alive: bool
    idle_s: float

    @property
    def pid(self) -> int:
        """The owner's pid (an instance name starts with it: ``<pid>-<random>``)."""
        head = self.instance.split("-", 1)[0]
        return int(head) if head.isdigit() else -1


def _digest(prefix: str) -> str:
    """The namespace's digest in its socket prefix (``omnikv-shm/<uid>/<digest>/``)."""
    return prefix.rstrip("/").rsplit("/", 1)[-1]


def _directory() -> str:
    """The records' directory, made ``0700`` inside the private directory; ``OSError`` if it is
    not a plain directory of ours."""
    path = os.path.join(private_dir(), _DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory")
    return path


def record_path(prefix: str, instance: str) -> str:
    """Where the record of the connector ``instance`` of the namespace of ``prefix`` lives
    (whether or not it exists); ``OSError`` as :class:`SenderRecord`."""
    return os.path.join(_directory(), f"{_digest(prefix)}.{instance}")


class SenderRecord:
    """This connector's record while it sends (see the module docstring).

    Made by the connector when it becomes a sender (``OSError`` if it cannot be: the caller logs
    it and goes on); :meth:`touch` on its puts; :meth:`close` on close (idempotent, never raises).
    """

    def __init__(self, prefix: str, instance: str) -> None:
        self.path = record_path(prefix, instance)
        directory, name = os.path.split(self.path)
        sweep(directory)
        tmp = os.path.join(directory, f".{name}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)
        try:
            # locked before it has its name: a scan never sees a live record unlocked
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fd: int | None = fd
        self._touched = time.monotonic()

    def touch(self) -> None:
        """A sign of life (called by every put): refresh the mtime at most every
        :data:`TOUCH_EVERY_S`; one clock read otherwise. Never raises."""
        now = time.monotonic()
        fd = self._fd
        if fd is None or now - self._touched < TOUCH_EVERY_S:
            return
        self._touched = now
        with contextlib.suppress(OSError):
            os.utime(fd)

    def close(self) -> None:
        """Remove the record, then drop the lock (a clean close leaves nothing). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(fd)


def _inspect(directory: str, name: str, now: float) -> SenderSeen | None:
    """The record ``name``, or ``None`` when it is gone, not a record, or removed here (a dead
    owner last alive over :data:`GONE_KEEP_S` ago; a stale half-made record)."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not st.st_nlink:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None if name.startswith(".") else SenderSeen(name, True, now - st.st_mtime)
        if not os.fstat(fd).st_nlink:
            return None  # its owner closed (unlinked, then unlocked) while we looked
        idle = now - st.st_mtime
        if idle > (_TMP_KEEP_S if name.startswith(".") else GONE_KEEP_S):
            with contextlib.suppress(OSError):
                os.unlink(path)  # while we hold its lock: nobody can be taking it over
            return None
        return None if name.startswith(".") else SenderSeen(name, False, idle)
    except OSError:
        return None
    finally:
        os.close(fd)


def sweep(directory: str) -> None:
    """Remove dead records past :data:`GONE_KEEP_S` (any namespace) and stale half-made ones."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(directory))[:MAX_SCAN]:
            _inspect(directory, name, now)


def scan(prefix: str, *, skip: str = "") -> list[SenderSeen]:
    """The records of the namespace of ``prefix`` (but ``skip``, the caller's own instance),
    live and dead, with their instance names; ``[]`` when the directory cannot be read.
    Called when a receive found nothing (never on a request's path); removes what is stale."""
    head = f"{_digest(prefix)}."
    now = time.time()
    try:
        directory = _directory()
        names = sorted(n for n in os.listdir(directory) if n.startswith(head))[:MAX_SCAN]
    except OSError:
        return []
    found = (_inspect(directory, name, now) for name in names)
    out = [SenderSeen(s.instance[len(head) :], s.alive, s.idle_s) for s in found if s]
    return [s for s in out if s.instance != skip]
