"""``miaohui serve --workers 2 --shared-engine``: a real supervisor, one engine process and two HTTP workers.

The tiny ONNX Runtime engine (``tiny_model``), real clients on localhost:

* raw tensors through the KServe API come back with exactly the logits the engine computes in this process,
  whichever worker answered — the rows travelled to the engine process and back;
* 64 concurrent ``/v1/intent`` requests over both workers: all answered, and the batch metrics (written by the
  engine process, shown by every worker) count every row once, in fewer batches than rows;
* errors keep their class across the hop: a deadline that passed is 504, an over-long text 400, an unknown
  model 404, and the server keeps serving;
* the engine process killed with SIGKILL: requests meanwhile are rejected with 503 (never hang), the supervisor
  restarts it and the same workers serve again;
* SIGTERM stops every process with status 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from tests.e2e.test_workers import Served, ready_workers, scrape, serve_workers

from miaohui.config import BuildConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

pytestmark = pytest.mark.slow  # three spawned interpreters load ORT: ~20-40 s on 2 cores


@pytest.fixture(scope="module")
def repo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shared-engine-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    config = ModelConfig(
        threads=1, batching=BatcherConfig(max_queue_delay_ms=5.0), warmup=[WarmupShape(batch=1, sequence=8)]
    )
    write_model_config(root / "intent" / "config.yaml", config)
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[Served]:
    yield from serve_workers(repo, "--workers", "2", "--shared-engine")


def engine_pid(server: Served) -> int:
    pids = re.findall(r"the engine process \(pid (\d+)\) is ready", server.log.read_text())
    assert pids, server.log.read_text()
    return int(pids[-1])


def test_rows_go_to_the_engine_process_and_come_back_exact(server: Served, repo: Path) -> None:
    assert sorted(ready_workers(server.url)) == [1, 2]
    ids = np.array([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 7592, 102, 0, 0, 0, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    want = load_engine(repo / "intent" / "1", threads=1).infer({"input_ids": ids, "attention_mask": mask})["logits"]
    body = {
        "inputs": [
            {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.ravel().tolist()},
            {"name": "attention_mask", "shape": list(mask.shape), "datatype": "INT64", "data": mask.ravel().tolist()},
        ]
    }
    for _ in range(6):  # fresh connections: both workers answer in turn
        r = httpx.post(server.url + "/v2/models/intent-raw/infer", json=body, timeout=10)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        got = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_engine_process_froze_its_warm_heap_before_it_was_ready(server: Served) -> None:
    """miaohui.gcpolicy in the engine process: frozen once warm, logged before its ready line."""
    ready_workers(server.url)
    text = server.log.read_text()
    frozen = re.search(r"engine process: froze (\d+) objects", text)
    assert frozen is not None and int(frozen.group(1)) > 10_000, text
    assert text.index(frozen.group(0)) < text.index("the engine process (pid"), text


def test_concurrent_requests_are_batched_in_the_engine_process(server: Served) -> None:
    before = scrape(server.url)
    n = 64

    async def load() -> list[int]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as client:
            rs = await asyncio.gather(*(client.post("/v1/intent", json={"text": f"我想查余额 {i}"}) for i in range(n)))
        return [r.status_code for r in rs]

    assert asyncio.run(load()) == [200] * n
    after = scrape(server.url)
    rows = after.total("miaohui_batch_size_sum") - before.total("miaohui_batch_size_sum")
    batches = after.total("miaohui_batch_size_count") - before.total("miaohui_batch_size_count")
    assert rows == pytest.approx(n), "every row is computed once, by the engine process"
    assert batches < n, f"{n} concurrent rows ran in {batches} batches: no batching"
    per_worker = [after.total("miaohui_worker_requests_total", worker=w, protocol="http") for w in ("1", "2")]
    assert all(v > 0 for v in per_worker), per_worker


def test_errors_keep_their_status_across_the_hop(server: Served) -> None:
    r = httpx.post(
        server.url + "/v1/intent", json={"text": "hello"}, headers={"x-request-timeout-ms": "0.001"}, timeout=10
    )
    assert r.status_code == 504, r.text
    assert httpx.post(server.url + "/v1/intent", json={"text": "字" * 5000}, timeout=10).status_code == 400
    assert httpx.post(server.url + "/v2/models/nope/infer", json={"inputs": []}, timeout=10).status_code == 404
    assert httpx.post(server.url + "/v1/intent", json={"text": "hello"}, timeout=10).status_code == 200


def test_a_killed_engine_process_gives_503_then_restarts(server: Served) -> None:
    old = engine_pid(server)
    os.kill(old, signal.SIGKILL)
    codes: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.post(server.url + "/v1/intent", json={"text": "hello"}, timeout=30)
        codes.add(r.status_code)
        if r.status_code == 200 and engine_pid(server) != old:
            break
        assert r.status_code == 503, r.text  # rejected, never hanging or a 500
        time.sleep(0.2)
    assert 200 in codes and engine_pid(server) != old, server.log.read_text()
    assert "the engine process (pid" in server.log.read_text() and "restarting it" in server.log.read_text()


def test_sigterm_stops_every_process(server: Served) -> None:
    pids = [*ready_workers(server.url).values(), engine_pid(server)]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
