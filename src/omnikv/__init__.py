"""omnikv: KV cache transfer between the stages of multi-stage inference pipelines.

The public names are those of the seed API (``OmniKVTransferManager``, ``OmniKVCacheConfig``,
``KVCacheTransferData``, ``KVPrefetchConsumeError``, the connectors and their factory), plus the
typed results and errors underneath them.
"""

from omnikv.config import OmniKVCacheConfig, RetryPolicy, TransferOptions
from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase
from omnikv.connectors.factory import ConnectorSpec, OmniConnectorFactory, OmniTransferConfig
from omnikv.errors import (
    ConfigError,
    ConnectorError,
    DecodeError,
    DistributionError,
    KVPrefetchConsumeError,
    OmniKVError,
    PayloadError,
    ReceiveTimeout,
)
from omnikv.manager import OmniKVTransferManager
from omnikv.ranks.context import ParallelContext, ReceiveRole, TopoConfig
from omnikv.topology.tp import KVTPTopology
from omnikv.transfer.prefetch import KVPrefetchJob
from omnikv.transfer.receive import ReceiveResult, ReceiveStatus
from omnikv.transfer.send import SendResult, SendStatus
from omnikv.wire.transfer_data import KVCacheTransferData

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConnectorError",
    "ConnectorSpec",
    "DecodeError",
    "DistributionError",
    "KVCacheTransferData",
    "KVPrefetchConsumeError",
    "KVPrefetchJob",
    "KVTPTopology",
    "ManagedBuffer",
    "OmniConnectorBase",
    "OmniConnectorFactory",
    "OmniKVCacheConfig",
    "OmniKVError",
    "OmniKVTransferManager",
    "OmniTransferConfig",
    "ParallelContext",
    "PayloadError",
    "ReceiveResult",
    "ReceiveRole",
    "ReceiveStatus",
    "ReceiveTimeout",
    "RetryPolicy",
    "SendResult",
    "SendStatus",
    "TopoConfig",
    "TransferOptions",
    "__version__",
]
