"""What a Mooncake Store client writes for another to read, besides the payloads: the verdict
record.

A receiver that took the payload stored under ``key`` stores its verdict under
:func:`ack_key` (``key + ".ack"``) as ASCII JSON ``{"key", "verdict", "reason"}``
(:func:`encode_record`); the sender reads it back with :func:`parse_record`, which treats it
as hostile input: bounded in size (:data:`MAX_RECORD_BYTES`), parsed as JSON (never pickle),
naming the key it answers, one of the three verdicts, the reason a string clipped to
:data:`~omnikv.connectors.delivery.MAX_REASON_CHARS`. Used by
:mod:`omnikv.connectors.mooncake_store.acks` on both sides.
"""

from __future__ import annotations

import json

from omnikv.connectors.delivery import MAX_KEY_CHARS, MAX_REASON_CHARS, Verdict, clip_reason

__all__ = ["ACK_SUFFIX", "MAX_RECORD_BYTES", "ack_key", "encode_record", "parse_record"]

#: What a payload key is followed by to name its verdict record.
ACK_SUFFIX = ".ack"
#: Largest verdict record read: a key of ``MAX_KEY_CHARS`` and a reason of ``MAX_REASON_CHARS``,
#: JSON-escaped at 6 bytes a character, fit with room to spare.
MAX_RECORD_BYTES = 6 * (MAX_KEY_CHARS + MAX_REASON_CHARS) + 256
_VERDICTS = {v.value: v for v in Verdict}


def ack_key(key: str) -> str:
    """The store key of the verdict record for the payload stored under ``key``."""
    return key + ACK_SUFFIX


def encode_record(key: str, verdict: Verdict, reason: str | None) -> bytes:
    """The record body a receiver stores: ``{"key", "verdict", "reason"}`` as ASCII JSON."""
    body = {"key": key, "verdict": Verdict(verdict).value, "reason": clip_reason(reason)}
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def parse_record(body: bytes, key: str) -> tuple[Verdict, str | None] | None:
    """``(verdict, reason)`` from a record read for ``key``; ``None`` when it is malformed (too
    large, not JSON, not an object naming ``key``, an unknown verdict or a reason that is not a
    string). The reason comes back clipped to :data:`MAX_REASON_CHARS`. Never raises."""
    if len(body) > MAX_RECORD_BYTES:
        return None
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("key") != key:
        return None
    name = obj.get("verdict")
    verdict = _VERDICTS.get(name) if isinstance(name, str) else None
    reason = obj.get("reason")
    if verdict is None or not (reason is None or isinstance(reason, str)):
        return None
    return verdict, clip_reason(reason)
