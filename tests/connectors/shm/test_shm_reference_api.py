"""The shared-memory parts of the reference's newer API, called as code written for it calls them.

* vllm-omni 0.32: ``cleanup_prefix(prefix)`` drops the unconsumed payloads whose key starts with
  ``prefix`` (a request's chunks) and says how many; ``cleanup(key)`` says whether it dropped
  anything. Called in the receiving process; the payloads live in the sender's.
* ``inline_small_payloads``: small payloads travel in the put's metadata (``inline_bytes``),
  nothing is stored for them, and ``get`` / ``get_with_deadline`` given that metadata decode
  them; larger ones go through the pool as before.

The sender is another process (a peer of tests/connectors/shm/test_shm_peer.py, or a script whose
put metadata
comes back over its stdout as msgpack); every process is stopped by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv.connectors import ConnectorSpec, OmniConnectorFactory
from omnikv.connectors.shm.connector import SharedMemoryConnector
from support import paths

pytestmark = pytest.mark.slow

KIB = 1024
_SRC = str(paths.SRC)
# A stage written for the reference: it builds its connector through the factory, puts a small
# and a large object, prints each put's metadata (msgpack, hex) and serves until stdin closes.
_INLINE_SENDER = """
import sys, msgpack, torch
from omnikv.connectors import ConnectorSpec, OmniConnectorFactory
extra = {"namespace": sys.argv[1], "shm_threshold_bytes": 1024, "inline_small_payloads": True,
         "linger_s": 0}
connector = OmniConnectorFactory.create_connector(ConnectorSpec("SharedMemoryConnector", extra))
small = {"request_id": "req_1", "token_ids": [1, 2, 3], "finished": True}
large = {"request_id": "req_2", "hidden": torch.arange(4096, dtype=torch.float32)}
for key, data in (("req_1", small), ("req_2", large)):
    ok, size, metadata = connector.put("stage_0", "stage_1", key, data)
    assert ok, key
    print(msgpack.packb([key, size, metadata], use_bin_type=True).hex(), flush=True)
print(msgpack.packb(connector.health(), use_bin_type=True).hex(), flush=True)
sys.stdin.read()
connector.close()
"""


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _shm_connector(**extra: Any) -> Any:
    """A shared-memory connector made as reference code makes it (the factory, a spec)."""
    return OmniConnectorFactory.create_connector(ConnectorSpec("SharedMemoryConnector", extra))


# -- cleanup_prefix and a boolean cleanup ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_cleanup_prefix_and_cleanup_from_the_receiving_process(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    keys = ["req_7_chunk_0", "req_7_chunk_1", "req_7_chunk_2", "req_70_chunk_0", "req_8"]
    for key in keys:
        assert sender.call("put", key, 4 * KIB, 1, 5.0)[:2] == ("put", True)
    connector = _shm_connector(namespace=namespace)
    try:
        assert isinstance(connector, SharedMemoryConnector)
        # an aborted request's chunks: every key that starts with its prefix, none other
        assert connector.cleanup_prefix("req_7_chunk_") == 3
        assert connector.cleanup_prefix("req_7_chunk_") == 0
        assert sender.call("health")[1]["published"] == 2
        for gone in keys[:3]:
            assert connector.get("0", "1", gone) is None
        # cleanup(key): True when something was dropped, False when nothing was there
        assert connector.cleanup("req_8") is True
        assert connector.cleanup("req_8") is False
        got = connector.get("0", "1", "req_70_chunk_0")  # another request's: still there
        assert got is not None and got[1] == 4 * KIB
        got[0].release()
        with pytest.raises(ValueError, match="non-empty"):
            connector.cleanup_prefix("")  # would drop every stage's payloads
    finally:
        connector.close()
    assert connector.cleanup("req_8") is False and connector.cleanup_prefix("req") == 0


@pytest.mark.timeout(60)
def test_cleanup_prefix_drops_on_every_edge_and_only_unconsumed_payloads(
    namespace: str,
) -> None:
    connector = _shm_connector(namespace=namespace, linger_s=0, pool_size_bytes=1 << 20)
    try:
        for edge in (("0", "1"), ("1", "2")):
            assert connector.put(*edge, "job/9 part 1", b"x" * 100)[0]  # escaped characters
        assert connector.put("0", "1", "job/9 part 2", b"y")[0]
        held = connector.wait("0", "1", "job/9 part 2", deadline=time.monotonic() + 5)
        assert held is not None  # taken by a reader: the reader's, not cleanup's
        assert connector.cleanup_prefix("job/9 ") == 2
        assert held.to_bytes() == b"y"
        held.release()
        assert connector.health()["published"] == 0
    finally:
        connector.close()


# -- inline_small_payloads -------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_small_payloads_travel_inline_in_the_put_metadata(namespace: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _INLINE_SENDER, namespace],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": _SRC},
    )
    # the sender's answer to a get can take longer than the default 0.1 s on a loaded host
    connector = _shm_connector(namespace=namespace, get_timeout_s=2.0)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        puts = {}
        for _ in range(2):
            key, size, metadata = msgpack.unpackb(bytes.fromhex(proc.stdout.readline()))
            puts[key] = (size, metadata)
        health = msgpack.unpackb(bytes.fromhex(proc.stdout.readline()))
        size, small_meta = puts["req_1"]
        assert set(small_meta) == {"inline_bytes", "size"} and small_meta["size"] == size
        assert size == len(small_meta["inline_bytes"]) <= 1024
        assert "shm" in puts["req_2"][1] and "inline_bytes" not in puts["req_2"][1]
        assert health["puts"] == 1  # the small payload never touched the pool
        # nothing of the small one is stored: only its metadata has it
        assert connector.get("stage_0", "stage_1", "req_1") is None
        small = {"request_id": "req_1", "token_ids": [1, 2, 3], "finished": True}
        assert connector.get("stage_0", "stage_1", "req_1", small_meta) == (small, size)
        wrapped = {"req_1": small_meta}  # the reference also passes it keyed by request
        got = connector.get_with_deadline(
            "stage_0", "stage_1", "req_1", wrapped, deadline=time.monotonic() + 1.0
        )
        assert got == (small, size)
        # the large one went through the sender's pool, consume-once
        large = connector.get("stage_0", "stage_1", "req_2", puts["req_2"][1])
        assert large is not None
        assert torch.equal(large[0]["hidden"], torch.arange(4096, dtype=torch.float32))
        assert connector.get("stage_0", "stage_1", "req_2", puts["req_2"][1]) is None
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        connector.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.timeout(30)
def test_inline_follows_the_threshold_and_bad_inline_bytes_are_a_miss(namespace: str) -> None:
    connector = _shm_connector(
        namespace=namespace, shm_threshold_bytes=64, inline_small_payloads=True, linger_s=0
    )
    off = _shm_connector(namespace=namespace, shm_threshold_bytes=64, linger_s=0)
    try:
        ok, size, meta = connector.put("0", "1", "tiny", b"abc")
        assert ok and meta is not None and "inline_bytes" in meta
        assert connector.get("0", "1", "tiny", meta) == (b"abc", size)
        ok, size, meta = connector.put("0", "1", "big", b"z" * 65)  # raw size over: pooled
        assert ok and meta is not None and "shm" in meta and size == 65
        ok, _size, meta = connector.put("0", "1", "obj", {"n": "z" * 62})  # serialized over
        assert ok and meta is not None and "shm" in meta
        obj = connector.get("0", "1", "obj", meta)
        assert obj is not None and obj[0] == {"n": "z" * 62} and obj[1] > 64
        ok, _size, meta = off.put("0", "1", "tiny", b"abc")  # not enabled: the pool
        assert ok and meta is not None and "shm" in meta
        assert connector.get("0", "1", "x", {"inline_bytes": b"\xc1"}) is None  # logged
    finally:
        off.close()
        connector.close()
