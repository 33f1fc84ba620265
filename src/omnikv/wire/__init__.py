"""The bytes on the wire. No transport here.

The KV payload: :mod:`~omnikv.wire.format` (constants, dtype tables, header structs, checksum),
:mod:`~omnikv.wire.encode` (the plan and the writers), :mod:`~omnikv.wire.decode` (validation of
hostile input, ``decode_kv``), :mod:`~omnikv.wire.views` (zero-copy views of payload memory) and
:mod:`~omnikv.wire.transfer_data` (the seed's ``KVCacheTransferData``). Beside it:
:mod:`~omnikv.wire.frames` (intra-stage frames) and :mod:`~omnikv.wire.serializer` (the object
serializer).
"""
