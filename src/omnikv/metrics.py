"""Counters and phase histograms for sends and receives, exportable as Prometheus text.

The manager records one observation per request (outcome + phase timings + bytes); reading is
cheap and thread-safe. No dependency on a Prometheus client: :meth:`TransferMetrics.prometheus`
renders the text exposition format, which any scraper or sidecar can serve.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

__all__ = ["BUCKETS_MS", "TransferMetrics"]

#: Histogram bucket upper bounds in milliseconds.
BUCKETS_MS: tuple[float, ...] = (0.1, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000)


class _Histogram:
    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS_MS) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for i, bound in enumerate(BUCKETS_MS):
            if value <= bound:
                self.buckets[i] += 1
                return
        self.buckets[-1] += 1


class TransferMetrics:
    """Outcome counters (``direction``, ``status``), bytes, and per-phase latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str], int] = defaultdict(int)
        self._bytes: dict[str, int] = defaultdict(int)
        self._phases: dict[tuple[str, str], _Histogram] = {}

    def record(
        self, direction: str, status: str, nbytes: int, timings_ms: Mapping[str, float]
    ) -> None:
        """Called by the manager once per request; never raises."""
        with self._lock:
            self._outcomes[(direction, status)] += 1
            self._bytes[direction] += int(nbytes)
            for phase, ms in timings_ms.items():
                key = (direction, phase.removesuffix("_ms"))
                hist = self._phases.get(key)
                if hist is None:
                    hist = self._phases[key] = _Histogram()
                hist.observe(float(ms))

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy: outcomes, bytes, and per-phase count / mean (ms)."""
        with self._lock:
            return {
                "outcomes": {f"{d}.{s}": n for (d, s), n in sorted(self._outcomes.items())},
                "bytes": dict(self._bytes),
                "phases_ms": {
                    f"{d}.{p}": {"count": h.count, "mean": h.total / h.count if h.count else 0.0}
                    for (d, p), h in sorted(self._phases.items())
                },
            }

    def prometheus(self, prefix: str = "omnikv") -> str:
        """The metrics in Prometheus text exposition format."""
        lines = [f"# TYPE {prefix}_requests_total counter"]
        with self._lock:
            for (d, s), n in sorted(self._outcomes.items()):
                lines.append(f'{prefix}_requests_total{{direction="{d}",status="{s}"}} {n}')
            lines.append(f"# TYPE {prefix}_bytes_total counter")
            for d, n in sorted(self._bytes.items()):
                lines.append(f'{prefix}_bytes_total{{direction="{d}"}} {n}')
            lines.append(f"# TYPE {prefix}_phase_ms histogram")
            for (d, p), h in sorted(self._phases.items()):
                labels = f'direction="{d}",phase="{p}"'
                acc = 0
                for bound, n in zip((*BUCKETS_MS, "+Inf"), h.buckets, strict=True):
                    acc += n
                    lines.append(f'{prefix}_phase_ms_bucket{{{labels},le="{bound}"}} {acc}')
                lines.append(f"{prefix}_phase_ms_sum{{{labels}}} {h.total}")
                lines.append(f"{prefix}_phase_ms_count{{{labels}}} {h.count}")
        return "\n".join(lines) + "\n"
