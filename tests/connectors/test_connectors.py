"""The connector registry (factory) and the optional-backend import rule."""

from __future__ import annotations

from typing import Any

import pytest

from omnikv import ConnectorSpec, OmniConnectorFactory
from omnikv.connectors.local import LocalConnector


def test_factory_registry() -> None:
    assert "SharedMemoryConnector" in OmniConnectorFactory.list_connectors()
    with pytest.raises(
        ValueError, match=r"Unknown connector 'Nope'; known connectors: .*LocalConnector"
    ):
        OmniConnectorFactory.create_connector(ConnectorSpec("Nope"))
    conn = OmniConnectorFactory.create_connector(
        ConnectorSpec("LocalConnector", {"namespace": "f"})
    )
    assert isinstance(conn, LocalConnector) and conn.namespace == "f"
    OmniConnectorFactory.register_connector("LocalAlias", "omnikv.connectors.local:LocalConnector")
    OmniConnectorFactory.register_connector("LocalAlias", "omnikv.connectors.local:LocalConnector")
    with pytest.raises(ValueError, match="already registered"):
        OmniConnectorFactory.register_connector(
            "LocalAlias", "omnikv.connectors.shm.connector:Other"
        )
    OmniConnectorFactory.register_connector(
        "MissingDep", "omnikv_not_installed.mod:X", extra="fancy"
    )
    with pytest.raises(ImportError, match=r"omnikv\[fancy\]"):
        OmniConnectorFactory.get_connector_class("MissingDep")


def test_factory_wraps_constructor_failures() -> None:
    class Boom(LocalConnector):
        def __init__(self, config: Any) -> None:
            raise OSError("no shm")

    OmniConnectorFactory.register_connector("Boom", Boom)
    with pytest.raises(ValueError, match="Failed to create connector 'Boom': no shm"):
        OmniConnectorFactory.create_connector(ConnectorSpec("Boom"))


@pytest.mark.slow
def test_import_omnikv_needs_no_optional_backend() -> None:
    import subprocess
    import sys

    code = "import sys, omnikv, omnikv.connectors; print('mooncake' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
