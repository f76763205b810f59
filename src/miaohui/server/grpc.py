"""gRPC: KServe v2 / Triton's ``inference.GRPCInferenceService`` on grpc.aio, so ``tritonclient.grpc`` works.

Same contracts as HTTP (:mod:`miaohui.server.kserve`), same inference path (:func:`~miaohui.server.http.infer_tensors`)
and the same error mapping (:mod:`miaohui.server.status`): every failure is a gRPC status with a message that
says how to fix the call, and fails that request only.

Tensors arrive as ``raw_input_contents`` (what tritonclient sends: little-endian values; BYTES elements each
prefixed by a 4-byte little-endian length) or as typed ``InferTensorContents``; outputs always go back as
``raw_output_contents``. Deadline: ``parameters["timeout"]`` (microseconds, Triton's) or the gRPC deadline,
whichever comes first. A cancelled RPC cancels its handler task; the batcher drops its rows before compute.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import struct
import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

import grpc
import numpy as np

from miaohui import __version__
from miaohui.errors import ConfigError, InputError, MiaohuiError, ModelNotFoundError
from miaohui.server import kserve
from miaohui.server.http import MAX_TEXTS, ServerState, check_not_shutting_down, infer_tensors
from miaohui.server.proto import grpc_service_pb2 as pb
from miaohui.server.proto import grpc_service_pb2_grpc as pb_grpc
from miaohui.server.status import grpc_status, http_status, message, reason
from miaohui.serving.repository import ModelManager
from miaohui.serving.served import ServedVersion, deadline_from_ms

log = logging.getLogger("miaohui.grpc")
T = TypeVar("T")

MAX_REQUEST_BYTES = 16 << 20
"""Largest ModelInfer request we decode; bigger ones get INVALID_ARGUMENT with this limit in the message."""
GRPC_MAX_RECEIVE_BYTES = 2 * MAX_REQUEST_BYTES
"""gRPC's own cap: a message above it is refused by gRPC itself (RESOURCE_EXHAUSTED) before it is read."""
MAX_BYTES_ELEMENTS = 16 * MAX_TEXTS
"""Most elements in one BYTES tensor (bounds the decode loop; the text contract allows MAX_TEXTS)."""
EXTENSIONS = ["model_repository"]
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_LENGTH = struct.Struct("<I")
# InferTensorContents field per KServe datatype (FP16/BF16 have none: they must come raw).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


async def start_grpc(state: ServerState, host: str, port: int) -> grpc.aio.Server:
    """Bind ``host:port`` and start serving on the running event loop; ``await server.stop(grace)`` ends it.

    Raises :class:`ConfigError` when the address cannot be bound (port in use, bad host). SO_REUSEPORT is
    off, so a second server on the same port fails here instead of silently sharing the port.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX_RECEIVE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    address = f"{host}:{port}"
    cause = "bind failed"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc ≥ 1.5x raises; older versions return port 0
        bound, cause = 0, str(exc)
    if not bound:
        raise ConfigError(
            f"cannot listen for gRPC on {address}: {cause}",
            "stop the process using the port or choose another with --grpc-port",
        )
    await server.start()
    log.info("gRPC (KServe v2) listening on %s", address)
    return server


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs; each answers or aborts with the status :mod:`miaohui.server.status` gives its error."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.manager: ModelManager = state.manager

    # ------------------------------------------------------------------ health & metadata

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.manager.ready and not self.state.shutting_down)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            served = self.manager.get(kserve.split_name(request.name)[0], request.version or None)
        except ModelNotFoundError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=served.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="miaohui", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        return await _answer(context, self._metadata(request.name, request.version))

    async def _metadata(self, model: str, version: str) -> pb.ModelMetadataResponse:
        meta = model_metadata(self.manager, model, version or None)
        tensors = {
            key: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta[key]] for key in ("inputs", "outputs")
        }
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"], **tensors
        )

    # ------------------------------------------------------------------ repository

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        rows = [r for r in self.manager.index() if not request.ready or r["state"] == "READY"]
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**r) for r in rows])

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        async def load() -> pb.RepositoryModelLoadResponse:
            if request.parameters:
                raise InputError(
                    f"load parameters {sorted(request.parameters)} are not supported (no inline config or files)",
                    "put config.yaml and the versions in the repository, then load the model by name",
                )
            await self.manager.load(_model_name(request.model_name))
            return pb.RepositoryModelLoadResponse()

        return await _answer(context, load())

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            await self.manager.unload(_model_name(request.model_name))  # "unload_dependents": no ensembles here
            return pb.RepositoryModelUnloadResponse()

        return await _answer(context, unload())

    # ------------------------------------------------------------------ inference

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        started = time.perf_counter()
        model, metrics = request.model_name, self.state.metrics
        served: ServedVersion | None = None
        error: BaseException | None = None
        metrics.in_flight.labels(model).inc()
        try:
            check_not_shutting_down(self.state)
            size = request.ByteSize()
            if size > MAX_REQUEST_BYTES:
                raise InputError(f"request is {size} bytes; the limit is {MAX_REQUEST_BYTES}", "send smaller batches")
            base, raw = kserve.split_name(model)
            served = self.manager.get(base, request.model_version or None)
            tensors = decode_inputs(request)
            deadline = _deadline(request, context)
            outputs = await infer_tensors(served, raw, tensors, deadline)
            response = encode_outputs(request, served, outputs)
        except asyncio.CancelledError:  # the client went away: the batcher already dropped its rows
            metrics.done(model, _version(served), "grpc", 499, time.perf_counter() - started, "cancelled")
            raise
        except Exception as exc:
            error = exc
            if not isinstance(exc, MiaohuiError):
                log.exception("ModelInfer %r failed unexpectedly", model)
        finally:
            metrics.in_flight.labels(model).dec()
        code = http_status(error) if error else 200
        metrics.done(
            model, _version(served), "grpc", code, time.perf_counter() - started, reason(error) if error else ""
        )
        if error is not None:
            await context.abort(grpc_status(error), message(error))
        return response


def model_metadata(manager: ModelManager, model: str, version: str | None) -> dict[str, Any]:
    """The KServe model metadata of ``model`` (text model ``M`` or tensor model ``M-raw``), as HTTP gives it."""
    base, raw = kserve.split_name(model)
    served = manager.get(base, version)
    versions = [v.version for s in manager.states() if s.name == base for v in s.versions.values()]
    platform = f"miaohui_{served.manifest.backend}"
    if served.manifest.task == "intent" and not raw:
        return kserve.text_metadata(model, versions, platform)
    if raw and served.manifest.task != "intent":
        raise ModelNotFoundError(f"model {model!r} does not exist", f"use {base!r} for the tensor interface")
    out = served.manifest.outputs[0]
    return kserve.tensor_metadata(model, versions, platform, out.name, int(out.dims[-1]))


# ---------------------------------------------------------------------- tensors


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Every input as a numpy array (BYTES → object array of str), checked against its shape and datatype."""
    if not request.inputs:
        raise InputError("request has no inputs", "see the KServe v2 inference request format")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InputError(
            f"request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents",
            "send one raw_input_contents entry per input, in order",
        )
    tensors: dict[str, np.ndarray] = {}
    for i, spec in enumerate(request.inputs):
        if spec.name in tensors:
            raise InputError(f"input {spec.name!r} is given twice", "send each input once")
        if raw and spec.HasField("contents"):
            raise InputError(
                f"input {spec.name!r} sets contents while the request uses raw_input_contents",
                "send all inputs raw or all in contents",
            )
        shape, count = _shape(spec)
        if raw:
            tensors[spec.name] = _from_raw(spec.name, spec.datatype, shape, count, raw[i])
        else:
            tensors[spec.name] = _from_contents(spec, shape, count)
    return tensors


def _shape(spec: pb.ModelInferRequest.InferInputTensor) -> tuple[list[int], int]:
    shape = [int(d) for d in spec.shape]
    if any(d < 0 for d in shape):
        raise InputError(f"input {spec.name!r} has a negative dimension in shape {shape}", "give concrete sizes")
    return shape, math.prod(shape)


def _from_raw(name: str, datatype: str, shape: list[int], count: int, data: bytes) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(_split_bytes(name, data, count), dtype=object).reshape(shape)
    dtype = _numeric_dtype(name, datatype)
    if len(data) != count * dtype.itemsize:
        raise InputError(
            f"input {name!r} has {len(data)} bytes of raw data but shape {shape} of {datatype} "
            f"needs {count * dtype.itemsize}",
            "make the data match the shape and datatype",
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _split_bytes(name: str, data: bytes, count: int) -> list[str]:
    """KServe's BYTES wire format: per element a uint32 little-endian length, then that many bytes."""
    _check_bytes_count(name, count)
    items: list[str] = []
    offset = 0
    for index in range(count):
        if offset + 4 > len(data):
            raise InputError(
                f"input {name!r} raw data ends after {index} of {count} BYTES elements",
                "prefix every element with its 4-byte little-endian length",
            )
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += 4
        if offset + length > len(data):
            raise InputError(
                f"input {name!r} BYTES element #{index} claims {length} bytes but only {len(data) - offset} remain",
                "prefix every element with its exact length",
            )
        items.append(_utf8(name, index, data[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise InputError(
            f"input {name!r} has {len(data) - offset} bytes after its {count} BYTES elements",
            "make the shape match the number of elements",
        )
    return items


def _from_contents(spec: pb.ModelInferRequest.InferInputTensor, shape: list[int], count: int) -> np.ndarray:
    name, datatype = spec.name, spec.datatype
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        _numeric_dtype(name, datatype)  # unknown datatype: its own message
        raise InputError(
            f"input {name!r} of datatype {datatype} has no contents field", "send it in raw_input_contents"
        )
    values = getattr(spec.contents, field)
    if len(values) != count:
        raise InputError(
            f"input {name!r} has {len(values)} values in contents.{field} but shape {shape} needs {count}",
            "make the data match the shape",
        )
    if datatype == "BYTES":
        _check_bytes_count(name, count)
        return np.array([_utf8(name, i, v) for i, v in enumerate(values)], dtype=object).reshape(shape)
    dtype = _numeric_dtype(name, datatype)
    wide = np.asarray(values)  # the field's own type: int32/uint32 hold INT8/16 and UINT8/16
    if dtype.kind in "iu" and wide.size and (wide.min() < np.iinfo(dtype).min or wide.max() > np.iinfo(dtype).max):
        raise InputError(f"input {name!r} values do not fit datatype {datatype}", "send numbers of that type")
    return wide.astype(dtype).reshape(shape)


def _numeric_dtype(name: str, datatype: str) -> np.dtype[Any]:
    if datatype not in kserve.DTYPES:
        raise InputError(
            f"input {name!r} has unsupported datatype {datatype!r}", f"use one of {sorted(kserve.DTYPES)} or BYTES"
        )
    return kserve.DTYPES[datatype]


def _check_bytes_count(name: str, count: int) -> None:
    if count > MAX_BYTES_ELEMENTS:
        raise InputError(
            f"input {name!r} has {count} BYTES elements; the limit is {MAX_BYTES_ELEMENTS}", "split the batch"
        )


def _utf8(name: str, index: int, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"input {name!r} element #{index} is not valid UTF-8", "send text as UTF-8") from None


def encode_outputs(
    request: pb.ModelInferRequest, served: ServedVersion, outputs: dict[str, np.ndarray]
) -> pb.ModelInferResponse:
    """The requested outputs (all when none are named), as raw_output_contents in that order."""
    wanted = [o.name for o in request.outputs] or list(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InputError(f"requested outputs {unknown} do not exist", f"this model's outputs are {list(outputs)}")
    for out in request.outputs:
        classes = out.parameters.get("classification")
        if classes is not None and classes.WhichOneof("parameter_choice") and classes.int64_param:
            raise InputError(
                f"output {out.name!r} asks for classification, which is not supported",
                "request the output itself (INTENT/CONFIDENCE are the classification)",
            )
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(served.version), id=request.id)
    for name in wanted:
        arr = outputs[name]
        response.outputs.add(name=name, datatype=kserve.v2_dtype(arr), shape=list(arr.shape))
        response.raw_output_contents.append(_to_raw(arr))
    return response


def _to_raw(arr: np.ndarray) -> bytes:
    if kserve.v2_dtype(arr) == "BYTES":
        return b"".join(_LENGTH.pack(len(b)) + b for b in _as_bytes(arr.ravel()))
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _as_bytes(values: Iterable[Any]) -> Iterable[bytes]:
    return (v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values)


# ---------------------------------------------------------------------- helpers


def _deadline(request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> float | None:
    """The earlier of ``parameters["timeout"]`` (µs) and the gRPC deadline, in ``time.monotonic()`` seconds."""
    deadline = None
    if "timeout" in request.parameters:
        param = request.parameters["timeout"]
        kind = param.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param", "double_param"):
            raise InputError(
                f"parameter 'timeout' is a {kind}, not a number", "give the timeout in microseconds as int64_param"
            )
        deadline = deadline_from_ms(float(getattr(param, kind)) / 1000.0)
    remaining = context.time_remaining()
    if remaining is not None:
        rpc_deadline = time.monotonic() + max(remaining, 0.0)
        deadline = rpc_deadline if deadline is None else min(deadline, rpc_deadline)
    return deadline


def _model_name(name: str) -> str:
    if not _MODEL_NAME.match(name) or name in (".", ".."):
        raise InputError(f"model name {name!r} is not a plain name", "use the model's folder name in the repository")
    return name


def _version(served: ServedVersion | None) -> str:
    return str(served.version) if served else ""


async def _answer(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """Await ``work``; turn an error into the gRPC status and message that status.py gives it."""
    try:
        return await work
    except Exception as exc:
        error = exc
        if not isinstance(exc, MiaohuiError):
            log.exception("gRPC call failed unexpectedly")
    await context.abort(grpc_status(error), message(error))
    raise error  # not reached: abort() raises
