"""``omnikv bench shm|manager --plot FILE`` writes a PNG of latency and bandwidth against payload
size from the rows the benchmark printed; without matplotlib the command stops before it runs,
with exit code 2 and the install hint (issue 24, item 7)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnikv.bench.common import Stats
from omnikv.bench.plot import INSTALL_HINT, human_seconds, human_size, size_ticks, write_plot
from omnikv.cli import PLOTTED, main, plot_file_for, split_plot_option

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KIB, MIB = 1 << 10, 1 << 20

# the fastest runs that verify, as in test_bench_smoke.py and test_bench_manager.py
SHM_FAST = [
    "--size-mib",
    "8",
    "--iters",
    "2",
    "--ref-iters",
    "1",
    "--small-iters",
    "20",
    "--no-targets",
]
MANAGER_FAST = [
    "--skip-large",
    "--small-iters",
    "20",
    "--warmup",
    "1",
    "--pool-mib",
    "16",
    "--wait-iters",
    "0",
    "--idle-s",
    "0",
    "--no-targets",
]

# the CLI in a process where every import of matplotlib fails, as where it is not installed
NO_MATPLOTLIB = """\
import sys

class _NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoMatplotlib())
from omnikv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; the group (the benchmark's receiver child
    included) is SIGKILLed when it outlives ``timeout`` and after it exits, so nothing lingers."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{argv[3:]} ran past {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:16]
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0, pixels.shape
    with contextlib.suppress(ImportError):
        from PIL import Image

        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


def _stats(name: str, nbytes: int, median_s: float) -> Stats:
    return Stats(name, [median_s * (1 + i / 50) for i in range(21)], nbytes)


def test_write_plot_draws_synthetic_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = {
        "view": [_stats("v", 224 * MIB, 0.023), _stats("v", 64 * KIB, 130e-6)],
        "copy-out": [_stats("c", 224 * MIB, 0.06)],
    }
    memcpy = [_stats("m", 64 * KIB, 5e-6), _stats("m", 224 * MIB, 0.026)]
    out = write_plot(tmp_path / "synthetic.png", paths, memcpy, title="synthetic")
    assert out == tmp_path / "synthetic.png"
    _assert_png(out)


def test_write_plot_refuses_rows_without_bytes_before_writing(tmp_path: Path) -> None:
    target = tmp_path / "bad.png"
    with pytest.raises(ValueError, match="nbytes > 0"):
        write_plot(target, {"view": [Stats("v", [1e-3], 0)]}, [], title="bad")
    with pytest.raises(ValueError, match="at least one row"):
        write_plot(target, {"view": []}, [_stats("m", KIB, 1e-6)], title="bad")
    assert not target.exists()


def test_human_units_and_size_ticks() -> None:
    assert [human_size(n) for n in (512, 64 * KIB, 224 * MIB, 1536 * MIB)] == [
        "512 B",
        "64 KiB",
        "224 MiB",
        "1.5 GiB",
    ]
    assert [human_seconds(s) for s in (2.5, 1e-3, 1e-4, 5e-6)] == [
        "2.5 s",
        "1 ms",
        "100 \N{MICRO SIGN}s",
        "5 \N{MICRO SIGN}s",
    ]
    ticks = size_ticks(40 * KIB, 360 * MIB, [64 * KIB, 224 * MIB])
    assert 64 * KIB in ticks and 224 * MIB in ticks and 256 * MIB not in ticks
    assert all(t & (t - 1) == 0 for t in ticks if t != 224 * MIB)  # powers of two besides
    assert size_ticks(1, 1 << 40) == [1, KIB, MIB, 1 << 30, 1 << 40]


def test_bench_all_gives_each_plotting_benchmark_its_own_file() -> None:
    assert PLOTTED == ("shm", "manager")
    assert plot_file_for("out/x.png", "shm") == "out/x-shm.png"
    assert plot_file_for("x", "manager") == "x-manager.png"
    split = split_plot_option(["--json", "r.json", "--plot=x.png"])
    assert split == ("x.png", ["--json", "r.json"])
    assert split_plot_option(["--plot", "x.png", "--quick"]) == ("x.png", ["--quick"])
    assert split_plot_option(["--quick"]) == (None, ["--quick"])


@pytest.mark.parametrize("argv", [("bench", "--help"), ("bench", "shm", "--help")])
def test_help_names_the_plot_option(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    with contextlib.suppress(SystemExit):
        main(list(argv))
    text = capsys.readouterr().out
    assert "--plot FILE" in text and INSTALL_HINT in text


@pytest.mark.timeout(120)
def test_bench_shm_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "x.png"
    argv = [sys.executable, "-m", "omnikv.cli", "bench", "shm", *SHM_FAST, "--plot", str(target)]
    proc = _run(argv, timeout=100)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    # --no-targets: a missed speed target (likely on a busy machine) is reported, not fatal;
    # a verification failure still fails the run
    assert proc.returncode == 0, output
    assert f"plot written to {target}" in proc.stdout, output
    _assert_png(target)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_manager_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "m.png"
    argv = [sys.executable, "-m", "omnikv.cli", "bench", "manager", *MANAGER_FAST]
    proc = _run([*argv, "--plot", str(target)], timeout=140)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    _assert_png(target)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "bench", [["shm", *SHM_FAST], ["manager", *MANAGER_FAST], ["all"]], ids=lambda b: b[0]
)
def test_without_matplotlib_the_bench_stops_before_it_runs(
    tmp_path: Path, bench: list[str]
) -> None:
    target = tmp_path / "x.png"
    t0 = time.monotonic()
    proc = _run([sys.executable, "-c", NO_MATPLOTLIB, "bench", *bench, "--plot", str(target)], 80)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert INSTALL_HINT in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "payload:" not in proc.stdout and "case" not in proc.stdout, proc.stdout  # no run
    assert list(tmp_path.iterdir()) == []  # no figure, no x-shm.png either
    assert elapsed < 60, f"took {elapsed:.1f} s to refuse"
