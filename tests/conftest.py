"""Shared test fixtures. Every test gets a default timeout from pyproject (pytest-timeout)."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture
def namespace() -> str:
    """A namespace unique to the test, so connectors of parallel tests never meet."""
    return f"t{uuid.uuid4().hex[:12]}"
