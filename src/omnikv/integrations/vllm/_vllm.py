"""The vLLM names the connector builds on, imported once, with one clear error without vLLM."""

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "omnikv.integrations.vllm needs vLLM (pip install 'omnikv[vllm]'); "
        f"importing it failed: {exc}"
    ) from exc

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
]
