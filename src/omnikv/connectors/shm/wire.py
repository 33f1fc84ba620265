"""Control plane of :mod:`omnikv.connectors.shm.connector`: names, keys, framing, discovery.

Listeners live in the Linux *abstract* Unix-socket namespace, which has no files: a name
disappears with the last socket bound to it, so a SIGKILLed process leaves nothing behind. Names
are ``omnikv-shm/<uid>/<namespace hash>/<instance>`` (a random instance, so nobody can take ours
in advance); peers find each other by listing ``/proc/net/unix`` and accept only peers of their
own uid (``SO_PEERCRED``), since abstract sockets carry no file permissions and any user can bind
any name. The join lock is therefore an ``flock`` on a file in a directory only our uid can write
(:func:`private_dir`), removed by its holder after use.

Frames are ``<u32 little-endian length><msgpack array>``; the first element is the message type.
Never pickled. Frames are bounded (:data:`MAX_FRAME`) and validated by the reader.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import socket
import stat
import struct
import tempfile
import time
from typing import Any

import msgpack

from omnikv.polling import wait_writable

__all__ = [
    "MAX_FRAME",
    "MAX_KEY_CHARS",
    "DescriptorFlood",
    "FrameReader",
    "NamespaceLock",
    "connect_peer",
    "discover",
    "encode_frame",
    "escape_key",
    "namespace_prefix",
    "peer_uid",
    "private_dir",
    "recv_nowait",
]

MAX_FRAME = 64 * 1024
MAX_KEY_CHARS = 1024
_LEN = struct.Struct("<I")
_SAFE = re.compile(r"[A-Za-z0-9_.:=+-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_.:=+-]*")


def escape_key(part: str) -> str:
    """Escape one key component: characters outside ``[A-Za-z0-9_.:=+-]`` become ``%XX``.

    Injective (``%`` is escaped too) so distinct keys never collide, and free of ``@`` (the edge
    separator) so a request id can be recovered from a transport key. Raises ``ValueError`` for a
    non-string.
    """
    if not isinstance(part, str):
        raise ValueError(f"key components must be str, got {type(part).__name__}")
    if _ALL_SAFE.fullmatch(part):
        return part  # the common case, without a per-character loop
    out: list[str] = []
    for ch in part:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def transport_key(key: str, from_stage: Any, to_stage: Any) -> str:
    """``"<key>@<from>_<to>"`` with every part escaped; ``ValueError`` if empty or too long."""
    if not key:
        raise ValueError("empty key")
    out = f"{escape_key(key)}@{escape_key(str(from_stage))}_{escape_key(str(to_stage))}"
    if len(out) > MAX_KEY_CHARS:
        raise ValueError(
            f"key too long: {len(out)} characters after escaping (max {MAX_KEY_CHARS})"
        )
    return out


def namespace_prefix(namespace: str) -> str:
    """The abstract-socket name prefix of a namespace for this uid (fixed length, no NUL)."""
    digest = hashlib.sha256(namespace.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"omnikv-shm/{os.getuid()}/{digest}/"


def encode_frame(msg: list[Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ValueError(f"control message of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded messages. ``feed`` raises ``ValueError`` on garbage."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[list[Any]]:
        """The messages ``data`` completes. Whole frames are decoded straight from ``data``
        (a memoryview of a reused read buffer is fine: nothing refers to it afterwards); only
        an incomplete tail is kept until the next call."""
        buf = self._buf
        src: bytes | bytearray | memoryview = data
        if buf:
            buf += data
            src = buf
        out: list[list[Any]] = []
        pos, end = 0, len(src)
        while end - pos >= 4:
            (n,) = _LEN.unpack_from(src, pos)
            if n > MAX_FRAME:
                raise ValueError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
            if end - pos - 4 < n:
                break
            body = src[pos + 4 : pos + 4 + n]
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
            if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
                raise ValueError("control frame is not a typed msgpack array")
            out.append(msg)
            pos += 4 + n
        if src is buf:
            del buf[:pos]
        elif pos < end:
            buf += src[pos:]
        return out


_FD = struct.Struct("i")


class DescriptorFlood(OSError):
    """A peer passed more descriptors in one message than the reader accepts (its link is
    dropped; the kernel closed those that did not fit, :func:`recv_nowait` the others)."""


def recv_nowait(sock: socket.socket, buf: memoryview, maxfds: int) -> tuple[int, list[int]]:
    """One non-blocking read into ``buf``: ``(bytes read, descriptors)``; ``BlockingIOError``
    when nothing is there.

    ``socket.recv_fds`` ignores its ``flags`` argument (CPython 3.10-3.12), so it cannot be
    asked not to block; this passes ``MSG_DONTWAIT`` itself. The caller's buffer is reused
    from read to read: ``recvmsg`` would allocate one of the full size per call, which above
    glibc's mmap threshold (128 KiB) costs an mmap, an mremap and a munmap every time. Only
    ``SCM_RIGHTS`` data is taken (whole descriptors), at most ``maxfds`` (the kernel closes
    what did not fit).
    """
    nbytes, ancdata, flags, _addr = sock.recvmsg_into(
        [buf],
        socket.CMSG_LEN(maxfds * _FD.size),
        socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC,
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _FD.size
            fds.extend(v for (v,) in _FD.iter_unpack(payload[:whole]))
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise DescriptorFlood(f"more than {maxfds} descriptors in one message")
    return nbytes, fds


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def discover(prefix: str) -> set[str]:
    """Listening abstract names starting with ``prefix`` (read from ``/proc/net/unix``)."""
    found: set[str] = set()
    want = "@" + prefix
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                # Num RefCount Protocol Flags Type St Inode Path; listeners have St 01, Flags 10000
                if len(parts) >= 8 and parts[7].startswith(want) and parts[3] == "00010000":
                    found.add(parts[7][1:])
    except OSError:
        return found
    return found


def abstract(name: str) -> bytes:
    return b"\0" + name.encode()


def private_dir() -> str:
    """A directory only this uid can write: the first usable of ``$XDG_RUNTIME_DIR/omnikv``,
    ``<tmp>/omnikv-<uid>`` and ``~/.cache/omnikv`` (created ``0700``). A candidate that exists but
    is a symlink, not a directory, owned by another uid or open to others is skipped, so no other
    user can pre-create it and hold our locks. Raises ``OSError`` if none is usable."""
    uid = os.getuid()
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        candidates.append(os.path.join(runtime, "omnikv"))
    candidates.append(os.path.join(tempfile.gettempdir(), f"omnikv-{uid}"))
    candidates.append(os.path.join(os.path.expanduser("~"), ".cache", "omnikv"))
    for path in candidates:
        with contextlib.suppress(FileExistsError, FileNotFoundError, PermissionError):
            os.makedirs(path, mode=0o700)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            return path
    raise OSError(f"no private directory for shared-memory locks among {candidates}")


class NamespaceLock:
    """A node-wide mutex per namespace and uid: an ``flock`` on a file in :func:`private_dir`.

    Used only around a connector's join (bind listener, list peers, connect), so that two
    connectors starting at once never miss or double-connect each other. The kernel releases it
    when its holder dies. Only processes of our uid can reach the file, so another user cannot
    hold it; a same-uid holder holds it for a few milliseconds. Acquiring retries every
    millisecond until ``timeout`` (then ``TimeoutError``).
    """

    def __init__(self, prefix: str, timeout: float = 10.0) -> None:
        digest = prefix.rstrip("/").rsplit("/", 1)[-1]
        self._path = os.path.join(private_dir(), f"ns-{digest}.lock")
        self._timeout = timeout
        self._fd: int | None = None

    def __enter__(self) -> NamespaceLock:
        end = time.monotonic() + self._timeout
        while True:
            fd = self._try_lock()
            if fd is not None:
                self._fd = fd
                return self
            if time.monotonic() >= end:
                raise TimeoutError(f"namespace lock busy for {self._timeout}s")
            time.sleep(0.001)

    def _try_lock(self) -> int | None:
        """The locked descriptor of the file now at the path, or ``None`` if busy or replaced."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self._path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(self._path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass  # busy, or the holder removed the file after we opened it: try again
        os.close(fd)
        return None

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            # remove the file while holding the lock (nothing is left behind); a waiter that
            # opened it meanwhile sees the inode change and starts over
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = None


def connect_peer(name: str, timeout: float) -> socket.socket | None:
    """Connect to the listener ``name`` without blocking past ``timeout`` seconds.

    A listener whose backlog is full (``EAGAIN``) or that does not complete the connection in
    time is skipped (``None``): a squatter cannot stall a join. The caller checks the peer's
    credentials before trusting anything on the socket.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        err = s.connect_ex(abstract(name))
        if err == errno.EINPROGRESS:
            writable = wait_writable(s.fileno(), max(timeout, 0.0))
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if writable else errno.ETIMEDOUT
        if err:
            raise OSError(err, os.strerror(err))
        s.setblocking(True)
        return s
    except OSError:
        s.close()
        return None
