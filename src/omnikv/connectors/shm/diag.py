"""Why a shared-memory wait found nothing: the namespace's senders and what they hold.

Used by ``SharedMemoryConnector.explain_miss``, once per receive that timed out (never on a
request's path). Three sources, each bounded:

* the links: which connected peers send (they said so in their ``hello``, or passed their pool);
* :class:`SenderWatch`: the senders this connector saw go (the last :data:`MAX_LOST`), with
  when;
* the namespace's records (:mod:`omnikv.connectors.shm.registry`): senders that live, and
  senders that died without closing, also before this connector started;

plus the answers to a probe (``RecvSide.probe``): how many payloads each peer holds unconsumed,
the newest of their keys, and whether the key waited for arrived after all.

The sender is *gone* (``peer_gone``) when none lives in the namespace (other than this connector)
and one that did went away: it closed, or its process died. Otherwise the wait timed out, and the
report says which senders were seen and which keys wait at them (a key put under another name or
stage edge shows up there).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.base import MissReport
from omnikv.connectors.shm.mesh import Link
from omnikv.connectors.shm.registry import SenderSeen, scan

__all__ = ["MAX_KEYS_SHOWN", "MAX_LOST", "SenderWatch", "held_size", "probe_answer"]

#: Senders a connector remembers having seen go.
MAX_LOST = 16
#: Keys of unconsumed payloads named in one report (and asked of each peer).
MAX_KEYS_SHOWN = 8


@dataclass(frozen=True)
class _Lost:
    """A sender this connector saw go: its instance name, pid and when (monotonic)."""

    instance: str
    pid: int
    at: float


def probe_answer(info: Any) -> tuple[int, list[str], bool]:
    """A peer's probe answer, checked: (payloads it holds unconsumed, up to
    :data:`MAX_KEYS_SHOWN` of their keys, whether it holds the key asked for). Whatever does not
    have the expected shape counts as nothing (a peer of an older version answers without it)."""
    if not isinstance(info, dict):
        return 0, [], False
    n = info.get("n")
    keys = info.get("keys")
    keys = [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []
    count = n if type(n) is int and n >= 0 else len(keys)
    return count, keys[:MAX_KEYS_SHOWN], info.get("has") is True


def held_size(answers: Iterable[tuple[Link, Any]]) -> int | None:
    """The size of the asked key at the first peer whose probe answer says it holds it
    (``SharedMemoryConnector.probe``); ``None`` when none does. A peer that holds it without
    naming a usable size (an older version) gives 0."""
    for _link, info in answers:
        if probe_answer(info)[2]:
            size = info.get("size")
            return size if type(size) is int and size >= 0 else 0
    return None


def _pids(instances: Iterable[str]) -> str:
    return ", ".join(f"pid {SenderSeen(i, True, 0.0).pid}" for i in sorted(instances))


class SenderWatch:
    """What one connector knows of its namespace's senders (see the module docstring).

    :meth:`lost` is called by the connector when a link goes (I/O thread); :meth:`explain` by a
    receive that timed out. Thread-safe.
    """

    def __init__(self, prefix: str, namespace: str, instance: str) -> None:
        self.prefix = prefix
        self.namespace = namespace
        self.instance = instance
        self._lock = threading.Lock()
        self._lost: deque[_Lost] = deque(maxlen=MAX_LOST)

    def lost(self, link: Link) -> None:
        """A link went: remember it if the peer was a sender."""
        if link.sender:
            with self._lock:
                self._lost.append(_Lost(link.peer, link.pid, time.monotonic()))

    def explain(
        self, key: str, links: list[Link], answers: list[tuple[Link, Any]], *, waited_s: float
    ) -> MissReport:
        """The report for a wait for ``key`` that found nothing: ``links`` are the connected
        peers, ``answers`` the probe's (link, answer) pairs, gathered for ``waited_s``. A peer
        of ``links`` that did not answer by then is named as such: what it holds is unknown,
        never reported as nothing. Never raises."""
        held = [(link, *probe_answer(info)) for link, info in answers]
        answered = {link for link, _info in answers}
        silent = [link for link in links if link not in answered]
        live = {link.peer for link in links if link.sender}
        live |= {link.peer for link, n, _k, _h in held if n and not link.local}
        records = scan(self.prefix, skip=self.instance)
        live |= {r.instance for r in records if r.alive}
        gone = self._gone(live, {r.instance: r for r in records if not r.alive})
        parts = [
            f"{len(live)} sender(s) alive in namespace {self.namespace!r} ({_pids(live)})"
            if live
            else f"no sender alive in namespace {self.namespace!r}"
        ]
        if gone:
            parts.append("gone: " + ", ".join(gone))
        elif not live:
            parts.append("none was seen there")
        parts.append(_unconsumed(key, held, bool(silent)))
        if silent:
            parts.append(
                f"{len(silent)} of {len(links)} peer(s) did not answer within"
                f" {waited_s * 1000:.0f} ms ({', '.join(f'pid {link.pid}' for link in silent)}):"
                " what they hold is unknown"
            )
        return MissReport("; ".join(parts), peer_gone=not live and bool(gone))

    def _gone(self, live: set[str], dead: dict[str, SenderSeen]) -> list[str]:
        """The senders seen go that do not live now, newest first, each with how and when."""
        now = time.monotonic()
        with self._lock:
            lost = [s for s in reversed(self._lost) if s.instance not in live]
        out, named = [], set()
        for s in lost:
            if s.instance in named:
                continue
            named.add(s.instance)
            how = "died without closing" if s.instance in dead else "closed or disconnected"
            out.append(f"pid {s.pid} ({how}, {now - s.at:.1f}s ago)")
        for r in sorted(dead.values(), key=lambda r: r.idle_s):
            if r.instance not in named:
                out.append(f"pid {r.pid} (died without closing; last alive {r.idle_s:.1f}s ago)")
        return out


def _unconsumed(key: str, held: list[tuple[Link, int, list[str], bool]], partial: bool) -> str:
    """What the peers that answered hold unconsumed: how many payloads, the newest keys, and
    whether ``key`` is among them (it arrived after the wait's deadline). ``partial``: some
    peers did not answer, so "nothing" is said of those that did only."""
    total = sum(n for _link, n, _keys, _has in held)
    if any(has for *_rest, has in held):
        return f"{key} arrived after the deadline ({total} payload(s) unconsumed there)"
    if not total:
        return (
            "no payload is waiting at the peers that answered"
            if partial
            else "no payload is waiting there"
        )
    keys = [k for _link, _n, ks, _has in held for k in ks][:MAX_KEYS_SHOWN]
    more = f" (+{total - len(keys)} more)" if total > len(keys) else ""
    return f"{total} payload(s) wait there unconsumed, not {key}: {', '.join(keys)}{more}"
