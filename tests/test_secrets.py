"""Secrets stay secret: ``auth_secret_file`` and ``$OMNIKV_AUTH_SECRET`` beside ``auth_secret``
for every connector that takes it, and the secret never shows in omnikv's reprs, errors or
logs, nor in the vLLM server's ``--kv-transfer-config`` when the README's recipe is followed.
"""

from __future__ import annotations

import json
import logging
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from omnikv.config import OmniKVCacheConfig
from omnikv.connectors.mooncake_te.config import TEConfig
from omnikv.connectors.nixl.config import NixlSettings
from omnikv.errors import ConfigError
from omnikv.values import MAX_SECRET_FILE_BYTES, SECRET_ENV, redacted, resolve_secret

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-Zq8v-never-shown"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "omnikv-secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def _no_secret(*texts: object) -> None:
    for text in texts:
        assert SECRET not in str(text), text


def test_a_secret_comes_from_the_config_a_file_or_the_environment(
    secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret({"auth_secret": SECRET}) == SECRET.encode()
    assert resolve_secret({"auth_secret_file": str(secret_file)}) == SECRET.encode()
    assert resolve_secret({}) is None
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert resolve_secret({}) == SECRET.encode()
    assert resolve_secret({}, env=False) is None
    assert resolve_secret({"auth_secret": "other"}) == b"other"  # the config wins


@pytest.mark.parametrize("case", ["both", "empty", "missing", "oversized", "not a path"])
def test_a_bad_secret_setting_is_refused_without_showing_the_secret(
    case: str, secret_file: Path, tmp_path: Path
) -> None:
    cfg: dict[str, Any] = {
        "both": {"auth_secret": SECRET, "auth_secret_file": str(secret_file)},
        "empty": {"auth_secret_file": str(tmp_path / "empty")},
        "missing": {"auth_secret_file": str(tmp_path / "nope")},
        "oversized": {"auth_secret_file": str(tmp_path / "big")},
        "not a path": {"auth_secret_file": 7},
    }[case]
    (tmp_path / "empty").write_bytes(b"\n")
    (tmp_path / "big").write_bytes(SECRET.encode() * (MAX_SECRET_FILE_BYTES // len(SECRET) + 1))
    with pytest.raises(ConfigError) as info:
        resolve_secret(cfg)
    _no_secret(info.value, repr(info.value))


def test_the_pull_connectors_take_the_file_and_never_show_the_secret(secret_file: Path) -> None:
    """The Transfer Engine's and NIXL's settings: the file's secret is used, and neither their
    reprs nor a config repr holds it."""
    conn = {"role": "sender", "host": "127.0.0.1", "zmq_port": 15000}
    te = TEConfig.parse({**conn, "auth_secret_file": str(secret_file)})
    nixl = NixlSettings.from_config({**conn, "auth_secret_file": str(secret_file)})
    assert te.secret == nixl.secret == SECRET.encode()
    inline = TEConfig.parse({**conn, "auth_secret": SECRET})
    config = OmniKVCacheConfig(connector_config={"type": "X", "auth_secret": SECRET})
    _no_secret(repr(te), repr(nixl), repr(inline), repr(config), str(config))
    assert redacted({"a": [{"auth_secret": SECRET}]}) == {"a": [{"auth_secret": "<redacted>"}]}


def _readme_kv_transfer_config(role: str) -> str:
    """The ``--kv-transfer-config`` argument the README's served recipe builds: its first lines
    (the secret file and the ``kv`` shell function) run by bash as written."""
    import subprocess

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("### Serving with `vllm serve`", 1)[1].split("```bash", 1)[1]
    head = block.split("```", 1)[0].split("SHM=", 1)[0]
    script = f"{head}\nkv {role} '{{\"stage_id\": 1}}'"
    out = subprocess.run(
        ["bash", "-c", script], check=True, capture_output=True, text=True, timeout=30
    )
    return out.stdout


@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.timeout(300)
def test_the_readme_recipe_keeps_the_secret_off_the_command_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The README's served recipe passes the secret by file: the ``--kv-transfer-config`` it
    builds (on vLLM's command line, and in its logged non-default args) names the file only;
    vLLM's parsed config and omnikv's options resolve the secret from it, and neither their
    reprs nor omnikv's log lines while the connector starts hold it."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omnikv.integrations.vllm import OmniKVConnector
    from omnikv.integrations.vllm.options import parse_options

    arg = _readme_kv_transfer_config("kv_consumer")
    raw = json.loads(arg)
    path = Path(raw["kv_connector_extra_config"]["auth_secret_file"])
    try:
        secret = path.read_bytes().rstrip(b"\n")
        assert len(secret) >= 32 and secret.decode() not in arg
        ktc = KVTransferConfig(**raw)
        options = parse_options(ktc.kv_connector_extra_config, producer=False, consumer=True)
        assert options.secret == secret
        extra = dict(raw["kv_connector_extra_config"])
        extra["omni_kv_config"] = {
            "stage_id": 1,
            "connector_config": {"type": "LocalConnector", "namespace": "secrets"},
        }
        ktc = KVTransferConfig(**{**raw, "kv_connector_extra_config": extra})
        cfg = SimpleNamespace(
            kv_transfer_config=ktc,
            cache_config=SimpleNamespace(block_size=4, enable_prefix_caching=True),
        )
        with caplog.at_level(logging.DEBUG, logger="omnikv"):
            groups = SimpleNamespace(kv_cache_groups=[0])
            sched = OmniKVConnector(cfg, KVConnectorRole.SCHEDULER, groups)
            worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
            worker.shutdown()
        shown = [repr(ktc), str(ktc), repr(options), caplog.text, repr(sched), repr(worker)]
        assert not any(secret.decode() in text for text in shown)
    finally:
        path.unlink()
