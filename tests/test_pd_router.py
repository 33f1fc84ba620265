"""examples/pd_router.py against stand-in servers (aiohttp apps on loopback): what it sends to the
producer and the consumer, streaming pass-through, errors, /v1/models and /health. The router
in front of real vLLM servers is tested in tests/integrations/vllm_connector/test_vllm_serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402 - after the skip

from support import paths  # noqa: E402

ROUTER_PATH = paths.EXAMPLES / "pd_router.py"
PARAMS = {"do_remote_prefill": True, "omnikv_transfer_id": "okv1-0123abcd-" + "5" * 32}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _load_router() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pd_router", ROUTER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pd_router"] = module
    spec.loader.exec_module(module)
    return module


pd_router = _load_router()


class Upstream:
    """A stand-in for one vLLM server: records what it was sent, answers with ``handler``."""

    def __init__(self, handler: Handler | None = None) -> None:
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.handler = handler
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._post)
        self.app.router.add_post("/v1/chat/completions", self._post)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.health_status = 200

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body, dict(request.headers)))
        if self.handler is not None:
            return await self.handler(request)
        return web.json_response({"choices": [{"text": " w1"}], "kv_transfer_params": PARAMS})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)


@asynccontextmanager
async def _serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _deployment(
    producer: Upstream, consumer: Upstream, *, consumer_url: str | None = None
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with _serve(producer.app) as p_url, _serve(consumer.app) as c_url:
        app = pd_router.build_app(p_url, consumer_url or c_url, timeout_s=10.0)
        async with _serve(app) as r_url, aiohttp.ClientSession() as session:
            yield r_url, session


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def _post_once(producer: Upstream, consumer: Upstream, path: str, body: Any) -> tuple[int, Any]:
    """One POST through a router in front of ``producer`` and ``consumer``: (status, JSON)."""
    out: list[tuple[int, Any]] = []

    async def go() -> None:
        async with (
            _deployment(producer, consumer) as (url, session),
            session.post(url + path, json=body) as r,
        ):
            out.append((r.status, await r.json()))

    _run(go())
    return out[0]


BODY = {
    "model": "tiny",
    "prompt": [5, 6, 7],
    "max_tokens": 16,
    "temperature": 0.0,
    "n": 2,
    "stream_options": {"include_usage": True},
    "kv_transfer_params": {"do_remote_prefill": True, "omnikv_transfer_id": "stolen"},
}


def test_prefill_on_the_producer_then_decode_on_the_consumer_with_its_params() -> None:
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        async with _deployment(producer, consumer) as (url, session):
            headers = {"Authorization": "Bearer k"}
            async with session.post(url + "/v1/completions", json=BODY, headers=headers) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == " w1"

    _run(go())
    ((p_path, sent, p_headers),) = producer.requests
    ((c_path, got, c_headers),) = consumer.requests
    assert p_path == c_path == "/v1/completions"
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["n"] == BODY["n"]
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in sent and sent["prompt"] == BODY["prompt"]
    # The consumer gets the client's request as it was, with the producer's params only.
    assert got == {**BODY, "kv_transfer_params": PARAMS}
    assert p_headers["Authorization"] == c_headers["Authorization"] == "Bearer k"


def test_chat_completions_take_the_same_path() -> None:
    producer, consumer = Upstream(), Upstream()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]}
    body |= {"max_completion_tokens": 9}

    async def go() -> None:
        async with (
            _deployment(producer, consumer) as (url, session),
            session.post(url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200

    _run(go())
    sent, got = producer.requests[0][1], consumer.requests[0][1]
    assert producer.requests[0][0] == consumer.requests[0][0] == "/v1/chat/completions"
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert got == {**body, "kv_transfer_params": PARAMS}


def test_a_stream_passes_through_chunk_by_chunk() -> None:
    release = asyncio.Event()
    chunks = [
        b'data: {"choices": [{"text": " w1"}]}\n\n',
        b'data: {"choices": [{"text": " w2"}]}\n\n',
    ]

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        await out.write(chunks[0])
        await asyncio.wait_for(release.wait(), 10)  # the client saw chunk 0 first
        await out.write(chunks[1])
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    producer, consumer = Upstream(), Upstream(stream)
    received: list[bytes] = []

    async def go() -> None:
        async with _deployment(producer, consumer) as (url, session):
            body = {"model": "tiny", "prompt": "w1", "stream": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                async for line in r.content:
                    received.append(line)
                    release.set()

    _run(go())
    assert b"".join(received) == b"".join(chunks) + b"data: [DONE]\n\n"
    assert producer.requests[0][1]["stream"] is False
    assert consumer.requests[0][1]["stream"] is True


def test_a_producer_error_comes_back_with_its_status_and_the_consumer_is_not_asked() -> None:
    error = {"error": {"message": "The model `x` does not exist.", "code": 404}}

    async def not_found(request: web.Request) -> web.StreamResponse:
        return web.json_response(error, status=404)

    producer, consumer = Upstream(not_found), Upstream()

    async def go() -> None:
        async with (
            _deployment(producer, consumer) as (url, session),
            session.post(url + "/v1/completions", json={"model": "x"}) as r,
        ):
            assert r.status == 404 and await r.json() == error

    _run(go())
    assert consumer.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_consumer_error_comes_back_with_its_status(stream: bool) -> None:
    async def bad_request(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "too long", "code": 400}}, status=400)

    producer, consumer = Upstream(), Upstream(bad_request)

    body = {"model": "tiny", "prompt": "w1", "stream": stream}
    status, answer = _post_once(producer, consumer, "/v1/completions", body)
    assert status == 400 and answer["error"]["message"] == "too long"


def test_router_errors_bad_bodies_and_an_unreachable_server() -> None:
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        dead = "http://127.0.0.1:9"  # discard port: nothing listens there
        async with _deployment(producer, consumer, consumer_url=dead) as (url, session):
            async with session.post(url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == 400
            async with session.post(url + "/v1/completions", json=[1, 2]) as r:
                assert r.status == 400
            async with session.post(url + "/v1/completions", json={"prompt": "w1"}) as r:
                assert r.status == 502 and "upstream" in (await r.json())["error"]["message"]
            async with session.get(url + "/health") as r:
                assert r.status == 503 and await r.json() == {"producer": 200, "consumer": 0}

    _run(go())
    assert len(producer.requests) == 1  # the bad bodies never reached a server


def test_without_params_from_the_producer_the_consumer_gets_none() -> None:
    async def no_params(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [{"text": " w1"}], "kv_transfer_params": None})

    producer, consumer = Upstream(no_params), Upstream()

    async def go() -> None:
        async with (
            _deployment(producer, consumer) as (url, session),
            session.post(url + "/v1/completions", json=BODY) as r,
        ):
            assert r.status == 200

    _run(go())
    assert "kv_transfer_params" not in consumer.requests[0][1]


def test_models_and_health_are_proxied() -> None:
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        async with _deployment(producer, consumer) as (url, session):
            async with session.get(url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
            async with session.get(url + "/health") as r:
                assert r.status == 200
            producer.health_status = 500
            async with session.get(url + "/health") as r:
                assert r.status == 503 and json.loads(await r.text())["producer"] == 500

    _run(go())


# -- parity with vLLM's own disaggregated proxy ------------------------------------------------
# What vLLM 0.32's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) does,
# written down as expectations: the producer gets the client's body with stream false,
# max_tokens 1, max_completion_tokens 1 when the client set one, no stream_options, every other
# field (n included) as given; both servers get one X-Request-Id; the consumer gets the
# client's body with the producer's kv_transfer_params. omnikv's deliberate differences: the
# producer's kv_transfer_params are omnikv's, min_tokens / min_completion_tokens are dropped.
def vllm_proxy_prefill_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request fields as vLLM's proxy sets them (kv_transfer_params aside)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    out.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def _request_id(headers: dict[str, str]) -> str:
    """The X-Request-Id a stand-in server saw (header names are case-insensitive)."""
    (value,) = [v for k, v in headers.items() if k.lower() == "x-request-id"]
    return value


_OURS_ONLY = ("kv_transfer_params", "min_tokens", "min_completion_tokens")
PARITY_BODIES = [
    {"model": "tiny", "prompt": "w1 w2", "max_tokens": 8},
    {
        "model": "tiny",
        "prompt": [5, 6],
        "max_tokens": 8,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "seed": 7,
    },
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w1"}],
        "max_completion_tokens": 12,
        "n": 2,
        "logprobs": True,
    },
    {"model": "tiny", "prompt": "w1", "max_tokens": 8, "min_tokens": 4},
]


@pytest.mark.parametrize("body", PARITY_BODIES)
@pytest.mark.parametrize("client_id", [None, "client-req-42"])
def test_the_requests_match_vllms_proxy(body: dict[str, Any], client_id: str | None) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        headers = {} if client_id is None else {"X-Request-Id": client_id}
        async with (
            _deployment(producer, consumer) as (url, session),
            session.post(url + path, json=body, headers=headers) as r,
        ):
            assert r.status == 200
            await r.read()

    _run(go())
    ((_, sent, p_headers),) = producer.requests
    ((_, got, c_headers),) = consumer.requests
    theirs = vllm_proxy_prefill_fields(body)
    assert {k: v for k, v in sent.items() if k not in _OURS_ONLY} == {
        k: v for k, v in theirs.items() if k not in _OURS_ONLY
    }
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert "min_tokens" not in sent
    assert got == {**body, "kv_transfer_params": PARAMS}
    rid = _request_id(p_headers)
    assert rid == _request_id(c_headers)
    if client_id is None:
        assert len(rid) == 36 and rid.count("-") == 4  # a fresh UUID per request
    else:
        assert rid == client_id


def test_each_request_gets_its_own_id() -> None:
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        async with _deployment(producer, consumer) as (url, session):
            for _ in range(2):
                async with session.post(url + "/v1/completions", json=BODY) as r:
                    assert r.status == 200

    _run(go())
    ids = [_request_id(h) for _, _, h in producer.requests]
    assert len(set(ids)) == 2 and ids == [_request_id(h) for _, _, h in consumer.requests]


def test_healthcheck_is_health_under_vllms_name() -> None:
    producer, consumer = Upstream(), Upstream()

    async def go() -> None:
        async with _deployment(producer, consumer) as (url, session):
            async with session.get(url + "/healthcheck") as r:
                assert r.status == 200
            consumer.health_status = 500
            async with session.get(url + "/healthcheck") as r:
                assert r.status == 503

    _run(go())


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait, bounded, until ``check()`` holds (for what the test can only observe by asking)."""
    end = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < end, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("whole", [True, False], ids=["read-to-the-end", "gone-mid-stream"])
def test_the_disconnect_line_is_for_a_client_gone_mid_stream_only(
    caplog: pytest.LogCaptureFixture, whole: bool
) -> None:
    """A client that read the stream to its ``[DONE]`` and closed before the router's end of
    the stream (as streaming clients do) logs no disconnect line; one that closed while the
    consumer was still generating logs it once. The router writes to its client only after it
    noticed the client's close, so both cases reach the router's write to a closed client."""
    chunk, done = b'data: {"choices": [{"text": " w1"}]}\n\n', b"data: [DONE]\n\n"
    go_on, handled = asyncio.Event(), asyncio.Event()
    seen: list[web.Request] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        await out.write(chunk + done if whole else chunk)
        await asyncio.wait_for(go_on.wait(), 10)  # the client left, and the router knows
        with contextlib.suppress(ConnectionResetError):
            if not whole:
                await out.write(chunk)  # still generating
                await asyncio.wait_for(handled.wait(), 10)
            await out.write_eof()
        return out

    @web.middleware
    async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
        seen.append(request)
        try:
            return await handler(request)
        finally:
            handled.set()

    async def go() -> None:
        producer, consumer = Upstream(), Upstream(stream)
        async with _serve(producer.app) as p_url, _serve(consumer.app) as c_url:
            app = pd_router.build_app(p_url, c_url, timeout_s=10.0)
            app.middlewares.append(note)
            async with _serve(app) as url, aiohttp.ClientSession() as session:
                body = {"model": "tiny", "prompt": "w1", "stream": True}
                r = await session.post(url + "/v1/completions", json=body)
                got = b""
                while not got.endswith(done if whole else chunk):
                    got += await r.content.readany()
                r.close()  # the connection, not back to the pool
                await _until(lambda: seen[0].transport is None, "the router saw the close")
                go_on.set()
                await asyncio.wait_for(handled.wait(), 10)

    with caplog.at_level("DEBUG", logger="pd_router"):
        _run(go())
    lines = [r for r in caplog.records if r.name == "pd_router"]
    gone = [r for r in lines if "disconnected during the stream" in r.getMessage()]
    closed = [r for r in lines if "closed after the whole stream" in r.getMessage()]
    assert (len(gone), len(closed)) == ((0, 1) if whole else (1, 0)), lines
    assert all(r.levelname == "DEBUG" for r in closed) and all(r.levelname == "INFO" for r in gone)
