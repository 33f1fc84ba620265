"""``cleanup`` and ``cleanup_prefix`` of :mod:`omnikv.connectors.shm.connector`, across the
namespace.

Payloads live in their sender's pool, so a cleanup asked anywhere (a receiver, an orchestrator)
is carried out by every connector of the namespace: the asker drops its own matches and sends
``cleanup(pattern, id, mode)`` to every peer; each drops its matches and answers
``cleaned(id, n)``. The asker waits for the answers at most its timeout (``get_timeout_s``) and
counts what went. A peer of an older version drops by the request rule and does not answer (it
is not counted, and the wait ends at the timeout). Only published payloads go: one already
offered to a reader is that reader's to release.

Modes: ``"request"``, the reference's rule (:func:`~omnikv.connectors.base.matches_request`:
the key is the id, starts with ``id_`` or ends with ``_id``), and ``"prefix"``: the caller's key
starts with the prefix (any stage edge). Keys are compared escaped (``wire.escape_key``
maps each character on its own, so a key starts with a prefix exactly when their escapes do).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnikv.connectors.base import matches_request
from omnikv.connectors.shm.mesh import Link, Mesh
from omnikv.connectors.shm.store import SendStore
from omnikv.connectors.shm.wire import escape_key
from omnikv.deadline import remaining

__all__ = ["MODES", "Cleanups", "matcher"]

logger = logging.getLogger(__name__)

MODES = ("request", "prefix")


def matcher(pattern: str, mode: str) -> Callable[[str], bool]:
    """Whether a transport key (``<key>@<from>_<to>``, escaped) is one ``pattern`` names."""
    escaped = escape_key(pattern)
    if mode == "prefix":
        return lambda key: key.rsplit("@", 1)[0].startswith(escaped)
    return lambda key: matches_request(key, escaped)


@dataclass
class _Ask:
    """One cleanup this connector asked for: the peers yet to answer, what they dropped."""

    pending: set[Link] = field(default_factory=set)
    dropped: int = 0


class Cleanups:
    """The cleanups one connector asks for and answers (see the module docstring).

    :meth:`run` is called by ``cleanup`` / ``cleanup_prefix`` (any thread); :meth:`on_cleanup`,
    :meth:`on_cleaned` and :meth:`on_link_gone` by the connector's message dispatch.
    """

    def __init__(self, mesh: Mesh, store: SendStore) -> None:
        self._mesh = mesh
        self._store = store
        self._cond = threading.Condition()
        self._asks: dict[int, _Ask] = {}
        self._next_id = 1

    def run(self, pattern: str, mode: str, timeout: float) -> int:
        """Drop what ``pattern`` names here and at every peer; how many payloads went (peers
        that did not answer within ``timeout`` seconds are not counted)."""
        dropped = self.drop_here(pattern, mode)
        links = self._mesh.links(local=False)
        if not links:
            return dropped
        with self._cond:
            ask_id, self._next_id = self._next_id, self._next_id + 1
            ask = self._asks[ask_id] = _Ask(set(links))
        for link in links:
            if not self._mesh.send(link, [["cleanup", pattern, ask_id, mode]]):
                with self._cond:
                    ask.pending.discard(link)
        self._mesh.leadership.resume()  # the answers are read by the I/O thread
        deadline = time.monotonic() + timeout
        with self._cond:
            while ask.pending and remaining(deadline) > 0:
                self._cond.wait(remaining(deadline))
            del self._asks[ask_id]
            return dropped + ask.dropped

    def drop_here(self, pattern: str, mode: str) -> int:
        """Drop this connector's published payloads that ``pattern`` names; how many."""
        labels = self._store.drop_matching(matcher(pattern, mode))
        for label in labels:
            logger.debug("cleanup dropped %s", label)
        return len(labels)

    def on_cleanup(self, link: Link, pattern: str, ask_id: int | None, mode: Any) -> None:
        """A peer's ``cleanup(pattern[, id, mode])`` (checked by ``protocol``): drop, and answer
        when it asked with an id. Without a known mode: the request rule. An empty prefix
        drops nothing (``cleanup_prefix`` refuses one; it would name every payload)."""
        rule = mode if isinstance(mode, str) and mode in MODES else "request"
        dropped = self.drop_here(pattern, rule) if pattern or rule != "prefix" else 0
        if ask_id is not None:
            self._mesh.send(link, [["cleaned", ask_id, dropped]])

    def on_cleaned(self, link: Link, ask_id: int, dropped: int) -> None:
        """A peer's answer to one of our cleanups."""
        with self._cond:
            ask = self._asks.get(ask_id)
            if ask is not None and link in ask.pending:
                ask.pending.discard(link)
                ask.dropped += dropped
                self._cond.notify_all()

    def on_link_gone(self, link: Link) -> None:
        """A peer went: no answer will come from it."""
        with self._cond:
            for ask in self._asks.values():
                ask.pending.discard(link)
            self._cond.notify_all()
