"""``miaohui serve --workers 2``: a real supervisor process and two spawned worker processes on localhost.

One tiny ONNX Runtime engine (the ``tiny_model`` fixture). Checked with real clients:

* both workers answer HTTP (``/v2/health/ready`` names the worker that answered; connections to the shared
  socket go to whichever worker accepts) and gRPC (``tritonclient.grpc``; each worker binds the gRPC port
  with SO_REUSEPORT, so fresh channels spread over them — ``miaohui_worker_requests_total`` shows the split);
* ``/metrics`` on either worker shows the totals of both (multiprocess mode): every request the clients sent
  is counted exactly once, whichever worker answered it, and the Triton statistics agree;
* model control is refused (HTTP 409, gRPC FAILED_PRECONDITION) with a message that says why;
* SIGTERM to the supervisor stops both workers and the supervisor with status 0 and frees both ports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from miaohui.bench.scrape import Snapshot, fetch_metrics
from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

pytestmark = pytest.mark.slow  # two spawned interpreters load torch/ORT: ~20-40 s on 2 cores

ROOT = Path(__file__).resolve().parents[2]
HTTP_REQUESTS = 24
GRPC_CHANNELS = 16
GRPC_PER_CHANNEL = 2


def free_port() -> int:
    from tests.servers import free_port as pick

    return pick()


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    grpc_url: str
    log: Path


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("workers-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    write_model_config(
        root / "intent" / "config.yaml", ModelConfig(threads=1, warmup=[WarmupShape(batch=1, sequence=8)])
    )
    yield from serve_workers(root, "--workers", "2")


def serve_workers(root: Path, *options: str, models: str = "intent") -> Iterator[Served]:
    """``miaohui serve`` on ``root`` with ``options`` (free ports, the log in ``root``), yielded once ready and
    killed at the end if still running."""
    port, grpc_port = free_port(), free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(root), "--port", str(port)]
    cmd += ["--grpc-port", str(grpc_port), *options, "--models", models]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
    served = Served(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", log)
    try:
        wait_ready(served, timeout_s=180)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_ready(served: Served, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            pytest.fail(f"server exited with {served.proc.returncode}:\n{served.log.read_text()}")
        try:
            if httpx.get(served.url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not ready after {timeout_s} s:\n{served.log.read_text()}")


def ready_workers(url: str, want: int = 2, timeout_s: float = 120.0) -> dict[int, int]:
    """Worker index → pid, from fresh connections to /v2/health/ready, until ``want`` distinct workers answered
    ready (a worker accepts connections only once its models are warm, and says ready once its gRPC listens too)."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        r = httpx.get(url + "/v2/health/ready", timeout=5)  # a new connection every time
        if r.status_code == 503 and r.json()["ready"] is False:  # warm, its gRPC not yet listening: ask again
            time.sleep(0.01)
            continue
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ready"] is True and body["workers"] == want, body
        seen[body["worker"]] = body["pid"]
        time.sleep(0.01)
    return seen


def scrape(url: str) -> Snapshot:
    snap = fetch_metrics(url)
    assert snap is not None
    return snap


def test_two_workers_share_the_ports_and_count_together(server: Served) -> None:
    workers = ready_workers(server.url)
    assert sorted(workers) == [1, 2], f"both workers must answer; saw {workers}"
    assert len(set(workers.values())) == 2 and server.proc.pid not in workers.values()
    before = scrape(server.url)

    for i in range(HTTP_REQUESTS):  # a fresh connection per request: either worker may accept it
        r = httpx.post(server.url + "/v1/intent", json={"text": f"你好，我想查一下社保 {i}"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["intent"] in {"greeting", "goodbye", "human_agent", "out_of_scope"}

    text = np.array([b"hello, I want to talk to a person"], dtype=object)
    for _ in range(GRPC_CHANNELS):  # each client opens its own channel (connection)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for _ in range(GRPC_PER_CHANNEL):
                inp = grpcclient.InferInput("TEXT", [1], "BYTES")
                inp.set_data_from_numpy(text)
                result = client.infer("intent", [inp])
                assert result.as_numpy("CONFIDENCE").shape == (1,)
        finally:
            client.close()

    after = scrape(server.url)
    grpc_sent = GRPC_CHANNELS * GRPC_PER_CHANNEL
    ok = {"model": "intent", "code": "200"}
    assert after.total("miaohui_requests_total", protocol="http", **ok) - before.total(
        "miaohui_requests_total", protocol="http", **ok
    ) == pytest.approx(HTTP_REQUESTS)
    assert after.total("miaohui_requests_total", protocol="grpc", **ok) - before.total(
        "miaohui_requests_total", protocol="grpc", **ok
    ) == pytest.approx(grpc_sent)
    per_worker = {w: after.total("miaohui_worker_requests_total", worker=w, protocol="grpc") for w in ("1", "2")}
    assert all(v > 0 for v in per_worker.values()), f"gRPC went to one worker only: {per_worker}"
    assert sum(per_worker.values()) == pytest.approx(grpc_sent)
    assert after.total("miaohui_inflight_requests") == 0

    # the statistics extension reads the same totals (rows: one per request; only inference so far)
    stats = httpx.get(server.url + "/v2/models/intent/stats", timeout=5).json()["model_stats"][0]
    assert stats["inference_count"] == HTTP_REQUESTS + grpc_sent  # warm-up runs no requests
    assert stats["inference_stats"]["success"]["count"] == HTTP_REQUESTS + grpc_sent


def test_model_control_is_refused_with_several_workers(server: Served) -> None:
    r = httpx.post(server.url + "/v2/repository/models/intent/unload", timeout=5)
    assert r.status_code == 409, r.text
    assert "--workers 1" in r.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="--workers 1") as err:
            client.load_model("intent")
        assert "FAILED_PRECONDITION" in str(err.value.status())
        assert client.is_model_ready("intent")  # nothing was unloaded
    finally:
        client.close()
    assert httpx.post(server.url + "/v1/intent", json={"text": "hi"}, timeout=5).status_code == 200


def test_each_worker_froze_its_warm_heap_and_counts_gc_pauses(server: Served) -> None:
    """miaohui.gcpolicy: every worker freezes its heap once it is warm (its log says how many objects) and counts its
    collections in ``miaohui_gc_pause_seconds`` (the freeze's own full collection at least), summed over workers."""
    workers = ready_workers(server.url)
    frozen = [line for line in server.log.read_text().splitlines() if "froze" in line and "gc.freeze()" in line]
    assert {int(line.split("server pid ")[1].split(":")[0]) for line in frozen} >= set(workers.values()), frozen
    deadline = time.monotonic() + 10  # each worker flushes its pauses into the shared files every second
    while scrape(server.url).total("miaohui_gc_pause_seconds_count", generation="2") < len(workers):
        assert time.monotonic() < deadline, "the workers' full collections never reached /metrics"
        time.sleep(0.2)
    assert scrape(server.url).total("miaohui_gc_pause_seconds_sum") > 0


def test_sigterm_stops_every_process_and_frees_the_ports(server: Served) -> None:
    pids = list(ready_workers(server.url).values())
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = server.log.read_text()
    assert "received SIGTERM" in log and "all workers stopped" in log, log
    http_port = int(server.url.rsplit(":", 1)[1])
    grpc_port = int(server.grpc_url.rsplit(":", 1)[1])
    for port in (http_port, grpc_port):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # nobody listens there any more
