"""What a transfer is bound to: unguessable transfer ids, the KV binding, and the payload MAC.

``kv_transfer_params`` arrive in API clients' request bodies, so everything in them is hostile
until checked. Three things make a load safe to accept:

* **The transfer id** is ``okv1-<producer tag>-<32 random hex>`` (and ``-<32 hex MAC>`` with an
  ``auth_secret``). The random part is made per request and returned only to the client that
  asked for the prefill; the tag names the producer (derived from the connector namespace, or
  ``producer_tag``). Ids of another form, length or tag are refused at admission, never waited
  for. With a secret the MAC covers the tag, the random part and the binding, so a consumer
  refuses at once an id that its producer did not issue for this very request.
* **A router's id** (:func:`new_router_transfer_id`, for the early hand-off) is
  ``okv1r-<producer tag>-<32 random hex>-<32 hex MAC>``: issued *before* the prefill by a router
  that holds the ``auth_secret``, sent to the producer and to the consumer at once, so that the
  consumer can take a streamed prefill's blocks while the producer computes them. Its MAC covers
  the tag and the random part (the router does not know the engines' binding); the binding still
  names the key, so such an id with another prompt misses. Without a secret there are no router
  ids: a producer ignores one (it issues its own) and a consumer refuses it.
* **The binding** (:func:`request_binding`) is a digest over everything that makes KV differ for
  the same tokens: the model fingerprint (:func:`model_fingerprint`: model id, revision, dtype,
  KV cache dtype, layer and KV-head counts, head size), the prompt tokens the KV covers, the LoRA
  adapter, ``cache_salt`` and the multimodal input hashes. The consumer computes it from its own
  request and engine, never from what the client says.
* **The storage key** (:func:`payload_key`) is ``<transfer id>.<binding>``: a consumer looks up
  only the key its own binding gives, so a load that does not fit its payload never finds it and
  never consumes it (check first, consume only what fits). A stolen id with another prompt,
  model, adapter or salt misses; it cannot destroy the victim's payload.

With an ``auth_secret``, the producer also puts :func:`kv_mac` (keyed BLAKE3 over the key, the
first token and every layer's K/V bytes in wire order) in the payload's metadata and the
consumer checks it before writing a byte into its cache. The MAC names its construction
(``omnikv-kv-v4:<32 hex>``, :data:`KV_MAC_VERSION`): a consumer refuses a MAC of another
construction (an older producer's bare HMAC-SHA256 hex, ``omnikv-kv-v3``) saying so, and an
older consumer finds the new one unequal to its own; either way the load fails and vLLM
recomputes the prefill, and no MAC is ever checked under a construction it was not made with
(the construction: :mod:`omnikv.wire.mac`). A streamed prefill is sealed piece by piece: each
chunk carries the MAC of its own tokens, so a consumer can check and write it as
it arrives, and the finish carries the list of every piece's range and MAC
(:func:`check_sealed_ranges`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from omnikv.transfer.stream.manifest import pieces_out_of_order
from omnikv.wire.format import MAX_STREAM_CHUNKS
from omnikv.wire.mac import (
    KV_MAC_DOMAIN,
    KV_MAC_VERSION,
    construction_refusal,
    kv_mac,
    mac_refusal,
)

__all__ = [
    "BINDING_HEX",
    "KV_MAC_DOMAIN",
    "KV_MAC_VERSION",
    "MAX_SEALED_RANGES",
    "MAX_TRANSFER_ID_CHARS",
    "PARAM_BINDING",
    "PARAM_NUM_TOKENS",
    "PARAM_TRANSFER_ID",
    "check_sealed_ranges",
    "check_transfer_id",
    "early_handoff_params",
    "is_router_id",
    "kv_mac",
    "kv_mac_matches",
    "kv_mac_refusal",
    "model_fingerprint",
    "new_router_transfer_id",
    "new_transfer_id",
    "payload_key",
    "producer_tag",
    "request_binding",
    "token_digest",
]

#: ``kv_transfer_params`` keys the producer returns and the consumer reads.
PARAM_TRANSFER_ID = "omnikv_transfer_id"
PARAM_NUM_TOKENS = "omnikv_num_tokens"
PARAM_BINDING = "omnikv_binding"
#: Most entries (``[start, stop, mac]``, five for a layer group) a streamed finish's sealed
#: ranges may hold (its chunks, at most :data:`omnikv.wire.format.MAX_STREAM_CHUNKS`, and its
#: tail).
MAX_SEALED_RANGES = MAX_STREAM_CHUNKS + 1
#: Hex digits of a binding (128 bits).
BINDING_HEX = 32
#: Longest transfer id accepted from a client (longer ones are refused unread).
MAX_TRANSFER_ID_CHARS = 96
_ID_FORMAT = re.compile(r"okv1(r?)-([0-9a-f]{8})-([0-9a-f]{32})(?:-([0-9a-f]{32}))?")
_TAG_FORMAT = re.compile(r"[0-9a-f]{8}")


def token_digest(token_ids: Sequence[int]) -> str:
    """A digest of token ids alone (kept for callers that hash prompts; not a binding)."""
    data = np.asarray(list(token_ids), dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def producer_tag(namespace: str) -> str:
    """The default tag of the producers of ``namespace`` (8 hex): both sides derive the same."""
    return hashlib.blake2b(f"omnikv-vllm|{namespace}".encode(), digest_size=4).hexdigest()


def is_tag(value: Any) -> bool:
    """True for a well-formed producer tag (8 lowercase hex digits)."""
    return isinstance(value, str) and _TAG_FORMAT.fullmatch(value) is not None


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:  # a config that cannot answer: the field stays unknown on both sides
        return None


def model_fingerprint(vllm_config: Any, model_id: str | None = None) -> str:
    """The engine's model identity as canonical JSON; called once per connector half.

    ``model_id`` overrides the model's name or path (set it on both sides when the same
    weights live under different paths on the producer and the consumer).
    """
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    fields = {
        "model": model_id if model_id is not None else getattr(model, "model", None),
        "revision": getattr(model, "revision", None),
        "dtype": str(getattr(model, "dtype", None)),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "layers": _call(model, "get_total_num_hidden_layers"),
        "kv_heads": _call(model, "get_total_num_kv_heads"),
        "head_size": _call(model, "get_head_size"),
    }
    return json.dumps(fields, sort_keys=True, default=str)


def _field(h: Any, value: bytes) -> None:
    h.update(len(value).to_bytes(8, "little"))
    h.update(value)


def request_binding(fingerprint: str, request: Any, num_tokens: int) -> str | None:
    """The binding of ``request``'s first ``num_tokens`` prompt tokens (32 hex), or ``None``
    when the request has no prompt token ids (prompt embeddings: nothing to bind KV to).

    Called by the scheduler half on both sides: the producer when a request finishes, the
    consumer at admission. Every field is length-prefixed, so no two inputs hash alike.
    """
    prompt = getattr(request, "prompt_token_ids", None)
    if prompt is None or num_tokens <= 0 or num_tokens > len(prompt):
        return None
    h = hashlib.blake2b(digest_size=BINDING_HEX // 2, person=b"omnikv-bind-v1")
    _field(h, fingerprint.encode())
    _field(h, np.asarray(prompt[:num_tokens], dtype=np.int64).tobytes())
    lora = getattr(request, "lora_request", None)
    _field(h, str(getattr(lora, "lora_name", "") if lora is not None else "").encode())
    salt = getattr(request, "cache_salt", None)
    _field(h, b"" if salt is None else b"s" + str(salt).encode())
    features = getattr(request, "mm_features", None) or ()
    ids = [str(getattr(f, "identifier", "")) for f in features]
    _field(h, json.dumps(ids).encode())
    return h.hexdigest()


def payload_key(transfer_id: str, binding: str) -> str:
    """The request id under which the producer stores the KV and the consumer looks it up."""
    return f"{transfer_id}.{binding}"


def _secret_key(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=32, person=b"omnikv-key-v1").digest()


def _id_mac(secret: bytes, tag: str, nonce: str, binding: str) -> str:
    msg = f"id|{tag}|{nonce}|{binding}".encode()
    return hashlib.blake2b(msg, key=_secret_key(secret), digest_size=16).hexdigest()


def new_transfer_id(tag: str, binding: str, secret: bytes | None) -> str:
    """A fresh transfer id for one request (called by the producer's scheduler half)."""
    nonce = secrets.token_hex(16)
    if secret is None:
        return f"okv1-{tag}-{nonce}"
    return f"okv1-{tag}-{nonce}-{_id_mac(secret, tag, nonce, binding)}"


def _router_mac(secret: bytes, tag: str, nonce: str) -> str:
    msg = f"router|{tag}|{nonce}".encode()
    return hashlib.blake2b(msg, key=_secret_key(secret), digest_size=16).hexdigest()


def new_router_transfer_id(tag: str, secret: bytes) -> str:
    """A fresh router id for one request to producer ``tag`` (called by a router that holds
    the engines' ``auth_secret``, before it sends the request to the producer and the consumer;
    :func:`early_handoff_params` makes both requests' parameters). Each id serves one request:
    a producer refuses one it has used already."""
    nonce = secrets.token_hex(16)
    return f"okv1r-{tag}-{nonce}-{_router_mac(secret, tag, nonce)}"


def is_router_id(transfer_id: Any) -> bool:
    """True when ``transfer_id`` has a router id's form (checked by :func:`check_transfer_id`)."""
    match = isinstance(transfer_id, str) and _ID_FORMAT.fullmatch(transfer_id)
    return bool(match and match.group(1))


def early_handoff_params(
    transfer_id: str, num_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kv_transfer_params`` of an early hand-off: ``(producer's, consumer's)``.

    A router sends both requests at once, with the same prompt: the producer prefills under
    ``transfer_id`` (a :func:`new_router_transfer_id`), and the consumer, admitted at once,
    waits for the KV of its first ``num_tokens`` prompt tokens (the whole prompt) and, with
    ``stream_kv`` on both engines, takes its blocks while the producer computes them.
    """
    producer = {"do_remote_decode": True, PARAM_TRANSFER_ID: transfer_id}
    consumer = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PARAM_TRANSFER_ID: transfer_id,
        PARAM_NUM_TOKENS: int(num_tokens),
    }
    return producer, consumer


def check_transfer_id(
    transfer_id: Any, tags: frozenset[str], binding: str, secret: bytes | None
) -> str | None:
    """Why ``transfer_id`` cannot be a payload of ours for this binding, or ``None`` if it can.

    Called by the consumer's scheduler half at admission, before anything waits: a bad type,
    length or character set, a tag that is not one of ``tags`` (all tags when empty), a missing
    or wrong MAC when a secret is set, a router id without a secret. The producer's scheduler
    half calls it too, for a router id offered with ``do_remote_decode``. Never raises.
    """
    if not isinstance(transfer_id, str):
        return f"transfer id is a {type(transfer_id).__name__}, not a string"
    if len(transfer_id) > MAX_TRANSFER_ID_CHARS:
        return f"transfer id longer than {MAX_TRANSFER_ID_CHARS} characters"
    match = _ID_FORMAT.fullmatch(transfer_id)
    if match is None:
        return "transfer id is not of the form okv1-<tag>-<hex>"
    router, tag, nonce, mac = match.groups()
    if tags and tag not in tags:
        return f"transfer id names producer tag {tag}, not one this consumer accepts"
    if router:
        if secret is None:
            return "router transfer ids need auth_secret, which is not set"
        if mac is None or not hmac.compare_digest(mac, _router_mac(secret, tag, nonce)):
            return "router transfer id was not issued with this auth_secret (MAC mismatch)"
        return None
    if secret is not None:
        if mac is None:
            return "transfer id carries no MAC but auth_secret is set"
        if not hmac.compare_digest(mac, _id_mac(secret, tag, nonce, binding)):
            return "transfer id was not issued for this request (MAC mismatch)"
    return None


def kv_mac_refusal(
    expected: Any,
    secret: bytes,
    key: str,
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    start: int = 0,
    first_layer: int = 0,
) -> str | None:
    """Why ``expected`` (a MAC read from a payload) does not seal these tokens, or ``None``:
    missing, of another construction than :data:`KV_MAC_VERSION` (checked before any byte is
    hashed: an older producer's MAC is refused, never checked under this construction), or
    not :func:`kv_mac` of them (constant-time comparison). Called by the consumer's worker."""
    why = construction_refusal(expected)
    if why is None:
        why = mac_refusal(expected, kv_mac(secret, key, layers, start, first_layer))
    return why


def kv_mac_matches(
    expected: Any,
    secret: bytes,
    key: str,
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    start: int = 0,
    first_layer: int = 0,
) -> bool:
    """Whether ``expected`` (a MAC read from a payload) is :func:`kv_mac` of these tokens
    (:func:`kv_mac_refusal` finds no reason)."""
    return kv_mac_refusal(expected, secret, key, layers, start, first_layer) is None


def mac_matches(expected: Any, actual: str) -> bool:
    """Constant-time comparison of a MAC read from a payload with the one computed here."""
    return isinstance(expected, str) and hmac.compare_digest(expected, actual)


def check_sealed_ranges(
    secret: bytes,
    key: str,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    sealed: Any,
    offset: int = 0,
) -> str | None:
    """Why ``layers`` (tokens ``[offset, offset + n)`` of the request, every layer) are not
    what the sealed ranges say, or ``None``.

    ``sealed`` is a streamed finish's list of ``[start, stop, mac]`` per range, or
    ``[start, stop, mac, first, end]`` per layer group of a range shipped layer by layer
    (hostile input: at most :data:`MAX_SEALED_RANGES` entries, ranges contiguous from token 0
    to ``offset + n``, a range's groups consecutive from layer 0 to the last, ``offset`` one of
    the range boundaries). The entries from ``offset`` on are checked with :func:`kv_mac`;
    those before it were checked piece by piece as they arrived (the consumer's ``on_chunk``).
    """
    if not isinstance(sealed, list) or not 1 <= len(sealed) <= MAX_SEALED_RANGES:
        return "the payload's sealed ranges are missing or too many"
    n = int(layers[0][0].shape[0]) if layers else 0
    entries = _sealed_entries(sealed, len(layers))
    if isinstance(entries, str):
        return entries
    at = entries[-1][1]
    if at != offset + n:
        return f"the sealed ranges end at {at}, the KV holds tokens [{offset}, {offset + n})"
    if offset not in {e[0] for e in entries if e[3] == 0} | {at}:
        return f"the KV starts at token {offset}, which no sealed range starts at"
    for start, stop, mac, first, end in entries:
        if start < offset:
            continue
        lo, hi = start - offset, stop - offset
        piece = [(k[lo:hi], v[lo:hi]) for k, v in layers[first:end]]
        why = kv_mac_refusal(mac, secret, key, piece, start, first)
        if why is not None:
            return f"tokens [{start}, {stop}): {why}"
    return None


def _sealed_entries(
    sealed: list[Any], num_layers: int
) -> list[tuple[int, int, str, int, int]] | str:
    """``sealed``'s entries as ``(start, stop, mac, first layer, layer stop)``, checked: ranges
    contiguous from token 0, none empty; a range's layer groups consecutive from layer 0 to
    ``num_layers`` (:func:`~omnikv.transfer.stream.manifest.pieces_out_of_order`, as for a stream's
    manifest); or why not."""
    out: list[tuple[int, int, str, int, int]] = []
    for item in sealed:
        if (
            not isinstance(item, list)
            or len(item) not in (3, 5)
            or any(type(v) is not int for v in (*item[:2], *item[3:]))
            or not isinstance(item[2], str)
        ):
            return f"the payload's sealed ranges are not contiguous from token 0 ({item!r:.60})"
        first, end = (item[3], item[4]) if len(item) == 5 else (0, num_layers)
        out.append((item[0], item[1], item[2], first, end))
    why = pieces_out_of_order([(a, b, f, e) for a, b, _, f, e in out], num_layers, "entry")
    if why is not None:
        return f"the payload's sealed ranges are not in order: {why}"
    return out
