"""The KV MAC: keyed BLAKE3 over tensors in wire order, its construction named on the wire.

:func:`kv_mac` seals a run of KV tokens (each layer's K then V, their dtypes and shapes, the
key they travel under, their first token and layer) under a key derived from a shared secret;
the MAC it returns names its construction (``omnikv-kv-v4:<32 hex>``), so that a peer of
another version is refused by name (:func:`mac_refusal`), never checked under a construction
the MAC was not made with. The vLLM connector puts it in a payload's metadata with
``auth_secret`` (:mod:`omnikv.integrations.vllm.binding` says what it binds and why). It lives
here, beside the payload format, because it hashes exactly the bytes the format carries, and so
that ``omnikv bench codec`` measures it where vLLM is not installed.

BLAKE3 because the MAC covers the whole KV on both sides of a hand-off: with SIMD it hashes
several GB/s per core and splits large inputs between threads (``omnikv bench codec`` reports
it against memcpy and against HMAC-SHA256, the construction of ``omnikv-kv-v3``).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import blake3
import numpy as np
import torch

__all__ = [
    "KV_MAC_DOMAIN",
    "KV_MAC_KEY_CONTEXT",
    "KV_MAC_VERSION",
    "MAC_THREADS",
    "PayloadSeal",
    "construction_refusal",
    "find_seals",
    "kv_mac",
    "kv_mac_key",
    "mac_refusal",
    "tensor_bytes",
]

#: The construction of :func:`kv_mac`, named in front of every MAC it makes (``<version>:<hex>``).
#: v3 (before): bare hex of HMAC-SHA256; v4: keyed BLAKE3 under :data:`KV_MAC_KEY_CONTEXT`.
KV_MAC_VERSION = "omnikv-kv-v4"
#: The first bytes :func:`kv_mac` hashes (its domain: no other MAC of omnikv starts with them).
KV_MAC_DOMAIN = KV_MAC_VERSION.encode() + b"\x00"
#: BLAKE3's key derivation context for :func:`kv_mac`'s key (from the ``auth_secret``).
KV_MAC_KEY_CONTEXT = "omnikv 2026-12-07 vLLM connector KV MAC v4"


def _default_threads() -> int:
    """BLAKE3's own thread count (``AUTO``) where this process may run on 4 CPUs or more, one
    thread below: on 2 shared cores (measured: ``omnikv bench codec``'s two ``kv_mac`` rows)
    the extra threads only compete with the engine and with each other."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        cpus = os.cpu_count() or 1
    return int(blake3.blake3.AUTO) if cpus >= 4 else 1


#: Threads one :func:`kv_mac` may use by default (BLAKE3 splits a large tensor's bytes between
#: them; ``AUTO``: as many as BLAKE3 sees fit).
MAC_THREADS: int = _default_threads()


def _field(h: Any, value: bytes) -> None:
    h.update(len(value).to_bytes(8, "little"))
    h.update(value)


def tensor_bytes(t: torch.Tensor) -> bytes | memoryview:
    """A tensor's bytes, row-major (a device tensor copied to host, a strided one compacted)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat: np.ndarray = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.data


def kv_mac_key(secret: bytes) -> bytes:
    """:func:`kv_mac`'s 32-byte key: BLAKE3's key derivation from ``secret`` under
    :data:`KV_MAC_KEY_CONTEXT` (no other key of omnikv is derived under it)."""
    return bytes(blake3.blake3(secret, derive_key_context=KV_MAC_KEY_CONTEXT).digest())


class _MacStream:
    """The message :func:`kv_mac` hashes, fed in pieces: its head (domain, key, first token,
    first layer), then per tensor its dtype and shape and its bytes, in wire order."""

    __slots__ = ("_h",)

    def __init__(self, secret: bytes, key: str, start: int, first_layer: int, threads: int) -> None:
        self._h = blake3.blake3(key=kv_mac_key(secret), max_threads=threads)
        self._h.update(KV_MAC_DOMAIN)
        _field(self._h, key.encode())
        _field(self._h, str(int(start)).encode())
        _field(self._h, str(int(first_layer)).encode())

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], data: Any) -> None:
        """One tensor: ``data`` is its bytes (any contiguous buffer), row-major."""
        _field(self._h, json.dumps([str(dtype), [int(d) for d in shape]]).encode())
        self._h.update(data)

    def mac(self) -> str:
        return f"{KV_MAC_VERSION}:{self._h.hexdigest(length=16)}"


def kv_mac(
    secret: bytes,
    key: str,
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    start: int = 0,
    first_layer: int = 0,
    *,
    threads: int = MAC_THREADS,
) -> str:
    """``"omnikv-kv-v4:"`` and 32 hex (128 bits) of keyed BLAKE3 (:func:`kv_mac_key`) over its
    domain, ``key``, ``start``, ``first_layer`` and every layer's K, then every layer's V (the
    payload's wire order), each its dtype, shape and bytes: the seal of the request's tokens
    ``[start, start + n)`` (``n``: the tensors' first dimension, covered through their shapes)
    of layers ``first_layer`` on (a layer group of a stream shipped layer by layer; 0 for every
    layer).

    The producer's encoder computes it over the tokens it writes (:class:`PayloadSeal`: a whole
    request, or one piece of a streamed one); the consumer's worker calls this over what it
    decoded, before writing into its cache. Both see ``[tokens, heads, head_size]`` tensors of
    the cache dtype, so both hash the same bytes. BLAKE3 because it hashes the whole KV on
    both sides: with SIMD it runs at several GB/s per core and splits large inputs between
    ``threads`` threads (BLAKE3's ``max_threads``; by default as many as it sees fit;
    ``omnikv bench codec`` reports it against memcpy and the HMAC-SHA256 of v3). The threads
    change the speed, never the MAC.
    """
    stream = _MacStream(secret, key, start, first_layer, threads)
    pairs = list(layers)
    for t in [k for k, _ in pairs] + [v for _, v in pairs]:
        stream.tensor(t.dtype, t.shape, tensor_bytes(t))
    return stream.mac()


class PayloadSeal:
    """A :func:`kv_mac` that the payload's encoder computes over the bytes it writes.

    The vLLM producer puts one in a payload's metadata where the MAC goes (at the top level,
    or inside a list there, as a streamed finish's sealed ranges): the encoder
    (:class:`omnikv.wire.encode.PackedPayload`) writes :attr:`placeholder` (random, as long as
    a MAC) into the header, hashes each tensor right after writing it (with a wire codec: the
    tensor as the receiver will decode it), and writes the MAC in the placeholder's place, so
    the tokens are gathered and coded once, for the payload. :attr:`value` is then the MAC
    (the same for every payload packed with this seal over the same bytes; ``None`` before,
    and when two packs disagreed: payloads of different bytes, such as head slices for several
    receivers, have no one MAC). A consumer checks it with :func:`kv_mac` over the tensors it
    decoded: the same bytes in the same order."""

    __slots__ = ("_conflict", "_secret", "first_layer", "key", "placeholder", "start", "value")

    def __init__(self, secret: bytes, key: str, start: int = 0, first_layer: int = 0) -> None:
        self._secret = secret
        self.key = key
        self.start = int(start)
        self.first_layer = int(first_layer)
        self.placeholder = f"{KV_MAC_VERSION}:{secrets.token_hex(16)}"
        self.value: str | None = None
        self._conflict = False

    def __repr__(self) -> str:  # never the secret
        return f"PayloadSeal(key={self.key!r:.80}, start={self.start}, value={self.value})"

    def stream(self, threads: int = MAC_THREADS) -> _MacStream:
        """A fresh hash of this seal's message, for one pack (called by the encoder)."""
        return _MacStream(self._secret, self.key, self.start, self.first_layer, threads)

    def settle(self, mac: str) -> None:
        """Record one pack's MAC (called by the encoder after writing it into the header)."""
        if self._conflict:
            return
        if self.value is not None and self.value != mac:
            self._conflict, self.value = True, None
            return
        self.value = mac


def find_seals(meta: Any, depth: int = 3) -> list[PayloadSeal]:
    """Every :class:`PayloadSeal` in a payload's metadata: its values, and the items of lists
    in them down to ``depth`` levels (a streamed finish's sealed ranges). Called by the
    encoder for each plan."""
    found: list[PayloadSeal] = []
    items = meta.values() if isinstance(meta, Mapping) else meta
    for item in items:
        if isinstance(item, PayloadSeal):
            found.append(item)
        elif depth > 1 and isinstance(item, list | tuple | Mapping):
            found.extend(find_seals(item, depth - 1))
    return found


def construction_refusal(expected: Any) -> str | None:
    """Why ``expected`` (a MAC read from a payload) cannot be checked here, or ``None``:
    missing, or of another construction than :data:`KV_MAC_VERSION` (an older producer's bare
    HMAC-SHA256 hex is ``omnikv-kv-v3``). Needs no hashing: a consumer asks it first."""
    if not isinstance(expected, str):
        return "the payload carries no MAC"
    version, sep, _ = expected.partition(":")
    if sep and version == KV_MAC_VERSION:
        return None
    named = version if sep else "bare hex: omnikv-kv-v3, HMAC-SHA256"
    return (
        f"the payload's MAC is of construction {named!r:.40}, this consumer checks "
        f"{KV_MAC_VERSION} (a producer of another omnikv version)"
    )


def mac_refusal(expected: Any, actual: str) -> str | None:
    """Why ``expected`` (a MAC read from a payload) is not ``actual`` (the :func:`kv_mac` this
    side computed), or ``None``: :func:`construction_refusal`'s reasons, or unequal
    (constant-time comparison)."""
    why = construction_refusal(expected)
    if why is None and not hmac.compare_digest(expected, actual):
        why = "the MAC does not match (forged or damaged KV)"
    return why
