"""The ``omnikv`` command line: help for every command, the benchmark list, ``inspect`` and a
``doctor`` that imports each backend for real."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from omnikv.cli import BENCHES, main, plain_text
from omnikv.wire.transfer_data import KVCacheTransferData


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's --help
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _is_plain(text: str) -> bool:
    return "``" not in text and ":func:" not in text and ":class:" not in text


def test_top_level_help_lists_every_command_and_no_stray_positional(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, text = _run(capsys, "--help")
    assert rc == 0 and _is_plain(text)
    for command in ("demo", "bench", "inspect", "doctor"):
        assert command in text
    assert "rest" not in text
    rc, text = _run(capsys)  # no command: the same help, exit code 2
    assert rc == 2 and "COMMAND" in text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("demo", "--help"), "--new-tokens"),
        (("inspect", "--help"), "payload file"),
        (("doctor", "--help"), "connector"),
        (("bench", "codec", "--help"), "--tokens"),
    ],
)
def test_every_command_has_plain_help(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], expected: str
) -> None:
    rc, text = _run(capsys, *argv)
    assert rc == 0 and expected in text and _is_plain(text)


def test_bench_help_describes_each_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _run(capsys, "bench", "--help")
    assert rc == 0 and _is_plain(text)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    for name in BENCHES:
        if importlib.util.find_spec(f"omnikv.bench.{name}") is not None:
            assert len(lines[name].split()) > 4, lines[name]  # a name and a description
    assert _run(capsys, "bench")[0] == 2
    assert _run(capsys, "bench", "nosuch")[0] == 2


def test_plain_text_drops_restructuredtext() -> None:
    doc = "``omnikv bench x``: see :func:`omnikv.wire.decode.decode` and **this**.\n\n* one\n* two"
    assert (
        plain_text(doc) == "omnikv bench x: see omnikv.wire.decode.decode and this.\n\n- one\n- two"
    )


def test_inspect_prints_the_payload_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = KVCacheTransferData(
        request_id="req-7",
        layer_blocks={"key_cache": [torch.zeros(5, 2, 8)], "value_cache": [torch.zeros(5, 2, 8)]},
        block_ids=[3],
        metadata={"seq_len": 5},
    )
    path = tmp_path / "req-7.kv"
    path.write_bytes(kv.to_bytes())
    rc, text = _run(capsys, "inspect", str(path))
    summary = json.loads(text)
    assert rc == 0 and summary["request_id"] == "req-7"
    assert summary["layers"] == [{"dtype": "torch.float32", "shape": [5, 2, 8]}]


def _doctor_lines(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    rc, text = _run(capsys, "doctor")
    assert rc == 0
    return {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if ":" in line
    }


def test_doctor_imports_each_engine_for_real(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("mooncake", "mooncake.engine", "mooncake.store", "nixl._api", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the engines were not installed
    lines = _doctor_lines(capsys)
    for name in ("MooncakeConnector", "MooncakeTransferEngineConnector", "MooncakeStoreConnector"):
        assert lines[f"connector {name}"].startswith("unavailable: Mooncake is not importable")
        assert "omnikv[mooncake]" in lines[f"connector {name}"]
    nixl = lines["connector NixlConnector"]
    assert nixl.startswith("unavailable: ") and "NIXL is not importable" in nixl
    assert lines["connector SharedMemoryConnector"] == "ok"
    assert lines["connector LocalConnector"] == "ok"


def test_doctor_reports_the_integrations(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _doctor_lines(capsys)
    hf = lines["integration transformers"]
    if importlib.util.find_spec("transformers") is None:
        assert hf.startswith("not installed")
    else:
        assert hf.startswith("ok (transformers ") and "omnikv.integrations.transformers" in hf
    vllm = lines["integration vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert vllm.startswith("not installed here; give vLLM its own environment")
        assert "make vllm-env" in vllm and "pip install" not in vllm
    else:
        assert vllm.startswith(("ok (vllm ", "unavailable: "))


def test_doctor_reports_the_shared_memory_send_pool(capsys: pytest.CaptureFixture[str]) -> None:
    pool = _doctor_lines(capsys)["shared-memory send pool"]
    assert pool.startswith("1024 MiB, committed as used; start-up reserve 16 MiB")
    assert "set expected_payload_bytes, or kv_bytes_per_token and max_model_len" in pool


class _Parsed(Exception):
    """Carries the parser a benchmark built, instead of running it."""


@pytest.mark.parametrize("name", BENCHES)
def test_every_benchmark_option_has_help_and_the_description_keeps_its_layout(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import importlib

    try:
        module = importlib.import_module(f"omnikv.bench.{name}")
    except ImportError as exc:  # pragma: no cover - an engine missing here
        pytest.skip(f"omnikv.bench.{name}: {exc}")

    def grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    with pytest.raises(_Parsed) as got:
        module.main([])
    parser = got.value.args[0]
    assert isinstance(parser, argparse.ArgumentParser)
    assert [a.option_strings for a in parser._actions if a.help is None] == []
    assert issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)


def test_bench_shm_help_keeps_its_bullets(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _run(capsys, "bench", "shm", "--help")
    assert rc == 0 and _is_plain(text)
    assert "\n- view: a KV payload" in text and "\n- 64 KiB: small payloads" in text
    assert "--model MODEL         the model whose KV shape is sent" in text


def test_table_header_names_the_whole_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    from omnikv.bench.common import Stats, print_table

    base = Stats("memcpy (aligned, pre-faulted)", [1e-3, 1e-3], 1 << 20)
    print_table([base], baseline=base, title="t")
    head = capsys.readouterr().out.splitlines()[2]
    assert head.rstrip().endswith("x memcpy") and "(aligne" not in head


def test_doctor_explains_vllms_cpu_kv_cache_space() -> None:
    from omnikv.cli import vllm_cpu_note

    unset = vllm_cpu_note(None)
    assert "VLLM_CPU_KVCACHE_SPACE is unset" in unset and "omnikv demo --save-model" in unset
    assert vllm_cpu_note("1").startswith("VLLM_CPU_KVCACHE_SPACE=1 (GiB")
