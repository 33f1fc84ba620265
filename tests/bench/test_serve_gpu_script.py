"""``scripts/serve_gpu.sh``: its options and GPU checks, run here with a stand-in ``nvidia-smi``
(no GPU on the host that runs the suite); what it runs is ``omnikv bench serve --device cuda``,
whose options are checked in test_bench_serve.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from omnikv.bench import serve
from support import paths

pytestmark = pytest.mark.timeout(60)

SCRIPT = paths.SCRIPTS / "serve_gpu.sh"


def _run(args: list[str], bin_dir: Path | None, gpus: int | None = None) -> tuple[int, str, str]:
    """Run the script with only ``bin_dir`` (a stand-in nvidia-smi listing ``gpus`` GPUs, or
    none) and the system's tools on PATH."""
    env = dict(os.environ, PATH=os.pathsep.join(p for p in ("/usr/bin", "/bin") if p))
    if bin_dir is not None:
        smi = bin_dir / "nvidia-smi"
        lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus or 0))
        smi.write_text("#!/bin/sh\n" + lines)
        smi.chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_help() -> None:
    rc, out, _ = _run(["--help"], None)
    assert rc == 0 and "usage: scripts/serve_gpu.sh" in out and "--share-gpu" in out


def test_without_a_gpu_it_refuses() -> None:
    rc, out, err = _run(["--dry-run"], None)
    assert rc == 2 and out == "" and "no GPU here" in err


def test_two_gpus_one_engine_each(tmp_path: Path) -> None:
    rc, out, err = _run(
        ["--dry-run", "--python", "/opt/py", "--clients", "4", "--", "--tokens", "1024"],
        tmp_path,
        gpus=2,
    )
    assert rc == 0, err
    argv = shlex.split(out)
    assert argv[:5] == ["/opt/py", "-m", "omnikv.cli", "bench", "serve"]
    rest = argv[5:]
    assert rest == ["--device", "cuda", "--gpus", "0,1", "--clients", "4", "--tokens", "1024"]
    ns = serve.parse_args(rest)  # what it runs is a valid bench serve command line
    assert (ns.device, ns.gpus, ns.clients, ns.tokens) == ("cuda", "0,1", "4", "1024")
    assert "producer on GPU 0, consumer on GPU 1" in err


def test_chosen_gpus_must_exist_and_differ(tmp_path: Path) -> None:
    rc, out, err = _run(["--dry-run", "--producer-gpu", "3", "--consumer-gpu", "1"], tmp_path, 4)
    assert rc == 0 and shlex.split(out)[-2:] == ["--gpus", "3,1"]
    rc, _, err = _run(["--dry-run", "--consumer-gpu", "2"], tmp_path, 2)
    assert rc == 2 and "2 GPU(s) visible" in err
    rc, _, err = _run(["--dry-run", "--consumer-gpu", "0"], tmp_path, 2)
    assert rc == 2 and "different GPUs" in err
    rc, _, err = _run(["--dry-run", "--producer-gpu", "x"], tmp_path, 2)
    assert rc == 2 and "a GPU index is a number" in err


def test_one_gpu_needs_share_gpu(tmp_path: Path) -> None:
    rc, _, err = _run(["--dry-run"], tmp_path, 1)
    assert rc == 2 and "--share-gpu" in err
    rc, out, err = _run(["--dry-run", "--share-gpu"], tmp_path, 1)
    assert rc == 0, err
    rest = shlex.split(out)[5:]
    assert rest == ["--device", "cuda", "--gpus", "0,0", "--gpu-memory-utilization", "0.4"]
    ns = serve.parse_args(rest)
    assert serve.server_env("kv_producer", ns.device, ns.gpus.split(",")) == {
        "CUDA_VISIBLE_DEVICES": "0"
    }
