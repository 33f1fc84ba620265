"""Which cache layout a vLLM engine's attention backend gives its layers.

One table for both users: the vLLM connector (:mod:`omnikv.integrations.vllm`, at
``register_kv_caches``) and ``OmniKVTransferManager.from_vllm_config`` (a vllm-omni stage's seed
API, which then declares the layout itself). The layout is taken from the backend, never from a
tensor's shape: vLLM 0.32's GPU and CPU caches have the same shape. vLLM is imported only by
:func:`cpu_cache_layout` and :func:`attention_backend_layout`, whose callers run inside vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from omnikv.layouts.specs import VLLM_BHNC_LAYOUT, VLLM_CPU_AMX_LAYOUT, VLLM_CPU_LAYOUT

__all__ = [
    "BACKEND_LAYOUTS",
    "CPU_ISA_LAYOUTS",
    "attention_backend_layout",
    "cpu_cache_layout",
]

logger = logging.getLogger(__name__)

#: vLLM attention backend name -> the cache layout its layers use (``CPU_ATTN``: see
#: :func:`cpu_cache_layout`). In vLLM 0.32 every one of these gets the logical per-layer view
#: ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (its physical stride order is the
#: engine's ``KVCacheLayout``; the views keep it) and splits K and V off the last dim.
BACKEND_LAYOUTS: dict[str, str] = {
    "CPU_ATTN": VLLM_CPU_LAYOUT,
    "FLASH_ATTN": VLLM_BHNC_LAYOUT,
    "FLASHINFER": VLLM_BHNC_LAYOUT,
    "TRITON_ATTN": VLLM_BHNC_LAYOUT,
    "FLEX_ATTENTION": VLLM_BHNC_LAYOUT,
}
#: The ISAs of vLLM's CPU attention whose cache layout omnikv reads (checked against vLLM's own
#: cache writer in the tests): ``vec`` and ``vec16`` share one layout, ``amx`` packs blocks.
CPU_ISA_LAYOUTS: dict[str, str] = {
    "vec": VLLM_CPU_LAYOUT,
    "vec16": VLLM_CPU_LAYOUT,
    "amx": VLLM_CPU_AMX_LAYOUT,
}


def cpu_cache_layout(vllm_config: Any, layer_names: Iterable[str] | None = None) -> str | None:
    """The layout of ``CPU_ATTN``'s caches: it depends on the ISA the backend picks for this
    dtype, block size and head size (the shapes are the same). With ``layer_names`` (the vLLM
    connector at ``register_kv_caches``), it is read where vLLM's CPU attention metadata builder
    put it, on each named attention layer (``layer.isa``), through vLLM's public
    ``get_layers_from_vllm_config``: the kernel's own choice. Without (``from_vllm_config``,
    before the model's layers exist), the backend's selector is asked for this config.
    ``None``, logged, for an ISA whose layout omnikv does not read, or layers without one or of
    several."""
    if layer_names is not None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(vllm_config, Attention, list(layer_names))
        isas = sorted({str(getattr(layer, "isa", None)) for layer in layers.values()})
    else:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = vllm_config.model_config
        cache = vllm_config.cache_config
        isas = [
            str(
                _get_attn_isa(
                    model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype
                )
            )
        ]
    layout = CPU_ISA_LAYOUTS.get(isas[0]) if len(isas) == 1 else None
    if layout is None:
        logger.error(
            "vLLM's CPU attention uses ISA %s, whose cache layout omnikv does not read (known: %s)",
            ", ".join(repr(isa) for isa in isas) or "(none set on the attention layers)",
            sorted(CPU_ISA_LAYOUTS),
        )
    return layout


def attention_backend_layout(
    vllm_config: Any, layer_names: Iterable[str] | None = None
) -> str | None:
    """The layout of the caches of the engine ``vllm_config`` describes: that of its attention
    backends (the layers' own once the model is loaded, else the one vLLM's selector picks for
    this config; ``layer_names``, the registered layers, go to :func:`cpu_cache_layout`).
    ``None``, logged, when the backends disagree or one is unknown."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    if names == ["CPU_ATTN"]:
        return cpu_cache_layout(vllm_config, layer_names)
    layouts = {BACKEND_LAYOUTS.get(n) for n in names}
    if len(layouts) != 1 or None in layouts:
        logger.error("no known cache layout for vLLM attention backend(s) %s", names)
        return None
    return layouts.pop()
