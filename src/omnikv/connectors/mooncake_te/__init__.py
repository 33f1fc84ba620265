"""The Mooncake Transfer Engine connector (pull model), split by concern.

* :mod:`.protocol`: control messages, limits, configuration, error translation.
* :mod:`.sender`: publishing, long-polled queries, pull workers, TTL.
* :mod:`.receiver`: queries, receive slots, pulls, quarantine, late arrivals.
* :mod:`.connector`: :class:`MooncakeTransferEngineConnector`, which owns the engine and the pool
  and picks its sides once, from ``role``.

``omnikv.connectors.mooncake_te:MooncakeTransferEngineConnector`` is the public path.
"""

from omnikv.connectors.mooncake_te.connector import MooncakeTransferEngineConnector

__all__ = ["MooncakeTransferEngineConnector"]
