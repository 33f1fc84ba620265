"""Deadlines as absolute ``time.monotonic()`` values (``math.inf`` for none).

A deadline is made once at a public entry point from a timeout in seconds and passed down; every
wait below takes ``remaining(deadline)`` (or ``min(step, remaining)``) so nested waits can never
outlive their caller.
"""

from __future__ import annotations

import math
import time

__all__ = ["deadline_after", "remaining", "validate_timeout"]


def validate_timeout(value: float | None, name: str = "timeout") -> float:
    """Return ``value`` as a float number of seconds; ``None`` means no limit (``math.inf``).

    Raises ``ValueError`` naming ``name`` for negative or NaN values.
    """
    if value is None:
        return math.inf
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from exc
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return seconds


def deadline_after(timeout: float | None, name: str = "timeout") -> float:
    """Absolute monotonic deadline ``timeout`` seconds from now (``math.inf`` for ``None``)."""
    seconds = validate_timeout(timeout, name)
    if math.isinf(seconds):
        return math.inf
    return time.monotonic() + seconds


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative; ``math.inf`` for no deadline)."""
    if math.isinf(deadline):
        return math.inf
    return max(0.0, deadline - time.monotonic())
