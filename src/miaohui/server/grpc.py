"""gRPC: KServe v2 / Triton's ``inference.GRPCInferenceService`` on grpc.aio, so ``tritonclient.grpc`` works.

Same contracts as HTTP (:mod:`miaohui.server.kserve`), same inference path
(:func:`~miaohui.server.kserve.infer_tensors`), the same state (:mod:`miaohui.server.state`) and the same error
mapping (:mod:`miaohui.server.status`): every failure is a gRPC status with a message that says how to fix the
call, and fails that request only.

Tensors arrive as ``raw_input_contents`` (what tritonclient sends; the layout of
:mod:`miaohui.server.tensor_codec`: little-endian values, BYTES elements each prefixed by a 4-byte little-endian
length) or as typed ``InferTensorContents``; outputs always go back as ``raw_output_contents``.
Deadline: ``parameters["timeout"]`` (microseconds, Triton's) or the gRPC deadline, whichever comes first.
A cancelled RPC cancels its handler task; the batcher drops its rows before compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from miaohui import __version__
from miaohui.errors import ConfigError, InputError, MiaohuiError, ModelNotFoundError
from miaohui.server import kserve, tensor_codec
from miaohui.server.auth import GrpcGate
from miaohui.server.proto import grpc_service_pb2 as pb
from miaohui.server.proto import grpc_service_pb2_grpc as pb_grpc
from miaohui.server.state import ServerState, check_model_control, check_not_shutting_down
from miaohui.server.status import grpc_status, http_status, message, reason
from miaohui.serving.repository import ModelManager
from miaohui.serving.served import ServedVersion, deadline_from_ms

log = logging.getLogger("miaohui.grpc")
T = TypeVar("T")

MAX_REQUEST_BYTES = 16 << 20
"""Largest ModelInfer request we decode; bigger ones get INVALID_ARGUMENT with this limit in the message."""
GRPC_MAX_RECEIVE_BYTES = 2 * MAX_REQUEST_BYTES
"""gRPC's own cap: a message above it is refused by gRPC itself (RESOURCE_EXHAUSTED) before it is read."""
EXTENSIONS = ["model_repository"]
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


async def start_grpc(
    state: ServerState, host: str, port: int, reuse_port: bool = False, tls: tuple[Path, Path] | None = None
) -> grpc.aio.Server:
    """Bind ``host:port`` and start serving on the running event loop; ``await server.stop(grace)`` ends it.

    Raises :class:`ConfigError` when the address cannot be bound (port in use, bad host). SO_REUSEPORT is
    off unless ``reuse_port`` (the workers of ``--workers N`` share the port; their parent reserved it), so a
    second server on the same port fails here instead of silently sharing the port. ``tls``: (certificate, key)
    PEM files: the port then speaks TLS only.
    """
    gate = (
        GrpcGate(state.auth, lambda tenant, model, code, why: state.metrics.refused(tenant, model, "grpc", code, why))
        if state.auth is not None
        else None
    )
    server = grpc.aio.server(
        interceptors=[gate] if gate is not None else None,
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX_RECEIVE_BYTES),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    address = f"{host}:{port}"
    cause = "bind failed"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            pair = (tls[1].read_bytes(), tls[0].read_bytes())
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
    except RuntimeError as exc:  # grpc ≥ 1.5x raises; older versions return port 0
        bound, cause = 0, str(exc).rstrip(".")
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
        meta = kserve.model_metadata(self.manager, model, version or None)
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
            check_model_control(self.state)
            kserve.check_load_parameters(list(request.parameters))
            await self.manager.load(request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await _answer(context, load())

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            check_model_control(self.state)
            await self.manager.unload(request.model_name)  # "unload_dependents": no ensembles here
            return pb.RepositoryModelUnloadResponse()

        return await _answer(context, unload())

    # ------------------------------------------------------------------ inference

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        started = time.perf_counter()
        model, metrics = request.model_name, self.state.metrics
        label = kserve.model_label(self.manager, model)
        served: ServedVersion | None = None
        error: BaseException | None = None
        in_flight = metrics.child(metrics.in_flight, label)
        in_flight.inc()
        try:
            check_not_shutting_down(self.state)
            size = request.ByteSize()
            if size > MAX_REQUEST_BYTES:
                raise InputError(f"request is {size} bytes; the limit is {MAX_REQUEST_BYTES}", "send smaller batches")
            base, raw = kserve.split_name(model)
            served = self.manager.get(base, request.model_version or None)
            tensors = decode_inputs(request)
            deadline = _deadline(request, context)
            outputs = await kserve.infer_tensors(served, raw, tensors, deadline)
            response = encode_outputs(request, served, outputs)
        except asyncio.CancelledError:  # the client went away: the batcher already dropped its rows
            metrics.done(label, _version(served), "grpc", 499, time.perf_counter() - started, "cancelled")
            raise
        except Exception as exc:
            error = exc
            if not isinstance(exc, MiaohuiError):
                log.exception("ModelInfer %r failed unexpectedly", model)
        finally:
            in_flight.dec()
        code = http_status(error) if error else 200
        metrics.done(
            label, _version(served), "grpc", code, time.perf_counter() - started, reason(error) if error else ""
        )
        if error is not None:
            await context.abort(grpc_status(error), message(error))
        return response


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
        shape = [int(d) for d in spec.shape]
        if raw:
            tensors[spec.name] = tensor_codec.decode(spec.name, spec.datatype, shape, raw[i])
        else:
            tensors[spec.name] = _from_contents(spec, shape)
    return tensors


def _from_contents(spec: pb.ModelInferRequest.InferInputTensor, shape: list[int]) -> np.ndarray:
    name, datatype = spec.name, spec.datatype
    count = tensor_codec.check_shape(name, shape)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        tensor_codec.numeric_dtype(name, datatype)  # unknown datatype: its own message
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
        tensor_codec.check_bytes_count(name, count)
        return np.array([tensor_codec.utf8(name, i, v) for i, v in enumerate(values)], dtype=object).reshape(shape)
    dtype = tensor_codec.numeric_dtype(name, datatype)
    wide = np.asarray(values)  # the field's own type: int32/uint32 hold INT8/16 and UINT8/16
    if dtype.kind in "iu" and wide.size and (wide.min() < np.iinfo(dtype).min or wide.max() > np.iinfo(dtype).max):
        raise InputError(f"input {name!r} values do not fit datatype {datatype}", "send numbers of that type")
    return wide.astype(dtype).reshape(shape)


def encode_outputs(
    request: pb.ModelInferRequest, served: ServedVersion, outputs: dict[str, np.ndarray]
) -> pb.ModelInferResponse:
    """The requested outputs (all when none are named), as raw_output_contents in that order."""
    classify = [o.name for o in request.outputs if _asks_classification(o)]
    selected = kserve.select_outputs(outputs, [o.name for o in request.outputs], classify)
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(served.version), id=request.id)
    for name, arr in selected.items():
        response.outputs.add(name=name, datatype=kserve.v2_dtype(arr), shape=list(arr.shape))
        response.raw_output_contents.append(tensor_codec.encode(arr))
    return response


def _asks_classification(out: pb.ModelInferRequest.InferRequestedOutputTensor) -> bool:
    classes = out.parameters.get("classification")
    return bool(classes is not None and classes.WhichOneof("parameter_choice") and classes.int64_param)


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
