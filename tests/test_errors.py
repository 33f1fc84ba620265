"""The error tree: what is retryable (``transient``) and what code written for the reference
still catches (``ValueError`` for payload errors, ``RuntimeError`` for consume errors)."""

from __future__ import annotations

import pytest

from omnikv import errors


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (errors.ConnectorUnavailableError("down"), True),
        (errors.PoolExhaustedError("full"), True),
        (errors.ConnectorClosedError("closed"), False),
        (errors.PeerGoneError("gone"), False),
        (errors.ConnectorError("other"), False),
        (errors.DecodeError("bad"), False),
        (errors.ConfigError("bad"), False),
        (RuntimeError("not ours"), False),
    ],
)
def test_only_errors_marked_transient_are_retryable(exc: BaseException, transient: bool) -> None:
    assert errors.is_transient(exc) is transient


def test_receive_timeout_says_which_request_and_how_long() -> None:
    exc = errors.ReceiveTimeout("r1", 1.5, "key k missing")
    assert isinstance(exc, TimeoutError) and exc.request_id == "r1" and exc.waited_s == 1.5
    assert "r1" in str(exc) and "1.500s" in str(exc) and "key k missing" in str(exc)


def test_reference_base_classes_are_kept() -> None:
    assert issubclass(errors.DecodeError, ValueError)
    assert issubclass(errors.KVPrefetchConsumeError, RuntimeError)
