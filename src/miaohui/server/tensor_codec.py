"""Raw tensor bytes ↔ numpy: the KServe v2 binary layout that gRPC (``raw_input_contents`` /
``raw_output_contents``) and HTTP (the binary tensor extension, data after the JSON header) share.

Numbers are little-endian, C order. A BYTES tensor is, per element, a uint32 little-endian length followed by
that many bytes; we decode BYTES elements as UTF-8 text (object arrays of ``str``). Every error names the
tensor and says how to fix the data.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from miaohui.errors import InputError

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
"""KServe datatype → numpy dtype, for every datatype but BYTES (object arrays of str) and BF16 (unsupported)."""
NUMPY_TO_V2 = {v: k for k, v in DTYPES.items()}
MAX_BYTES_ELEMENTS = 4096
"""Most elements in one BYTES tensor (bounds the decode loop; the text contract allows 256 texts)."""
LENGTH = struct.Struct("<I")


def v2_dtype(arr: np.ndarray) -> str:
    if arr.dtype == object or arr.dtype.kind in ("S", "U"):
        return "BYTES"
    return NUMPY_TO_V2[arr.dtype]


def check_shape(name: str, shape: Sequence[int]) -> int:
    """The element count of ``shape``; a negative dimension is an error."""
    if any(d < 0 for d in shape):
        raise InputError(f"input {name!r} has a negative dimension in shape {list(shape)}", "give concrete sizes")
    return math.prod(shape)


def numeric_dtype(name: str, datatype: str) -> np.dtype[Any]:
    if datatype not in DTYPES:
        raise InputError(
            f"input {name!r} has unsupported datatype {datatype!r}", f"use one of {sorted(DTYPES)} or BYTES"
        )
    return DTYPES[datatype]


def check_bytes_count(name: str, count: int) -> None:
    if count > MAX_BYTES_ELEMENTS:
        raise InputError(
            f"input {name!r} has {count} BYTES elements; the limit is {MAX_BYTES_ELEMENTS}", "split the batch"
        )


def utf8(name: str, index: int, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"input {name!r} element #{index} is not valid UTF-8", "send text as UTF-8") from None


def decode(name: str, datatype: str, shape: list[int], data: bytes) -> np.ndarray:
    """One tensor from its raw bytes, checked against ``shape`` and ``datatype`` (BYTES → object array of str)."""
    count = check_shape(name, shape)
    if datatype == "BYTES":
        return np.array(split_bytes(name, data, count), dtype=object).reshape(shape)
    dtype = numeric_dtype(name, datatype)
    if len(data) != count * dtype.itemsize:
        raise InputError(
            f"input {name!r} has {len(data)} bytes of raw data but shape {shape} of {datatype} "
            f"needs {count * dtype.itemsize}",
            "make the data match the shape and datatype",
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def split_bytes(name: str, data: bytes, count: int) -> list[str]:
    """KServe's BYTES wire format: per element a uint32 little-endian length, then that many bytes."""
    check_bytes_count(name, count)
    items: list[str] = []
    offset = 0
    for index in range(count):
        if offset + 4 > len(data):
            raise InputError(
                f"input {name!r} raw data ends after {index} of {count} BYTES elements",
                "prefix every element with its 4-byte little-endian length",
            )
        (length,) = LENGTH.unpack_from(data, offset)
        offset += 4
        if offset + length > len(data):
            raise InputError(
                f"input {name!r} BYTES element #{index} claims {length} bytes but only {len(data) - offset} remain",
                "prefix every element with its exact length",
            )
        items.append(utf8(name, index, data[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise InputError(
            f"input {name!r} has {len(data) - offset} bytes after its {count} BYTES elements",
            "make the shape match the number of elements",
        )
    return items


def encode(arr: np.ndarray) -> bytes:
    """The raw bytes of ``arr``: little-endian C-order values, or length-prefixed UTF-8 for BYTES."""
    if v2_dtype(arr) == "BYTES":
        return b"".join(LENGTH.pack(len(b)) + b for b in _as_bytes(arr.ravel()))
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _as_bytes(values: Iterable[Any]) -> Iterable[bytes]:
    return (v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values)
