"""Measured kernel tuning as data: which of miaohui's GPU kernels the ``inductor`` engine runs, with which launch
configuration, for which model shapes, on one GPU with one set of library versions.

A tuning file (``<gpu-slug>-sm<major><minor>.json`` in this folder) is written by ``scripts/gpu/tune.py`` on the GPU it
describes: the skinny GEMM configurations, the forced splits of the fused LayerNorm, the attention kernel's
configurations and the cuBLASLt algorithms that its timing found faster than the library kernels (cuBLAS, SDPA), per
model widths. TensorRT keeps its tactic choices in a timing cache the same way.

:func:`select` finds the file for the running GPU (name and compute capability) and checks the versions it was
measured with: a torch or Triton other than the file's → no entries at all (library kernels) and a warning; another
cuBLASLt → no cuBLASLt algorithms (they are 64 opaque bytes valid for one cuBLASLt version). The file's sha256
(:func:`digest_for`) enters the build key, so an engine is rebuilt when its table changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miaohui.errors import ConfigError

log = logging.getLogger(__name__)

TUNING_DIR = Path(__file__).resolve().parent
"""Where the committed tuning files live."""

SEARCH_PATH: list[Path] = [TUNING_DIR]
"""Folders searched for a GPU's file, first match wins (``bench_gpu_encoder.py --tuning DIR`` puts a folder first)."""

Gemm = Literal["qkv", "attn_out", "ffn_in", "ffn_out"]
SkinnyConfig = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps) of ``miaohui.models.skinny_gemm.skinny_linear``."""
AttnConfig = tuple[int, int, int, int]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``miaohui.models.encoder_attention.triton_encoder_attention``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Versions(_Strict):
    """The libraries the entries were measured with; an entry is trusted only under the same ones."""

    torch: str
    """``torch.__version__`` (its CUDA tag included: cuBLAS comes with it)."""
    triton: str
    """``triton.__version__``: the Triton kernels' configurations were timed as this Triton compiled them."""
    cublaslt: int | None = None
    """``cublasLtGetVersion()`` (e.g. 130100): the cuBLASLt algorithms are valid for this version only."""


class Written(_Strict):
    """Where the file came from."""

    date: str
    commit: str
    command: str


class AttnEntry(_Strict):
    batch: int = Field(ge=1)
    seq: int = Field(ge=1)
    config: AttnConfig


class ModelTuning(_Strict):
    """The entries of one encoder width (every layer of a FastBert of these widths has the same four GEMMs)."""

    hidden: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    heads: int = Field(ge=1)
    skinny: dict[int, dict[Gemm, SkinnyConfig]] = Field(default_factory=dict)
    """rows (batch × sequence) → GEMM → configuration where the 12-layer chain of skinny GEMMs launched as
    programmatic dependents beat cuBLAS's."""
    ln_split: dict[int, dict[Gemm, SkinnyConfig]] = Field(default_factory=dict)
    """rows → first GEMM of a fused (GEMM, add + LayerNorm, GEMM) pair → a split of K that ``skinny`` does not have,
    where the fused pair beat the unfused one."""
    attention: list[AttnEntry] = Field(default_factory=list)
    """(batch, sequence) → the attention kernel's configuration where it beat the SDPA form."""
    cublaslt: dict[int, dict[Gemm, str]] = Field(default_factory=dict)
    """rows → GEMM → the cuBLASLt algorithm (its 64 bytes as hex) that beat torch's call (the heuristic's pick)."""


class TuningFile(_Strict):
    """One GPU's tuning file."""

    format: Literal[1] = 1
    gpu: str
    """``torch.cuda.get_device_name()``."""
    compute_capability: str
    """``major.minor``, e.g. ``9.0``."""
    precision: Literal["fp16"] = "fp16"
    """The precision the entries were measured in; other builds run the library kernels."""
    versions: Versions
    pdl_max_rows: int | None = None
    """Static programs of more rows than this compile Inductor's kernels without programmatic dependent launch (it
    measured slower there); None: every program uses it."""
    written: Written
    models: list[ModelTuning] = Field(default_factory=list)


@dataclass(frozen=True)
class Runtime:
    """What a tuning file is matched against: the GPU and the library versions of this process."""

    gpu: str
    capability: tuple[int, int]
    torch: str
    triton: str | None
    cublaslt: int | None

    @classmethod
    def detect(cls) -> Runtime | None:
        """This process's GPU and versions; None without a CUDA GPU."""
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            import triton

            triton_version: str | None = str(triton.__version__)
        except ImportError:
            triton_version = None
        from miaohui.models import cublaslt

        major, minor = torch.cuda.get_device_capability()
        return cls(torch.cuda.get_device_name(), (major, minor), str(torch.__version__), triton_version,
                   cublaslt.version_or_none())  # fmt: skip


def file_name(gpu: str, capability: tuple[int, int]) -> str:
    """``NVIDIA H200``, (9, 0) → ``nvidia-h200-sm90.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"{slug}-sm{capability[0]}{capability[1]}.json"


def find(gpu: str, capability: tuple[int, int]) -> Path | None:
    """The tuning file for this GPU in :data:`SEARCH_PATH`, if any."""
    for folder in SEARCH_PATH:
        path = Path(folder) / file_name(gpu, capability)
        if path.is_file():
            return path
    return None


def load(path: Path) -> TuningFile:
    """A tuning file, validated; a file that does not parse raises naming it."""
    try:
        return TuningFile.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"tuning file {path} is not valid: {exc}", "rewrite it with scripts/gpu/tune.py") from exc


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest_for(gpu: str | None, capability: tuple[int, int] | None) -> str | None:
    """The sha256 of the tuning file a build on this GPU reads (None: no GPU, or no file for it)."""
    if gpu is None or capability is None:
        return None
    path = find(gpu, capability)
    return digest(path) if path is not None else None


def dump(tuning: TuningFile, path: Path) -> None:
    """Write ``tuning`` as JSON, each configuration on one line."""
    text = json.dumps(tuning.model_dump(mode="json"), indent=1)
    text = re.sub(r"\[\s+([-0-9.,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    Path(path).write_text(text + "\n", encoding="utf-8")


def products(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """An encoder layer's four GEMMs → (N, K) of the weight."""
    return {
        "qkv": (3 * hidden, hidden),
        "attn_out": (hidden, hidden),
        "ffn_in": (intermediate, hidden),
        "ffn_out": (hidden, intermediate),
    }


@dataclass
class Selection:
    """The entries a build uses for one model on this GPU, keyed by problem shape (empty: library kernels)."""

    skinny: dict[tuple[int, int, int], SkinnyConfig] = field(default_factory=dict)
    """(M, N, K) → configuration."""
    ln_split: dict[tuple[int, int, int], SkinnyConfig] = field(default_factory=dict)
    """(M, N, K) → configuration of the first GEMM of a fused LayerNorm pair."""
    attention: dict[tuple[int, int, int, int], AttnConfig] = field(default_factory=dict)
    """(batch, heads, sequence, head size) → configuration."""
    cublaslt: dict[tuple[int, int, int, bool], str] = field(default_factory=dict)
    """(M, N, K, GELU epilogue) → algorithm hex."""
    pdl_max_rows: int | None = None
    file: str | None = None
    digest: str | None = None
    reason: str | None = None
    """Why there are no entries (or no cuBLASLt entries), where that is so."""


def select(runtime: Runtime | None, dims: tuple[int, int, int], precision: str = "fp16") -> Selection:
    """The tuning file's entries for a model of these (hidden, intermediate, heads) on ``runtime``'s GPU."""
    if runtime is None:
        return Selection(reason="no CUDA GPU")
    path = find(runtime.gpu, runtime.capability)
    if path is None:
        where = ", ".join(map(str, SEARCH_PATH))
        name = file_name(runtime.gpu, runtime.capability)
        return Selection(reason=f"no tuning file {name} for {runtime.gpu} in {where}")
    tuning = load(path)
    out = Selection(file=path.name, digest=digest(path))
    if precision != tuning.precision:
        out.reason = f"{path.name} was measured in {tuning.precision}, not {precision}"
        return out
    measured = (tuning.versions.torch, tuning.versions.triton)
    if measured != (runtime.torch, runtime.triton):
        out.reason = (
            f"{path.name} was measured with torch {measured[0]} and Triton {measured[1]}, this process has torch "
            f"{runtime.torch} and Triton {runtime.triton}: library kernels (run scripts/gpu/tune.py here)"
        )
        log.warning("%s", out.reason)
        return out
    hidden, intermediate, heads = dims
    entry = next((m for m in tuning.models if (m.hidden, m.intermediate, m.heads) == dims), None)
    if entry is None:
        out.reason = f"{path.name} has no entries for a model of hidden {hidden}, FFN {intermediate}, {heads} heads"
        return out
    gemms = products(hidden, intermediate)
    out.skinny = {(m, *gemms[g]): cfg for m, row in entry.skinny.items() for g, cfg in row.items()}
    if out.skinny:
        out.ln_split = {(m, *gemms[g]): cfg for m, row in entry.ln_split.items() for g, cfg in row.items()}
        out.pdl_max_rows = tuning.pdl_max_rows
    out.attention = {(a.batch, heads, a.seq, hidden // heads): a.config for a in entry.attention}
    if entry.cublaslt and tuning.versions.cublaslt != runtime.cublaslt:
        out.reason = (
            f"{path.name}'s cuBLASLt algorithms are for cuBLASLt {tuning.versions.cublaslt}, this process has "
            f"{runtime.cublaslt}: torch's cuBLAS call for those GEMMs (run scripts/gpu/tune.py here)"
        )
        log.warning("%s", out.reason)
    elif out.skinny:  # the cuBLASLt call is a branch of the skinny op
        out.cublaslt = {
            (m, *gemms[g], g == "ffn_in"): algo for m, row in entry.cublaslt.items() for g, algo in row.items()
        }
    return out
