"""Served disaggregated prefill: two vLLM OpenAI-compatible servers and examples/pd_router.py.

Runs in ``.venv-vllm`` (``make test-vllm``); skipped where vLLM is not installed. A producer and a
consumer server (``python -m vllm.entrypoints.openai.api_server``, OmniKVConnector over
SharedMemoryConnector in a namespace of this module's own, the tiny local Llama in float32) and
the router start once for the module, in parallel, on free loopback ports; every process is
stopped by its PID at the end. The consumer alone, without ``kv_transfer_params``, is the single
server the router's answers are compared with.

Both servers share an ``auth_secret`` passed as the README's recipe passes it, by file
(``auth_secret_file``); it must appear in none of their logged lines (vLLM's "non-default args"
included) and on none of their processes' command lines.

That the KV was loaded and not recomputed is read from the consumer: its ``/metrics``
(``vllm:omnikv_loads_*`` from the connector, and vLLM's prompt tokens by source) and its log
(no warning from ``omnikv.integrations.vllm``). ``OmniKVConnector.stats()`` lives in the
server's engine process, out of a client's reach.

Last, ``omnikv bench serve`` runs its four cases, reduced, on these servers: its own ``main``,
handed this deployment instead of starting two more servers of its own.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import urllib.request
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from support.leaks import assert_secret_hidden

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
    ),
    pytest.mark.timeout(900),
]

LENGTHS = (45, 77, 130)  # none a multiple of the block size (32)
NEW_TOKENS = 12
MAX_MODEL_LEN = 512
#: The consumer's recv_timeout: a load's whole budget from admission. A load waits for the
#: producer's send, which shares two cores with every lane of ``make test``: milliseconds when
#: quiet, up to a few hundred ms loaded. No test here waits it out (a forged id is refused at
#: admission), so a generous budget costs nothing when loads work.
RECV_TIMEOUT = 20.0
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
EXTERNAL = 'vllm:prompt_tokens_by_source{source="external_kv_transfer"}'
HANDOFF = "vllm:omnikv_handoff_seconds"
SUM_COUNT = ("_sum", "_count")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from omnikv.bench.serve import ServedModel, start_deployment, write_secret_file
    from omnikv.bench.vllm import build_tiny_llama

    root = tmp_path_factory.mktemp("serve")
    model = build_tiny_llama(root / "model", "float32")
    served = ServedModel(
        model,
        namespace=f"omnikv-serve-test-{os.getpid()}-{secrets.token_hex(3)}",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        recv_timeout=RECV_TIMEOUT,
        chat_template=CHAT_TEMPLATE,
        auth_secret_file=write_secret_file(root / "auth-secret"),
    )
    deployment = start_deployment(root, served, omnikv_log_level="DEBUG", timeout=600)
    try:
        yield deployment
    finally:
        deployment.stop()


def _prompts(seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(4, 500) for _ in range(n)] for n in LENGTHS]


def _body(prompt: Any = None, **fields: Any) -> dict[str, Any]:
    """A greedy request body of ``prompt`` (or of ``messages=`` for chat), ``fields`` on top."""
    body = {"model": "tiny", "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return body | ({} if prompt is None else {"prompt": prompt}) | fields


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    from omnikv.bench.serve import post_json

    status, answer = post_json(url, body)
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _stream(url: str, body: dict[str, Any]) -> tuple[str, str]:
    """(content type, the text of every chunk joined); the stream must end with [DONE]."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = json.dumps(body | {"stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    texts, done = [], False
    with opener.open(req, timeout=120) as resp:
        ctype = resp.headers.get("Content-Type", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            choice = json.loads(payload)["choices"][0]
            texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    assert done, "the stream ended without [DONE]"
    return ctype, "".join(texts)


def _consumer_state(dep: Any) -> tuple[dict[str, float], int]:
    from omnikv.bench.serve import fetch_metrics

    return fetch_metrics(dep.consumer.url), dep.consumer.log_size()


def _assert_loaded(dep: Any, before: tuple[dict[str, float], int], loads: int, tokens: int) -> None:
    """``loads`` loads since ``before``, all ok, covering ``tokens`` prompt tokens, each with its
    hand-off measured (``vllm:omnikv_handoff_seconds``); no warning."""
    from omnikv.bench.serve import connector_warnings, fetch_metrics, load_counts

    after = fetch_metrics(dep.consumer.url)
    counts = load_counts(before[0], after)
    expected = {"loads_ok": loads, "loads_failed": 0, "loads_refused": 0}
    assert counts == expected, (counts, _load_story(dep, before[1]))
    handoffs = [after.get(HANDOFF + s, 0.0) - before[0].get(HANDOFF + s, 0.0) for s in SUM_COUNT]
    assert handoffs[1] == loads and 0.0 < handoffs[0] < loads * RECV_TIMEOUT, handoffs
    assert after[EXTERNAL] - before[0].get(EXTERNAL, 0.0) == tokens
    assert connector_warnings(dep.consumer.log_since(before[1])) == []


def _load_story(dep: Any, offset: int) -> str:
    """What a failure report shows: the last omnikv lines of the consumer's log since
    ``offset`` (a failed load's reason) and of the producer's recent log (the sends' outcomes
    and timelines)."""

    def ours(log: str) -> list[str]:
        return [ln for ln in log.splitlines() if "omnikv" in ln or "OmniKV" in ln][-60:]

    consumer, producer = dep.consumer.log_since(offset), dep.producer.tail(20000)
    return "\n".join(["consumer:", *ours(consumer), "producer:", *ours(producer)])


def test_greedy_completions_through_the_router_equal_a_single_server(dep: Any) -> None:
    prompts: list[Any] = [*_prompts(1), " ".join(f"w{i}" for i in range(3, 200, 3))]
    single = [_post(dep.consumer.url + "/v1/completions", _body(p)) for p in prompts]
    tokens = sum(a["usage"]["prompt_tokens"] for a in single)
    assert tokens > sum(LENGTHS)
    before = _consumer_state(dep)
    routed = [_post(dep.router.url + "/v1/completions", _body(p)) for p in prompts]
    assert [_text(a) for a in routed] == [_text(a) for a in single]
    assert all(a["usage"]["completion_tokens"] == NEW_TOKENS for a in routed)
    streamed = [_stream(dep.router.url + "/v1/completions", _body(p)) for p in prompts]
    assert all(ctype.startswith("text/event-stream") for ctype, _ in streamed)
    assert [text for _, text in streamed] == [_text(a) for a in single]
    _assert_loaded(dep, before, 2 * len(prompts), 2 * tokens)


def test_chat_completions_through_the_router_equal_a_single_server(dep: Any) -> None:
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(7, 300, 5))}]
    single = _post(dep.consumer.url + "/v1/chat/completions", _body(messages=messages))
    before = _consumer_state(dep)
    routed = _post(dep.router.url + "/v1/chat/completions", _body(messages=messages))
    _, streamed = _stream(dep.router.url + "/v1/chat/completions", _body(messages=messages))
    assert _text(routed) == streamed == _text(single) != ""
    _assert_loaded(dep, before, 2, 2 * single["usage"]["prompt_tokens"])


def test_server_errors_pass_through_the_router_with_their_status(dep: Any) -> None:
    from omnikv.bench.serve import post_json

    url = dep.router.url + "/v1/completions"
    status, answer = post_json(url, _body([5, 6, 7], model="no-such-model"))
    assert status == 404 and "no-such-model" in answer["error"]["message"]
    status, answer = post_json(url, _body(list(range(4, 4 + MAX_MODEL_LEN + 10))))
    assert status == 400 and answer["error"]["message"]
    status, answer = post_json(url, _body(list(range(4, 40)), stream=True, max_tokens=-1))
    assert status == 400
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(dep.router.url + "/v1/models", timeout=30) as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == ["tiny"]
    with opener.open(dep.router.url + "/health", timeout=30) as resp:
        assert json.load(resp) == {"producer": 200, "consumer": 200}


def test_an_unknown_transfer_id_is_not_loaded_and_does_not_spoil_the_real_one(dep: Any) -> None:
    from omnikv.bench.serve import fetch_metrics, forge_transfer_id, load_counts

    (prompt,) = _prompts(2)[:1]
    single = _text(_post(dep.consumer.url + "/v1/completions", _body(prompt)))
    prefill = _body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    sent = _post(dep.producer.url + "/v1/completions", prefill)
    params = sent["kv_transfer_params"]
    forged = params | {"omnikv_transfer_id": forge_transfer_id(params["omnikv_transfer_id"])}
    before = _consumer_state(dep)
    got = _post(dep.consumer.url + "/v1/completions", _body(prompt, kv_transfer_params=forged))
    assert _text(got) == single
    counts = load_counts(before[0], fetch_metrics(dep.consumer.url))
    assert counts is not None and counts["loads_ok"] == 0
    assert counts["loads_failed"] + counts["loads_refused"] == 1, counts
    # The genuine params still load: the forged attempt consumed nothing.
    before = _consumer_state(dep)
    got = _post(dep.consumer.url + "/v1/completions", _body(prompt, kv_transfer_params=params))
    assert _text(got) == single
    _assert_loaded(dep, before, 1, len(prompt))


def test_the_secret_is_in_no_log_line_and_on_no_command_line(dep: Any) -> None:
    """After the servers started and served (their connectors read the secret from its file),
    the secret is nowhere in the producer's, the consumer's or the router's log (vLLM's INFO
    "non-default args" line, with the connector settings, included; omnikv at DEBUG) nor in
    ``/proc/<pid>/cmdline`` of any of their processes."""
    (prompt,) = _prompts(3)[:1]
    _post(dep.router.url + "/v1/completions", _body(prompt))  # a hand-off: both connectors used
    ktc = dep.consumer.argv[dep.consumer.argv.index("--kv-transfer-config") + 1]
    secret_file = json.loads(ktc)["kv_connector_extra_config"]["auth_secret_file"]
    secret = open(secret_file, "rb").read().strip()  # noqa: SIM115
    assert len(secret) >= 32
    for server in (dep.producer, dep.consumer):
        log = server.log_since(0).encode()
        assert_secret_hidden(secret, pgid=server.proc.pid, log=log, servers=1)
    assert secret not in dep.router.log_since(0).encode()


def test_bench_serve_runs_its_four_cases_against_the_servers(
    dep: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``omnikv bench serve`` reduced: the four cases with one client and three requests each,
    ``auth_secret`` on (the default), run by the command's own ``main`` on this module's servers
    (its ``_run`` is handed them instead of starting a deployment of its own through the same
    :func:`~omnikv.bench.serve.start_deployment`). Speed is the benchmark's report, never asserted
    here. Asserted: every request of the measured clients completed with its KV loaded in (a),
    (c) and (d); the hostile ids of (c) were refused at admission (none waited for and failed);
    each case reports where the consumer's requests spent their time (KV wait where KV was
    loaded, prefill always); the (c)-against-(d) target is computed. Runs last: the hostile case
    leaves the consumer busy for a while."""
    from omnikv.bench import serve

    out = tmp_path / "serve.json"
    monkeypatch.setattr(serve, "_run", lambda ns, workdir: serve.run_cases(dep, ns))
    argv = ["--clients", "1", "--tokens", "96", "--requests", "3", "--max-tokens", "4"]
    argv += ["--hostile-rate", "4", "--case-timeout", "120", "--json", str(out)]
    argv += ["--recv-timeout", str(RECV_TIMEOUT)]  # what its header reports: these servers' own
    rc = serve.main(argv)
    stdout = capsys.readouterr().out
    log = stdout[-6000:]
    assert rc == 0, log
    assert "auth_secret" in stdout.splitlines()[0], log
    data = json.loads(out.read_text())
    assert data["config"]["no_auth"] is False and "json" not in data["config"]
    cases = {r["case"]: r for r in data["results"]}
    assert list(cases) == ["pd", "recompute", "hostile", "busy"]
    for name in ("pd", "hostile", "busy"):
        r = cases[name]
        assert r["completed"] == 3 and r["failed"] == 0, log
        assert r["completed_without_loaded_kv"] == 0, log
        assert r["loads"]["loads_ok"] == 3 and r["loads"]["loads_failed"] == 0, log
        assert r["consumer_timing"]["kv_wait"]["count"] == 3, log
        assert r["consumer_timing"]["prefill"]["count"] >= 3, log
    assert cases["pd"]["loads"]["loads_refused"] == 0, log
    hostile = cases["hostile"]
    assert hostile["hostile"]["sent"] >= 1, log
    assert hostile["loads"]["loads_refused"] >= 1, log  # at admission: a forged id's MAC
    recompute = cases["recompute"]
    assert (recompute["completed"], recompute["failed"], recompute["connector_warnings"]) == (
        3,
        0,
        0,
    ), log
    assert recompute["loads"] == {"loads_ok": 0, "loads_failed": 0, "loads_refused": 0}, log
    assert "kv_wait" not in recompute["consumer_timing"], log
    assert recompute["consumer_timing"]["prefill"]["count"] == 3, log
    (target,) = data["hostile_overhead"]
    assert (target["clients"], target["tokens"]) == (1, 96)
    assert target["added"] == pytest.approx(target["hostile_p99_s"] / target["busy_p99_s"] - 1)
    assert serve.drain(dep, 60.0)
