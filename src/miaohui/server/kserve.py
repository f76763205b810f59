"""KServe v2 / Open Inference Protocol: tensors ↔ numpy, and the model contracts we expose.

For every repository model ``M`` of task ``intent``:

* ``M``      — text model: input ``TEXT`` (BYTES, [-1]) → ``INTENT`` (BYTES, [-1]), ``CONFIDENCE`` (FP32, [-1])
* ``M-raw``  — tensor model: ``input_ids``, ``attention_mask`` (INT64, [-1, -1]) → ``logits`` (FP32, [-1, labels])

Encoder models expose only the tensor form under their own name (output ``embeddings``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miaohui.errors import InputError

RAW_SUFFIX = "-raw"

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_V2 = {v: k for k, v in DTYPES.items()}


def v2_dtype(arr: np.ndarray) -> str:
    if arr.dtype == object or arr.dtype.kind in ("S", "U"):
        return "BYTES"
    return NUMPY_TO_V2[arr.dtype]


def split_name(model: str) -> tuple[str, bool]:
    """``intent-raw`` → (``intent``, True); ``intent`` → (``intent``, False)."""
    if model.endswith(RAW_SUFFIX):
        return model[: -len(RAW_SUFFIX)], True
    return model, False


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
    if any(d < 0 for d in shape):
        raise InputError(f"input {name!r} has a negative dimension in shape {shape}", "give concrete sizes")
    flat = _flatten(data)
    count = int(np.prod(shape)) if shape else 1
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
    data = [str(x) for x in arr.ravel()] if datatype == "BYTES" else arr.ravel().tolist()
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": data}


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
