"""``omnikv bench serve`` without vLLM: its options, the skip path, the id forgery of its hostile
client, what it reads from a server (metrics, log lines) and its process handling. The bench
against real servers runs in tests/integrations/vllm_connector/test_vllm_serve.py."""

from __future__ import annotations

import random
import re
import sys
import textwrap
from pathlib import Path

import pytest

from omnikv.bench import serve
from omnikv.cli import BENCHES
from omnikv.cli import main as cli_main
from support import paths

pytestmark = pytest.mark.timeout(60)


def test_defaults_are_the_issue_grid() -> None:
    ns = serve.parse_args([])
    assert (ns.clients, ns.tokens, ns.requests) == ("1,4,16", "256,1024,4096", 32)
    assert ns.cases == "pd,recompute,hostile,busy" and ns.hostile_rate == 8.0
    ns = serve.parse_args(["--clients", "2", "--tokens", "64", "--requests", "3", "--cases", "pd"])
    assert (ns.clients, ns.tokens, ns.requests, ns.cases) == ("2", "64", 3, "pd")


@pytest.mark.parametrize(
    "args",
    [["--cases", "pd,nope"], ["--requests", "0"], ["--rounds", "0"], ["--hostile-rate", "0"]],
)
def test_bad_options_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(args)
    assert exc.value.code == 2


def test_without_vllm_the_bench_says_it_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve, "find_spec", lambda name: None)
    assert "serve" in BENCHES
    assert cli_main(["bench", "serve", "--requests", "2"]) == 0
    assert "bench serve: skipped, vLLM is not installed" in capsys.readouterr().out


def test_the_default_router_is_the_example() -> None:
    example = paths.EXAMPLES / "pd_router.py"
    assert example == serve.DEFAULT_ROUTER and example.is_file()


def test_server_argv_is_the_served_recipe() -> None:
    argv = serve.server_argv(
        serve.ServedModel("/m", namespace="ns", recv_timeout=2), role="kv_consumer", port=8200
    )
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert (
        argv[argv.index("--port") + 1] == "8200" and argv[argv.index("--host") + 1] == "127.0.0.1"
    )
    ktc = serve.json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "OmniKVConnector" and ktc["kv_role"] == "kv_consumer"
    assert ktc["kv_connector_module_path"] == "omnikv.integrations.vllm"
    omni = ktc["kv_connector_extra_config"]["omni_kv_config"]
    assert omni["connector_config"]["namespace"] == "ns" and omni["recv_timeout"] == 2


def test_each_engine_gets_its_own_half_of_the_cpus() -> None:
    assert serve.server_cpus("kv_producer", [0, 1]) == "0"
    assert serve.server_cpus("kv_consumer", [0, 1]) == "1"
    assert serve.server_cpus("kv_producer", [4, 5, 6, 7, 8]) == "4,5"
    assert serve.server_cpus("kv_consumer", [4, 5, 6, 7, 8]) == "6,7,8"
    assert serve.server_cpus("kv_consumer", [3]) is None  # one CPU: vLLM's own choice


@pytest.mark.parametrize(
    ("tid", "kept", "alphabet"),
    [
        ("okv1-0123abcd-" + "7f" * 16, "okv1-0123abcd-", "0123456789abcdef"),
        ("okv1-0123abcd-" + "7f" * 16 + "-" + "a1" * 16, "okv1-0123abcd-" + "7f" * 16 + "-", None),
        ("7748980c-cmpl-85868f52e8718ea2-0-a0171ff3", "7748980c-cmpl-85868f52e8718ea2-0-", None),
        (
            "tag.AbCdEfGh12345678",
            "tag.",
            "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
        ),
    ],
)
def test_a_forged_id_keeps_the_head_and_replaces_the_random_tail(
    tid: str, kept: str, alphabet: str | None
) -> None:
    forged = {serve.forge_transfer_id(tid, random.Random(seed)) for seed in range(20)}
    assert tid not in forged and len(forged) == 20
    for f in forged:
        assert len(f) == len(tid) and f.startswith(kept)
        tail = f[len(kept) :]
        assert set(tail) <= set(alphabet or "0123456789abcdef")


def test_an_id_without_a_tail_cannot_be_forged() -> None:
    with pytest.raises(ValueError, match="no random-looking tail"):
        serve.forge_transfer_id("...")


METRICS = textwrap.dedent(
    """\
    # HELP vllm:omnikv_loads_ok Prompt KV payloads this consumer loaded through omnikv.
    # TYPE vllm:omnikv_loads_ok counter
    vllm:omnikv_loads_ok_total{engine="0",model_name="tiny"} 5.0
    vllm:omnikv_loads_ok_created{engine="0",model_name="tiny"} 1.7e+09
    vllm:omnikv_loads_failed_total{engine="0",model_name="tiny"} 1.0
    vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 45.0
    vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="local_compute"} 5.0
    vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
    """
)


def test_metrics_are_summed_over_engines_and_keep_other_labels() -> None:
    m = serve.parse_metrics(METRICS)
    assert m == {
        "vllm:omnikv_loads_ok": 5.0,
        "vllm:omnikv_loads_failed": 1.0,
        'vllm:prompt_tokens_by_source{source="local_compute"}': 50.0,
        "vllm:num_requests_running": 0.0,
    }
    before = {"vllm:omnikv_loads_ok": 2.0}
    assert serve.load_counts(before, m) == {"loads_ok": 3, "loads_failed": 1, "loads_refused": 0}
    assert serve.load_counts({}, {"vllm:num_requests_running": 0.0}) is None


def test_connector_warnings_are_the_integrations_warnings() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,000 WARNING omnikv.integrations.vllm.worker: not loaded x",
            "2026-01-01 00:00:00,000 ERROR omnikv.integrations.vllm: boom",
            "2026-01-01 00:00:00,000 INFO omnikv.integrations.vllm.worker: fine",
            "2026-01-01 00:00:00,000 WARNING omnikv.transfer.receive: timeout",
            "2026-01-01 00:00:00,000 WARNING vllm.config: eager",
        ]
    )
    assert [line.split(" ", 3)[3] for line in serve.connector_warnings(log)] == [
        "omnikv.integrations.vllm.worker: not loaded x",
        "omnikv.integrations.vllm: boom",
    ]


HEALTHY = textwrap.dedent(
    """\
    import http.server, sys

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_servers_are_waited_for_and_stopped_by_pid(tmp_path: Path) -> None:
    (port,) = serve.free_ports(1)
    env = dict(serve.os.environ)
    ok = serve.ServerProcess(
        "ok",
        [sys.executable, "-c", HEALTHY, str(port)],
        port=port,
        log=tmp_path / "ok.log",
        env=env,
    )
    try:
        serve.wait_healthy([ok], timeout=30)
        assert "serving" in ok.log_since(0)
    finally:
        ok.stop(timeout=5)
    assert ok.proc.returncode is not None
    bad = serve.ServerProcess(
        "bad",
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
        port=port,
        log=tmp_path / "bad.log",
        env=env,
    )
    try:
        with pytest.raises(RuntimeError, match=re.compile(r"bad exited \(rc=3\).*boom", re.S)):
            serve.wait_healthy([bad], timeout=30)
    finally:
        bad.stop(timeout=5)


def test_the_report_lines(capsys: pytest.CaptureFixture[str]) -> None:
    loads = {"loads_ok": 2, "loads_failed": 9, "loads_refused": 0}
    hostile = {"rate": 8.0, "sent": 40, "skipped": 0, "answered": {"200": 30}, "errors": 0}
    pd = serve.CaseResult("pd", 4, 1024, 4, [0.1, 0.2, 0.3], 0, 1, 2.0, [], loads=loads)
    attacked = serve.CaseResult(
        "hostile", 4, 1024, 4, [0.5], 1, 2, 5.0, ["HTTP 500: x"], loads=loads, hostile=hostile
    )
    alone = serve.CaseResult("recompute", 4, 1024, 4, [0.1] * 4, 0, 0, 1.0, [], loads=None)
    assert (pd.recomputed(), attacked.recomputed(), alone.recomputed()) == (1, 0, None)
    assert "loads: ok 2, failed 9, refused 0" in serve.describe_case(pd)
    assert "hostile sent 40" in serve.describe_case(attacked) and "HTTP 500" in serve.describe_case(
        attacked
    )
    assert "connector counters not on /metrics" in serve.describe_case(alone)
    serve.print_summary([pd, attacked, alone])
    rows = capsys.readouterr().out.splitlines()[-3:]
    assert rows[0] == (
        "| 4 | 1024 | (a) PD through omnikv | 200 | 300 | 1.50 | 3/4 | 9 | 0 | 1 | - | - |"
    )
    assert rows[2].endswith("| 4.00 | 4/4 | n/a | n/a | - | - | - |")
    assert pd.as_dict()["completed_without_loaded_kv"] == 1


def test_drain_waits_for_a_quiet_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    class Consumer:
        url = "http://127.0.0.1:1"

    class Dep:
        consumer = Consumer()

    busy = {"vllm:num_requests_running": 1.0}
    quiet = {"vllm:num_requests_running": 0.0, 'vllm:request_success{finished_reason="stop"}': 3}
    seen = iter([busy, busy, quiet | {"vllm:omnikv_loads_failed": 1.0}])
    monkeypatch.setattr(serve, "fetch_metrics", lambda url: next(seen, quiet))
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    assert serve.drain(Dep(), timeout=30, quiet_s=0.0)  # type: ignore[arg-type]
    monkeypatch.setattr(serve, "fetch_metrics", lambda url: busy)
    assert not serve.drain(Dep(), timeout=0.0, quiet_s=0.0)  # type: ignore[arg-type]


def test_auth_is_on_by_default_and_off_on_request(tmp_path: Path) -> None:
    """The secret goes by file: its path is in the servers' settings, the secret itself is on
    no command line."""
    assert serve.parse_args([]).no_auth is False and serve.parse_args(["--no-auth"]).no_auth
    path = serve.write_secret_file(tmp_path / "secret")
    secret = path.read_text().strip()
    assert len(secret) == 64 and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        serve.write_secret_file(path)  # never reused nor overwritten
    served = serve.ServedModel("/m", namespace="ns", auth_secret_file=path)
    for role in ("kv_producer", "kv_consumer"):
        argv = serve.server_argv(served, role=role, port=8200)
        ktc = serve.json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector_extra_config"]["auth_secret_file"] == str(path)
        assert "auth_secret" not in ktc["kv_connector_extra_config"]
        assert not any(secret in a for a in argv)
    argv = serve.server_argv(serve.ServedModel("/m", namespace="ns"), role="kv_consumer", port=1)
    ktc = serve.json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert not {"auth_secret", "auth_secret_file"} & set(ktc["kv_connector_extra_config"])


@pytest.mark.timeout(300)  # importing vLLM takes a minute on a busy host
def test_the_served_secret_is_one_the_connector_accepts(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the connector's options need vLLM (make test-vllm)")
    from omnikv.integrations.vllm.options import parse_options

    path = serve.write_secret_file(tmp_path / "secret")
    argv = serve.server_argv(
        serve.ServedModel("/m", namespace="ns", auth_secret_file=path), role="kv_consumer", port=1
    )
    ktc = serve.json.loads(argv[argv.index("--kv-transfer-config") + 1])
    opts = parse_options(ktc["kv_connector_extra_config"], producer=False, consumer=True)
    assert opts.secret == path.read_text().strip().encode()


def test_device_cuda_puts_each_engine_on_its_own_gpu() -> None:
    ns = serve.parse_args(["--device", "cuda", "--gpus", "2,5"])
    assert (ns.device, ns.gpus) == ("cuda", "2,5")
    assert serve.server_env("kv_producer", "cuda", ["2", "5"]) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert serve.server_env("kv_consumer", "cuda", ["2", "5"]) == {"CUDA_VISIBLE_DEVICES": "5"}
    cpu = serve.server_env("kv_consumer", "cpu")
    assert set(cpu) <= {"VLLM_CPU_OMP_THREADS_BIND"}
    with pytest.raises(ValueError, match="two GPUs"):
        serve.server_env("kv_producer", "cuda", ["0"])
    with pytest.raises(ValueError, match="cpu or cuda"):
        serve.server_env("kv_producer", "tpu")
    served = serve.ServedModel("/m", namespace="ns", device="cuda", gpu_memory_utilization=0.4)
    argv = serve.server_argv(served, role="kv_producer", port=1)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--gpu-memory-utilization" not in serve.server_argv(
        serve.ServedModel("/m", namespace="ns"), role="kv_producer", port=1
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "0"],
        ["--gpus", "0,x"],
        ["--gpus", "0,1,2"],
        ["--device", "tpu"],
        ["--gpu-memory-utilization", "0"],
        ["--model", "/nonexistent/model"],
    ],
)
def test_bad_device_options_are_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(args)
    assert exc.value.code == 2


def test_consumer_timing_is_the_histograms_mean_between_two_reads() -> None:
    before = {
        "vllm:omnikv_load_seconds_sum": 1.0,
        "vllm:omnikv_load_seconds_count": 2.0,
        "vllm:request_prefill_time_seconds_sum": 3.0,
        "vllm:request_prefill_time_seconds_count": 10.0,
    }
    after = before | {
        "vllm:omnikv_load_seconds_sum": 1.6,
        "vllm:omnikv_load_seconds_count": 5.0,
        "vllm:request_prefill_time_seconds_sum": 3.5,
        "vllm:request_prefill_time_seconds_count": 15.0,
        "vllm:request_queue_time_seconds_sum": 2.0,
        "vllm:request_queue_time_seconds_count": 4.0,
    }
    timing = serve.consumer_timing(before, after)
    assert timing.keys() == {"kv_wait", "queued", "prefill"}
    assert timing["kv_wait"]["count"] == 3 and timing["kv_wait"]["mean_s"] == pytest.approx(0.2)
    assert timing["prefill"]["count"] == 5 and timing["prefill"]["mean_s"] == pytest.approx(0.1)
    assert timing["queued"]["mean_s"] == pytest.approx(0.5)
    assert serve.consumer_timing(after, after) == {}  # nothing observed: nothing reported


def test_the_hostile_target_compares_c_with_d(capsys: pytest.CaptureFixture[str]) -> None:
    def case(name: str, p99: float) -> serve.CaseResult:
        return serve.CaseResult(name, 4, 1024, 3, [p99 / 2, p99 / 2, p99], 0, 0, 1.0, [])

    timing = {"kv_wait": {"count": 3, "mean_s": 0.012}, "prefill": {"count": 3, "mean_s": 0.5}}
    pd = case("pd", 1.0)
    pd.timing = timing
    cell = [pd, case("recompute", 1.0), case("hostile", 1.05), case("busy", 1.0)]
    other = [case("hostile", 1.5), case("busy", 1.0)]
    for c in other:
        c.clients = 16
    (met, missed) = serve.hostile_overhead(cell + other)
    assert (met["clients"], met["within_target"]) == (4, True)
    assert met["added"] == pytest.approx(0.05)
    assert (missed["clients"], missed["within_target"]) == (16, False)
    assert missed["added"] == pytest.approx(0.5)
    assert serve.hostile_overhead(cell[:3]) == []  # no (d): no comparison
    assert "consumer, mean per request: kv_wait 12 ms x 3, prefill 500 ms x 3" in (
        serve.describe_case(pd)
    )
    serve.print_summary(cell + other)
    out = capsys.readouterr().out
    assert "| 4 | 1024 | (a) PD through omnikv | 500 | 1000 |" in out
    assert out.count("| 12 | 500 |") == 1
    assert "4 client(s) x 1024 tokens: the hostile ids add +5 %" in out and "within 10 %" in out
    assert "16 client(s) x 1024 tokens: the hostile ids add +50 %" in out and "OVER 10 %" in out


def test_rounds_alternate_the_order_of_the_cases() -> None:
    assert serve.parse_args([]).rounds == 1
    cases = ["pd", "recompute", "hostile", "busy"]
    assert serve.round_order(cases, 0) == cases
    assert serve.round_order(cases, 1) == cases[::-1]
    assert serve.round_order(cases, 2) == cases


def test_a_cases_rounds_are_reported_together() -> None:
    """TTFTs, outcomes and counts add up; the consumer's means are weighted by observations."""
    one = serve.CaseResult(
        "hostile",
        4,
        1024,
        16,
        [0.1, 0.2],
        1,
        0,
        2.0,
        ["e1"],
        loads={"loads_ok": 2, "loads_refused": 5},
        warnings=1,
        hostile={"rate": 8.0, "sent": 10, "skipped": 1, "answered": {"200": 9}, "errors": 0},
        timing={"kv_wait": {"count": 2, "mean_s": 0.010}, "prefill": {"count": 1, "mean_s": 0.5}},
    )
    two = serve.CaseResult(
        "hostile",
        4,
        1024,
        16,
        [0.3],
        0,
        2,
        3.0,
        ["e2"],
        loads={"loads_ok": 1, "loads_refused": 7},
        hostile_warnings=1,
        hostile={
            "rate": 8.0,
            "sent": 12,
            "skipped": 0,
            "answered": {"200": 11, "500": 1},
            "errors": 1,
        },
        timing={"kv_wait": {"count": 6, "mean_s": 0.030}},
    )
    got = serve.pooled([one, two])
    assert (got.case, got.clients, got.tokens, got.requests) == ("hostile", 4, 1024, 32)
    assert got.ttfts == [0.1, 0.2, 0.3] and got.completed == 3
    assert (got.failed, got.unfinished, got.wall_s, got.errors) == (1, 2, 5.0, ["e1", "e2"])
    assert got.loads == {"loads_ok": 3, "loads_refused": 12}
    assert (got.warnings, got.hostile_warnings) == (1, 1)
    assert got.hostile == {
        "rate": 8.0,
        "sent": 22,
        "skipped": 1,
        "answered": {"200": 20, "500": 1},
        "errors": 1,
    }
    assert got.timing["kv_wait"]["count"] == 8
    assert got.timing["kv_wait"]["mean_s"] == pytest.approx(0.025)
    assert got.timing["prefill"] == {"count": 1, "mean_s": 0.5}
    # a round whose consumer exported no counters leaves the pooled counts unknown
    three = serve.CaseResult("hostile", 4, 1024, 16, [0.4], 0, 0, 1.0, [], loads=None)
    assert serve.pooled([one, three]).loads is None
