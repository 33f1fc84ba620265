"""Latency and bandwidth against payload size, drawn from a benchmark's rows (``--plot FILE``).

``omnikv bench shm`` and ``omnikv bench manager`` call :func:`write_plot` after their report
with the rows they printed (nothing is measured here). The PNG has two panels sharing a log-scale
payload-size axis labelled in KiB/MiB/GiB: the median latency of each path with its p99 as an
error bar, and the bandwidth (bytes / median, down to bytes / p99). The memcpy rows of the same
run are drawn as a dashed line: the ceiling of this machine.

matplotlib is an optional dependency (``pip install 'omnikv[plot]'``), imported only by this
module's functions, with the non-interactive Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnikv.bench.common import Stats

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "INSTALL_HINT",
    "add_plot_option",
    "human_seconds",
    "human_size",
    "require_plot",
    "size_ticks",
    "unavailable_reason",
    "write_plot",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'omnikv[plot]'"
CEILING_LABEL = "memcpy (ceiling)"

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("\N{MICRO SIGN}s", 1e-6), ("ns", 1e-9))


def unavailable_reason() -> str | None:
    """Why ``--plot`` cannot work here (matplotlib missing or failing to import, with the
    install hint), or None. Imports matplotlib for real; called before a benchmark starts so that
    a run never ends without its figure."""
    try:
        import matplotlib
        import matplotlib.backends.backend_agg  # noqa: F401 - the canvas write_plot draws on
    except ImportError as exc:
        return f"--plot needs matplotlib, which is not importable here ({exc}): {INSTALL_HINT}"
    logger.debug("matplotlib %s available for --plot", matplotlib.__version__)
    return None


def add_plot_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--plot FILE`` to a benchmark's parser (``args.plot``: the path or None)."""
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also write a PNG of latency (median, p99) and bandwidth against payload size, "
        f"next to the memcpy ceiling (needs matplotlib: {INSTALL_HINT})",
    )


def require_plot(parser: argparse.ArgumentParser, plot: str | None) -> None:
    """Exit with status 2 and the install hint (argparse's error, no traceback) when ``plot`` is
    set and matplotlib cannot be imported. Called by a benchmark right after parsing, before it
    measures anything."""
    if plot:
        reason = unavailable_reason()
        if reason is not None:
            parser.error(reason)


def human_size(nbytes: float) -> str:
    """``65536`` -> ``"64 KiB"``, ``234881024`` -> ``"224 MiB"`` (binary units, 3 digits)."""
    value = float(nbytes)
    for unit in _SIZE_UNITS:
        if abs(value) < 1024 or unit == _SIZE_UNITS[-1]:
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def human_seconds(seconds: float) -> str:
    """``0.0001`` -> ``"100 µs"``, ``0.025`` -> ``"25 ms"`` (3 significant digits)."""  # noqa: RUF002
    for unit, scale in _TIME_UNITS:
        if seconds >= scale * (1 - 1e-9):
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def size_ticks(lo: float, hi: float, sizes: Sequence[int] = (), most: int = 8) -> list[int]:
    """Tick positions in bytes for a log axis from ``lo`` to ``hi``: every measured size in
    ``sizes`` (within the range) and the powers of two between them, at most ``most`` powers on
    a stride of 1, 2, 5, 10 or 20 exponents (1 KiB, 1 MiB, 1 GiB when the range is wide); a
    power of two within a factor of 2 of a measured size is left out so labels do not collide."""
    first = max(0, math.ceil(math.log2(max(lo, 1.0))))
    last = math.floor(math.log2(max(hi, 1.0)))
    exponents: list[int] = []
    for stride in (1, 2, 5, 10, 20):
        exponents = [e for e in range(first, last + 1) if e % stride == 0]
        if len(exponents) <= most:
            break
    measured = sorted({n for n in sizes if lo <= n <= hi})
    powers = [1 << e for e in exponents]
    powers = [p for p in powers if all(max(p, n) / min(p, n) > 2 for n in measured if n != p)]
    return sorted({*powers, *measured})


def _sorted_rows(label: str, rows: Sequence[Stats]) -> list[Stats]:
    for st in rows:
        if st.nbytes <= 0 or not st.samples:
            raise ValueError(
                f"plot row {st.name!r} of {label!r}: expected nbytes > 0 and samples, got "
                f"nbytes={st.nbytes} and {len(st.samples)} samples"
            )
    return sorted(rows, key=lambda st: st.nbytes)


def write_plot(
    path: str | Path,
    paths: Mapping[str, Sequence[Stats]],
    ceiling: Sequence[Stats],
    *,
    title: str,
) -> Path:
    """Write the two-panel PNG to ``path`` and return it.

    ``paths`` maps a line's label to its rows (one :class:`Stats` per payload size, ``nbytes``
    set); ``ceiling`` holds the memcpy rows of the same run. Raises ``ValueError`` for a row
    without bytes or samples (before anything is written), ``ImportError`` without matplotlib and
    ``OSError`` when the file cannot be written. The file is PNG whatever its suffix.
    """
    lines = {label: _sorted_rows(label, rows) for label, rows in paths.items()}
    memcpy = _sorted_rows(CEILING_LABEL, ceiling)
    if not any(lines.values()):
        raise ValueError("plot: expected at least one row to draw, got none")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 4.8), layout="constrained")
    FigureCanvasAgg(fig)  # the figure draws on Agg (no display, no pyplot state)
    latency, bandwidth = fig.subplots(1, 2)
    for label, rows in lines.items():
        _draw(latency, bandwidth, label, rows, color=None, linestyle="-")
    if memcpy:
        _draw(latency, bandwidth, CEILING_LABEL, memcpy, color="black", linestyle="--")
    every = [st.nbytes for rows in (*lines.values(), memcpy) for st in rows]
    _size_axis(latency, every)
    _size_axis(bandwidth, every)
    _latency_axis(latency)
    bandwidth.set_ylabel("bandwidth, GB/s (median; bar: p99)")
    bandwidth.set_ylim(bottom=0)
    bandwidth.grid(True, which="major", alpha=0.3)
    latency.legend(fontsize="small")
    fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, format="png", dpi=110)
    logger.info("plot written to %s", out)
    return out


def _draw(
    latency: Axes,
    bandwidth: Axes,
    label: str,
    rows: Sequence[Stats],
    *,
    color: str | None,
    linestyle: str,
) -> None:
    sizes = [st.nbytes for st in rows]
    zeros = [0.0] * len(rows)
    style: dict[str, Any] = {
        "label": label,
        "capsize": 3,
        "color": color,
        "linestyle": linestyle,
        "marker": "o",
    }
    above = [max(0.0, st.p99 - st.median) for st in rows]
    latency.errorbar(sizes, [st.median for st in rows], yerr=[zeros, above], **style)
    below = [max(0.0, st.gbps() - st.gbps(st.p99)) for st in rows]
    bandwidth.errorbar(sizes, [st.gbps() for st in rows], yerr=[below, zeros], **style)


def _size_axis(ax: Axes, sizes: Sequence[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = min(sizes), max(sizes)
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.6, hi * 1.6)
    ax.xaxis.set_major_locator(FixedLocator(size_ticks(lo / 1.6, hi * 1.6, sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_size(x)))
    ax.set_xlabel("payload size")


def _latency_axis(ax: Axes) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=10))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: human_seconds(y)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("latency (median; bar: p99)")
    ax.grid(True, which="major", alpha=0.3)
