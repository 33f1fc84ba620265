"""The control messages of :mod:`omnikv.connectors.shm.connector`: checked, then handed to the part
that acts.

Every message is a msgpack array (``wire``) whose first element names it:

* ``hello(instance, pid[, "sender"])``: a peer's name; ``"sender"`` when it sends (repeated when
  it starts sending), so a receive can tell a sender that went away;
* ``want(wid, key, block[, "probe"])``: a reader asks for ``key`` (``probe``: only what the
  sender holds, to explain a miss; answered with ``miss``, never an offer);
* ``offer(wid, token, offset, size, kind[, "ack"])``, ``release(token)``, ``return(token)``,
  ``cancel(wid)``, ``miss(wid[, answer])``, ``evict(token)``: the hand-over of one payload
  (``store``, ``recv``); ``"ack"``: the sender takes a verdict on it;
* ``verdict(token, key, verdict[, reason])``: a reader's verdict on a payload it was offered
  with ``"ack"`` (``acks``): checked by :func:`~omnikv.connectors.shm.acks.parse_verdict`
  (bounded key and reason, a known verdict) and accepted only from the link that offer went to;
* ``pool(id, size)`` with the pool's descriptor: the sender's pool, once per connection;
* ``cleanup(pattern[, id, mode])`` and ``cleaned(id, n)``: a namespace-wide cleanup
  (``cleanup``).

Trailing arguments a receiver does not know are ignored, so a peer of an older version still
understands the newer forms. Leading integer arguments are checked (non-negative ``int``, not
``bool``) before anything acts; a malformed or unknown message raises ``ValueError`` and the
mesh drops that peer.
"""

from __future__ import annotations

import os
from typing import Any

from omnikv.connectors.shm.acks import SentVerdicts, parse_verdict
from omnikv.connectors.shm.cleanup import Cleanups
from omnikv.connectors.shm.diag import MAX_KEYS_SHOWN
from omnikv.connectors.shm.mesh import Link, Mesh
from omnikv.connectors.shm.pool import PeerPool
from omnikv.connectors.shm.recv import RecvSide
from omnikv.connectors.shm.store import SendStore

__all__ = ["Dispatcher"]

# leading non-negative int arguments of each control message
_INT_ARGS = {"offer": 4, "release": 1, "return": 1, "cancel": 1, "miss": 1, "evict": 1}
_INT_ARGS.update({"want": 1, "pool": 2, "cleaned": 2, "verdict": 1})


class Dispatcher:
    """Checks and dispatches the messages of one connector's peers (see the module docstring).

    Called by the connector's ``on_message`` for every message, in the thread that read it
    (the I/O thread, a waiter leading the mesh, a put pumping it, or the sending thread for
    the local link); holds no state of its own.
    """

    def __init__(
        self,
        mesh: Mesh,
        store: SendStore,
        recv: RecvSide,
        cleanups: Cleanups,
        verdicts: SentVerdicts | None = None,
    ) -> None:
        self._mesh = mesh
        self._store = store
        self._recv = recv
        self._cleanups = cleanups
        self._verdicts = verdicts

    def on_message(self, link: Link, msg: list[Any]) -> None:
        """Validate and dispatch one control message (``ValueError`` drops the peer)."""
        kind, args = msg[0], msg[1:]
        n = _INT_ARGS.get(kind, 0)
        if len(args) < n:
            raise ValueError(f"malformed {kind!r} message")
        for v in args[:n]:  # a loop, not any(<generator>): this runs for every message
            if type(v) is not int or v < 0:  # bool is not int here
                raise ValueError(f"malformed {kind!r} message")
        self._dispatch(link, kind, args)

    def _dispatch(self, link: Link, kind: str, args: list[Any]) -> None:
        if kind == "want":
            if len(args) < 3 or not isinstance(args[1], str):
                raise ValueError("want key must be a string")
            if len(args) > 3 and args[3] == "probe":
                answer = self._store.published_summary(args[1], MAX_KEYS_SHOWN)
                self._mesh.send(link, [["miss", args[0], answer]])
            else:
                self._store.on_want(link, args[0], args[1], bool(args[2]))
        elif kind == "offer":
            self._recv.on_offer(link, ["offer", *args])
        elif kind in ("release", "return"):
            self._store.on_release(link, args[0], republish=kind == "return")
        elif kind == "cancel":
            self._store.on_cancel(link, args[0])
        elif kind == "miss":
            self._recv.on_miss(link, args[0], args[1] if len(args) > 1 else None)
        elif kind == "evict":
            self._recv.on_evict(link, args[0])
        elif kind == "verdict":
            token, key, verdict, reason = parse_verdict(args)
            if self._verdicts is not None:
                self._verdicts.on_verdict(link, token, key, verdict, reason)
        else:
            self._dispatch_peer(link, kind, args)

    def _dispatch_peer(self, link: Link, kind: str, args: list[Any]) -> None:
        """The messages about the peer itself and the namespace (not one payload)."""
        if kind == "pool":
            self._on_pool(link, args[0], args[1])
        elif kind == "hello":
            link.peer = str(args[0]) if args else link.peer
            link.sender = link.sender or (len(args) > 2 and args[2] == "sender")
        elif kind == "cleanup":
            if args and isinstance(args[0], str):
                self._cleanups.on_cleanup(link, args)
        elif kind == "cleaned":
            self._cleanups.on_cleaned(link, args[0], args[1])
        else:
            raise ValueError(f"unknown control message {kind!r}")

    @staticmethod
    def _on_pool(link: Link, pool_id: int, size: int) -> None:
        fd = link.take_fd()
        if link.pool is not None:
            os.close(fd)
            raise ValueError("a second pool on one connection")
        try:
            link.pool = PeerPool(pool_id, fd, size)
        except OSError as exc:
            raise ValueError(f"cannot map the peer's pool: {exc}") from exc
        link.sender = True
