"""The NIXL connector (pull model over UCX); see :mod:`.connector`."""

from omnikv.connectors.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]
