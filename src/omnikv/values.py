"""The one strict value parser: every omnikv key and every connector key is read through it.

Values are strict: booleans are ``true``/``false`` (or those strings, any case), counts and sizes
are integers (sizes may carry a K/M/G/T suffix), timeouts are finite numbers, ports are in range;
anything else is a :class:`~omnikv.errors.ConfigError` naming the key. Nothing is coerced with
``bool(...)``, ``int(...)`` or ``float(...)``: ``bool("false")`` is ``True`` and ``int(2.9)`` is 2.
Each parser takes the key (for the message), the raw value (``None`` when the key is absent) and
the default.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from omnikv.errors import ConfigError

__all__ = [
    "parse_bool",
    "parse_choice",
    "parse_int",
    "parse_number",
    "parse_port",
    "parse_positive",
    "parse_ratio",
    "parse_secret",
    "parse_size",
    "redacted",
    "resolve_secret",
]

#: The environment variable a shared secret is read from when the config names none.
SECRET_ENV = "OMNIKV_AUTH_SECRET"
#: Largest secret file read (bytes).
MAX_SECRET_FILE_BYTES = 4096
#: Config keys whose values are secrets: never shown (:func:`redacted`).
SECRET_KEYS = frozenset({"auth_secret"})

_TRUE_FALSE = {"true": True, "false": False}
_INT_TEXT = re.compile(r"[+-]?[0-9]{1,18}")


def parse_bool(key: str, value: Any, default: bool = False) -> bool:
    """A boolean: ``True``/``False``, or the strings ``"true"``/``"false"`` in any case.

    ``None`` (key absent) gives ``default``. Anything else (``"no"``, ``0``, ``1``) is a
    :class:`ConfigError` naming ``key``: ``bool("false")`` is ``True``, so nothing is coerced.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE_FALSE:
        return _TRUE_FALSE[value.strip().lower()]
    raise ConfigError(f"{key} must be a boolean (true or false), got {value!r:.60}")


def parse_int(key: str, value: Any, default: int, *, minimum: int = 1) -> int:
    """An integer ``>= minimum``: an ``int`` or a string of decimal digits (``None``: default)."""
    if value is None:
        return default
    out: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        out = value
    elif isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        out = int(value.strip())
    if out is None:
        raise ConfigError(f"{key} must be an integer, got {value!r:.60}")
    if out < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {out}")
    return out


def parse_number(key: str, value: Any, default: float, *, minimum: float = 0.0) -> float:
    """A finite number ``>= minimum`` (int, float or numeric string; ``None``: default)."""
    if value is None:
        return float(default)
    out: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value)
        except ValueError:
            out = None
    if out is None or not math.isfinite(out):
        raise ConfigError(f"{key} must be a finite number, got {value!r:.60}")
    if out < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {out}")
    return out


def parse_positive(key: str, value: Any, default: float) -> float:
    """A finite number ``> 0`` (sizes, timeouts, intervals); ``None`` gives ``default``."""
    out = parse_number(key, value, default, minimum=0.0)
    if out <= 0:
        raise ConfigError(f"{key} must be > 0, got {out}")
    return out


def parse_ratio(key: str, value: Any, default: float) -> float:
    """A fraction in ``[0, 1]``."""
    out = parse_number(key, value, default, minimum=0.0)
    if out > 1:
        raise ConfigError(f"{key} must be in [0, 1], got {out}")
    return out


_SIZE_SUFFIXES = (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40))


def parse_size(key: str, value: Any, default: int) -> int:
    """A positive byte count: an ``int`` or a string with an optional K/M/G/T suffix
    (``"512MB"``, ``"1GiB"``, ``"1.5G"``; binary multiples); ``None`` gives ``default``."""
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        out = value
    elif isinstance(value, str):
        out = _size_from_text(key, value)
    else:
        raise ConfigError(
            f"{key} must be a byte count (e.g. 1073741824 or '1GB'), got {value!r:.60}"
        )
    if out <= 0:
        raise ConfigError(f"{key} must be > 0 bytes, got {value!r:.60}")
    return out


def _size_from_text(key: str, value: str) -> int:
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, factor in _SIZE_SUFFIXES:
        if text.endswith(suffix):
            text, mult = text[:-1], factor
            break
    try:
        number = float(text) * mult
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or not number.is_integer():
        raise ConfigError(
            f"{key} must be a byte count (e.g. 1073741824 or '1GB'), got {value!r:.60}"
        )
    return int(number)


def parse_port(key: str, value: Any, default: int, *, allow_zero: bool = False) -> int:
    """A TCP port in ``[1, 65535]`` (``0``, "any free port", only with ``allow_zero``)."""
    out = parse_int(key, value, default, minimum=0 if allow_zero else 1)
    if out > 65535:
        raise ConfigError(f"{key} must be a TCP port <= 65535, got {out}")
    return out


def parse_secret(key: str, value: Any) -> bytes | None:
    """A shared secret: absent (``None``) or a non-empty ``str``/``bytes``.

    An empty secret is refused: it would silently turn authentication off; omit the key instead.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes):
        raise ConfigError(f"{key} must be a string, got {type(value).__name__}")
    if not value:
        raise ConfigError(f"{key} is empty: omit it to run without authentication")
    return value


def resolve_secret(cfg: Mapping[str, Any], where: str = "", *, env: bool = True) -> bytes | None:
    """The shared secret a config names: ``auth_secret`` (the value), or ``auth_secret_file``
    (a path: the file's bytes, one trailing newline dropped, at most
    :data:`MAX_SECRET_FILE_BYTES`), else, with ``env``, the environment variable
    :data:`SECRET_ENV`; ``None`` when none is set. Called by every connector that takes
    ``auth_secret`` (the pull engines' settings, the vLLM connector's options); ``where``
    prefixes the key names in errors. Both keys at once, an empty secret, an unreadable or
    oversized file are :class:`ConfigError` s; no error or log line ever holds the secret."""
    inline, path = cfg.get("auth_secret"), cfg.get("auth_secret_file")
    if inline is not None and path is not None:
        raise ConfigError(f"{where}auth_secret and {where}auth_secret_file are both set: give one")
    if path is not None:
        return _secret_file(f"{where}auth_secret_file", path)
    if inline is not None:
        return parse_secret(f"{where}auth_secret", inline)
    value = os.environ.get(SECRET_ENV) if env else None
    return None if value is None else parse_secret(SECRET_ENV, value)


def _secret_file(key: str, path: Any) -> bytes:
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ConfigError(f"{key} must be a file path, got {type(path).__name__}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r:.200}: {exc.strerror}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{key}: {str(path)!r:.200} is over {MAX_SECRET_FILE_BYTES} bytes")
    if data.endswith(b"\n"):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    if not data:
        raise ConfigError(f"{key}: {str(path)!r:.200} is empty")
    return data


def redacted(value: Any) -> Any:
    """``value`` with every :data:`SECRET_KEYS` entry of every mapping in it (nested in
    mappings, lists and tuples) replaced by ``"<redacted>"``: for reprs and log lines of
    configs. Other values are returned as they are."""
    if isinstance(value, Mapping):
        return {
            k: "<redacted>" if k in SECRET_KEYS and v is not None else redacted(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redacted(v) for v in value)
    return value


def parse_choice(key: str, value: Any, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (exact string); ``None`` gives ``default``."""
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key} must be one of {choices}, got {value!r:.60}")
    return value
