"""The shared-memory connector's control messages as msgspec Structs (``shm.protocol``).

Both directions keep the bytes: every message as the senders build it (a list) goes through a
real frame (``wire.encode_frame`` / ``FrameReader``), decodes to its Struct with the fields it
carries, and that Struct written back as a message (``as_message``) frames to the very same
bytes, with and without its optional trailing fields. Hostile messages (a field out of its
type or bound, an unknown name) are refused with ``ValueError`` (the mesh drops that peer);
trailing fields a reader does not know are ignored. The real-process cases (a malformed
verdict drops its peer, a stranger's verdict changes nothing) are in ``test_shm_delivery``.
"""

from __future__ import annotations

from typing import Any

import pytest
from msgspec import UNSET

from omnikv.connectors.delivery import MAX_REASON_CHARS, Verdict
from omnikv.connectors.shm import protocol
from omnikv.connectors.shm.protocol import as_message, parse_message
from omnikv.connectors.shm.wire import MAX_KEY_CHARS, FrameReader, encode_frame

#: Every message in the forms its senders write (mesh, store, recv, acks, cleanup, diag).
SENT: list[list[Any]] = [
    ["hello", "4242-a1b2c3d4e5f6", 4242],
    ["hello", "4242-a1b2c3d4e5f6", 4242, "sender"],
    ["want", 7, "r1@0_1", True],
    ["want", 7, "r1@0_1", False, "probe"],
    ["offer", 7, 3, 4096, 1 << 20, "raw"],
    ["offer", 7, 3, 4096, 1 << 20, "raw", "ack"],
    ["release", 3],
    ["return", 3],
    ["cancel", 7],
    ["evict", 3],
    ["miss", 7],
    ["miss", 7, {"n": 1, "keys": ["a@0_1"], "has": False}],
    ["verdict", 3, "r1@0_1", "refused", "binding mismatch"],
    ["verdict", 3, "r1@0_1", "delivered", None],
    ["verdict", 3, "r1@0_1", "expired"],
    ["pool", 1, 8 << 20],
    ["cleanup", "r1", 5, "request"],
    ["cleanup", "r1"],
    ["cleaned", 5, 2],
]


def _through_a_frame(msg: list[Any]) -> list[Any]:
    (got,) = FrameReader().feed(encode_frame(msg))
    return got


@pytest.mark.parametrize("sent", SENT, ids=lambda m: f"{m[0]}/{len(m)}")
def test_each_message_decodes_to_its_struct_and_writes_back_to_the_same_bytes(
    sent: list[Any],
) -> None:
    struct = parse_message(_through_a_frame(sent))
    assert type(struct) is protocol.MESSAGES[sent[0]]
    assert as_message(struct) == sent
    assert encode_frame(as_message(struct)) == encode_frame(sent)


def test_the_fields_carry_their_values_and_absent_ones_are_unset() -> None:
    verdict = parse_message(["verdict", 3, "k@0_1", "refused", "no"])
    assert isinstance(verdict, protocol.VerdictMsg)
    assert (verdict.token, verdict.key, verdict.verdict, verdict.reason) == (
        3,
        "k@0_1",
        Verdict.REFUSED,
        "no",
    )
    offer = parse_message(["offer", 1, 2, 3, 4, "raw"])
    assert isinstance(offer, protocol.Offer) and offer.ack is UNSET
    plain = parse_message(["verdict", 3, "k@0_1", "delivered", None])
    assert isinstance(plain, protocol.VerdictMsg) and plain.reason is None


def test_trailing_fields_a_reader_does_not_know_are_ignored() -> None:
    newer = ["release", 3, "a field of a newer version", 9]
    assert as_message(parse_message(newer)) == ["release", 3]
    assert as_message(parse_message(["want", 1, "k", True, "probe", "x"]))[-1] == "probe"


HOSTILE: list[list[Any]] = [
    ["nonsense", 1],
    [7, 1],
    ["release", -1],
    ["release", True],  # bool is not an int here
    ["release"],
    ["release", 1.5],
    ["release", 1 << 70],
    ["offer", 1, 2, -3, 4, "raw"],
    ["offer", 1, 2, 3, "4", "raw"],
    ["want", 1, 2, True],
    ["want", 1, "k" * (MAX_KEY_CHARS + 1), True],
    ["want", 1, "k", 1],
    ["verdict", 1, "", "refused"],
    ["verdict", 1, "k", "accepted"],
    ["verdict", -1, "k", "refused"],
    ["verdict", 1, "k", "refused", "r" * (MAX_REASON_CHARS + 1)],
    ["verdict", 1, "k", "refused", 5],
    ["pool", 1],
    ["cleaned", 1, -2],
    ["cleanup", 5],
    ["hello", 42, 1],
    ["hello", "i" * (protocol.MAX_INSTANCE_CHARS + 1), 1],
    ["hello", "i", -1],
]


@pytest.mark.parametrize("msg", HOSTILE, ids=lambda m: repr(m)[:40])
def test_hostile_messages_are_refused(msg: list[Any]) -> None:
    with pytest.raises(ValueError):
        parse_message(msg)
