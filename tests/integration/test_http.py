"""HTTP routes over a real tiny ONNX Runtime engine: KServe v2, /v1/intent, repository control, statistics,
metrics, and every kind of bad input answered with a 4xx and a message.

Most tests run in-process (httpx ASGI transport). The KServe binary tensor extension is tested with an unchanged
``tritonclient.http`` against a real uvicorn server on localhost (the app of :func:`miaohui.server.app.build_app`,
in a background thread), with binary inputs and outputs on and off.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as tc
from tests.servers import UvicornThread
from tritonclient.utils import InferenceServerException

from miaohui.config import BuildConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.server.app import build_app
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager

BINARY_FIX = (
    "Fix: set Inference-Header-Content-Length to the JSON header's length and append each input's bytes in input order"
)


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
    assert set(one) == {"intent", "confidence", "candidate", "out_of_scope", "slots", "model", "version"}
    assert one["candidate"] == one["intent"]  # no threshold: out of scope only as the model's own label
    assert one["out_of_scope"] is (one["intent"] == "out_of_scope")
    assert one["model"] == "intent" and one["version"] == 1 and 0 < one["confidence"] <= 1
    assert {"name": "amount", "value": 2000.0}.items() <= one["slots"][0].items()
    many = (await client.post("/v1/intent", json={"texts": ["hi", "bye", "hello again"]})).json()
    assert isinstance(many, list) and len(many) == 3


async def test_v2_text_and_raw_infer_match_the_engine(client: httpx.AsyncClient, repo: Path) -> None:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["hi", "bye"]}]}
    out = (await client.post("/v2/models/intent/infer", json=body)).json()
    assert [o["name"] for o in out["outputs"]] == ["INTENT", "CONFIDENCE"]
    ids = np.array([[101, 7592, 102, 0], [101, 7592, 2088, 102]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    body = {
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [2, 4], "data": ids.ravel().tolist()},
            {"name": "attention_mask", "datatype": "INT64", "shape": [2, 4], "data": mask.ravel().tolist()},
        ]
    }
    out = (await client.post("/v2/models/intent-raw/infer", json=body)).json()
    got = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(out["outputs"][0]["shape"])
    with load_engine(repo / "intent" / "1") as engine:
        want = np.concatenate(
            [
                engine.infer(
                    {
                        "input_ids": ids[i : i + 1, : int(mask[i].sum())],
                        "attention_mask": mask[i : i + 1, : int(mask[i].sum())],
                    }
                )["logits"]
                for i in range(2)
            ]
        )
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
        (
            "/v2/models/intent/infer",
            {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
            400,
            "input 'TEXT' has 1 values but shape [2] needs 2",
        ),
        (
            "/v2/models/intent/infer",
            {"inputs": [{"name": "X", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
            400,
            "takes one input TEXT (BYTES), got ['X']",
        ),
        (
            "/v2/models/intent-raw/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
                ]
            },
            400,
            "input 'input_ids' has datatype INT32; the model expects INT64",
        ),
        (
            "/v2/models/intent-raw/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [2], "data": [1, 2]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [2], "data": [1, 1]},
                ]
            },
            400,
            "must both be [batch, sequence]",
        ),
        (
            "/v2/models/intent-raw/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [], "data": 5},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [], "data": 1},
                ]
            },
            400,
            "input_ids [] and attention_mask [] must both be [batch, sequence]",
        ),
        (
            "/v2/models/intent-raw/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]},
                ]
            },
            400,
            "input_ids [3] and attention_mask [1, 3] must both be [batch, sequence]",
        ),
        (
            "/v2/models/intent/infer",
            {
                "inputs": [
                    {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                    {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["b"]},
                ]
            },
            400,
            "input 'TEXT' is given twice",
        ),
        (
            "/v2/models/intent/infer",
            {
                "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
                "outputs": [{"name": "LABEL"}],
            },
            400,
            "requested outputs ['LABEL'] do not exist. Fix: this model's outputs are ['INTENT', 'CONFIDENCE']",
        ),
        (
            "/v2/models/intent/infer",
            {
                "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
                "outputs": [{"name": "INTENT", "parameters": {"classification": 2}}],
            },
            400,
            "output 'INTENT' asks for classification, which is not supported",
        ),
        (
            "/v2/models/intent-raw/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [40, 1], "data": [1] * 40},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [40, 1], "data": [1] * 40},
                ]
            },
            400,
            "batch of 40 rows exceeds max_batch_size 32",
        ),
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


async def test_oversized_and_compressed_bodies_are_refused(client: httpx.AsyncClient) -> None:
    big = await client.post("/v2/models/intent/infer", content=b"x" * ((8 << 20) + 1))
    assert big.status_code == 413
    assert big.json()["error"] == "request body is larger than the limit of 8388608 bytes. Fix: send smaller batches"
    gz = await client.post("/v1/intent", content=b"...", headers={"Content-Encoding": "gzip"})
    assert gz.status_code == 400
    assert gz.json()["error"] == "Content-Encoding 'gzip' is not supported. Fix: send the body uncompressed"


async def test_deadline_gives_504(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/intent", json={"text": "hello", "timeout_ms": 0.001})
    assert resp.status_code == 504 and "deadline" in resp.json()["error"]


async def test_not_ready_until_every_protocol_listens(repo: Path) -> None:
    """Warm models but gRPC not yet listening (``serve`` starts it once HTTP accepts): not ready, then ready."""
    metrics = Metrics()
    manager = ModelManager(repo, observer_factory=metrics.observer)
    await manager.load_all()
    state = ServerState(manager, metrics)
    state.listening = False
    transport = httpx.ASGITransport(app=create_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.get("/v2/health/ready")
            assert (r.status_code, r.json()) == (503, {"ready": False})
            state.listening = True
            assert (await c.get("/v2/health/ready")).status_code == 200
    finally:
        await manager.stop()


async def test_repository_reload_and_unload(client: httpx.AsyncClient) -> None:
    index = (await client.post("/v2/repository/index")).json()
    assert index == [{"name": "intent", "version": "1", "state": "READY", "reason": ""}]
    assert (await client.post("/v2/repository/models/intent/load")).json()["state"] == "READY"
    assert (await client.post("/v2/repository/models/nope/load")).status_code == 404
    assert (await client.post("/v2/repository/models/intent/unload")).status_code == 200
    assert (await client.post("/v1/intent", json={"text": "hi"})).status_code == 404
    assert (await client.get("/v2/health/ready")).status_code == 503
    assert (await client.post("/v2/repository/models/intent/load")).status_code == 200


async def test_a_frozen_server_refreezes_after_load_and_unload(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """miaohui.gcpolicy: in a process frozen at start-up (``miaohui serve``; simulated here by marking this test
    process frozen, since freezing pytest's own heap would outlive the test), a model load and an unload each unfreeze,
    collect (an unloaded version's cycles are freed) and freeze again."""
    import gc

    from miaohui import gcpolicy

    monkeypatch.setattr(gcpolicy, "_frozen", [True])
    assert gcpolicy.freeze_enabled()
    try:
        with caplog.at_level("INFO", logger="miaohui.gcpolicy"):
            assert (await client.post("/v2/repository/models/intent/unload")).status_code == 200
            assert gc.get_freeze_count() > 0
            gc.unfreeze()
            assert (await client.post("/v2/repository/models/intent/load")).status_code == 200
            assert gc.get_freeze_count() > 0
        froze = [r.getMessage() for r in caplog.records if "froze" in r.getMessage()]
        assert [m.split(":")[0] for m in froze] == ["after unloading intent", "after loading intent"], froze
    finally:
        gc.unfreeze()


async def test_metrics_exposed(client: httpx.AsyncClient) -> None:
    await client.post("/v1/intent", json={"text": "hello"})
    await client.post("/v1/intent", json={"text": ""})
    text = (await client.get("/metrics")).text
    assert 'miaohui_requests_total{code="200",model="intent",protocol="http",version="1"}' in text
    assert 'miaohui_request_failures_total{model="intent",reason="bad_input",version="1"}' in text
    for name in (
        "miaohui_batch_size_bucket",
        "miaohui_queue_duration_seconds_bucket",
        "miaohui_compute_duration_seconds_count",
        "miaohui_process_resident_memory_bytes",
        "miaohui_process_cpu_seconds_total",
    ):
        assert name in text
    assert 'miaohui_model_ready{model="intent",version="1"} 1.0' in text
    # the version's cold start: load and warm-up (no compile phase: ONNX Runtime compiles nothing after ready)
    starts = {
        line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('miaohui_model_start_seconds{model="intent"')
    }
    assert set(starts) == {"load", "warmup"} and all(v > 0 for v in starts.values()), starts
    # where the time goes around the batcher: tokenize and slots per /v1/intent request (the ORT engine on
    # the CPU measures no h2d/gpu/d2h stages)
    for stage in ("tokenize", "slots"):
        assert f'miaohui_stage_duration_seconds_count{{model="intent",stage="{stage}",version="1"}} 1.0' in text
    assert 'stage="gpu"' not in text


async def test_statistics(client: httpx.AsyncClient) -> None:
    assert "statistics" in (await client.get("/v2")).json()["extensions"]
    for _ in range(2):
        await client.post("/v1/intent", json={"texts": ["hi", "bye"]})
    stats = (await client.get("/v2/models/intent/stats")).json()["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("intent", "1")]
    one = stats[0]
    assert one["inference_count"] == 4 and 1 <= one["execution_count"] <= 4
    assert one["inference_stats"]["success"] == {"count": 2}
    assert one["inference_stats"]["queue"]["count"] == 4 and one["inference_stats"]["queue"]["ns"] > 0
    compute = one["inference_stats"]["compute_infer"]
    assert compute["count"] == one["execution_count"] and compute["ns"] > 0
    assert (await client.get("/v2/models/intent-raw/versions/1/stats")).json()["model_stats"] == stats
    assert (await client.get("/v2/models/stats")).json() == {"model_stats": stats}
    missing = await client.get("/v2/models/nope/stats")
    assert missing.status_code == 404 and missing.json()["error"].startswith("model 'nope' is not loaded")


async def test_unknown_model_names_share_one_metrics_label(client: httpx.AsyncClient) -> None:
    for i in range(3):
        assert (await client.post(f"/v2/models/random-{i}/infer", json={"inputs": []})).status_code == 404
        assert (await client.post("/v1/intent", json={"text": "hi", "model": f"other-{i}"})).status_code == 404
    text = (await client.get("/metrics")).text
    assert 'miaohui_requests_total{code="404",model="_unknown",protocol="http",version=""} 6.0' in text
    assert "random-" not in text and "other-" not in text


# ---------------------------------------------------------------------- repository: names and failed loads


@pytest.fixture
async def broken_client(repo: Path, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``intent`` plus ``broken``: the same artifact with an invalid config.yaml, so its first load fails."""
    shutil.copytree(repo / "intent", tmp_path / "intent")
    shutil.copytree(repo / "intent", tmp_path / "broken")
    (tmp_path / "broken" / "config.yaml").write_text("max_batch: 4\n", encoding="utf-8")
    metrics = Metrics()
    manager = ModelManager(tmp_path, observer_factory=metrics.observer)
    await manager.load_all()
    app = create_app(ServerState(manager, metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
    await manager.stop()


async def test_a_failed_first_load_is_not_listed_as_loaded(broken_client: httpx.AsyncClient) -> None:
    index = {m["name"]: m for m in (await broken_client.post("/v2/repository/index")).json()}
    assert index["intent"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE" and index["broken"]["reason"].startswith("load failed: ")
    assert "config.yaml is invalid" in index["broken"]["reason"]
    assert (await broken_client.get("/v2/health/ready")).status_code == 200  # the other model serves
    resp = await broken_client.post("/v1/intent", json={"text": "hi", "model": "broken"})
    assert resp.status_code == 404 and resp.json()["error"].startswith("model 'broken' is not loaded (load failed: ")
    resp = await broken_client.post("/v2/models/nope/infer", json={"inputs": []})
    assert resp.json()["error"] == "model 'nope' is not loaded. Fix: loaded models: intent"
    again = await broken_client.post("/v2/repository/models/broken/load")
    assert again.status_code == 400 and "config.yaml is invalid" in again.json()["error"]
    assert [m["name"] for m in (await broken_client.post("/v2/repository/index")).json()] == ["broken", "intent"]


@pytest.mark.parametrize("name", ["bad..name", ".hidden", "_private", "x%20y"])
async def test_load_and_unload_take_plain_names_only(client: httpx.AsyncClient, name: str) -> None:
    shown = name.replace("%20", " ")
    for action in ("load", "unload"):
        resp = await client.post(f"/v2/repository/models/{name}/{action}")
        assert resp.status_code == 400, resp.text
        assert resp.json() == {
            "error": f"model name {shown!r} is not a plain name. Fix: use the model's folder name in the repository"
        }


async def test_load_parameters_are_refused(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v2/repository/models/intent/load", json={"parameters": {"config": "{}"}})
    assert resp.status_code == 400
    assert resp.json()["error"] == (
        "load parameters ['config'] are not supported (no inline config or files). "
        "Fix: put config.yaml and the versions in the repository, then load the model by name"
    )


# ---------------------------------------------------------------------- tritonclient.http on a real server


@pytest.fixture(scope="module")
def http_server(repo: Path) -> Iterator[UvicornThread]:
    with UvicornThread(build_app(repo)) as srv:
        yield srv


@pytest.fixture(scope="module")
def triton(http_server: UvicornThread) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(url=f"127.0.0.1:{http_server.port}") as c:
        yield c


@pytest.fixture(scope="module")
def reference(repo: Path) -> Iterator[Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """Logits of the ``intent`` artifact run directly on its engine, one row at a time without padding."""
    with load_engine(repo / "intent" / "1") as engine:

        def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            rows = []
            for i in range(len(ids)):
                n = int(mask[i].sum())
                feeds = {"input_ids": ids[i : i + 1, :n], "attention_mask": mask[i : i + 1, :n]}
                rows.append(engine.infer(feeds)["logits"][0])
            return np.stack(rows)

        yield run


def _texts(arr: np.ndarray) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else str(x) for x in arr]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_text_model(
    http_server: UvicornThread, triton: tc.InferenceServerClient, binary: bool
) -> None:
    texts = ["hello there", "查一下我的社保", "bye"]
    inp = tc.InferInput("TEXT", [3], "BYTES")
    inp.set_data_from_numpy(np.array(texts, dtype=object), binary_data=binary)
    outputs = [tc.InferRequestedOutput(n, binary_data=binary) for n in ("INTENT", "CONFIDENCE")]
    result = triton.infer("intent", [inp], outputs=outputs, request_id="r-7")
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("intent", "1", "r-7")
    assert [("binary_data_size" in o.get("parameters", {})) for o in response["outputs"]] == [binary, binary]
    intents, confidence = result.as_numpy("INTENT"), result.as_numpy("CONFIDENCE")
    assert intents.shape == (3,) and confidence.shape == (3,) and confidence.dtype == np.float32
    want = httpx.post(f"http://127.0.0.1:{http_server.port}/v1/intent", json={"texts": texts}).json()
    assert _texts(intents) == [w["intent"] for w in want]
    np.testing.assert_allclose(confidence, [w["confidence"] for w in want], atol=1e-5)

    default = triton.infer("intent", [inp])  # no outputs named: tritonclient asks for binary_data_output
    assert _texts(default.as_numpy("INTENT")) == _texts(intents)
    np.testing.assert_array_equal(default.as_numpy("CONFIDENCE"), confidence)


@pytest.mark.parametrize(
    ("binary_in", "outputs"),
    [(True, None), (True, False), (False, True), (False, False)],
    ids=["bin-in-default-out", "bin-in-json-out", "json-in-bin-out", "json-in-json-out"],
)
def test_tritonclient_http_raw_model(
    triton: tc.InferenceServerClient,
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray],
    binary_in: bool,
    outputs: bool | None,
) -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, 30000, size=(3, 10), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    inputs = []
    for name, arr in (("input_ids", ids), ("attention_mask", mask)):
        inputs.append(tc.InferInput(name, list(arr.shape), "INT64").set_data_from_numpy(arr, binary_data=binary_in))
    wanted = None if outputs is None else [tc.InferRequestedOutput("logits", binary_data=outputs)]
    result = triton.infer("intent-raw", inputs, outputs=wanted)
    logits = result.as_numpy("logits")
    assert logits.shape == (3, 4) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference(ids, mask), rtol=1e-4, atol=1e-4)
    out = result.get_response()["outputs"][0]
    assert ("binary_data_size" in out.get("parameters", {})) == (outputs is not False)


def test_tritonclient_http_selected_and_mixed_outputs(triton: tc.InferenceServerClient) -> None:
    inp = tc.InferInput("TEXT", [2], "BYTES").set_data_from_numpy(np.array(["hi", "bye"], dtype=object))
    only = triton.infer("intent", [inp], outputs=[tc.InferRequestedOutput("CONFIDENCE")])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["CONFIDENCE"]
    assert only.as_numpy("INTENT") is None and only.as_numpy("CONFIDENCE").shape == (2,)
    mixed = triton.infer(
        "intent",
        [inp],
        outputs=[tc.InferRequestedOutput("CONFIDENCE"), tc.InferRequestedOutput("INTENT", binary_data=False)],
    )
    rows = mixed.get_response()["outputs"]
    assert [o["name"] for o in rows] == ["CONFIDENCE", "INTENT"]
    assert "data" in rows[1] and rows[0]["parameters"]["binary_data_size"] == 8
    np.testing.assert_array_equal(mixed.as_numpy("CONFIDENCE"), only.as_numpy("CONFIDENCE"))


def test_tritonclient_http_errors_and_metadata(http_server: UvicornThread, triton: tc.InferenceServerClient) -> None:
    assert triton.is_server_ready() and triton.is_model_ready("intent-raw")
    assert "statistics" in triton.get_server_metadata()["extensions"]
    assert triton.get_model_metadata("intent")["outputs"][0] == {"name": "INTENT", "datatype": "BYTES", "shape": [-1]}
    ids = np.full((2, 5), 7, dtype=np.int64)
    inp = tc.InferInput("input_ids", [2, 5], "INT64").set_data_from_numpy(ids)
    inp.set_shape([3, 5])  # the declared shape disagrees with the 80 bytes sent
    mask = tc.InferInput("attention_mask", [2, 5], "INT64").set_data_from_numpy(np.ones_like(ids))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("intent-raw", [inp, mask])
    assert (info.value.status(), info.value.message()) == (
        "400",
        "input 'input_ids' has 80 bytes of raw data but shape [3, 5] of INT64 needs 120. "
        "Fix: make the data match the shape and datatype",
    )
    before = http_server.sample("miaohui_requests_total", model="_unknown", version="", protocol="http", code="404")
    with pytest.raises(InferenceServerException) as info:
        triton.infer("nope", [tc.InferInput("TEXT", [1], "BYTES").set_data_from_numpy(np.array(["hi"], dtype=object))])
    assert (info.value.status(), info.value.message()) == (
        "404",
        "model 'nope' is not loaded. Fix: loaded models: intent",
    )
    after = http_server.sample("miaohui_requests_total", model="_unknown", version="", protocol="http", code="404")
    assert after == before + 1
    stats = triton.get_inference_statistics("intent")["model_stats"][0]
    assert stats["inference_count"] > 0 and stats["inference_stats"]["compute_infer"]["ns"] > 0


def _binary_request(header: dict[str, Any], binary: bytes, length: int | None = None) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    size = len(text) if length is None else length
    return text + binary, {"Inference-Header-Content-Length": str(size)}


def _prefixed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _text_header(size: int, shape: list[int] | None = None) -> dict[str, Any]:
    spec = {"name": "TEXT", "datatype": "BYTES", "shape": shape or [1], "parameters": {"binary_data_size": size}}
    return {"inputs": [spec]}


MALFORMED_BINARY: list[tuple[str, Callable[[], tuple[bytes, dict[str, str]]], str]] = [
    (
        "header length past the body",
        lambda: _binary_request(_text_header(6), _prefixed(b"hi"), length=4000),
        f"Inference-Header-Content-Length is 4000 but the request body has {len(json.dumps(_text_header(6))) + 6} "
        f"bytes. {BINARY_FIX}",
    ),
    (
        "header length not a number",
        lambda: (b"{}", {"Inference-Header-Content-Length": "12ab"}),
        f"Inference-Header-Content-Length '12ab' is not an integer. {BINARY_FIX}",
    ),
    (
        "header cut short",
        lambda: _binary_request(_text_header(6), _prefixed(b"hi"), length=5),
        "the inference header (the first 5 bytes) is not valid JSON",
    ),
    (
        "size larger than the data",
        lambda: _binary_request(_text_header(100), _prefixed(b"hi")),
        f"input 'TEXT' has binary_data_size 100 but only 6 bytes of binary data remain. {BINARY_FIX}",
    ),
    (
        "size smaller than the data",
        lambda: _binary_request(_text_header(6), _prefixed(b"hi") + b"xx"),
        "request body has 2 bytes after the binary data of its inputs. "
        "Fix: make each input's binary_data_size match the bytes sent",
    ),
    (
        "binary data without the header",
        lambda: (json.dumps(_text_header(6)).encode(), {}),
        f"input 'TEXT' has binary_data_size 6 but only 0 bytes of binary data remain. {BINARY_FIX}",
    ),
    (
        "size not a count",
        lambda: _binary_request(_text_header(-1), b""),
        f"input 'TEXT' has binary_data_size -1, not a byte count. {BINARY_FIX}",
    ),
    (
        "element overclaims",
        lambda: _binary_request(_text_header(6), struct.pack("<I", 10) + b"hi"),
        "input 'TEXT' BYTES element #0 claims 10 bytes but only 2 remain. Fix: prefix every element with its exact length",
    ),
    (
        "fewer elements than the shape",
        lambda: _binary_request(_text_header(6, [2]), _prefixed(b"hi")),
        "input 'TEXT' raw data ends after 1 of 2 BYTES elements. "
        "Fix: prefix every element with its 4-byte little-endian length",
    ),
    (
        "data and binary",
        lambda: _binary_request({"inputs": [{**_text_header(6)["inputs"][0], "data": ["hi"]}]}, _prefixed(b"hi")),
        "input 'TEXT' has both data and binary_data_size. Fix: send its values one way",
    ),
    (
        "shared memory",
        lambda: _binary_request(
            {
                "inputs": [
                    {
                        "name": "TEXT",
                        "datatype": "BYTES",
                        "shape": [1],
                        "parameters": {"shared_memory_region": "r0", "shared_memory_byte_size": 6},
                    }
                ]
            },
            b"",
        ),
        "input 'TEXT' uses shared memory, which this server does not support. Fix: send the data inline",
    ),
]


@pytest.mark.parametrize(
    ("build", "expected"), [(b, m) for _, b, m in MALFORMED_BINARY], ids=[i for i, _, _ in MALFORMED_BINARY]
)
def test_malformed_binary_bodies_are_400(
    http_server: UvicornThread, build: Callable[[], tuple[bytes, dict[str, str]]], expected: str
) -> None:
    body, headers = build()
    url = f"http://127.0.0.1:{http_server.port}/v2/models/intent/infer"
    resp = httpx.post(url, content=body, headers=headers)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"].startswith(expected), resp.json()["error"]
    ok = httpx.post(url, json={"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]})
    assert ok.status_code == 200


def test_raw_int64_binary_size_mismatch_is_400(http_server: UvicornThread) -> None:
    ids = np.array([[101, 102]], dtype=np.int64)
    specs = [
        {"name": n, "datatype": "INT64", "shape": [1, 2], "parameters": {"binary_data_size": s}}
        for n, s in (("input_ids", 8), ("attention_mask", 24))
    ]
    body, headers = _binary_request({"inputs": specs}, ids.tobytes())
    resp = httpx.post(f"http://127.0.0.1:{http_server.port}/v2/models/intent-raw/infer", content=body, headers=headers)
    assert resp.status_code == 400
    assert resp.json()["error"] == (
        "input 'input_ids' has 8 bytes of raw data but shape [1, 2] of INT64 needs 16. "
        "Fix: make the data match the shape and datatype"
    )


async def test_a_worker_starting_mirrors_the_engine_process_not_the_newest_version(repo: Path, tmp_path: Path) -> None:
    """An HTTP worker of ``--shared-engine`` that starts after a version was added to disk but before the engine
    process loaded it serves what the engine process serves (version 1), not the newest on disk: asking for
    version 2 would fail the whole model in that worker. The engine process is a stand-in answering ``status``
    only: the moment between a version's copy and its load cannot be held still with the real one."""
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(repo, root)
    shutil.copytree(root / "intent" / "1", root / "intent" / "2")  # added, not yet loaded by the engine process

    class EngineServing1:
        async def status(self) -> dict[str, list[int]]:
            return {"intent": [1]}

    manager = ModelManager(root, engine_process=EngineServing1())  # type: ignore[arg-type]
    await manager.load_all()
    try:
        assert [sorted(s.versions) for s in manager.states() if s.name == "intent"] == [[1]]
        assert manager.get("intent").version == 1
    finally:
        await manager.stop()
    # without an engine process (or once it serves 2) the policy's newest is served
    manager = ModelManager(root)
    await manager.load_all()
    try:
        assert [sorted(s.versions) for s in manager.states() if s.name == "intent"] == [[2]]
    finally:
        await manager.stop()
