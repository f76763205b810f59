"""KServe v2 / Open Inference Protocol: tensors ↔ JSON, the HTTP binary tensor extension, and the model
contracts we expose (shared by HTTP and gRPC).

For every repository model ``M`` of task ``intent``:

* ``M``      — text model: input ``TEXT`` (BYTES, [-1]) → ``INTENT`` (BYTES, [-1]), ``CONFIDENCE`` (FP32, [-1])
* ``M-raw``  — tensor model: ``input_ids``, ``attention_mask`` (INT64, [-1, -1]) → ``logits`` (FP32, [-1, labels])

For every model ``M`` of task ``encoder``: ``M`` takes ``TEXT`` (BYTES, [-1]) → ``EMBEDDING`` (FP32, [-1, width]);
``M-raw`` the tensors (output ``embeddings``).

HTTP binary tensor extension (Triton's ``binary_data``, what ``tritonclient.http`` sends by default): the
header ``Inference-Header-Content-Length`` gives the length of the JSON inference header; the rest of the body
holds the inputs that carry ``parameters.binary_data_size``, in input order, in the raw layout of
:mod:`miaohui.server.tensor_codec`. Outputs go back the same way when the request asks for it
(``outputs[].parameters.binary_data`` or request ``parameters.binary_data_output``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from miaohui.errors import InputError, ModelNotFoundError
from miaohui.server import tensor_codec
from miaohui.server.metrics import UNKNOWN_MODEL
from miaohui.server.tensor_codec import DTYPES, v2_dtype

if TYPE_CHECKING:
    from miaohui.engines.base import Manifest, TensorSpec
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.served import ServedVersion

RAW_SUFFIX = "-raw"
MAX_TEXTS = 256
"""Most strings in one text request (``TEXT`` of a KServe request, ``texts`` of ``/v1/intent``)."""
INFERENCE_HEADER = "Inference-Header-Content-Length"
BINARY_FIX = f"set {INFERENCE_HEADER} to the JSON header's length and append each input's bytes in input order"


def split_name(model: str) -> tuple[str, bool]:
    """``intent-raw`` → (``intent``, True); ``intent`` → (``intent``, False)."""
    if model.endswith(RAW_SUFFIX):
        return model[: -len(RAW_SUFFIX)], True
    return model, False


def model_label(manager: ModelManager, model: str) -> str:
    """The ``model`` label for metrics: the name as the client gave it if that model exists (on disk or
    loaded), else :data:`~miaohui.server.metrics.UNKNOWN_MODEL` — random names must not create new series."""
    return model if manager.is_known(split_name(model)[0]) else UNKNOWN_MODEL


# ---------------------------------------------------------------------- JSON tensors


def parse_json_object(data: bytes, what: str = "request body") -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} is not valid JSON: {exc}", "send a JSON object") from None
    if not isinstance(doc, dict):
        raise InputError(f"{what} is a JSON {type(doc).__name__}, not an object", "send a JSON object")
    return doc


def tensor_from_json(spec: dict[str, Any]) -> np.ndarray:
    """Decode one JSON input tensor ({name, shape, datatype, data}) with checks that name the tensor."""
    name = spec.get("name", "?")
    try:
        shape = [int(d) for d in spec["shape"]]
        datatype = str(spec["datatype"])
        data = spec["data"]
    except (KeyError, TypeError, ValueError):
        raise InputError(
            f"input {name!r} needs name, shape, datatype and data",
            "see the KServe v2 inference request format",
        ) from None
    count = tensor_codec.check_shape(name, shape)
    flat = _flatten(data)
    if len(flat) != count:
        raise InputError(
            f"input {name!r} has {len(flat)} values but shape {shape} needs {count}", "make data match shape"
        )
    if datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise InputError(f"input {name!r} is BYTES but holds non-string values", "send strings")
        return np.array(flat, dtype=object).reshape(shape)
    if datatype not in DTYPES:
        raise InputError(f"input {name!r} has unknown datatype {datatype!r}", f"use one of {sorted(DTYPES)} or BYTES")
    try:
        return np.asarray(flat, dtype=DTYPES[datatype]).reshape(shape)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"input {name!r} values do not fit datatype {datatype}", "send numbers of that type") from None


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if data and isinstance(data[0], list):
        out: list[Any] = []
        for item in data:
            out.extend(_flatten(item))
        return out
    return data


def tensor_to_json(name: str, arr: np.ndarray) -> dict[str, Any]:
    datatype = v2_dtype(arr)
    if datatype == "BYTES":
        data: list[Any] = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in arr.ravel()]
    else:
        data = arr.ravel().tolist()
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": data}


# ---------------------------------------------------------------------- HTTP inference requests & responses


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON inference header and the binary data after it (none without ``Inference-Header-Content-Length``)."""
    if header_length is None:
        return parse_json_object(body), b""
    try:
        length = int(header_length)
    except ValueError:
        raise InputError(f"{INFERENCE_HEADER} {header_length!r} is not an integer", BINARY_FIX) from None
    if not 0 <= length <= len(body):
        raise InputError(f"{INFERENCE_HEADER} is {length} but the request body has {len(body)} bytes", BINARY_FIX)
    return parse_json_object(body[:length], f"the inference header (the first {length} bytes)"), body[length:]


def inputs_from_request(header: dict[str, Any], binary: bytes) -> dict[str, np.ndarray]:
    """Every input as a numpy array: from JSON ``data``, or from its ``binary_data_size`` bytes of ``binary``."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InputError("request has no 'inputs' list", "see the KServe v2 inference request format")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict):
            raise InputError(f"input #{i} is a JSON {type(spec).__name__}, not an object", "send {name, shape, ...}")
        name = str(spec.get("name", f"#{i}"))
        if name in tensors:
            raise InputError(f"input {name!r} is given twice", "send each input once")
        size = _binary_size(name, _parameters(f"input {name!r}", spec))
        if size is None:
            tensors[name] = tensor_from_json(spec)
            continue
        if "data" in spec:
            raise InputError(f"input {name!r} has both data and binary_data_size", "send its values one way")
        if offset + size > len(binary):
            raise InputError(
                f"input {name!r} has binary_data_size {size} but only {len(binary) - offset} bytes "
                "of binary data remain",
                BINARY_FIX,
            )
        tensors[name] = _tensor_from_binary(name, spec, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise InputError(
            f"request body has {len(binary) - offset} bytes after the binary data of its inputs",
            "make each input's binary_data_size match the bytes sent",
        )
    return tensors


def _tensor_from_binary(name: str, spec: dict[str, Any], data: bytes) -> np.ndarray:
    try:
        shape = [int(d) for d in spec["shape"]]
        datatype = str(spec["datatype"])
    except (KeyError, TypeError, ValueError):
        raise InputError(
            f"input {name!r} needs name, shape and datatype", "see the KServe v2 inference request format"
        ) from None
    return tensor_codec.decode(name, datatype, shape, data)


def _parameters(what: str, spec: dict[str, Any]) -> dict[str, Any]:
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise InputError(f"{what} parameters are a JSON {type(params).__name__}, not an object", "send an object")
    if "shared_memory_region" in params:
        raise InputError(f"{what} uses shared memory, which this server does not support", "send the data inline")
    return params


def _binary_size(name: str, params: dict[str, Any]) -> int | None:
    size = params.get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InputError(f"input {name!r} has binary_data_size {size!r}, not a byte count", BINARY_FIX)
    return size


def _flag(what: str, params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InputError(f"{what} parameter {key!r} is {value!r}, not true or false", f"send {key}: true or false")
    return value


def select_outputs(outputs: dict[str, np.ndarray], wanted: list[str], classify: list[str]) -> dict[str, np.ndarray]:
    """The outputs a request names (all when it names none), in that order; ``classify``: those that ask for
    Triton's classification extension (not supported)."""
    wanted = wanted or list(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InputError(f"requested outputs {unknown} do not exist", f"this model's outputs are {list(outputs)}")
    if classify:
        raise InputError(
            f"output {classify[0]!r} asks for classification, which is not supported",
            "request the output itself (INTENT/CONFIDENCE are the classification)",
        )
    return {n: outputs[n] for n in wanted}


def infer_response(
    model: str, version: int, header: dict[str, Any], outputs: dict[str, np.ndarray]
) -> tuple[bytes, int | None]:
    """The response body and, when some outputs go as binary data, the length of its JSON header."""
    default = _flag("request", _parameters("request", header), "binary_data_output", False)
    requested = header.get("outputs") or []
    if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
        raise InputError("'outputs' must be a list of objects", 'send "outputs": [{"name": "..."}]')
    wanted: list[str] = []
    binary: dict[str, bool] = {}
    classify: list[str] = []
    for spec in requested:
        name = str(spec.get("name"))
        params = _parameters(f"output {name!r}", spec)
        wanted.append(name)
        binary[name] = _flag(f"output {name!r}", params, "binary_data", default)
        if params.get("classification"):
            classify.append(name)
    rows, blobs = [], []
    for name, arr in select_outputs(outputs, wanted, classify).items():
        if binary.get(name, default):
            blob = tensor_codec.encode(arr)
            blobs.append(blob)
            meta = {"name": name, "datatype": v2_dtype(arr), "shape": list(arr.shape)}
            rows.append({**meta, "parameters": {"binary_data_size": len(blob)}})
        else:
            rows.append(tensor_to_json(name, arr))
    doc = {"model_name": model, "model_version": str(version), "id": header.get("id", ""), "outputs": rows}
    text = json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)


# ---------------------------------------------------------------------- repository & metadata


def check_load_parameters(names: list[str]) -> None:
    """Triton's load parameters (inline ``config``, ``file:...``) are not supported: the repository is the truth."""
    if names:
        raise InputError(
            f"load parameters {sorted(names)} are not supported (no inline config or files)",
            "put config.yaml and the versions in the repository, then load the model by name",
        )


def model_metadata(manager: ModelManager, model: str, version: str | None) -> dict[str, Any]:
    """The KServe model metadata of ``model`` (text model ``M`` or tensor model ``M-raw``)."""
    base, raw = split_name(model)
    served = manager.get(base, version)
    versions = [v.version for s in manager.states() if s.name == base for v in s.versions.values()]
    platform = f"miaohui_{served.manifest.backend}"
    if served.manifest.task == "intent" and not raw:
        return text_metadata(model, versions, platform)
    if served.manifest.task == "tensor" and not raw:
        return own_tensor_metadata(model, versions, platform, served.manifest)
    if served.manifest.task == "encoder" and not raw:
        from miaohui.server.embeddings_api import embedding_metadata

        return embedding_metadata(model, versions, platform, int(served.manifest.outputs[0].dims[-1]))
    if raw and served.manifest.task not in ("intent", "encoder"):
        raise ModelNotFoundError(f"model {model!r} does not exist", f"use {base!r} for the tensor interface")
    out = served.manifest.outputs[0]
    return tensor_metadata(model, versions, platform, out.name, int(out.dims[-1]))


def own_tensor_metadata(name: str, versions: list[int], platform: str, manifest: Manifest) -> dict[str, Any]:
    """A raw-tensor model's own inputs and outputs (-1 for a dynamic dimension), as its ONNX graph declares them."""

    def rows(specs: list[TensorSpec]) -> list[dict[str, Any]]:
        return [
            {
                "name": s.name,
                "datatype": tensor_codec.NUMPY_TO_V2[np.dtype(s.dtype)],
                "shape": [d if isinstance(d, int) else -1 for d in s.dims],
            }
            for s in specs
        ]

    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": platform,
        "inputs": rows(manifest.inputs),
        "outputs": rows(manifest.outputs),
    }


def text_metadata(name: str, versions: list[int], platform: str) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": platform,
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "INTENT", "datatype": "BYTES", "shape": [-1]},
            {"name": "CONFIDENCE", "datatype": "FP32", "shape": [-1]},
        ],
    }


def tensor_metadata(name: str, versions: list[int], platform: str, output: str, width: int) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": platform,
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
        ],
        "outputs": [{"name": output, "datatype": "FP32", "shape": [-1, width]}],
    }


async def infer_tensors(
    served: ServedVersion, raw: bool, tensors: dict[str, np.ndarray], deadline: float | None
) -> dict[str, np.ndarray]:
    """Shared by HTTP and gRPC: the text contracts (TEXT → INTENT, CONFIDENCE; TEXT → EMBEDDING) or the tensor
    contract."""
    if served.manifest.task == "encoder" and not raw:
        from miaohui.server.embeddings_api import embed_tensors

        return await embed_tensors(served, tensors, deadline, MAX_TEXTS)
    if served.manifest.task == "tensor":
        if raw:
            raise ModelNotFoundError(
                f"model {served.name + RAW_SUFFIX!r} does not exist", f"use {served.name!r}: it takes tensors"
            )
        return await served.infer_raw(tensors)
    if served.manifest.task == "intent" and not raw:
        if set(tensors) != {"TEXT"}:
            raise InputError(
                f"model {served.name!r} takes one input TEXT (BYTES), got {sorted(tensors)}",
                f"send TEXT, or use {served.name + RAW_SUFFIX!r} for input_ids/attention_mask",
            )
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in tensors["TEXT"].ravel()]
        if not texts or len(texts) > MAX_TEXTS:
            raise InputError(f"TEXT holds {len(texts)} strings; send 1..{MAX_TEXTS}", "split the batch")
        results = await served.classify(texts, deadline, with_slots=False)
        return {
            "INTENT": np.array([r.intent for r in results], dtype=object),
            "CONFIDENCE": np.array([r.confidence for r in results], dtype=np.float32),
        }
    expected = {"input_ids", "attention_mask"}
    if set(tensors) != expected:
        raise InputError(f"model takes inputs {sorted(expected)}, got {sorted(tensors)}", "send both INT64 tensors")
    for name, arr in tensors.items():
        if arr.dtype != np.int64:
            raise InputError(
                f"input {name!r} has datatype {v2_dtype(arr)}; the model expects INT64",
                "send INT64 token ids and mask",
            )
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise InputError(
            f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} must both be [batch, sequence]",
            "send two int64 tensors of the same 2-D shape",
        )
    if ids.shape[0] > served.max_batch:
        raise InputError(f"batch of {ids.shape[0]} rows exceeds max_batch_size {served.max_batch}", "split the request")
    out = await served.infer_tensors(ids, mask, deadline)
    return {served.output_name: out.astype(np.float32)}
