"""Hostile peers for the shared-memory tests: a standalone script run as a real process.

``python shm_attack.py <scenario> <namespace> <uid-of-victims>`` speaks the wire protocol by
hand (u32 length + msgpack array, no omnikv import, so it starts fast and can run as another
uid with a bare interpreter). It prints ``ready`` once the attack is in place, then a result
line when it has one, and exits on EOF of stdin. Scenarios:

* ``sigbus``: connect to every peer, answer a ``want`` with an unsealed memfd as its pool and an
  offer, then truncate the memfd to 0 (a receiver that mapped it would die of SIGBUS).
* ``wants``: connect and send blocking wants until disconnected; prints how many were sent.
* ``fds``: connect and pass descriptors until disconnected; prints how many were sent.
* ``vanish``: connect, then exit without answering on the first ``want`` (a sender killed while
  a probe asks it).
* ``mute``: connect and read every message, answering none (a hung peer); prints ``asked`` on
  the first ``want``.
* ``squat``: (run as another uid) bind the namespace's legacy lock name and a listener under the
  victims' prefix whose backlog is full, and pre-create the victims' lock directory if absent.

:class:`Attacker` runs one from a test and stops it by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

_LEN = struct.Struct("<I")


def prefix(namespace: str, uid: int) -> str:
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:24]
    return f"omnikv-shm/{uid}/{digest}/"


def peers(pfx: str) -> list[str]:
    out = []
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith("@" + pfx) and parts[3] == "00010000":
                out.append(parts[7][1:])
    return out


def frame(msg: list[Any]) -> bytes:
    import msgpack

    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def connect(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(b"\0" + name.encode())
    s.sendall(frame(["hello", "attacker", os.getpid()]))
    return s


def read_msgs(s: socket.socket) -> list[list[Any]]:
    import msgpack

    data = s.recv(65536)
    if not data:
        raise EOFError
    out = []
    while len(data) >= 4:
        (n,) = _LEN.unpack_from(data)
        out.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
        data = data[4 + n :]
    return out


def batches(pfx: str) -> Iterator[tuple[socket.socket, list[list[Any]]]]:
    """Connect to the namespace's first peer, say ``ready``, then yield each batch of messages
    it sends with the socket, until it disconnects."""
    s = connect(peers(pfx)[0])
    print("ready", flush=True)
    while True:
        try:
            msgs = read_msgs(s)
        except (EOFError, OSError):
            return
        yield s, msgs


def sigbus(pfx: str) -> str:
    for s, msgs in batches(pfx):
        for m in msgs:
            if m[0] != "want":
                continue
            fd = os.memfd_create("omnikv-attack", os.MFD_CLOEXEC)
            os.ftruncate(fd, 1 << 20)
            pool = frame(["pool", 1, 1 << 20])
            try:
                socket.send_fds(s, [pool], [fd])
                s.sendall(frame(["offer", m[1], 1, 0, 4096, "raw"]))
            except OSError:
                return "disconnected"
            finally:
                os.ftruncate(fd, 0)
                os.close(fd)
    return "disconnected"


def vanish(pfx: str) -> str:
    for _s, msgs in batches(pfx):
        if any(m[0] == "want" for m in msgs):
            os._exit(0)  # gone with the question unanswered, as after SIGKILL
    return "disconnected"


def mute(pfx: str) -> str:
    wants = 0
    for _s, msgs in batches(pfx):
        came = sum(1 for m in msgs if m[0] == "want")
        if came and not wants:
            print("asked", flush=True)
        wants += came
    return f"wants {wants}"


def flood(pfx: str, what: str) -> str:
    s = connect(peers(pfx)[0])
    print("ready", flush=True)
    r, w = os.pipe()
    sent = 0
    try:
        while sent < 200_000:
            if what == "wants":
                s.sendall(frame(["want", sent + 1, f"k{sent}@0_1", True]))
            else:
                socket.send_fds(s, [frame(["hello", "x", 1])], [r])
            sent += 1
    except OSError:
        return f"disconnected after {sent}"
    finally:
        os.close(r)
        os.close(w)
    return f"still connected after {sent}"


def squat(pfx: str, victim_uid: int) -> str:
    held = []
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lock.bind(b"\0" + (pfx + "lock").encode())  # the lock name omnikv once used
    held.append(lock)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(b"\0" + (pfx + "0-squatter").encode())
    lst.listen(0)
    held.append(lst)
    for _ in range(64):  # fill the backlog: later connects would block forever
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        if c.connect_ex(b"\0" + (pfx + "0-squatter").encode()):
            c.close()
            break
        held.append(c)
    tmp = f"/tmp/omnikv-{victim_uid}"
    with contextlib.suppress(OSError):
        os.mkdir(tmp, 0o777)
    print("ready", flush=True)
    sys.stdin.read()
    return "done"


def main() -> None:
    scenario, namespace, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pfx = prefix(namespace, uid)
    if scenario == "sigbus":
        result = sigbus(pfx)
    elif scenario in ("wants", "fds"):
        result = flood(pfx, scenario)
    elif scenario == "vanish":
        result = vanish(pfx)
    elif scenario == "mute":
        result = mute(pfx)
    else:
        result = squat(pfx, uid)
    print(result, flush=True)
    sys.stdin.read()


class Attacker:
    """One attacker process (optionally as another uid); stopped by PID."""

    def __init__(self, namespace: str, scenario: str, user: int | None = None) -> None:
        exe = sys.executable
        if user is not None and os.path.exists("/usr/bin/python3"):
            exe = "/usr/bin/python3"  # readable by any uid
        self.proc = subprocess.Popen(
            [exe, __file__, scenario, namespace, str(os.getuid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            user=user,
        )

    def ready(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def result(self) -> str:
        return self.ready()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


if __name__ == "__main__":
    main()
