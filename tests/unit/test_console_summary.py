"""The console's routes and its plot data, in-process: the histogram quantile, the sampler over a real
:class:`~miaohui.server.metrics.Metrics` fed known observations, ``/v1/console/*`` and the static files at ``/ui``
(the browser test is tests/e2e/test_console.py)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from miaohui.errors import ConfigError
from miaohui.server.console import UI_DIR, ConsoleSampler, mount_console, quantile
from miaohui.server.http import create_app
from miaohui.server.metrics import LATENCY_BUCKETS, Metrics
from miaohui.server.observer_metrics import MetricsObserver
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager


def test_quantile_interpolates_within_the_bucket_as_promql() -> None:
    bounds = (0.1, 0.2, 0.4)
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.4], none above
    counts = (4.0, 8.0, 10.0, 10.0)
    assert quantile(0.5, bounds, counts) == pytest.approx(0.1 + 0.1 * (5 - 4) / 4)
    assert quantile(0.99, bounds, counts) == pytest.approx(0.2 + 0.2 * (9.9 - 8) / 2)
    assert quantile(0.2, bounds, counts) == pytest.approx(0.1 * 2 / 4)
    assert quantile(0.5, bounds, (0.0, 0.0, 0.0, 0.0)) is None
    assert quantile(0.99, bounds, (0.0, 0.0, 0.0, 5.0)) == 0.4  # all above the last bound: its value


def test_sampler_points_from_known_observations() -> None:
    metrics = Metrics()
    sampler = ConsoleSampler(metrics, interval_s=1.0, keep_s=10.0)
    first = sampler.sample()
    for _ in range(90):
        metrics.done("intent", "1", "http", 200, 0.003)  # in (0.002, 0.005]
    for _ in range(10):
        metrics.done("intent", "1", "http", 500, 0.3, "engine")  # in (0.25, 0.5]
    observer = metrics.observer("intent", 1)
    observer.on_enqueue(7)
    observer.on_batch(8, 64, 64, [0.001] * 8)
    observer.on_batch(4, 32, 32, [0.001] * 4)
    llm = MetricsObserver(metrics, "chat", 1)
    llm.on_prefix_cache(100, 64)
    llm.on_prefix_cache(28, 0)
    sampler.sample()
    summary = sampler.summary(window_s=60)
    assert summary["interval_s"] == 1.0 and summary["requests_total"] == 100
    [point] = summary["points"]
    dt = sampler.samples[1].t - first.t
    assert point["rps"] == pytest.approx(100 / dt, rel=1e-3)
    assert point["p50_ms"] == pytest.approx(2 + 3 * 50 / 90, abs=1e-3)
    assert point["p99_ms"] == pytest.approx(250 + 250 * (99 - 90) / 10, abs=1e-3)
    assert point["queue_depth"] == 7
    assert point["batch_size"] == 6  # 12 rows in 2 batches
    assert point["prefix_hit_rate"] == 0.5  # 64 of 128 prompt tokens reused
    assert summary["prefix_cache"] == {"hit_tokens": 64, "queried_tokens": 128, "hit_rate": 0.5}
    assert b'miaohui_prefix_cache_hit_tokens_total{model="chat"} 64.0' in metrics.render()
    sampler.sample()  # nothing happened since: a quiet point
    quiet = sampler.summary(window_s=60)["points"][-1]
    assert (quiet["rps"], quiet["p50_ms"], quiet["p99_ms"], quiet["batch_size"], quiet["prefix_hit_rate"]) == (
        0,
        None,
        None,
        None,
        None,
    )


def test_sampler_keeps_only_its_window() -> None:
    sampler = ConsoleSampler(Metrics(), interval_s=1.0, keep_s=3.0)
    for _ in range(10):
        sampler.sample()
    assert len(sampler.samples) == 4
    with pytest.raises(ConfigError, match=re.escape("console sampling every 0.0 s keeping 3.0 s is not possible")):
        ConsoleSampler(Metrics(), interval_s=0.0, keep_s=3.0)


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    metrics = Metrics()
    state = ServerState(ModelManager(tmp_path, observer_factory=metrics.observer), metrics)
    app = create_app(state)
    sampler = mount_console(app, state)
    sampler.sample()
    sampler.sample()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        c.state = state  # type: ignore[attr-defined]
        yield c


async def test_ui_is_served_from_the_package(client: httpx.AsyncClient) -> None:
    redirect = await client.get("/ui")
    assert redirect.status_code == 307 and redirect.headers["location"] == "/ui/"
    page = await client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<select id="chat-model">' in page.text
    for name in ("console.js", "plot.js", "console.css"):
        asset = await client.get(f"/ui/{name}")
        assert asset.status_code == 200, name
    assert (await client.get("/ui/nope.js")).status_code == 404


def test_static_files_load_nothing_from_elsewhere() -> None:
    """No CDN: every page, script and style sheet refers only to this server."""
    for path in sorted(UI_DIR.iterdir()):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(src|href)=\"(https?:)?//", text), path.name
        assert not re.search(r"\bimport\s.*https?://|@import\s+url\(\s*['\"]?https?:", text), path.name


async def test_summary_route(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/console/summary", params={"window_s": 60})).json()
    assert body["window_s"] == 60 and len(body["points"]) == 1
    assert set(body["points"][0]) == {"t", "rps", "p50_ms", "p99_ms", "queue_depth", "batch_size", "prefix_hit_rate"}
    assert body["prefix_cache"] == {"hit_tokens": 0, "queried_tokens": 0, "hit_rate": None}
    bad = await client.get("/v1/console/summary", params={"window_s": 0})
    assert bad.status_code == 400
    assert bad.json() == {"error": "invalid request at query.window_s: Input should be greater than 0"}


async def test_models_route_says_why_control_is_refused(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/console/models")).json()
    assert body == {"models": [], "llms": [], "pipelines": [], "control": {"allowed": True, "reason": ""}}
    client.state.workers = 3  # type: ignore[attr-defined]
    control = (await client.get("/v1/console/models")).json()["control"]
    assert control["allowed"] is False
    assert control["reason"].startswith("model control (load/unload) is not available with --workers 3")
    assert control["reason"].endswith("serve with --workers 1 to load/unload over the API")


def test_latency_buckets_end_finite() -> None:
    """The summary's quantiles rely on the histogram's finite bounds (+Inf is added by the sampler)."""
    assert all(math.isfinite(b) for b in LATENCY_BUCKETS) and list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


def test_sampler_reads_every_workers_totals(tmp_path: Path) -> None:
    """With ``--workers N`` the counters live in the shared multiprocess directory: the sampler reads the totals
    of every worker there (two worker processes record here, a third samples)."""
    record = (
        "import sys; from miaohui.server.metrics import Metrics, use_worker_files; use_worker_files(int(sys.argv[1]));"
        "m = Metrics(); [m.done('intent', '1', 'http', 200, 0.003) for _ in range(int(sys.argv[2]))];"
        "m.observer('intent', 1).on_batch(4, 16, 16, [0.001] * 4)"
    )
    sample = (
        "from miaohui.server.metrics import Metrics; from miaohui.server.console import ConsoleSampler;"
        "s = ConsoleSampler(Metrics()).snapshot(); print(s.requests, s.batches, s.batch_rows, s.latency_buckets[3])"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for worker, count in ((1, 5), (2, 7)):
        subprocess.run([sys.executable, "-c", record, str(worker), str(count)], env=env, check=True)
    out = subprocess.run([sys.executable, "-c", sample], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["12.0", "2.0", "8.0", "12.0"]  # 0.003 s lies in the bucket le=0.005 (index 3)
