"""cuBLASLt through ``ctypes``: the encoder's ``linear(x, w, bias)`` (optionally its tanh GELU) with an algorithm
picked by timing, the way TensorRT picks a tactic per layer.

torch runs such a product through cuBLASLt too (``addmm`` with a bias, ``_addmm_activation`` with the GELU
epilogue), but takes the heuristic's first algorithm. :meth:`LtLinear.algos` asks the heuristic for up to N
candidates; ``scripts/gpu/tune.py`` times them on the GPU against torch's call. An :class:`Algo` is the 64-byte
``cublasLtMatmulAlgo_t`` as cuBLASLt returns it: valid for the cuBLASLt version and GPU it was found on, so tuning
files keep both.

No compiler and no headers are needed: the library torch has already loaded is opened by its path, and the few
enums used are written out below (``cublasLt.h``, CUDA 12 and 13 alike). Layouts: a row-major ``y [M, N] = x [M, K]
· w [N, K]ᵀ`` is cuBLAS's column-major ``yᵀ = op(w) · xᵀ`` with ``op = T`` on ``w`` ("TN"), so the bias, one value a
row of cuBLAS's D, is the usual [N] vector."""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
R_32F, R_16F, R_16BF = 0, 2, 14  # cudaDataType_t
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
EPILOGUES = {"bias": 4, "gelu_bias": 36}  # cublasLtEpilogue_t: BIAS, GELU_BIAS (= GELU 32 | BIAS 4; tanh GELU)
CONFIG_FIELDS = {  # cublasLtMatmulAlgoConfigAttributes_t → size in bytes
    "id": (0, 4), "tile": (1, 4), "split_k": (2, 4), "reduction": (3, 4), "swizzle": (4, 4), "custom": (5, 4),
    "stages": (6, 4), "inner_shape": (7, 2), "cluster_shape": (8, 2),
}  # fmt: skip
DTYPES = {torch.float16: R_16F, torch.bfloat16: R_16BF}
WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLAS on Hopper
POOL_ROWS = (16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class LtError(RuntimeError):
    """A cuBLASLt call failed; the message names the call, its status and the problem."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass(frozen=True)
class Algo:
    """One cuBLASLt algorithm for one problem: its 64 opaque bytes, the workspace it needs, what the heuristic
    said of it (waves) and its readable configuration (tile id, stages, split-K, swizzle, cluster …)."""

    blob: bytes
    workspace: int
    waves: float
    config: dict[str, int]

    def hex(self) -> str:
        return self.blob.hex()

    @classmethod
    def from_hex(cls, text: str) -> Algo:
        """A table's algorithm (its configuration is not read: that needs the library)."""
        blob = bytes.fromhex(text)
        if len(blob) != ctypes.sizeof(_Algo):
            raise ValueError(f"a cuBLASLt algorithm is {ctypes.sizeof(_Algo)} bytes, not {len(blob)} ({text[:16]}…)")
        return cls(blob, 0, 0.0, {})


_LIB: ctypes.CDLL | None = None


def _loaded_path() -> str | None:
    """The path of the libcublasLt this process has mapped (torch loads it with cuBLAS), if any."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


def library() -> ctypes.CDLL:
    """torch's libcublasLt (CUDA only): found among the process's mapped libraries after a cuBLAS call, else by name."""
    global _LIB
    if _LIB is not None:
        return _LIB
    if not torch.cuda.is_available():
        raise LtError("cuBLASLt needs a CUDA build of torch and a GPU; this process has none")
    torch.cuda.current_blas_handle()  # loads cuBLAS (and with it cuBLASLt)
    names = [p for p in (_loaded_path(),) if p] + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise LtError(f"libcublasLt not found (tried {names}); install torch's CUDA libraries (nvidia-cublas)")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtGetVersion.restype = sz
    lib.cublasLtGetVersion.argtypes = []
    for name, args in {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                       ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp, ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmulAlgoConfigGetAttribute": [vp, ctypes.c_int, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }.items():  # fmt: skip
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    _LIB = lib
    return lib


def version_or_none() -> int | None:
    """:func:`version`, or None where there is no GPU (or no cuBLASLt)."""
    try:
        return version()
    except (LtError, OSError):
        return None


def version() -> int:
    """cuBLASLt's version number (e.g. 130100 for 13.1.0): a table's algorithms are valid for this version only."""
    return int(library().cublasLtGetVersion())


def _check(status: int, call: str, what: str) -> None:
    if status != 0:
        raise LtError(f"{call} returned cuBLAS status {status} for {what}")


def describe(blob: bytes) -> dict[str, int]:
    """An algorithm's configuration attributes, read through ``cublasLtMatmulAlgoConfigGetAttribute``."""
    lib = library()
    algo = _Algo.from_buffer_copy(blob)
    out: dict[str, int] = {}
    for name, (attr, size) in CONFIG_FIELDS.items():
        value = ctypes.c_uint32(0) if size == 4 else ctypes.c_uint16(0)
        written = ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attr, ctypes.byref(value), size, ctypes.byref(written)
        )
        out[name] = int(value.value) if status == 0 else -1
    return out


_WORKSPACE: dict[tuple[int, int], torch.Tensor] = {}
_HANDLE: dict[int, ctypes.c_void_p] = {}
_STATE_LOCK = threading.Lock()


def _device_state(device: torch.device, stream: int = 0) -> tuple[ctypes.c_void_p, torch.Tensor]:
    """The device's cuBLASLt handle and ``stream``'s workspace: one per stream, as torch keeps its own, so engine
    instances on their own streams (and their captured graphs) never share one while both run."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STATE_LOCK:
        if index not in _HANDLE:
            handle = ctypes.c_void_p()
            _check(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate", f"cuda:{index}")
            _HANDLE[index] = handle
        if (index, stream) not in _WORKSPACE:
            _WORKSPACE[(index, stream)] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        return _HANDLE[index], _WORKSPACE[(index, stream)]


class LtLinear:
    """One problem: ``y [rows, n] = x [rows, k] · w [n, k]ᵀ + bias`` (``epilogue`` "bias" or "gelu_bias") in
    ``dtype`` with fp32 accumulation."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, epilogue: str = "bias"):
        if dtype not in DTYPES:
            raise ValueError(f"LtLinear: dtype {dtype} not supported; use one of {sorted(map(str, DTYPES))}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"LtLinear: epilogue {epilogue!r} not supported; use one of {sorted(EPILOGUES)}")
        self.rows, self.n, self.k, self.dtype, self.epilogue = rows, n, k, dtype, epilogue
        self.what = f"rows {rows}, N {n}, K {k}, {dtype}, {epilogue}"
        lib = library()
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), COMPUTE_32F, R_32F), "DescCreate", self.what)
        for attr, value in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N), (DESC_EPILOGUE, EPILOGUES[epilogue])):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), 4), "DescSetAttribute",
                   self.what)  # fmt: skip
        t = DTYPES[dtype]
        self._a, self._b, self._c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, (r, c, ld) in ((self._a, (k, n, k)), (self._b, (k, rows, k)), (self._c, (n, rows, n))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), t, r, c, ld), "MatrixLayoutCreate", self.what)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._lock = threading.Lock()  # the bias pointer is set on the shared descriptor just before each call

    def algos(self, limit: int = 32) -> list[Algo]:
        """Up to ``limit`` algorithms the heuristic offers, best-guess first (its first is what torch would run)."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate", self.what)
        try:
            ws = ctypes.c_size_t(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                   "PreferenceSetAttribute", self.what)  # fmt: skip
            results = (_Heuristic * limit)()
            returned = ctypes.c_int(0)
            handle, _ = _device_state(torch.device("cuda"))
            _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self._desc, self._a, self._b, self._c, self._c, pref,
                   limit, results, ctypes.byref(returned)), "MatmulAlgoGetHeuristic", self.what)  # fmt: skip
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        out = []
        for r in results[: returned.value]:
            if r.state == 0:
                blob = bytes(r.algo)
                out.append(Algo(blob, int(r.workspace_size), float(r.waves), describe(blob)))
        return out

    def candidates(self, limit: int = 32, pool_rows: tuple[int, ...] = POOL_ROWS) -> list[Algo]:
        """:meth:`algos` for this problem, then those the heuristic offers for the same product at other row counts
        (``pool_rows``), each once: an algorithm is not tied to a shape, and the heuristic offers only ~8 a shape.
        One that cannot run this problem fails its first call (skip it); run each against a reference before use."""
        seen: dict[bytes, Algo] = {a.blob: a for a in self.algos(limit)}
        for rows in pool_rows:
            if rows == self.rows:
                continue
            other = LtLinear(rows, self.n, self.k, self.dtype, self.epilogue)
            try:
                for algo in other.algos(limit):
                    seen.setdefault(algo.blob, algo)
            finally:
                other.close()
        return list(seen.values())

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, algo: Algo) -> torch.Tensor:
        """``y`` for ``x`` [rows, k], ``w`` [n, k], ``bias`` [n], on the current stream (so a CUDA graph being
        captured records it)."""
        shapes_ok = x.shape == (self.rows, self.k) and w.shape == (self.n, self.k) and bias.shape == (self.n,)
        if not shapes_ok or x.dtype != self.dtype or w.dtype != self.dtype or bias.dtype != self.dtype:
            raise ValueError(f"LtLinear({self.what}): got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)}, bias "
                             f"{tuple(bias.shape)}")  # fmt: skip
        if not (x.is_contiguous() and w.is_contiguous() and bias.is_contiguous()):
            raise ValueError(f"LtLinear({self.what}): x, w and bias must be contiguous")
        lib = library()
        stream = torch.cuda.current_stream(x.device).cuda_stream
        handle, workspace = _device_state(x.device, stream)
        out = torch.empty((self.rows, self.n), dtype=self.dtype, device=x.device)
        ptr = ctypes.c_void_p(bias.data_ptr())
        raw = _Algo.from_buffer_copy(algo.blob)
        with self._lock:
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, DESC_BIAS_POINTER, ctypes.byref(ptr), 8),
                   "DescSetAttribute(bias)", self.what)  # fmt: skip
            _check(lib.cublasLtMatmul(handle, self._desc, ctypes.byref(self._alpha), w.data_ptr(), self._a,
                   x.data_ptr(), self._b, ctypes.byref(self._beta), out.data_ptr(), self._c, out.data_ptr(), self._c,
                   ctypes.byref(raw), workspace.data_ptr(), WORKSPACE_BYTES, stream), "cublasLtMatmul",
                   self.what)  # fmt: skip
        return out

    def close(self) -> None:
        lib = library()
        for layout in (self._a, self._b, self._c):
            lib.cublasLtMatrixLayoutDestroy(layout)
        lib.cublasLtMatmulDescDestroy(self._desc)

    def __repr__(self) -> str:
        return f"LtLinear({self.what})"


def summary(algo: Algo) -> dict[str, Any]:
    """An algorithm as a JSON-friendly record (its blob in hex, so a table can hold it)."""
    return {"hex": algo.hex(), "workspace": algo.workspace, "waves": round(algo.waves, 3), **algo.config}
