"""Pieces shared by the two Mooncake connectors (no Mooncake import here).

* :func:`import_mooncake_engine` / :func:`import_mooncake_store`: the lazy imports, translated
  into an ``ImportError`` that names the extra to install; :func:`unavailable_reason` says up
  front whether they would succeed.
* :func:`encode_object` / :func:`decode_if_object`: non-raw objects (dicts the reference would
  msgpack) travel as ``MAGIC + msgpack``. The magic's first four bytes read as a big-endian header
  length of about 4.28 GB, far above the payload format's header limit, so a packed KV payload is
  never mistaken for an object and vice versa.
* :func:`as_host_bytes`: a zero-copy ``memoryview`` of bytes-like data / host tensors.
* :func:`matches_request`: the ``cleanup(request_id)`` rule shared with the other connectors.
* :func:`resolve_host`: the bind-what-you-are-told rule ("auto" is the only detection).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import msgpack
import numpy as np
import torch

from omnikv.connectors.base import ManagedBuffer
from omnikv.errors import ConfigError

__all__ = [
    "MAGIC",
    "as_host_bytes",
    "decode_if_object",
    "encode_object",
    "import_mooncake_engine",
    "import_mooncake_store",
    "matches_request",
    "parse_size",
    "resolve_host",
    "set_tcp_bind_address",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

MAGIC = b"\xffOMKVMP1"
_MISSING_HINT = (
    "Mooncake is not importable; install it with pip install 'omnikv[mooncake]' "
    "(CPU-only hosts: mooncake-transfer-engine-non-cuda, plus Debian's libibverbs1)"
)


def unavailable_reason() -> str | None:
    """Why the Mooncake connectors cannot run here (with the install hint), or ``None``.

    Imports the engine, the store and pyzmq. Called by ``omnikv bench mooncake`` before it
    starts peers, and by the engine tests to decide whether to skip.
    """
    try:
        import mooncake.engine
        import mooncake.store  # noqa: F401
        import zmq  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a missing libibverbs
        return f"{_MISSING_HINT}: {exc}"
    return None


def import_mooncake_engine() -> Any:
    """``mooncake.engine.TransferEngine``; ``ImportError`` with the install hint otherwise."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"{_MISSING_HINT}: {exc}") from exc
    return TransferEngine


def import_mooncake_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)``; ``ImportError`` with the hint otherwise."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ImportError(f"{_MISSING_HINT}: {exc}") from exc
    return MooncakeDistributedStore, ReplicateConfig


def resolve_host(host: Any) -> str:
    """The address to bind and advertise: exactly ``host``; ``"auto"`` detects a routable IP.

    Wildcards are refused: a peer must be told an address it can reach, and omnikv binds what it
    advertises. The detection opens a UDP socket towards a public address without sending.
    """
    value = "127.0.0.1" if host is None or host == "" else str(host)
    if value in {"0.0.0.0", "::", "*"}:
        raise ConfigError(
            f"host {value!r} is a wildcard; configure the address peers should use, or 'auto'"
        )
    if value != "auto":
        return value
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing lookup only, nothing is sent
        return str(probe.getsockname()[0])
    except OSError:
        logger.warning("host='auto' found no routable address; using 127.0.0.1")
        return "127.0.0.1"
    finally:
        probe.close()


def set_tcp_bind_address(host: str) -> None:
    """Make the engine's TCP transport bind ``host`` unless the operator set it already.

    Mooncake reads ``MC_TCP_BIND_ADDRESS`` at engine start; without it the TCP transport
    advertises (and listens on) the machine's first non-loopback address.
    """
    current = os.environ.get("MC_TCP_BIND_ADDRESS")
    if current is None:
        os.environ["MC_TCP_BIND_ADDRESS"] = host
    elif current != host:
        logger.warning("MC_TCP_BIND_ADDRESS=%s differs from the configured host %s", current, host)


def parse_size(value: Any, name: str) -> int:
    """A positive byte count from an int or a string with an optional KB/MB/GB suffix."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, int | float):
        n = int(value)
    else:
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        mult = 1
        for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
            if text.endswith(suffix):
                text, mult = text[:-1], m
                break
        try:
            n = int(float(text) * mult)
        except ValueError as exc:
            raise ConfigError(f"{name} must be a byte count, got {value!r}") from exc
    if n <= 0:
        raise ConfigError(f"{name} must be > 0 bytes, got {value!r}")
    return n


def encode_object(obj: Any) -> bytes:
    """``MAGIC + msgpack(obj)`` for objects that are not raw bytes (reference's non-raw path)."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return MAGIC + packed


def decode_if_object(buf: ManagedBuffer, size: int) -> tuple[Any, int] | None:
    """If ``buf`` holds an encoded object, decode it, release ``buf`` and return ``(obj, size)``."""
    if size < len(MAGIC):
        return None
    t = buf.tensor
    if bytes(t[: len(MAGIC)].numpy()) != MAGIC:
        return None
    try:
        obj = msgpack.unpackb(t[len(MAGIC) : size].numpy().data, raw=False)
    finally:
        buf.release()
    return obj, size


def as_host_bytes(data: Any) -> memoryview | None:
    """A flat byte view of host data (bytes-like, numpy, contiguous CPU tensor); else ``None``.

    Device tensors are copied to host (one copy) since the pools here are host memory.
    """
    if isinstance(data, ManagedBuffer):
        data = data.tensor
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1).view(torch.uint8)
        return t.numpy().data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B")
    return None


def matches_request(transport_key: str, request_id: str) -> bool:
    """True when the key (before its ``@from_to`` suffix) is, starts or ends with the id."""
    base = transport_key.rsplit("@", 1)[0]
    return (
        base == request_id or base.startswith(f"{request_id}_") or base.endswith(f"_{request_id}")
    )
