"""A disaggregated-prefill router for two vLLM OpenAI-compatible servers connected by omnikv.

The producer server runs with ``--kv-transfer-config`` ``kv_role="kv_producer"`` and the consumer
with ``kv_role="kv_consumer"``, both with ``kv_connector="OmniKVConnector"`` (see the README,
"With vLLM"). Clients talk to this router as if it were one server::

    python examples/pd_router.py --producer http://127.0.0.1:8100 \\
        --consumer http://127.0.0.1:8200 --host 127.0.0.1 --port 8000

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it

1. sends the request to the producer shaped as vLLM's own disaggregated proxy shapes it:
   ``max_tokens=1`` (and ``max_completion_tokens=1`` when the client set it), ``stream=false``,
   no ``stream_options``, ``n`` as the client gave it, and
   ``kv_transfer_params={"do_remote_decode": true}``; ``min_tokens`` /
   ``min_completion_tokens`` are left out (the server refuses a minimum above one token). The
   producer prefills the prompt, ships its KV through omnikv and answers with
   ``kv_transfer_params`` (opaque to the router);
2. sends the client's original request to the consumer with those ``kv_transfer_params``: the
   consumer loads the prompt's KV instead of computing it, and generates.

Both requests carry the same ``X-Request-Id`` (the client's, else a new one), so that one
request has one id in both servers' logs, as behind vLLM's proxy. The consumer's answer goes back
to the client unchanged: a streamed (SSE) answer chunk by chunk, as it arrives. An error answer
of either server goes back with its status and body. ``GET /v1/models`` is the consumer's;
``GET /health`` (also ``/healthcheck``, the name vLLM's proxy uses) is 200 only when both
servers are healthy. ``kv_transfer_params`` a client sends are dropped: only the producer's
reach the consumer.

Needs ``aiohttp`` (vLLM installs it). Run from a checkout; it imports nothing from omnikv.
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

#: The endpoints whose prompt the producer prefills.
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to the servers (the API key, if the servers check one).
FORWARDED_HEADERS = ("Authorization",)
#: The header that gives one request the same id in both servers (vLLM reads it).
REQUEST_ID_HEADER = "X-Request-Id"
#: The longest client-given request id passed on (a longer one is replaced by a new id).
MAX_REQUEST_ID_CHARS = 128

SESSION = web.AppKey("session", aiohttp.ClientSession)
PRODUCER = web.AppKey("producer", str)
CONSUMER = web.AppKey("consumer", str)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request for a client's ``body``: one token, not streamed, as vLLM's
    disaggregated proxy shapes it (``max_completion_tokens`` set to 1 when present, ``n``
    kept); minimum lengths dropped.

    Called once per client request by :func:`handle_pd`; ``body`` is left unchanged.
    """
    out = dict(body)
    for key in ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params"):
        out.pop(key, None)
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_request(body: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The consumer's request: the client's ``body`` with the producer's ``kv_transfer_params``
    (none when the producer returned none: the consumer then computes the prompt itself).

    Called once per client request by :func:`handle_pd`; ``body`` is left unchanged.
    """
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if isinstance(kv_transfer_params, dict):
        out["kv_transfer_params"] = kv_transfer_params
    return out


def error_response(status: int, message: str) -> web.Response:
    """An OpenAI-style error body, for failures of the router itself (bad input, server down)."""
    body = {"error": {"message": message, "type": "RouterError", "code": status}}
    return web.json_response(body, status=status)


def _headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def request_id(request: web.Request) -> str:
    """The ``X-Request-Id`` both servers get for one client request: the client's when it sent
    a printable one of at most :data:`MAX_REQUEST_ID_CHARS` characters, else a new UUID."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return str(uuid.uuid4())


async def _copy(upstream: aiohttp.ClientResponse) -> web.Response:
    """A whole (non-streamed) upstream answer, with its status and content type."""
    data = await upstream.read()
    return web.Response(status=upstream.status, body=data, content_type=upstream.content_type)


async def handle_pd(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` and ``/v1/chat/completions``: prefill on the producer, then
    generate on the consumer with the KV the producer sent.

    Called by aiohttp once per client request. Answers the consumer's response (streamed when the
    client asked for ``stream``), or the first error: the router's own 400 (body not a JSON
    object) or 502 (a server unreachable), or a server's error status and body as it sent them.
    """
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    session = request.app[SESSION]
    producer, consumer = request.app[PRODUCER], request.app[CONSUMER]
    headers = {**_headers(request), REQUEST_ID_HEADER: request_id(request)}
    try:
        # 1. Prefill: the producer computes the prompt's KV and ships it through omnikv.
        async with session.post(
            producer + request.path, json=prefill_request(body), headers=headers
        ) as prefilled:
            if prefilled.status != 200:
                return await _copy(prefilled)
            params = (await prefilled.json()).get("kv_transfer_params")
        if not isinstance(params, dict):
            logger.warning("producer returned no kv_transfer_params; the consumer recomputes")
        # 2. Decode: the consumer loads that KV and generates; its answer goes back as it comes.
        async with session.post(
            consumer + request.path, json=decode_request(body, params), headers=headers
        ) as decoded:
            if decoded.status != 200 or not body.get("stream"):
                return await _copy(decoded)
            out = web.StreamResponse(status=200)
            out.content_type = decoded.content_type
            await out.prepare(request)
            try:
                async for chunk in decoded.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:
                # The client went away: leaving this block closes the consumer's connection,
                # and the consumer aborts the request (nothing to abort once it was all read).
                if decoded.content.at_eof():
                    logger.debug("%s: the client closed after the whole stream", request.path)
                else:
                    logger.info("%s: the client disconnected during the stream", request.path)
            return out
    except aiohttp.ClientError as exc:
        logger.warning("%s %s: a server failed: %s", request.method, request.path, exc)
        return error_response(502, f"upstream server failed: {exc}")


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the consumer's answer, as it sent it (502 when it is unreachable)."""
    session = request.app[SESSION]
    try:
        async with session.get(
            request.app[CONSUMER] + "/v1/models", headers=_headers(request)
        ) as upstream:
            return await _copy(upstream)
    except aiohttp.ClientError as exc:
        return error_response(502, f"consumer failed: {exc}")


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 when both servers answer 200 to theirs, 503 otherwise (with the
    status each one gave, 0 for unreachable)."""
    session = request.app[SESSION]
    statuses: dict[str, int] = {}
    for role, key in (("producer", PRODUCER), ("consumer", CONSUMER)):
        try:
            async with session.get(request.app[key] + "/health") as upstream:
                statuses[role] = upstream.status
        except aiohttp.ClientError:
            statuses[role] = 0
    ok = all(status == 200 for status in statuses.values())
    return web.json_response(statuses, status=200 if ok else 503)


def build_app(producer: str, consumer: str, *, timeout_s: float = 600.0) -> web.Application:
    """The router as an aiohttp application; :func:`main` serves it, tests may too.

    ``producer`` and ``consumer`` are base URLs (``http://host:port``). One client session is
    opened when the application starts and closed when it stops. ``timeout_s`` bounds each wait
    for a server's next bytes (a long generation streams; it is not a bound on the whole answer).
    """
    app = web.Application()
    app[PRODUCER] = producer.rstrip("/")
    app[CONSUMER] = consumer.rstrip("/")

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    for path in PD_PATHS:
        app.router.add_post(path, handle_pd)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/healthcheck", handle_health)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and serve until interrupted (SIGINT / SIGTERM)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--producer", required=True, help="base URL of the producer (kv_producer)")
    p.add_argument("--consumer", required=True, help="base URL of the consumer (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may go silent")
    ns = p.parse_args(argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    app = build_app(ns.producer, ns.consumer, timeout_s=ns.timeout)
    web.run_app(app, host=ns.host, port=ns.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
