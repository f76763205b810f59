"""gRPC (KServe v2 / Triton) on a real grpc.aio server on localhost, backed by real ONNX Runtime engines of a
tiny model, driven by an unchanged ``tritonclient.grpc`` (sync and aio).

The server runs in a background thread with its own event loop, as ``miaohui serve`` runs it: ModelManager,
ServerState, Metrics and :func:`miaohui.server.grpc.start_grpc`. Models in the repository:

* ``intent`` — the text model ``intent`` and the tensor model ``intent-raw`` (defaults: delay 5 ms, batch 32)
* ``slow``   — same network, ``max_queue_delay_ms`` 1000: a lone request sits in the queue for a second,
  which makes deadlines and cancellation observable
* ``spare``  — on disk but not loaded at start: repository load / unload
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from miaohui.config import BuildConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.nlp.tokenizer import TextTokenizer, pad_batch
from miaohui.server.grpc import MAX_REQUEST_BYTES, start_grpc
from miaohui.server.metrics import Metrics
from miaohui.server.proto import grpc_service_pb2 as pb
from miaohui.server.state import ServerState, ServeSpec
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config
from miaohui.serving.repository import ModelManager
from miaohui.serving.served import softmax

T = TypeVar("T")
LABELS = ["greeting", "goodbye", "human_agent", "out_of_scope"]  # tests/conftest.py: tiny_model
FIX_TEXT = "Fix: send TEXT, or use 'intent-raw' for input_ids/attention_mask"


class ServerThread:
    """A miaohui gRPC server on its own event loop in a daemon thread."""

    def __init__(self, repository: Path, models: list[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-server", daemon=True)
        self.metrics = Metrics()
        self.manager = ModelManager(repository, observer_factory=self.metrics.observer)
        self.state = ServerState(self.manager, self.metrics)
        self.port = _free_port()
        self.models = models
        self.server: grpc.aio.Server | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self.manager.load_all(self.models))
        self.server = self.run(start_grpc(self.state, "127.0.0.1", self.port))

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(grace=1.0))
        self.run(self.manager.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def repo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc-repo")
    warmup = [WarmupShape(batch=1, sequence=8)]
    for name, delay_ms in (("intent", 5.0), ("slow", 1000.0), ("spare", 5.0)):
        build_artifact(tiny_model, name, BuildConfig(backend="onnxruntime", precision="fp32"), root, log=lambda m: None)
        config = ModelConfig(batching=BatcherConfig(max_queue_delay_ms=delay_ms), warmup=warmup)
        write_model_config(root / name / "config.yaml", config)
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[ServerThread]:
    srv = ServerThread(repo, ["intent", "slow"])
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(url=f"127.0.0.1:{server.port}") as c:
        yield c


def text_input(texts: list[str], shape: list[int] | None = None) -> tc.InferInput:
    arr = np.array(texts, dtype=object)
    inp = tc.InferInput("TEXT", shape or list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr.reshape(shape or arr.shape))
    return inp


def raw_inputs(ids: np.ndarray, mask: np.ndarray) -> list[tc.InferInput]:
    out = []
    for name, arr in (("input_ids", ids), ("attention_mask", mask)):
        inp = tc.InferInput(name, list(arr.shape), "INT64" if arr.dtype == np.int64 else "INT32")
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def rpc_error(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), str(info.value.message())


def call_raw(server: ServerThread, method: str, request: Any) -> Any:
    """One RPC with tritonclient's message classes on a plain channel: requests tritonclient would not build."""
    response_type = getattr(triton_pb, type(request).__name__.replace("Request", "Response"))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        rpc = channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return rpc(request, timeout=10)


def _prefixed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@pytest.fixture(scope="module")
def reference(repo: Path) -> Iterator[Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """Logits of the ``intent`` artifact run directly on its ONNX Runtime engine (no server)."""
    with load_engine(repo / "intent" / "1") as engine:
        yield lambda ids, mask: engine.infer({"input_ids": ids, "attention_mask": mask})["logits"]


# ---------------------------------------------------------------------- wire compatibility


def test_proto_matches_tritons_field_for_field() -> None:
    """Every message and method we define has Triton's names, numbers, types and labels."""
    ours, theirs = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(ours)
    triton_pb.DESCRIPTOR.CopyToProto(theirs)
    assert ours.package == theirs.package == "inference"
    triton_messages = {m.name: m for m in theirs.message_type}
    for message in ours.message_type:
        assert _shape_of(message) == _shape_of(triton_messages[message.name]), message.name
    triton_methods = {m.name: (m.input_type, m.output_type) for m in theirs.service[0].method}
    assert ours.service[0].name == theirs.service[0].name == "GRPCInferenceService"
    for method in ours.service[0].method:
        assert (method.input_type, method.output_type) == triton_methods[method.name]
    assert len(ours.service[0].method) == 9


def _shape_of(message: descriptor_pb2.DescriptorProto) -> Any:
    fields = sorted((f.number, f.name, f.type, f.label, f.type_name, f.HasField("oneof_index")) for f in message.field)
    nested = sorted((n.name, _shape_of(n)) for n in message.nested_type)
    return fields, nested


# ---------------------------------------------------------------------- health & metadata


def test_health_and_server_metadata(client: tc.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "miaohui" and meta["extensions"] == ["model_repository"]


def test_model_ready(client: tc.InferenceServerClient) -> None:
    assert client.is_model_ready("intent")
    assert client.is_model_ready("intent-raw")
    assert client.is_model_ready("intent", model_version="1")
    assert not client.is_model_ready("intent", model_version="7")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("spare")  # on disk, not loaded


def test_model_metadata_text_and_raw(client: tc.InferenceServerClient) -> None:
    text = client.get_model_metadata("intent", as_json=True)
    assert text == {
        "name": "intent",
        "versions": ["1"],
        "platform": "miaohui_onnxruntime",
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": ["-1"]}],
        "outputs": [
            {"name": "INTENT", "datatype": "BYTES", "shape": ["-1"]},
            {"name": "CONFIDENCE", "datatype": "FP32", "shape": ["-1"]},
        ],
    }
    raw = client.get_model_metadata("intent-raw", model_version="1")
    assert raw.name == "intent-raw" and list(raw.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in raw.inputs] == [
        ("input_ids", "INT64", [-1, -1]),
        ("attention_mask", "INT64", [-1, -1]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in raw.outputs] == [("logits", "FP32", [-1, 4])]


def test_metadata_of_unknown_model_is_not_found(client: tc.InferenceServerClient) -> None:
    assert rpc_error(lambda: client.get_model_metadata("nope")) == (
        "StatusCode.NOT_FOUND",
        "model 'nope' is not loaded. Fix: loaded models: intent, slow",
    )


# ---------------------------------------------------------------------- inference


def test_text_inference_matches_the_engine(
    client: tc.InferenceServerClient, repo: Path, reference: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> None:
    texts = ["hello there", "查一下我的社保", "bye", "I want to talk to a person"]
    result = client.infer("intent", [text_input(texts)], request_id="r-1")
    intents, confidence = result.as_numpy("INTENT"), result.as_numpy("CONFIDENCE")
    assert intents.shape == (4,) and intents.dtype == object
    assert confidence.shape == (4,) and confidence.dtype == np.float32
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("intent", "1", "r-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("INTENT", "BYTES", [4]),
        ("CONFIDENCE", "FP32", [4]),
    ]

    tok = TextTokenizer.from_file(repo / "intent" / "1" / "tokenizer.json", 64)
    ids, mask = pad_batch(tok.token_ids(texts), tok.pad_id)
    probs = softmax(reference(ids, mask))
    assert [x.decode() for x in intents] == [LABELS[i] for i in probs.argmax(-1)]
    np.testing.assert_allclose(confidence, probs.max(-1), rtol=1e-4, atol=1e-5)


def test_text_inference_takes_a_column_and_selected_outputs(client: tc.InferenceServerClient) -> None:
    result = client.infer(
        "intent", [text_input(["hi", "bye"], shape=[2, 1])], outputs=[tc.InferRequestedOutput("CONFIDENCE")]
    )
    assert [o.name for o in result.get_response().outputs] == ["CONFIDENCE"]
    assert result.as_numpy("CONFIDENCE").shape == (2,) and result.as_numpy("INTENT") is None


def test_raw_inference_matches_the_engine(
    client: tc.InferenceServerClient, reference: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(3, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    logits = client.infer("intent-raw", raw_inputs(ids, mask)).as_numpy("logits")
    assert logits.shape == (3, 4) and logits.dtype == np.float32
    for row in range(3):  # the server batches each row without its padding
        n = int(mask[row].sum())
        expected = reference(ids[row : row + 1, :n], mask[row : row + 1, :n])[0]
        np.testing.assert_allclose(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_typed_contents_are_accepted(server: ServerThread) -> None:
    """Inputs in InferTensorContents instead of raw bytes (what other KServe clients send)."""
    request = triton_pb.ModelInferRequest(model_name="intent")
    text = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend(["你好".encode(), b"bye"])
    reply = call_raw(server, "ModelInfer", request)
    assert [(o.name, list(o.shape)) for o in reply.outputs] == [("INTENT", [2]), ("CONFIDENCE", [2])]
    assert len(reply.raw_output_contents) == 2
    raw = triton_pb.ModelInferRequest(model_name="intent-raw")
    for name, values in (("input_ids", [101, 7592, 2088, 102]), ("attention_mask", [1, 1, 1, 1])):
        raw.inputs.add(name=name, datatype="INT64", shape=[1, 4]).contents.int64_contents.extend(values)
    reply = call_raw(server, "ModelInfer", raw)
    assert len(reply.raw_output_contents[0]) == 4 * 4  # 4 FP32 logits


# ---------------------------------------------------------------------- errors


def test_unknown_model_and_version_are_not_found(server: ServerThread, client: tc.InferenceServerClient) -> None:
    unknown = {"model": "_unknown", "version": "", "protocol": "grpc", "code": "404"}
    before = server.sample("miaohui_requests_total", **unknown)
    for name in ("nope", "nope-2", "nope-raw"):
        assert rpc_error(lambda name=name: client.infer(name, [text_input(["hi"])])) == (
            "StatusCode.NOT_FOUND",
            f"model {name.removesuffix('-raw')!r} is not loaded. Fix: loaded models: intent, slow",
        )
    # client-supplied names do not become label values: unknown models share one series
    assert server.sample("miaohui_requests_total", **unknown) == before + 3
    assert b"nope" not in server.metrics.render()
    assert rpc_error(lambda: client.infer("intent", [text_input(["hi"])], model_version="7")) == (
        "StatusCode.NOT_FOUND",
        "model 'intent' has no loaded version 7. Fix: loaded versions: 1",
    )


def _infer_request(model: str = "intent", **tensors: tuple[str, list[int], bytes | None]) -> Any:
    request = triton_pb.ModelInferRequest(model_name=model)
    for name, (datatype, shape, raw) in tensors.items():
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw is not None:
            request.raw_input_contents.append(raw)
    return request


def _mixed() -> Any:
    request = _infer_request(TEXT=("BYTES", [1], _prefixed(b"hi")))
    request.inputs[0].contents.bytes_contents.append(b"hi")
    return request


def _contents(datatype: str, field: str, values: list[Any], shape: list[int]) -> Any:
    request = triton_pb.ModelInferRequest(model_name="intent-raw")
    getattr(request.inputs.add(name="x", datatype=datatype, shape=shape).contents, field).extend(values)
    return request


def _with_timeout_string() -> Any:
    request = _infer_request(TEXT=("BYTES", [1], _prefixed(b"hi")))
    request.parameters["timeout"].string_param = "100ms"
    return request


def _twice() -> Any:
    request = _infer_request(TEXT=("BYTES", [1], _prefixed(b"hi")))
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(_prefixed(b"hi"))
    return request


def _too_many_raw() -> Any:
    request = _infer_request(TEXT=("BYTES", [1], _prefixed(b"hi")))
    request.raw_input_contents.append(b"")
    return request


MALFORMED: list[tuple[str, Callable[[], Any], str]] = [
    (
        "no inputs",
        lambda: triton_pb.ModelInferRequest(model_name="intent"),
        "request has no inputs. Fix: see the KServe v2 inference request format",
    ),
    (
        "raw count",
        _too_many_raw,
        "request has 1 inputs but 2 raw_input_contents. Fix: send one raw_input_contents entry per input, in order",
    ),
    (
        "truncated",
        lambda: _infer_request(TEXT=("BYTES", [2], _prefixed(b"hi"))),
        "input 'TEXT' raw data ends after 1 of 2 BYTES elements. "
        "Fix: prefix every element with its 4-byte little-endian length",
    ),
    (
        "overclaim",
        lambda: _infer_request(TEXT=("BYTES", [1], struct.pack("<I", 10) + b"hi")),
        "input 'TEXT' BYTES element #0 claims 10 bytes but only 2 remain. Fix: prefix every element with its exact length",
    ),
    (
        "trailing",
        lambda: _infer_request(TEXT=("BYTES", [1], _prefixed(b"hi") + b"xx")),
        "input 'TEXT' has 2 bytes after its 1 BYTES elements. Fix: make the shape match the number of elements",
    ),
    (
        "negative",
        lambda: _infer_request(TEXT=("BYTES", [-1], _prefixed(b"hi"))),
        "input 'TEXT' has a negative dimension in shape [-1]. Fix: give concrete sizes",
    ),
    (
        "mixed",
        _mixed,
        "input 'TEXT' sets contents while the request uses raw_input_contents. "
        "Fix: send all inputs raw or all in contents",
    ),
    ("twice", _twice, "input 'TEXT' is given twice. Fix: send each input once"),
    (
        "bf16",
        lambda: _infer_request("intent-raw", x=("BF16", [1], b"\0\0")),
        "input 'x' has unsupported datatype 'BF16'. Fix: use one of ['BOOL', 'FP16', 'FP32', 'FP64', 'INT16', "
        "'INT32', 'INT64', 'INT8', 'UINT16', 'UINT32', 'UINT64', 'UINT8'] or BYTES",
    ),
    (
        "fp16 contents",
        lambda: _contents("FP16", "fp32_contents", [1.0], [1]),
        "input 'x' of datatype FP16 has no contents field. Fix: send it in raw_input_contents",
    ),
    (
        "contents count",
        lambda: _contents("INT64", "int64_contents", [1], [2]),
        "input 'x' has 1 values in contents.int64_contents but shape [2] needs 2. Fix: make the data match the shape",
    ),
    (
        "int8 overflow",
        lambda: _contents("INT8", "int_contents", [300], [1]),
        "input 'x' values do not fit datatype INT8. Fix: send numbers of that type",
    ),
    (
        "timeout string",
        _with_timeout_string,
        "parameter 'timeout' is a string_param, not a number. Fix: give the timeout in microseconds as int64_param",
    ),
]


@pytest.mark.parametrize(("build", "expected"), [(b, m) for _, b, m in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_tensors_are_invalid_argument(server: ServerThread, build: Callable[[], Any], expected: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call_raw(server, "ModelInfer", build())
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def test_wrong_dtype_is_invalid_argument(client: tc.InferenceServerClient) -> None:
    ids = np.full((1, 4), 7, dtype=np.int32)
    assert rpc_error(lambda: client.infer("intent-raw", raw_inputs(ids, np.ones_like(ids)))) == (
        "StatusCode.INVALID_ARGUMENT",
        "input 'input_ids' has datatype INT32; the model expects INT64. Fix: send INT64 token ids and mask",
    )


def test_wrong_shapes_are_invalid_argument(client: tc.InferenceServerClient) -> None:
    ids = np.full((2, 5), 7, dtype=np.int64)
    status, msg = rpc_error(lambda: client.infer("intent-raw", raw_inputs(ids, np.ones((2, 4), np.int64))))
    assert (status, msg) == (
        "StatusCode.INVALID_ARGUMENT",
        "input_ids [2, 5] and attention_mask [2, 4] must both be [batch, sequence]. "
        "Fix: send two int64 tensors of the same 2-D shape",
    )
    inputs = raw_inputs(ids, np.ones_like(ids))
    inputs[0].set_shape([3, 5])  # declared shape disagrees with the 80 bytes sent
    assert rpc_error(lambda: client.infer("intent-raw", inputs)) == (
        "StatusCode.INVALID_ARGUMENT",
        "input 'input_ids' has 80 bytes of raw data but shape [3, 5] of INT64 needs 120. "
        "Fix: make the data match the shape and datatype",
    )
    long = np.full((1, 65), 7, dtype=np.int64)
    assert rpc_error(lambda: client.infer("intent-raw", raw_inputs(long, np.ones_like(long))))[1] == (
        "sequence length 65 exceeds this model's maximum 64. Fix: truncate the sequence"
    )
    assert rpc_error(lambda: client.infer("intent", [text_input(["hi"]), *raw_inputs(ids, ids)])) == (
        "StatusCode.INVALID_ARGUMENT",
        f"model 'intent' takes one input TEXT (BYTES), got ['TEXT', 'attention_mask', 'input_ids']. {FIX_TEXT}",
    )


def test_bad_text_is_invalid_argument(client: tc.InferenceServerClient) -> None:
    assert rpc_error(lambda: client.infer("intent", [text_input(["hi", "  "])])) == (
        "StatusCode.INVALID_ARGUMENT",
        "text #1 is empty. Fix: send non-empty text",
    )
    assert rpc_error(lambda: client.infer("intent", [text_input([], shape=[0])])) == (
        "StatusCode.INVALID_ARGUMENT",
        "TEXT holds 0 strings; send 1..256. Fix: split the batch",
    )
    assert rpc_error(lambda: client.infer("intent", [text_input(["x" * 5000])])) == (
        "StatusCode.INVALID_ARGUMENT",
        "text #0 has 5000 characters; the limit is 4096. Fix: shorten the text or split it",
    )
    status, msg = rpc_error(lambda: client.infer("intent", [text_input(["hello " * 100])]))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert msg == (
        "text #0 is 102 tokens long; this model accepts at most 64. "
        "Fix: shorten the text or split it into several requests"
    )
    bad_utf8 = tc.InferInput("TEXT", [1], "BYTES")
    bad_utf8.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=object))
    assert rpc_error(lambda: client.infer("intent", [bad_utf8])) == (
        "StatusCode.INVALID_ARGUMENT",
        "input 'TEXT' element #0 is not valid UTF-8. Fix: send text as UTF-8",
    )
    assert rpc_error(
        lambda: client.infer("intent", [text_input(["hi"])], outputs=[tc.InferRequestedOutput("LABEL")])
    ) == (
        "StatusCode.INVALID_ARGUMENT",
        "requested outputs ['LABEL'] do not exist. Fix: this model's outputs are ['INTENT', 'CONFIDENCE']",
    )


def test_too_large_batches_and_requests_are_invalid_argument(client: tc.InferenceServerClient) -> None:
    assert rpc_error(lambda: client.infer("intent", [text_input(["hi"] * 257)])) == (
        "StatusCode.INVALID_ARGUMENT",
        "TEXT holds 257 strings; send 1..256. Fix: split the batch",
    )
    ids = np.full((33, 4), 7, dtype=np.int64)
    assert rpc_error(lambda: client.infer("intent-raw", raw_inputs(ids, np.ones_like(ids)))) == (
        "StatusCode.INVALID_ARGUMENT",
        "batch of 33 rows exceeds max_batch_size 32. Fix: split the request",
    )
    huge = "x" * (MAX_REQUEST_BYTES + 1)
    status, msg = rpc_error(lambda: client.infer("intent", [text_input([huge])]))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert msg.startswith("request is 1677") and msg.endswith(
        f" bytes; the limit is {MAX_REQUEST_BYTES}. Fix: send smaller batches"
    )
    inp = tc.InferInput("TEXT", [5000], "BYTES")  # the element count is checked before the decode loop
    inp.set_data_from_numpy(np.array([b""] * 5000, dtype=object))
    assert rpc_error(lambda: client.infer("intent", [inp])) == (
        "StatusCode.INVALID_ARGUMENT",
        "input 'TEXT' has 5000 BYTES elements; the limit is 4096. Fix: split the batch",
    )


def test_errors_are_counted_and_the_server_keeps_serving(
    server: ServerThread, client: tc.InferenceServerClient
) -> None:
    labels = {"model": "intent-raw", "version": "1"}
    failures = server.sample("miaohui_request_failures_total", reason="bad_input", **labels)
    answered = server.sample("miaohui_requests_total", protocol="grpc", code="400", **labels)
    ok = server.sample("miaohui_requests_total", model="intent", version="1", protocol="grpc", code="200")
    ids = np.full((1, 4), 7, dtype=np.int32)
    good, bad = [text_input(["hello"])], raw_inputs(ids, np.ones_like(ids))

    def call(i: int) -> str:
        try:
            if i % 3 == 0:
                client.infer("intent-raw", bad)
                return "unexpected success"
            return client.infer("intent", good).as_numpy("INTENT")[0].decode()
        except InferenceServerException as exc:
            return str(exc.status())

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(24)))
    assert outcomes.count("StatusCode.INVALID_ARGUMENT") == 8
    assert all(o in LABELS for i, o in enumerate(outcomes) if i % 3)
    assert server.sample("miaohui_request_failures_total", reason="bad_input", **labels) == failures + 8
    assert server.sample("miaohui_requests_total", protocol="grpc", code="400", **labels) == answered + 8
    assert server.sample("miaohui_requests_total", model="intent", version="1", protocol="grpc", code="200") == ok + 16
    assert client.is_server_ready() and client.infer("intent", good).as_numpy("CONFIDENCE").shape == (1,)


# ---------------------------------------------------------------------- deadlines & cancellation


def test_timeout_parameter_gives_deadline_exceeded(server: ServerThread, client: tc.InferenceServerClient) -> None:
    before = server.sample("miaohui_rejected_total", model="slow", version="1", reason="deadline")
    started = time.perf_counter()
    status, msg = rpc_error(lambda: client.infer("slow", [text_input(["hi"])], timeout=100_000))  # µs
    assert time.perf_counter() - started < 0.9  # well before the 1 s queue delay
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    assert msg.startswith("request deadline passed while queued (") and "ms allowed" in msg
    assert server.sample("miaohui_rejected_total", model="slow", version="1", reason="deadline") == before + 1
    assert rpc_error(lambda: client.infer("slow", [text_input(["hi"])], client_timeout=0.2))[0] == (
        "StatusCode.DEADLINE_EXCEEDED"
    )


async def test_cancelled_rpc_is_dropped_before_compute(server: ServerThread) -> None:
    labels = {"model": "slow", "version": "1"}
    cancelled = server.sample("miaohui_rejected_total", reason="cancelled", **labels)
    batches = server.sample("miaohui_batch_size_count", **labels)
    async with tc_aio.InferenceServerClient(url=f"127.0.0.1:{server.port}") as client:
        call = asyncio.ensure_future(client.infer("slow", [text_input(["cancel me"])]))
        batcher = server.manager.get("slow").batcher
        for _ in range(100):  # wait until it is queued: the slow model waits 1 s for a batch to fill
            if batcher.queue_depth:
                break
            await asyncio.sleep(0.01)
        assert batcher.queue_depth == 1
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        for _ in range(50):
            if server.sample("miaohui_rejected_total", reason="cancelled", **labels) > cancelled:
                break
            await asyncio.sleep(0.05)
        assert server.sample("miaohui_rejected_total", reason="cancelled", **labels) == cancelled + 1
        assert server.sample("miaohui_requests_total", protocol="grpc", code="499", **labels) >= 1
        await asyncio.sleep(1.0)  # past the queue delay: the row would have been computed by now
        assert server.sample("miaohui_batch_size_count", **labels) == batches
        result = await client.infer("slow", [text_input(["still serving"])])  # ~1 s: the queue delay
        assert result.as_numpy("INTENT")[0].decode() in LABELS
        assert server.sample("miaohui_batch_size_count", **labels) == batches + 1


# ---------------------------------------------------------------------- repository


def test_repository_index_load_and_unload(server: ServerThread, client: tc.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert set(index) == {"intent", "slow", "spare"}
    assert index["intent"] == {"name": "intent", "version": "1", "state": "READY"}
    assert index["spare"] == {"name": "spare", "state": "UNAVAILABLE"}

    client.load_model("spare")
    assert client.is_model_ready("spare")
    assert client.infer("spare", [text_input(["hi"])]).as_numpy("INTENT")[0].decode() in LABELS
    client.unload_model("spare")
    assert not client.is_model_ready("spare")
    assert rpc_error(lambda: client.infer("spare", [text_input(["hi"])]))[0] == "StatusCode.NOT_FOUND"
    assert rpc_error(lambda: client.unload_model("spare")) == (
        "StatusCode.NOT_FOUND",
        "model 'spare' is not loaded. Fix: see GET /v2/repository/index",
    )
    status, msg = rpc_error(lambda: client.load_model("nope"))
    assert status == "StatusCode.NOT_FOUND" and msg.startswith("no versions of 'nope' in ")
    for bad in ("../intent", "a..b", "_x", "intent\n"):
        assert rpc_error(lambda bad=bad: client.load_model(bad)) == (
            "StatusCode.INVALID_ARGUMENT",
            f"model name {bad!r} is not a plain name. Fix: use the model's folder name in the repository",
        )
    assert rpc_error(lambda: client.unload_model("a/b"))[0] == "StatusCode.INVALID_ARGUMENT"
    assert rpc_error(lambda: client.load_model("spare", config='{"backend": "onnxruntime"}')) == (
        "StatusCode.INVALID_ARGUMENT",
        "load parameters ['config'] are not supported (no inline config or files). "
        "Fix: put config.yaml and the versions in the repository, then load the model by name",
    )
    assert client.is_model_ready("intent")


def test_repository_index_ready_filter(server: ServerThread) -> None:
    ready = call_raw(server, "RepositoryIndex", triton_pb.RepositoryIndexRequest(ready=True))
    assert sorted(m.name for m in ready.models) == ["intent", "slow"]


def test_unimplemented_methods_say_so(server: ServerThread, client: tc.InferenceServerClient) -> None:
    assert rpc_error(lambda: client.get_model_config("intent"))[0] == "StatusCode.UNIMPLEMENTED"


def test_port_in_use_is_a_clear_error(server: ServerThread) -> None:
    from miaohui.errors import ConfigError

    with pytest.raises(ConfigError, match=f"cannot listen for gRPC on 127.0.0.1:{server.port}"):
        server.run(start_grpc(server.state, "127.0.0.1", server.port))


def test_serve_stops_with_status_1_when_grpc_cannot_listen(
    server: ServerThread, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``miaohui serve``: HTTP starts (free port), gRPC's port is taken → logged, whole server stops, status 1."""
    from miaohui.server.app import serve_async

    started = time.perf_counter()
    with caplog.at_level("ERROR", logger="miaohui.server"):
        status = asyncio.run(serve_async(ServeSpec(repo, "127.0.0.1", _free_port(), server.port, ["spare"])))
    assert status == 1 and time.perf_counter() - started < 60
    assert f"gRPC could not start, stopping the server: cannot listen for gRPC on 127.0.0.1:{server.port}" in (
        caplog.text
    )
    assert client_still_serves(server)


def test_serve_stops_with_status_1_when_grpc_cannot_be_imported(
    repo: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grpcio older than the generated stubs need raises at import (seen on a GPU host with grpcio 1.84): the
    server must stop with status 1, not serve HTTP alone with the error lost in an unretrieved task. The import
    failure is simulated (``None`` in ``sys.modules``): installing an old grpcio in the test is not possible."""
    import sys

    from miaohui.server.app import serve_async

    monkeypatch.setitem(sys.modules, "miaohui.server.grpc", None)
    with caplog.at_level("ERROR", logger="miaohui.server"):
        status = asyncio.run(serve_async(ServeSpec(repo, "127.0.0.1", _free_port(), _free_port(), ["spare"])))
    assert status == 1
    assert "gRPC could not start, stopping the server" in caplog.text and "miaohui.server.grpc" in caplog.text


def client_still_serves(server: ServerThread) -> bool:
    with tc.InferenceServerClient(url=f"127.0.0.1:{server.port}") as c:
        return c.is_server_ready() and c.infer("intent", [text_input(["hi"])]).as_numpy("INTENT").shape == (1,)
