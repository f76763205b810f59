"""Bounded load test (issue 3, "Done means"): the real server under concurrency 64 with a small queue.

A real uvicorn server on a free localhost port (background thread; :func:`miaohui.server.app.build_app`,
whose lifespan loads and warms the repository) serves a tiny ONNX Runtime engine built from the
``tiny_model`` fixture. ``miaohui bench``'s own closed-loop runner (:func:`miaohui.bench.load.run_sync`,
the keep-alive HTTP client of :mod:`miaohui.bench.targets`) drives ``POST /v1/intent`` with 64 workers:

* ``intent`` — max_queue_size 8, max_batch_size 8, max_queue_delay_ms 2: far more callers than the queue
  holds, so the server must shed load with 429 and nothing else — no 5xx, no connection error, no client
  timeout, no lost request (sent == answered + errors) — and the server's own counters must agree with
  the client about every 200 and every 429. Afterwards it still answers a plain request.
* ``roomy`` — the same engine with the default queue (256 ≥ 64 callers: never full); every request carries
  ``X-Request-Timeout-Ms``: 2 ms for half the texts, 8 s for the others. Requests end as 200 or 504 only
  (both occur: expiring requests do not take their batch-mates with them), and each 504 is a deadline
  rejection the batcher counted.

Each load runs a few seconds (5 s measured in all); the whole module takes well under 20 s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.servers import UvicornThread

from miaohui.bench import load as bench_load
from miaohui.bench.load import LoadPlan, RawRun, run_sync
from miaohui.bench.report import summarize
from miaohui.bench.scrape import Snapshot, fetch_metrics
from miaohui.bench.sweep import fit_token_range, load_texts, tokenizer_counter
from miaohui.bench.targets import RawHttpTarget, Target, TargetSpec
from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.server.app import build_app
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

CONCURRENCY = 64
SMALL_QUEUE = BatcherConfig(max_batch_size=8, max_queue_delay_ms=2.0, max_queue_size=8)
TIGHT_MS = 2
RELAXED_MS = 8000


@pytest.fixture(scope="module")
def repo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load-repo")
    warmup = [WarmupShape(batch=1, sequence=8), WarmupShape(batch=8, sequence=32)]
    small = BatcherConfig(max_batch_size=8, max_queue_delay_ms=2.0)
    for name, batching in (("intent", SMALL_QUEUE), ("roomy", small)):
        build_artifact(tiny_model, name, BuildConfig(precision="fp32"), root, log=lambda m: None)
        write_model_config(root / name / "config.yaml", ModelConfig(batching=batching, warmup=warmup))
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[UvicornThread]:
    with UvicornThread(build_app(repo, ["intent", "roomy"])) as srv:
        yield srv


@pytest.fixture(scope="module")
def texts(repo: Path) -> list[str]:
    """Dev-split texts of 4-32 tokens (within the tiny model's max_length 64), composed where needed."""
    return fit_token_range(load_texts(), tokenizer_counter(repo / "intent" / "1"), 4, 32, seed=0)


def scrape(url: str) -> Snapshot:
    snap = fetch_metrics(url)
    assert snap is not None, f"{url}/metrics did not answer"
    return snap


def delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> int:
    return round(after.total(name, **labels) - before.total(name, **labels))


def drive(spec: TargetSpec, texts: list[str], seconds: float) -> tuple[RawRun, LoadPlan]:
    """Closed loop at concurrency 64, no warm-up: every request the server saw is in the client's counts."""
    plan = LoadPlan(mode="closed", level=CONCURRENCY, warmup_s=0.0, duration_s=seconds, seed=0)
    return run_sync(spec, texts, plan), plan


def assert_still_serving(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/v2/health/ready").status_code == 200
        r = client.post("/v1/intent", json={"text": "你好，我想查一下社保"})
        assert r.status_code == 200, r.text
        assert r.json()["intent"] in {"greeting", "goodbye", "human_agent", "out_of_scope"}


def test_concurrency_64_small_queue_sheds_with_429_only(server: UvicornThread, texts: list[str]) -> None:
    spec = TargetSpec(kind="http", url=server.url, timeout_s=10.0)
    before = scrape(server.url)
    raw, plan = drive(spec, texts, seconds=3.0)
    after = scrape(server.url)
    point = summarize(raw, plan)
    statuses = Counter(raw.status)

    assert point["lost"] == 0 and point["sent"] == point["answered"] + point["error_count"], point
    assert set(statuses) <= {"ok", "429"}, f"only 200 and 429 are allowed: {dict(statuses)}"
    groups = point["error_groups"]
    assert groups["5xx"] == groups["503"] == groups["504"] == 0, groups
    assert groups["connection"] == groups["timeout"] == groups["other"] == 0, groups
    assert point["answered"] > 0
    assert statuses["429"] > 0, "64 callers against a queue of 8 must see the queue full"

    # the server counted exactly what the client saw: each request is one text, i.e. one batcher row
    model = {"model": "intent"}
    assert delta(before, after, "miaohui_requests_total", code="200", **model) == statuses["ok"]
    assert delta(before, after, "miaohui_requests_total", code="429", **model) == statuses["429"]
    assert delta(before, after, "miaohui_rejected_total", reason="queue_full", **model) == statuses["429"]
    assert delta(before, after, "miaohui_request_failures_total", reason="queue_full", **model) == statuses["429"]
    assert delta(before, after, "miaohui_request_failures_total", **model) == statuses["429"]
    assert delta(before, after, "miaohui_batch_size_sum", **model) == statuses["ok"]
    assert after.total("miaohui_inflight_requests", model="v1/intent") == 0

    assert_still_serving(server.url)


class DeadlineHeaderTarget(RawHttpTarget):
    """The bench HTTP client for ``POST /v1/intent`` with an ``X-Request-Timeout-Ms`` header on every request:
    ``tight_ms`` for the texts in ``tight``, ``relaxed_ms`` for the others."""

    def __init__(self, spec: TargetSpec, tight: set[str], tight_ms: int, relaxed_ms: int) -> None:
        super().__init__(spec.url, "/v1/intent", lambda t: {"text": t, "model": spec.model}, b'"intent"', spec)
        self.tight, self.tight_ms, self.relaxed_ms = tight, tight_ms, relaxed_ms

    def request_bytes(self, text: str) -> bytes:
        raw = self._requests.get(text)
        if raw is None:
            header = f"\r\nX-Request-Timeout-Ms: {self.tight_ms if text in self.tight else self.relaxed_ms}\r\n\r\n"
            raw = self._requests[text] = super().request_bytes(text).replace(b"\r\n\r\n", header.encode(), 1)
        return raw


def test_tiny_deadline_header_ends_as_200_or_504_only(
    server: UvicornThread, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = set(texts[::2])  # half the texts carry a deadline too short to meet under this load

    def make_target(spec: TargetSpec) -> Target:
        return DeadlineHeaderTarget(spec, tight, TIGHT_MS, RELAXED_MS)

    monkeypatch.setattr(bench_load, "make_target", make_target)  # the runner's factory: same loop, our header
    spec = TargetSpec(kind="http", url=server.url, model="roomy", timeout_s=10.0)
    before = scrape(server.url)
    raw, plan = drive(spec, texts, seconds=2.0)
    after = scrape(server.url)
    point = summarize(raw, plan)
    statuses = Counter(raw.status)

    assert point["lost"] == 0 and point["sent"] == point["answered"] + point["error_count"], point
    assert set(statuses) <= {"ok", "504"}, f"only 200 and 504 are allowed: {dict(statuses)}"
    assert statuses["504"] > 0, f"64 callers, half with a {TIGHT_MS} ms deadline: some must expire"
    assert statuses["ok"] > 0, "requests with a relaxed deadline must be answered beside the expiring ones"
    model = {"model": "roomy"}
    assert delta(before, after, "miaohui_rejected_total", reason="deadline", **model) == statuses["504"]
    assert delta(before, after, "miaohui_request_failures_total", reason="deadline", **model) == statuses["504"]
    assert delta(before, after, "miaohui_requests_total", code="200", **model) == statuses["ok"]

    assert_still_serving(server.url)
