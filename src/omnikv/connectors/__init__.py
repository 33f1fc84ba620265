"""Transports. ``import omnikv.connectors`` never imports optional backends (Mooncake)."""

from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase
from omnikv.connectors.factory import ConnectorSpec, OmniConnectorFactory, OmniTransferConfig
from omnikv.wire.serializer import OmniSerializer

__all__ = [
    "ConnectorSpec",
    "ManagedBuffer",
    "OmniConnectorBase",
    "OmniConnectorFactory",
    "OmniSerializer",
    "OmniTransferConfig",
]
