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
    KVPrefetchConsumeError,
    OmniKVError,
    PayloadError,
    ReceiveTimeout,
)
from omnikv.manager import OmniKVTransferManager
from omnikv.parallel import DistributionError, ParallelContext, ReceiveRole, TopoConfig
from omnikv.payload import KVCacheTransferData
from omnikv.prefetch import KVPrefetchJob
from omnikv.receiver import ReceiveResult, ReceiveStatus
from omnikv.sender import SendResult, SendStatus
from omnikv.topology import KVTPTopology

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConnectorError",
    "ConnectorSpec",
    "DecodeError",
    "DistributionError",
    "KVTPTopology",
    "KVCacheTransferData",
    "KVPrefetchConsumeError",
    "KVPrefetchJob",
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
