"""benchmarks/bench_peers_cpu.py without any peer installed: argument parsing, the load tool's statistics and
request shapes, ratios, tables and the JSON/PNG it writes (on made-up rows), and a real localhost server."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _module("bench_peers_cpu", BENCH / "bench_peers_cpu.py")


def test_defaults_cover_every_peer_and_both_precisions(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.peers == ["llamacpp", "transformers", "mlserver", "pytriton", "litserve"]
    assert args.miaohui_precision == ["fp32", "int8"]
    assert (args.streams, args.concurrency, args.new_tokens) == ([1, 8, 32], [1, 16, 64], 64)


def test_smoke_shrinks_the_loads(bench: ModuleType) -> None:
    args = bench.parse_args(["--smoke", "--miaohui-precision", "int8", "--peers", "llamacpp,litserve"])
    assert (args.streams, args.concurrency, args.new_tokens, args.seconds) == ([2], [2], 8, 2.0)
    assert args.miaohui_precision == ["int8"] and args.peers == ["llamacpp", "litserve"]


def test_llamacpp_is_a_miaohui_configuration(bench: ModuleType) -> None:
    args = bench.parse_args(
        ["--smoke", "--part", "generation", "--miaohui-precision", "llamacpp", "--peers", "llamacpp"]
    )
    assert args.miaohui_precision == ["llamacpp"] and args.part == ["generation"]
    assert bench.miaohui_server_name("llamacpp") == "miaohui-llamacpp-q4_1"
    assert bench.miaohui_server_name("int8") == "miaohui-ort-int8"
    assert bench.miaohui_server_name("llamacpp-f16") == "miaohui-llamacpp-f16"


def test_rows_carry_their_decoder_gate(bench: ModuleType, tmp_path: Path) -> None:
    recipes = tmp_path / "decoder_recipes_cpu.json"
    gate = {"exact_match": 1.0, "teacher_forced": 1.0, "factual": 1.0, "gate_passed": True, "commit": "abc"}
    recipes.write_text(json.dumps({"rows": [{"recipe": "llamacpp-f16", **gate}]}))
    rows = [{"server": "miaohui-llamacpp-f16", "streams": 1}, {"server": "llamacpp-q4_1", "streams": 1}]
    bench.attach_gates(rows, recipes)
    assert rows[0]["gate"] == gate and "gate" not in rows[1]
    bench.attach_gates(rows, tmp_path / "missing.json")  # no recipes file: rows unchanged
    assert bench.report._gate(rows[0]) == "pass (exact 100%, TF 100.0%)" and bench.report._gate(rows[1]) == "n/a"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peers", "llamacpp,vllm"], "'llamacpp,vllm': use a comma-separated subset of llamacpp,transformers,"),
        (["--miaohui-precision", "fp16"], "'fp16': use a comma-separated subset of fp32,int4,int8"),
        (["--streams", "1,x"], "'1,x' is not a comma-separated list of integers"),
        (["--concurrency", "0,4"], "'0,4': give one or more integers >= 1, e.g. 1,8,32"),
    ],
)
def test_bad_lists_are_refused_with_the_value(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_percentile_and_stats(bench: ModuleType) -> None:
    load = bench.load
    assert load.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert load.percentile([1.0, 2.0], 100) == 2.0
    stats = load.stats_ms([0.001, 0.003])
    assert stats["n"] == 2 and stats["p50"] == pytest.approx(2.0) and stats["mean"] == pytest.approx(2.0)


def test_intent_requests_per_protocol(bench: ModuleType) -> None:
    target = bench.load.IntentTarget
    url, body = target("http://h", "kserve", kserve_shape=(1, 1)).request("hi")
    assert url == "http://h/v2/models/intent/infer"
    assert body == {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}
    assert target("http://h", "intent").request("hi") == ("http://h/v1/intent", {"text": "hi"})
    assert target("http://h", "litserve").request("hi") == ("http://h/predict", {"text": "hi"})
    with pytest.raises(ValueError, match="unknown protocol 'grpc'"):
        target("http://h", "grpc").request("hi")
    answer = {"outputs": [{"name": "CONFIDENCE", "data": [0.9]}, {"name": "INTENT", "data": ["balance"]}]}
    assert target.intent_of("kserve", answer) == "balance"


def _gen_row(server: str, streams: int, ttft: float, tps: float) -> dict[str, Any]:
    stat = {"n": 8, "p50": ttft, "p99": ttft * 2, "mean": ttft}
    return {
        "server": server,
        "streams": streams,
        "ttft_ms": stat,
        "tpot_ms": stat,
        "tokens_per_s": tps,
        "loadavg_1m_before": 1.0,
    }


def test_generation_results_ratios_json_png_and_table(bench: ModuleType, tmp_path: Path) -> None:
    rows = [
        _gen_row("miaohui-ort-int8", 8, 200.0, 180.0),
        _gen_row("llamacpp-q4_1", 8, 100.0, 120.0),
        _gen_row("llamacpp-q4_1", 1, 50.0, 90.0),
        {"server": "transformers-fp32", "streams": 8, "error": "ServerFailed: exited with 1"},
    ]
    env = {"cpu": "test CPU", "cores_usable": 2, "date": "now"}
    doc = bench.build_doc("t", "generation", {}, env, rows)
    (ratio,) = doc["ratios_miaohui_over_peer"]  # only the peer that ran at the same level
    assert (ratio["peer"], ratio["streams"]) == ("llamacpp-q4_1", 8)
    assert ratio["ttft_p50_ms"] == {"ratio": 2.0, "miaohui_better": False}
    assert ratio["tokens_per_s"] == {"ratio": 1.5, "miaohui_better": True}
    bench.report.write(doc, tmp_path / "g.json")
    assert json.loads((tmp_path / "g.json").read_text())["results"][3]["error"] == "ServerFailed: exited with 1"
    panels = [(("ttft_ms", "p50"), "TTFT", True), (("tokens_per_s",), "tok/s", False)]
    bench.report.plot(doc, tmp_path / "g.png", "streams", panels)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    table = bench.report.generation_table(doc)
    assert "miaohui-ort-int8                 8     200.0     400.0" in table
    assert "transformers-fp32                8  error: ServerFailed: exited with 1" in table
    ratios = bench.report.ratio_table(doc["ratios_miaohui_over_peer"], "streams", bench.report.GEN_METRICS)
    assert "miaohui-ort-int8 / llamacpp-q4_1" in ratios and "2.00-" in ratios and "1.50+" in ratios


class _Intent(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"intent": body["text"].upper(), "confidence": 1.0}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_load_tool_against_a_real_localhost_server(bench: ModuleType) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Intent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = bench.load.IntentTarget(f"http://127.0.0.1:{server.server_port}", "litserve")
        assert bench.load.intent_answers(target, ["a", "b"]) == ["A", "B"]
        res = bench.load.intent_load(target, ["a", "b"], concurrency=2, seconds=0.3, warmup=2)
        assert res["errors"] == 0 and res["requests"] > 0 and res["req_per_s"] > 0
        assert bench.procs.ready(f"http://127.0.0.1:{server.server_port}/") is False  # GET: 501, not ready
    finally:
        server.shutdown()


class _Chat(BaseHTTPRequestHandler):
    """A streaming /v1/chat/completions that answers ``max_tokens`` one-word chunks and logs its calls."""

    protocol_version = "HTTP/1.1"
    calls: ClassVar[list[tuple[str, int]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Chat.calls.append((self.server.name, len(_Chat.calls)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}  # fmt: skip
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


def test_interleaved_rounds_take_each_server_in_turn(bench: ModuleType) -> None:
    servers = []
    for name in ("a", "b"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    _Chat.calls.clear()
    try:
        targets = {s.name: bench.load.ChatTarget(f"http://127.0.0.1:{s.server_port}/v1", "m") for s in servers}  # type: ignore[attr-defined]
        res = bench.load.generation_rounds(targets, ["q"], streams=2, max_tokens=3, runs=3)
    finally:
        for server in servers:
            server.shutdown()
    assert set(res) == {"a", "b"}
    assert all(r["tokens"] == 3 * 2 * 3 and r["tpot_ms"]["n"] == 3 * 2 * 2 for r in res.values())
    order = [name for name, _ in _Chat.calls]
    # warm-up (2 requests each), then rounds of 2 requests: a b, b a, a b (each server first in turn)
    assert order == ["a", "a", "b", "b", "a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]


def test_append_keeps_the_rows_of_servers_not_measured_again(bench: ModuleType, tmp_path: Path) -> None:
    env_old = {"cpu": "c", "cores_usable": 2, "date": "earlier"}
    old = bench.build_doc(
        "t",
        "generation",
        {},
        env_old,
        [_gen_row("llamacpp-q4_1", 8, 100.0, 120.0), _gen_row("miaohui-ort-int8", 8, 300.0, 100.0)],
    )
    bench.report.write(old, tmp_path / "g.json")
    new = bench.build_doc(
        "t", "generation", {}, {"date": "now"}, [_gen_row("miaohui-ort-int8", 8, 200.0, 180.0)], tmp_path / "g.json"
    )
    assert [(r["server"], r.get("run")) for r in new["results"]] == [
        ("llamacpp-q4_1", "earlier"),
        ("miaohui-ort-int8", None),
    ]
    assert new["earlier_runs"] == [env_old]
    (ratio,) = new["ratios_miaohui_over_peer"]
    assert ratio["ttft_p50_ms"]["ratio"] == 2.0
