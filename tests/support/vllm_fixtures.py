"""Fixtures of the vLLM connector tests without an engine, imported by each test module of
tests/integrations/vllm_connector/ (a conftest.py there would shadow tests/conftest.py, which
other tests import as ``conftest``; and the folder is not named ``vllm``, which would make
``import vllm`` find it where vLLM is not installed): ``edge``, a producer and a consumer over
LocalConnector in a namespace of their own (both shut down after the test, with every side a
test adds to ``edge.made``), and ``secure``, the same with an ``auth_secret``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from support import vllm_halves as halves


@pytest.fixture(name="edge")
def edge_fixture() -> Iterator[Any]:
    ns = f"vllm-{uuid.uuid4().hex[:8]}"
    conn = {"type": "LocalConnector", "namespace": ns}
    producer = halves.pair(
        "kv_producer", {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    )
    consumer_omni = {"stage_id": 1, "recv_timeout": 0.5, "connector_config": conn}
    consumer = halves.pair("kv_consumer", consumer_omni)
    made = [producer, consumer]
    yield SimpleNamespace(
        producer=producer, consumer=consumer, consumer_omni=consumer_omni, conn=conn, made=made
    )
    for side in made:
        side.worker.shutdown()


@pytest.fixture(name="secure")
def secure_fixture(edge: Any) -> Any:
    conn = dict(edge.conn, namespace=edge.conn["namespace"] + "s")
    producer = halves.pair(
        "kv_producer",
        {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn},
        auth_secret="s3cret",
    )
    consumer = halves.pair(
        "kv_consumer",
        {"stage_id": 1, "recv_timeout": 0.5, "connector_config": conn},
        auth_secret="s3cret",
    )
    edge.made += [producer, consumer]
    return SimpleNamespace(producer=producer, consumer=consumer, conn=conn)
