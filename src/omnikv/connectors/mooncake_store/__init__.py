"""The Mooncake Store connector (put/get through a ``mooncake_master``); see :mod:`.connector`."""

from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

__all__ = ["MooncakeStoreConnector"]
