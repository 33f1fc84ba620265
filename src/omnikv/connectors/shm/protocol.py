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
  with ``"ack"`` (``acks``): a bounded key and reason, a known verdict, accepted only from the
  link that offer went to;
* ``pool(id, size)`` with the pool's descriptor: the sender's pool, once per connection;
* ``cleanup(pattern[, id, mode])`` and ``cleaned(id, n)``: a namespace-wide cleanup
  (``cleanup``).

Each message is a msgspec Struct here (:data:`MESSAGES`, decoded by :func:`parse_message`),
its limits the Struct's constraints: counts, ids, tokens, offsets and sizes are non-negative
``int`` (not ``bool``), keys, reasons and names bounded, the verdict one of its three values.
Nothing acts before the whole message passed; a malformed or unknown message raises
``ValueError`` and the mesh drops that peer. Trailing arguments a receiver does not know are
ignored, so a peer of an older version still understands the newer forms; a message built
from a Struct (:func:`as_message`) leaves absent optional fields out, so its bytes are those
of the list form every sender writes.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import UNSET, UnsetType

from omnikv.connectors.delivery import MAX_KEY_CHARS as MAX_VERDICT_KEY_CHARS
from omnikv.connectors.delivery import MAX_REASON_CHARS, Verdict
from omnikv.connectors.shm.acks import SentVerdicts
from omnikv.connectors.shm.cleanup import Cleanups
from omnikv.connectors.shm.diag import MAX_KEYS_SHOWN
from omnikv.connectors.shm.mesh import Link, Mesh
from omnikv.connectors.shm.pool import PeerPool
from omnikv.connectors.shm.recv import RecvSide
from omnikv.connectors.shm.store import SendStore
from omnikv.connectors.shm.wire import MAX_KEY_CHARS

__all__ = [
    "MESSAGES",
    "Cancel",
    "Cleaned",
    "Cleanup",
    "Dispatcher",
    "Evict",
    "Hello",
    "Message",
    "Miss",
    "Offer",
    "Pool",
    "Release",
    "Return",
    "VerdictMsg",
    "Want",
    "as_message",
    "parse_message",
]

#: A count, id, token, offset or size: an ``int`` (never ``bool``) from 0 to 2**63 - 1.
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: A transport key as a reader asks for it (never longer than any key a put can publish).
Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]
#: Longest instance name a ``hello`` may carry (``random_instance`` makes ~20 characters).
MAX_INSTANCE_CHARS = 256


class _Msg(msgspec.Struct, array_like=True):
    """A control message: a msgpack array whose first element is the message's name (the
    struct's tag), then its fields in order. Optional trailing fields default to ``UNSET``
    (absent, which :func:`as_message` leaves out; an explicit ``None`` stays); trailing
    fields a reader does not know are ignored. A field typed ``Any`` is one older peers
    send in more than one form and the part that acts on it checks (as before)."""

    name: ClassVar[str]


class Hello(_Msg, tag="hello"):
    instance: Annotated[str, msgspec.Meta(max_length=MAX_INSTANCE_CHARS)]
    pid: Count | UnsetType = UNSET
    role: Any = UNSET  # "sender" once the peer sends


class Want(_Msg, tag="want"):
    wid: Count
    key: Key
    block: bool
    probe: Any = UNSET  # "probe": only what the sender holds, answered with ``miss``


class Offer(_Msg, tag="offer"):
    wid: Count
    token: Count
    offset: Count
    size: Count
    kind: str
    ack: Any = UNSET  # "ack": the sender takes a verdict on it


class Release(_Msg, tag="release"):
    token: Count


class Return(_Msg, tag="return"):
    token: Count


class Cancel(_Msg, tag="cancel"):
    wid: Count


class Miss(_Msg, tag="miss"):
    wid: Count
    answer: Any = UNSET  # a probe's answer (``diag`` reads it as hostile input)


class Evict(_Msg, tag="evict"):
    token: Count


class VerdictMsg(_Msg, tag="verdict"):
    token: Count
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_VERDICT_KEY_CHARS)]
    verdict: Verdict
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] | UnsetType | None = UNSET


class Pool(_Msg, tag="pool"):
    pool_id: Count
    size: Count


class Cleanup(_Msg, tag="cleanup"):
    pattern: str
    ask_id: Any = UNSET  # answered with ``cleaned`` only when a non-negative int
    mode: Any = UNSET  # one of ``cleanup.MODES``, else the request rule


class Cleaned(_Msg, tag="cleaned"):
    ask_id: Count
    dropped: Count


Message = Union[  # noqa: UP007 - a runtime union of the message types
    Hello, Want, Offer, Release, Return, Cancel, Miss, Evict, VerdictMsg, Pool, Cleanup, Cleaned
]
#: Every control message type by its name.
MESSAGES: dict[str, type[_Msg]] = {
    str(t.__struct_config__.tag): t
    for t in (Hello, Want, Offer, Release, Return, Cancel, Miss, Evict, VerdictMsg, Pool)
}
MESSAGES.update({"cleanup": Cleanup, "cleaned": Cleaned})


def parse_message(msg: list[Any]) -> _Msg:
    """``msg`` (a decoded frame: its name first) as its checked struct; ``ValueError`` (the
    mesh then drops the peer) for an unknown name or any field out of its type or bounds."""
    cls = MESSAGES.get(msg[0]) if msg and isinstance(msg[0], str) else None
    if cls is None:
        raise ValueError(f"unknown control message {str(msg[0])[:32] if msg else ''!r}")
    try:
        return msgspec.convert(msg, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed {msg[0]!r} message: {exc}") from None


def as_message(struct: _Msg) -> list[Any]:
    """``struct`` as the array it travels as: its name, then its fields without the optional
    trailing ones it does not have (``UNSET``), so its bytes are those of the list form."""
    fields = [getattr(struct, f) for f in struct.__struct_fields__]
    while fields and fields[-1] is UNSET:
        fields.pop()
    return [struct.__struct_config__.tag, *fields]


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
        m = parse_message(msg)
        if isinstance(m, Want):
            if m.probe == "probe":
                answer = self._store.published_summary(m.key, MAX_KEYS_SHOWN)
                self._mesh.send(link, [["miss", m.wid, answer]])
            else:
                self._store.on_want(link, m.wid, m.key, m.block)
        elif isinstance(m, Offer):
            self._recv.on_offer(link, msg)
        elif isinstance(m, (Release, Return)):
            self._store.on_release(link, m.token, republish=isinstance(m, Return))
        elif isinstance(m, Cancel):
            self._store.on_cancel(link, m.wid)
        elif isinstance(m, Miss):
            self._recv.on_miss(link, m.wid, None if m.answer is UNSET else m.answer)
        elif isinstance(m, Evict):
            self._recv.on_evict(link, m.token)
        elif isinstance(m, VerdictMsg):
            if self._verdicts is not None:
                reason = None if m.reason is UNSET else m.reason
                self._verdicts.on_verdict(link, m.token, m.key, m.verdict, reason)
        else:
            self._on_peer_message(link, m)

    def _on_peer_message(self, link: Link, m: _Msg) -> None:
        """The messages about the peer itself and the namespace (not one payload)."""
        if isinstance(m, Pool):
            self._on_pool(link, m.pool_id, m.size)
        elif isinstance(m, Hello):
            link.peer = m.instance
            link.sender = link.sender or m.role == "sender"
        elif isinstance(m, Cleanup):
            ask_id = m.ask_id if type(m.ask_id) is int and m.ask_id >= 0 else None
            self._cleanups.on_cleanup(link, m.pattern, ask_id, m.mode)
        elif isinstance(m, Cleaned):
            self._cleanups.on_cleaned(link, m.ask_id, m.dropped)

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
