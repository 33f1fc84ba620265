"""Send and receive Hugging Face transformers KV caches through an :class:`OmniKVTransferManager`.

``pip install omnikv[transformers]``; transformers is imported only when a cache is built.

Sender stage (after a prefill with ``use_cache=True``, under ``torch.no_grad()``)::

    result = send_hf_cache(manager, "req-1", out.past_key_values, custom_metadata={...})

Receiver stage::

    cache, result = receive_hf_cache(manager, "req-1", config=model.config)
    model.generate(ids, past_key_values=cache, ...)

The sender presents each layer's ``[1, kv_heads, seq, head_dim]`` keys and values as one paged
block ``[1, seq, kv_heads, head_dim]`` (a strided view, no copy) and goes through the manager's
ordinary send path, so the only copy is the packing into the connector's buffer. The receiver
turns the decoded ``[seq, kv_heads, head_dim]`` tensors back into ``[1, kv_heads, seq, head_dim]``
views and fills a ``DynamicCache``. Batch size 1 only: one request is one sequence.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from omnikv.errors import HFCacheError
from omnikv.transfer.edge import KVCaches
from omnikv.transfer.results import ReceiveResult, SendResult

if TYPE_CHECKING:
    from omnikv.manager import OmniKVTransferManager

__all__ = ["HFCacheError", "cache_to_pairs", "check_kv", "receive_hf_cache", "send_hf_cache"]

logger = logging.getLogger(__name__)

_ACCEPTED = (
    "a transformers Cache with .layers[i].keys/.values (DynamicCache), or a tuple of "
    "(K, V) pairs, each [1, kv_heads, seq, head_dim]"
)


def _filled(idx: int, layer: Any) -> tuple[Any, Any]:
    """A cache layer's K and V, cut to the tokens it holds (a ``StaticCache`` preallocates)."""
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    length = getattr(layer, "get_seq_length", None)
    if not callable(length) or not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        return k, v
    if k.dim() != 4:
        return k, v
    seq = int(length())
    if seq > int(k.shape[2]):
        raise HFCacheError(
            f"layer {idx} holds {int(k.shape[2])} of {seq} tokens (a sliding-window layer); "
            "send_hf_cache needs every token of every layer"
        )
    return k[:, :, :seq], v[:, :, :seq]


def _layer_pairs(cache: Any) -> list[tuple[Any, Any]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [_filled(idx, layer) for idx, layer in enumerate(layers)]
    if isinstance(cache, tuple | list) and all(
        isinstance(p, tuple | list) and len(p) >= 2 for p in cache
    ):
        return [(p[0], p[1]) for p in cache]
    raise HFCacheError(f"unsupported cache type {type(cache).__name__}; expected {_ACCEPTED}")


def cache_to_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` tensors ``[1, kv_heads, seq, head_dim]`` of ``cache``, validated.

    Raises :class:`HFCacheError` naming the layer and shape for an empty or uninitialised layer,
    a batch size other than 1, layers of different lengths (sliding-window layers), or K and V
    of different shapes, dtypes or devices.
    """
    pairs = _layer_pairs(cache)
    if not pairs:
        raise HFCacheError("the cache has no layers")
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for idx, (k, v) in enumerate(pairs):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.numel() == 0:
            raise HFCacheError(f"layer {idx} holds no KV (run the prompt with use_cache=True)")
        if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise HFCacheError(
                f"layer {idx}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype}; "
                f"expected {_ACCEPTED}"
            )
        if int(k.shape[0]) != 1:
            raise HFCacheError(
                f"layer {idx}: batch size {int(k.shape[0])}; send_hf_cache sends one sequence "
                "(batch size 1) per request: split the batch into one request per row"
            )
        if out and k.shape != out[0][0].shape:
            raise HFCacheError(
                f"layer {idx}: shape {tuple(k.shape)} differs from layer 0's "
                f"{tuple(out[0][0].shape)} (sliding-window or mixed caches are not supported)"
            )
        out.append((k, v))
    return out


def _as_block(t: torch.Tensor) -> torch.Tensor:
    """``[1, heads, seq, dim]`` -> one block ``[1, seq, heads, dim]`` (a view, no copy)."""
    return t[0].transpose(0, 1).unsqueeze(0)


def send_hf_cache(
    manager: OmniKVTransferManager,
    request_id: str,
    cache: Any,
    *,
    custom_metadata: Mapping[str, Any] | None = None,
) -> SendResult:
    """Send one request's transformers KV cache; returns its :class:`SendResult`.

    ``cache`` is what the model returned (``out.cache``; ``out.past_key_values`` on older
    releases), batch size 1. ``custom_metadata``
    travels in the payload's metadata (``ReceiveResult.metadata`` on the receiver). Never raises
    for a send failure (the result says why); raises :class:`HFCacheError` for a cache it cannot
    read. KV that requires grad is detached (the model ran without ``torch.no_grad()``).
    """
    rid = str(request_id)
    pairs = cache_to_pairs(cache)
    seq = int(pairs[0][0].shape[2])
    layers = [(_as_block(k.detach()), _as_block(v.detach())) for k, v in pairs]
    entry: dict[str, Any] = {"block_ids": [0], "seq_len": seq}
    if custom_metadata:
        entry["custom_metadata"] = dict(custom_metadata)
    dtype = str(pairs[0][0].dtype).removeprefix("torch.")
    return manager.edge.send(rid, entry, KVCaches(list(layers), seq, dtype))


def receive_hf_cache(
    manager: OmniKVTransferManager,
    request_id: str,
    *,
    config: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    check_finite: bool = False,
) -> tuple[Any, ReceiveResult]:
    """Receive one request's KV as a ``DynamicCache`` ready for ``model(...)`` / ``generate``.

    Returns ``(cache, result)``; ``cache`` is ``None`` when ``result.ok`` is false (the status
    and reason say why). ``config`` (the model's config) lets transformers pick each layer's
    cache type; ``device`` moves the KV there (default: where it arrived, the host).
    ``result.metadata`` is the payload's metadata, ``custom_metadata`` keys included;
    ``result.kv`` keeps no tensors (the cache has its own copy, as ``DynamicCache`` makes one),
    so nothing received stays pinned once this returns.

    Before anything reaches transformers the received KV is checked (:func:`check_kv`): every
    layer holds K and V ``[seq, kv_heads, head_dim]`` of one shape and dtype; with ``config``,
    the layer count (more or fewer), KV heads, head size and dtype (``config.dtype``, set by
    ``from_pretrained``) match the model; ``dtype`` (e.g. ``model.dtype``) is checked when given
    and wins over the config's. ``check_finite`` (off by default: one pass over the KV) also
    refuses NaN or infinite values. A mismatch raises :class:`HFCacheError` naming both sides.
    """
    target = torch.device(device) if device is not None else None
    result = manager.receive_kv_cache_result(str(request_id), target)
    kv = result.kv
    if not result.ok or kv is None:
        return None, result
    check_kv(kv.key_cache, kv.value_cache, config, dtype=dtype, check_finite=check_finite)
    cache = _dynamic_cache(kv.key_cache, kv.value_cache, config)
    # The cache holds its own copy: drop the received tensors (they may pin the sender's pool).
    bare = dataclasses.replace(kv, key_cache=[], value_cache=[])
    return cache, dataclasses.replace(result, kv=bare)


def _text_config(config: Any) -> Any:
    """The decoder's config (``get_text_config()`` of a multimodal config; else ``config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _positive_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _as_dtype(value: Any, source: str) -> torch.dtype | None:
    """A torch dtype from a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``);
    ``None`` for ``None`` / ``"auto"``; :class:`HFCacheError` for anything else."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return None if value == "auto" else value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise HFCacheError(f"{source} {value!r} is not a torch dtype")
    return found


def _model_shape(config: Any) -> dict[str, tuple[int | None, str]]:
    """What the model expects: layer count, KV heads and head size, each with the key it came
    from (``None`` where the config does not say)."""
    text = _text_config(config)
    layers = _positive_int(text, "num_hidden_layers")
    heads = _positive_int(text, "num_attention_heads")
    kv_heads, kv_key = _positive_int(text, "num_key_value_heads"), "num_key_value_heads"
    if kv_heads is None:
        kv_heads, kv_key = heads, "num_attention_heads"
    head_dim, dim_key = _positive_int(text, "head_dim"), "head_dim"
    hidden = _positive_int(text, "hidden_size")
    if head_dim is None and hidden is not None and heads:
        head_dim, dim_key = hidden // heads, "hidden_size / num_attention_heads"
    return {
        "layers": (layers, "num_hidden_layers"),
        "kv_heads": (kv_heads, kv_key),
        "head_dim": (head_dim, dim_key),
    }


def _check_layer(idx: int, k: Any, v: Any, first: Any, check_finite: bool) -> None:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise HFCacheError(f"received KV has an empty layer {idx}")
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise HFCacheError(
            f"received layer {idx}: K {tuple(k.shape)} {k.dtype}, V {tuple(v.shape)} "
            f"{v.dtype}; expected K and V of one shape [seq, kv_heads, head_dim]"
        )
    if k.shape != first.shape or k.dtype != first.dtype:
        raise HFCacheError(
            f"received layer {idx}: {tuple(k.shape)} {k.dtype}, layer 0: "
            f"{tuple(first.shape)} {first.dtype}; every layer must match"
        )
    if check_finite and not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise HFCacheError(f"received layer {idx} holds NaN or infinite values")


def check_kv(
    keys: Sequence[Any],
    values: Sequence[Any],
    config: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    check_finite: bool = False,
) -> None:
    """Check received per-layer K/V (``[seq, kv_heads, head_dim]``) against each other and the
    model; raises :class:`HFCacheError` naming what arrived and what the model expects.

    Called by :func:`receive_hf_cache` before transformers sees the KV. See there for what is
    compared; keys the config does not have are not compared.
    """
    if len(keys) != len(values) or not keys:
        raise HFCacheError(f"received {len(keys)} K and {len(values)} V layers")
    for idx, (k, v) in enumerate(zip(keys, values, strict=True)):
        _check_layer(idx, k, v, keys[0], check_finite)
    first: torch.Tensor = keys[0]
    got = {"layers": len(keys), "kv_heads": int(first.shape[1]), "head_dim": int(first.shape[2])}
    if config is not None:
        said = {"layers": "{} layers", "kv_heads": "{} KV heads", "head_dim": "head size {}"}
        for what, (want, key) in _model_shape(config).items():
            if want is not None and got[what] != want:
                arrived = said[what].format(got[what])
                raise HFCacheError(f"received {arrived}, the model config has {want} ({key})")
    want_dtype = _as_dtype(dtype, "dtype=")
    source = "dtype="
    if want_dtype is None and config is not None:
        text = _text_config(config)
        raw = getattr(text, "dtype", None) or getattr(config, "dtype", None)
        want_dtype, source = _as_dtype(raw, "config.dtype"), "config.dtype"
    if want_dtype is not None and first.dtype != want_dtype:
        raise HFCacheError(
            f"received KV of dtype {first.dtype}, the model expects {want_dtype} ({source}); "
            "send the KV in the model's dtype or load the model in the KV's"
        )


def _dynamic_cache(keys: Sequence[Any], values: Sequence[Any], config: Any) -> Any:
    from transformers import DynamicCache

    pairs = [(_from_tokens(k), _from_tokens(v)) for k, v in zip(keys, values, strict=True)]
    return DynamicCache(pairs, config=config)


def _from_tokens(t: torch.Tensor) -> torch.Tensor:
    """``[seq, heads, dim]`` -> ``[1, heads, seq, dim]`` (a view)."""
    return t.transpose(0, 1).unsqueeze(0)
