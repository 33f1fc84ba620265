"""The strict value parser (omnikv.values): what each parser accepts and what it refuses."""

from __future__ import annotations

import pytest

from omnikv import ConfigError
from omnikv.values import (
    parse_bool,
    parse_choice,
    parse_int,
    parse_number,
    parse_port,
    parse_positive,
    parse_ratio,
    parse_secret,
    parse_size,
)


def test_parse_bool() -> None:
    assert parse_bool("k", True) is True and parse_bool("k", "fAlSe") is False
    assert parse_bool("k", None) is False and parse_bool("k", None, default=True) is True
    for bad in ("yes", "0", 0, 1, 2.0, [], "false, really"):
        with pytest.raises(ConfigError, match=r"^k must be a boolean"):
            parse_bool("k", bad)


def test_parse_numbers() -> None:
    assert parse_int("n", "12", 1) == 12 and parse_int("n", None, 7) == 7
    assert parse_int("n", 0, 1, minimum=0) == 0
    for bad in (True, 1.5, "1.5", "x", [3], "+-5", "1_0", "9" * 5000):
        with pytest.raises(ConfigError, match=r"^n must be an integer"):
            parse_int("n", bad, 1)
    assert parse_number("t", "2.5", 1.0) == 2.5 and parse_number("t", None, 3) == 3.0
    for bad in (float("nan"), float("inf"), "inf", True, [1]):
        with pytest.raises(ConfigError, match=r"^t must be a finite number"):
            parse_number("t", bad, 1.0)
    assert parse_positive("buffer_ttl_seconds", 0.5, 300.0) == 0.5
    for bad in (0, -1, -300):
        with pytest.raises(ConfigError, match=r"^buffer_ttl_seconds must be"):
            parse_positive("buffer_ttl_seconds", bad, 300.0)
    assert parse_ratio("r", 1, 0.0) == 1.0
    with pytest.raises(ConfigError, match=r"^r must be in \[0, 1\]"):
        parse_ratio("r", 1.01, 0.0)


def test_parse_port() -> None:
    assert parse_port("zmq_port", 50051, 1) == 50051 and parse_port("zmq_port", "5555", 1) == 5555
    assert parse_port("zmq_port", 0, 1, allow_zero=True) == 0
    for bad in (70000, 65536, 0, -1, "http"):
        with pytest.raises(ConfigError, match=r"^zmq_port"):
            parse_port("zmq_port", bad, 1)


def test_parse_secret_and_choice() -> None:
    assert parse_secret("auth_secret", None) is None
    assert parse_secret("auth_secret", "s3") == b"s3" and parse_secret("auth_secret", b"x") == b"x"
    with pytest.raises(ConfigError, match="auth_secret is empty"):
        parse_secret("auth_secret", "")
    with pytest.raises(ConfigError, match="auth_secret must be a string"):
        parse_secret("auth_secret", 1234)
    assert parse_choice("c", None, "a", ("a", "b")) == "a"
    with pytest.raises(ConfigError, match=r"^c must be one of"):
        parse_choice("c", "z", "a", ("a", "b"))


def test_parse_size() -> None:
    assert parse_size("memory_pool_size", None, 7) == 7
    assert parse_size("memory_pool_size", 4096, 1) == 4096
    assert parse_size("memory_pool_size", "512MB", 1) == 512 << 20
    assert parse_size("memory_pool_size", "1GiB", 1) == 1 << 30
    assert parse_size("memory_pool_size", "1.5g", 1) == 3 << 29
    for bad in (0, -1, "-1K", "0.3", True, 1.5, "lots", "nanGB", "infG", ""):
        with pytest.raises(ConfigError, match=r"^memory_pool_size must be"):
            parse_size("memory_pool_size", bad, 1)
