"""HTTP routes in-process (httpx ASGI transport) over a real tiny ONNX Runtime engine: KServe v2, /v1/intent,
repository control, metrics, and every kind of bad input answered with a 4xx and a message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from miaohui.config import BuildConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.server.http import ServerState, create_app
from miaohui.server.metrics import Metrics
from miaohui.serving.repository import ModelManager


@pytest.fixture(scope="module")
def repo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    build_artifact(tiny_model, "intent", BuildConfig(), repo, log=lambda m: None)
    return repo


@pytest.fixture
async def client(repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    metrics = Metrics()
    manager = ModelManager(repo, observer_factory=metrics.observer)
    await manager.load_all()
    app = create_app(ServerState(manager, metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
    await manager.stop()


async def test_health_and_metadata(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/live")).json() == {"live": True}
    assert (await client.get("/v2/health/ready")).status_code == 200
    meta = (await client.get("/v2/models/intent")).json()
    assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    raw = (await client.get("/v2/models/intent-raw")).json()
    assert [i["name"] for i in raw["inputs"]] == ["input_ids", "attention_mask"]
    assert raw["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 4]}]
    assert (await client.get("/v2/models/intent/versions/1/ready")).json() == {"name": "intent", "ready": True}


async def test_v1_intent_single_and_batch(client: httpx.AsyncClient) -> None:
    one = (await client.post("/v1/intent", json={"text": "hello there, transfer ¥2,000 please"})).json()
    assert set(one) == {"intent", "confidence", "slots", "model", "version"}
    assert one["model"] == "intent" and one["version"] == 1 and 0 < one["confidence"] <= 1
    assert {"name": "amount", "value": 2000.0} .items() <= one["slots"][0].items()
    many = (await client.post("/v1/intent", json={"texts": ["hi", "bye", "hello again"]})).json()
    assert isinstance(many, list) and len(many) == 3


async def test_v2_text_and_raw_infer_match_the_engine(client: httpx.AsyncClient, repo: Path) -> None:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["hi", "bye"]}]}
    out = (await client.post("/v2/models/intent/infer", json=body)).json()
    assert [o["name"] for o in out["outputs"]] == ["INTENT", "CONFIDENCE"]
    ids = np.array([[101, 7592, 102, 0], [101, 7592, 2088, 102]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 4], "data": ids.ravel().tolist()},
                       {"name": "attention_mask", "datatype": "INT64", "shape": [2, 4], "data": mask.ravel().tolist()}]}
    out = (await client.post("/v2/models/intent-raw/infer", json=body)).json()
    got = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(out["outputs"][0]["shape"])
    with load_engine(repo / "intent" / "1") as engine:
        want = np.concatenate([engine.infer({"input_ids": ids[i : i + 1, : int(mask[i].sum())],
                                             "attention_mask": mask[i : i + 1, : int(mask[i].sum())]})["logits"]
                               for i in range(2)])
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/intent", b"{not json", 400, "request body is not valid JSON"),
        ("/v1/intent", b"[1, 2]", 400, "is a JSON list, not an object"),
        ("/v1/intent", {"text": ""}, 400, "text #0 is empty"),
        ("/v1/intent", {"text": 5}, 400, "'text' must be a string, got int"),
        ("/v1/intent", {"texts": []}, 400, "missing 'text'"),
        ("/v1/intent", {"text": "hi " * 200}, 400, "tokens long; this model accepts at most 64"),
        ("/v1/intent", {"texts": ["a"] * 300}, 400, "300 texts in one request; the limit is 256"),
        ("/v1/intent", {"text": "hi", "model": "nope"}, 404, "model 'nope' is not loaded"),
        ("/v1/intent", {"text": "hi", "version": 7}, 404, "model 'intent' has no loaded version 7"),
        ("/v2/models/intent/infer", {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
         400, "input 'TEXT' has 1 values but shape [2] needs 2"),
        ("/v2/models/intent/infer", {"inputs": [{"name": "X", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
         400, "takes one input TEXT (BYTES), got ['X']"),
        ("/v2/models/intent-raw/infer",
         {"inputs": [{"name": "input_ids", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]},
                     {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]}]},
         400, "input 'input_ids' has datatype INT32; the model expects INT64"),
        ("/v2/models/intent-raw/infer",
         {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2], "data": [1, 2]},
                     {"name": "attention_mask", "datatype": "INT64", "shape": [2], "data": [1, 1]}]},
         400, "must both be [batch, sequence]"),
        ("/v2/models/intent-raw/infer",
         {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [40, 1], "data": [1] * 40},
                     {"name": "attention_mask", "datatype": "INT64", "shape": [40, 1], "data": [1] * 40}]},
         400, "batch of 40 rows exceeds max_batch_size 32"),
        ("/v2/models/missing/infer", {"inputs": []}, 404, "model 'missing' is not loaded"),
        ("/v2/models/intent/versions/9/infer", {"inputs": []}, 404, "has no loaded version 9"),
    ],
)
async def test_bad_requests_get_4xx_and_the_server_keeps_serving(
    client: httpx.AsyncClient, path: str, body: object, status: int, fragment: str
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = await client.post(path, **kwargs)  # type: ignore[arg-type]
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]
    assert (await client.post("/v1/intent", json={"text": "still here?"})).status_code == 200


async def test_deadline_gives_504(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/intent", json={"text": "hello", "timeout_ms": 0.001})
    assert resp.status_code == 504 and "deadline" in resp.json()["error"]


async def test_repository_reload_and_unload(client: httpx.AsyncClient) -> None:
    index = (await client.post("/v2/repository/index")).json()
    assert index == [{"name": "intent", "version": "1", "state": "READY", "reason": ""}]
    assert (await client.post("/v2/repository/models/intent/load")).json()["state"] == "READY"
    assert (await client.post("/v2/repository/models/nope/load")).status_code == 404
    assert (await client.post("/v2/repository/models/intent/unload")).status_code == 200
    assert (await client.post("/v1/intent", json={"text": "hi"})).status_code == 404
    assert (await client.get("/v2/health/ready")).status_code == 503
    assert (await client.post("/v2/repository/models/intent/load")).status_code == 200


async def test_metrics_exposed(client: httpx.AsyncClient) -> None:
    await client.post("/v1/intent", json={"text": "hello"})
    await client.post("/v1/intent", json={"text": ""})
    text = (await client.get("/metrics")).text
    assert 'miaohui_requests_total{code="200",model="intent",protocol="http",version="1"}' in text
    assert 'miaohui_request_failures_total{model="intent",reason="bad_input",version="1"}' in text
    for name in ("miaohui_batch_size_bucket", "miaohui_queue_duration_seconds_bucket",
                 "miaohui_compute_duration_seconds_count", "miaohui_process_resident_memory_bytes"):
        assert name in text
