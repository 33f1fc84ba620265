"""One payload in a sender's pool read by several readers of the node (CFG branches, SP ranks).

Who uses it: :meth:`SharedMemoryConnector.put_shared
<omnikv.connectors.shm.connector.SharedMemoryConnector.put_shared>` makes a :class:`Share` for a
payload that ``readers`` receivers need whole; :class:`~omnikv.connectors.shm.store.SendStore`
hands out its claims and frees its slot through :func:`claim` and :func:`drop_ref`.

The bytes are written into the pool once; every reader's ``want`` for the key is answered with
an offer of the same slot (its own token), so each reader maps the same pages zero-copy, as the
one reader of an ordinary put does. The slot is referenced by the entry still published (while
claims are left) and by each reader holding its offer; it goes back to the pool when the last
reference goes, whichever comes last of:

* each holder's ``release`` (or its migration when the pool is full: that holder copies its
  span to private memory, as for an ordinary payload), or its connection closing (a reader that
  died while holding it);
* the published entry's last claim taken, its TTL (``buffer_ttl_seconds``: readers that never
  came do not keep it), its grace when the pool is full, ``cleanup`` / ``withdraw``, or close.

Bounds: a share has 1 to :data:`MAX_SHARED_READERS` claims, set by the sender (a reader cannot
raise it: a want beyond the claims finds nothing, as for a key never put). A reader that gives
its offer back unused (its wait ended) returns its claim.

Delivery verdict: a shared payload is reported once, as any payload (``acks``): ``expired`` when
claims were left at its TTL or grace (a reader never came); otherwise the verdict of the reader
that took its last claim, the only offer that asks for one (``expired`` when that reader went
away before its verdict or sent none within ``ack_timeout_s``). Every reader maps the same
bytes, so the last reader's check of the data is everyone's; a reader that died after its
claim is not seen in the verdict (its reference is dropped with its connection).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnikv.connectors.shm.store import Entry

__all__ = ["COUNTER_NAMES", "MAX_SHARED_READERS", "Share", "check_readers", "claim", "drop_ref"]

#: Most readers one shared put may serve.
MAX_SHARED_READERS = 64
#: What the sending side counts about shared payloads: puts made for several readers
#: (``shared_puts``, their bytes once each in ``put_bytes``) and the offers of them made
#: (``shared_claims``).
COUNTER_NAMES = ("shared_puts", "shared_claims")


@dataclass(eq=False)
class Share:
    """The readers' claims on one slot: ``claims`` not yet taken, ``refs`` entries that point at
    the slot (the published one, the one being delivered, and one per holder). Guarded by the
    store's lock."""

    claims: int
    refs: int = 1


def check_readers(readers: object) -> int:
    """``readers`` as an int in 1..:data:`MAX_SHARED_READERS`; ``ValueError`` otherwise."""
    if isinstance(readers, bool) or not isinstance(readers, int):
        raise ValueError(f"readers must be an int, got {readers!r:.40}")
    if not 1 <= readers <= MAX_SHARED_READERS:
        raise ValueError(f"readers must be 1..{MAX_SHARED_READERS}, got {readers}")
    return readers


def claim(entry: Entry) -> tuple[Entry, bool]:
    """(store lock held) One reader's claim on ``entry``: the entry to offer it and whether
    ``entry`` stays published for more claims. An entry without a :class:`Share`, or its last
    claim, is offered itself; an earlier claim gets a copy that references the same slot."""
    share = entry.share
    if share is None or share.claims <= 1:
        if share is not None:
            share.claims = 0
        return entry, False
    share.claims -= 1
    share.refs += 1
    return replace(entry, token=0, holder=None, evicting=False, sent=False), True


def unclaim(entry: Entry) -> None:
    """(store lock held) A claim given back (its offer was not sent, or returned unused) while
    the share's published entry still exists: the claim counts again, the copy's reference
    goes (never the last one: the published entry keeps the slot)."""
    share = entry.share
    assert share is not None
    share.claims += 1
    share.refs -= 1


def drop_ref(entry: Entry) -> bool:
    """(store lock held) ``entry`` no longer references its slot; whether the slot is free to go
    back to the pool (always for an entry without a :class:`Share`)."""
    share = entry.share
    if share is None:
        return True
    share.refs -= 1
    return share.refs <= 0
