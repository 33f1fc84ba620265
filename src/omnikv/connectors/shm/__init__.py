"""The shared-memory connector (same host, memcpy speed); see :mod:`.connector`."""

from omnikv.connectors.shm.connector import SharedMemoryConnector

__all__ = ["SharedMemoryConnector"]
