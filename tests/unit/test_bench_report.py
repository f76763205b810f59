"""The load tool: percentile math, Poisson schedules, request accounting, the report schema, and real
closed/open-loop runs against a small FastAPI server on localhost that answers 200, 429 and 500."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from typer.testing import CliRunner

from miaohui.bench.cli import bench_command, parse_levels, parse_seconds
from miaohui.bench.load import LoadPlan, RawRun, poisson_arrivals, run_processes, run_sync
from miaohui.bench.report import (
    SCHEMA,
    error_groups,
    latency_stats,
    make_document,
    percentile,
    summarize,
    to_json,
    validate_document,
)
from miaohui.bench.scrape import breakdown, histogram_quantile, parse_metrics, share_above, window_histogram
from miaohui.bench.sweep import fit_token_range, measure
from miaohui.bench.targets import TargetSpec
from miaohui.errors import ConfigError
from miaohui.server.metrics import Metrics

# ---------------------------------------------------------------------------------------------- math


def test_percentile_is_nearest_rank() -> None:
    values = list(range(100, 0, -1))  # 100..1, unsorted on purpose
    assert [percentile(values, q) for q in (0, 1, 50, 90, 99, 100)] == [1, 1, 50, 90, 99, 100]
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile([5.0, 1.0, 3.0], 99) == 5.0
    assert percentile([2.0], 99.9) == 2.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile 101 is outside 0..100"):
        percentile([1.0], 101)


def test_latency_stats_are_milliseconds() -> None:
    stats = latency_stats([0.001 * i for i in range(1, 1001)])  # 1..1000 ms
    assert stats["n"] == 1000
    assert stats["p50"] == pytest.approx(500.0)
    assert stats["p90"] == pytest.approx(900.0)
    assert stats["p99"] == pytest.approx(990.0)
    assert stats["p99.9"] == pytest.approx(999.0)
    assert stats["max"] == pytest.approx(1000.0)
    assert stats["mean"] == pytest.approx(500.5)
    assert math.isnan(latency_stats([])["p99"])


def test_histogram_quantile_matches_prometheus_interpolation() -> None:
    buckets = {0.1: 50.0, 0.2: 90.0, 0.5: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.47)
    assert math.isnan(histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}))


# ---------------------------------------------------------------------------------------------- schedules


def test_poisson_schedule_rate_and_determinism() -> None:
    rate, horizon = 500.0, 20.0
    times = poisson_arrivals(rate, seed=7, horizon_s=horizon)
    n = len(times)
    assert abs(n - rate * horizon) < 4 * math.sqrt(rate * horizon)  # within 4 sigma of the Poisson count
    assert np.all(np.diff(times) > 0) and times[0] >= 0 and times[-1] < horizon
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV = 1
    assert np.array_equal(times, poisson_arrivals(rate, seed=7, horizon_s=horizon))
    assert not np.array_equal(times[:100], poisson_arrivals(rate, seed=8, horizon_s=horizon)[:100])


def test_poisson_schedule_by_count_after_warmup() -> None:
    times = poisson_arrivals(200.0, seed=1, after_s=1.0, count_after=300)
    assert int((times >= 1.0).sum()) == 300
    assert 150 < int((times < 1.0).sum()) < 250  # the warm-up second keeps its ~200 arrivals


def test_poisson_schedule_needs_an_end() -> None:
    with pytest.raises(ConfigError, match="a Poisson schedule needs a horizon or a count"):
        poisson_arrivals(10.0, seed=0)
    with pytest.raises(ConfigError, match="rate 0 must be > 0"):
        poisson_arrivals(0, seed=0, horizon_s=1.0)


def test_plan_checks_and_shares() -> None:
    with pytest.raises(ConfigError, match="the run has no end"):
        LoadPlan(mode="closed", level=1, duration_s=None, requests=None)
    with pytest.raises(ConfigError, match="concurrency 2.5 is not a whole number"):
        LoadPlan(mode="closed", level=2.5)
    closed = LoadPlan(mode="closed", level=10, requests=7, processes=3)
    assert [closed.share(i).level for i in range(3)] == [4, 3, 3]
    assert [closed.share(i).requests for i in range(3)] == [3, 2, 2]
    assert len({closed.share(i).seed for i in range(3)}) == 3
    assert LoadPlan(mode="closed", level=2, processes=4).workers == 2  # never a process without a worker
    opened = LoadPlan(mode="open", level=300.0, processes=4)
    assert sum(opened.share(i).level for i in range(4)) == pytest.approx(300.0)


def test_cli_parsers() -> None:
    assert parse_seconds("10", "--duration") == 10.0
    assert parse_seconds("500ms", "--duration") == 0.5
    assert parse_seconds("2m", "--duration") == 120.0
    with pytest.raises(ConfigError, match="--duration 'ten' is not a duration"):
        parse_seconds("ten", "--duration")
    assert parse_levels("1,8,32", "--concurrency", True) == [1, 8, 32]
    with pytest.raises(ConfigError, match="--concurrency '0,4' needs positive values"):
        parse_levels("0,4", "--concurrency", True)


def test_fit_token_range_composes_long_texts() -> None:
    def count(texts: list[str]) -> list[int]:
        return [len(t.split()) + 2 for t in texts]  # words + 2 special tokens

    texts = ["a", "b c", "d e f", "one two three four five six seven eight nine ten"]
    out = fit_token_range(texts, count, 8, 12, seed=0)
    assert all(8 <= n <= 12 for n in count(out))
    assert texts[3] in out and len(out) > 1
    with pytest.raises(ConfigError, match="token range 9-3 is empty"):
        fit_token_range(texts, count, 9, 3)


# ---------------------------------------------------------------------------------------------- accounting


def _raw(statuses: list[str], sent: int | None = None) -> RawRun:
    raw = RawRun()
    for i, st in enumerate(statuses):
        raw.record(1.0 + i * 0.01, 1.0 + i * 0.01 + 0.002 * (i + 1), st)
    raw.sent = len(statuses) if sent is None else sent
    raw.first_send, raw.cpu_s, raw.wall_s = 1.0, 0.1, 2.0
    return raw


def test_summary_accounts_for_every_request() -> None:
    plan = LoadPlan(mode="closed", level=4, warmup_s=1.0, duration_s=1.0)
    statuses = ["ok"] * 7 + ["429", "429", "connection", "503", "400"]
    point = summarize(_raw(statuses), plan)
    assert (point["sent"], point["answered"], point["error_count"], point["lost"]) == (12, 7, 5, 0)
    assert point["errors"] == {"400": 1, "429": 2, "503": 1, "connection": 1}
    assert point["error_groups"]["4xx"] == 1 and point["error_groups"]["connection"] == 1
    assert point["latency_ms"]["max"] == pytest.approx(14.0)  # successes only: the 7th took 14 ms
    assert point["throughput_rps"] == pytest.approx(7 / point["window_s"])
    assert point["concurrency"] == 4 and point["rate"] is None


def test_lost_requests_are_reported() -> None:
    plan = LoadPlan(mode="open", level=100.0, warmup_s=1.0, duration_s=1.0)
    point = summarize(_raw(["ok", "ok", "504"], sent=4), plan)
    assert point["lost"] == 1
    doc = make_document("miaohui bench", {"target": "http"}, [point])
    assert validate_document(doc) == ["points[0]: sent 4 != answered 2 + errors 1 (1 lost)"]


def test_error_groups_fold_codes() -> None:
    groups = error_groups({"429": 3, "404": 1, "400": 2, "500": 1, "502": 1, "timeout": 2, "bad_body": 1})
    assert groups == {"429": 3, "503": 0, "504": 0, "4xx": 3, "5xx": 2, "connection": 0, "timeout": 2, "other": 1}


def test_document_schema_and_strict_json() -> None:
    plan = LoadPlan(mode="closed", level=1, warmup_s=1.0, duration_s=1.0)
    doc = make_document("miaohui bench --target http", {"target": "http"}, [summarize(_raw(["503"]), plan)])
    assert validate_document(doc) == []
    text = to_json(doc)
    assert "NaN" not in text
    back = json.loads(text)
    assert back["schema"] == SCHEMA and back["points"][0]["latency_ms"]["p50"] is None
    assert validate_document(back) == []
    for key in ("cpu", "cpu_logical", "memory_gb", "python", "versions"):
        assert key in back["environment"]
    assert validate_document({"schema": "x"})[0] == "'command' missing or not a str"


def test_breakdown_from_real_metrics_registry() -> None:
    metrics = Metrics()
    obs = metrics.observer("intent", 1)
    before = parse_metrics(metrics.render().decode())
    for _ in range(4):
        metrics.done("intent", "1", "http", 200, 0.010)
    metrics.done("intent", "1", "http", 429, 0.001)
    obs.on_batch(size=2, tokens=20, padded_tokens=24, queue_wait_s=[0.002, 0.004])
    obs.on_batch(size=2, tokens=20, padded_tokens=24, queue_wait_s=[0.002, 0.004])
    obs.on_compute(0.005, 2, True)
    obs.on_compute(0.005, 2, True)
    obs.on_reject("queue_full")
    for stage, seconds in (("tokenize", 0.0002), ("tokenize", 0.0004), ("gpu", 0.003)):
        obs.on_stage(stage, seconds)
    metrics.gc_pause.labels("2").observe(0.004)
    after = parse_metrics(metrics.render().decode())
    out = breakdown(before, after, "intent", wall_s=1.0)
    # (this process's own collections may land in the window too: at least the one observed here)
    assert out["gc_pauses"]["2"]["collections"] >= 1 and out["gc_pauses"]["2"]["total_ms"] >= 4.0 - 1e-6
    assert set(out["stage_ms"]) == {"tokenize", "gpu"}
    assert out["stage_ms"]["tokenize"]["count"] == 2 and out["stage_ms"]["tokenize"]["mean"] == pytest.approx(0.3)
    assert out["stage_ms"]["gpu"]["mean"] == pytest.approx(3.0)
    assert out["requests_by_code"] == {"200": 4, "429": 1}
    assert out["rejected_by_reason"] == {"queue_full": 1}
    assert out["request_ms"]["count"] == 5 and out["request_ms"]["mean"] == pytest.approx(8.2)
    assert out["queue_ms"]["mean"] == pytest.approx(3.0)
    assert out["compute_ms_per_batch"]["mean"] == pytest.approx(5.0)
    assert out["batch_size"]["mean"] == pytest.approx(2.0)
    assert out["compute_ms_per_row"] == pytest.approx(2.5)
    assert out["other_ms"] == pytest.approx(8.2 - 3.0 - 5.0)


def test_window_histogram_and_share_above_count_only_the_window() -> None:
    metrics = Metrics()
    metrics.ttft.labels("llm").observe(0.5)  # before the window: not counted
    before = parse_metrics(metrics.render().decode())
    for seconds in (0.003, 0.015, 0.03, 0.04, 0.07):
        metrics.ttft.labels("llm").observe(seconds)
    after = parse_metrics(metrics.render().decode())
    name = "miaohui_time_to_first_token_seconds"
    hist = window_histogram(before, after, name, 1e3, model="llm")
    assert hist is not None and hist["count"] == 5 and hist["mean"] == pytest.approx(31.6)
    assert share_above(before, after, name, 0.05, model="llm") == pytest.approx(0.2)
    assert share_above(before, after, name, 0.02, model="llm") == pytest.approx(0.6)
    assert window_histogram(after, after, name, 1e3, model="llm") is None
    with pytest.raises(ValueError, match=r"has no bucket bound 0\.035; its bounds are \[0\.005, 0\.01, "):
        share_above(before, after, name, 0.035, model="llm")


# ---------------------------------------------------------------------------------------------- live server


def _fake_app() -> FastAPI:
    """Answers like ``POST /v1/intent``; every 5th request is a 429, text 'boom' a 500, 'slow' sleeps 2 s.
    Records into a real :class:`Metrics` and serves it on /metrics, like the real server."""
    app = FastAPI()
    metrics = Metrics()
    obs = metrics.observer("intent", 1)
    counter = iter(range(1 << 62))

    @app.post("/v1/intent")
    async def intent(request: Request) -> Response:
        started = time.perf_counter()
        text = (await request.json())["text"]
        if text == "slow":
            await asyncio.sleep(2.0)
        await asyncio.sleep(0.001)
        code = 500 if text == "boom" else 429 if next(counter) % 5 == 4 else 200
        if code == 200:
            obs.on_batch(size=1, tokens=8, padded_tokens=8, queue_wait_s=[0.0005])
            obs.on_compute(0.0005, 1, True)
        metrics.done("intent", "1", "http", code, time.perf_counter() - started)
        body = {"intent": "greeting", "confidence": 0.9, "slots": [], "model": "intent", "version": 1}
        return JSONResponse(body if code == 200 else {"error": "queue full"}, status_code=code)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def test_closed_loop_counts_429_and_500(server_url: str) -> None:
    spec = TargetSpec(kind="http", url=server_url, timeout_s=5.0)
    plan = LoadPlan(mode="closed", level=8, warmup_s=0.2, duration_s=0.8)
    point = measure(spec, ["你好", "hello", "boom"], plan, server_url)
    assert point["sent"] > 50
    assert point["sent"] == point["answered"] + point["error_count"] and point["lost"] == 0
    assert set(point["errors"]) == {"429", "500"} and point["answered"] > 0
    lat = point["latency_ms"]
    assert lat["p50"] >= 1.0 and lat["p50"] <= lat["p99"] <= lat["max"]
    server = point["server"]
    # the first scrape lands a little after the window opens (the server is busy), so fewer are counted
    assert server is not None and point["sent"] * 0.5 <= server["request_ms"]["count"] <= point["sent"] + 8
    assert set(server["requests_by_code"]) == {"200", "429", "500"}


def test_open_loop_keeps_schedule_and_accounts(server_url: str) -> None:
    spec = TargetSpec(kind="http", url=server_url, timeout_s=5.0, max_connections=64)
    plan = LoadPlan(mode="open", level=200.0, warmup_s=0.2, duration_s=None, requests=150, seed=3)
    raw = run_sync(spec, ["hi"], plan)
    point = summarize(raw, plan)
    assert point["sent"] == 150 == point["answered"] + point["error_count"]
    assert point["errors"] == {"429": point["error_count"]}
    # latency is measured from the scheduled arrival times, not from when the client got round to sending
    schedule = poisson_arrivals(plan.level, plan.seed, after_s=plan.warmup_s, count_after=plan.requests)
    measured = schedule[schedule >= plan.warmup_s]
    assert np.array_equal(np.sort(raw.sent_at), measured)
    # every measured send records how far behind schedule it went out (a speed figure, so not bounded here)
    assert len(raw.send_lag_s) == 150 and min(raw.send_lag_s) >= 0.0
    assert point["client"]["send_lag_p99_ms"] >= 0.0


def test_worker_processes_share_the_load_and_the_count(server_url: str) -> None:
    spec = TargetSpec(kind="http", url=server_url, timeout_s=5.0)
    plan = LoadPlan(mode="closed", level=4, warmup_s=0.1, duration_s=None, requests=40, processes=2)
    raw = run_processes(spec, ["hi"], plan)
    point = summarize(raw, plan)
    assert raw.processes == 2 and point["client"]["processes"] == 2
    assert point["sent"] == 40 == point["answered"] + point["error_count"]
    assert min(raw.sent_at) >= plan.warmup_s  # one clock: both processes start their window together


def test_timeouts_and_refused_connections_are_errors(server_url: str) -> None:
    spec = TargetSpec(kind="http", url=server_url, timeout_s=0.2)
    plan = LoadPlan(mode="closed", level=2, warmup_s=0.0, duration_s=None, requests=4)
    point = summarize(run_sync(spec, ["slow"], plan), plan)
    assert point["errors"] == {"timeout": 4} and point["sent"] == 4 and point["lost"] == 0

    dead = TargetSpec(kind="http", url=f"http://127.0.0.1:{_free_port()}", timeout_s=1.0)
    point = summarize(run_sync(dead, ["hi"], plan), plan)
    assert point["errors"] == {"connection": 4} and point["answered"] == 0 and point["lost"] == 0


def test_bench_command_writes_json_and_png(server_url: str, tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps the "bench" sub-command name
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    texts = _texts(tmp_path)
    # a window long enough that the opening /metrics scrape (a thread in this busy process, like the server)
    # lands inside it also on a loaded CI machine; with 0.4 s it once landed after the load had ended
    args = f"bench --url {server_url} --concurrency 1,4 --duration 1.5s --warmup 0.1s --texts {texts}".split()
    args += ["--out", str(out), "--plot", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert validate_document(doc) == []
    assert [p["concurrency"] for p in doc["points"]] == [1, 4]
    assert doc["config"]["target"] == "http" and doc["points"][1]["server"]["batch_size"]["mean"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _texts(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    path.write_text('{"text": "查社保"}\n{"text": "hello"}\n', encoding="utf-8")
    return path


def test_http_target_sends_the_model_it_is_given() -> None:
    """``miaohui bench --target http --model X`` asks /v1/intent for X (it used to ask the default ``intent``)."""
    from miaohui.bench.targets import RawHttpTarget, TargetSpec, make_target

    target = make_target(TargetSpec(kind="http", model="support"))
    assert isinstance(target, RawHttpTarget)
    body = target.request_bytes("我想买基金").split(b"\r\n\r\n", 1)[1]
    assert json.loads(body) == {"text": "我想买基金", "model": "support"}
