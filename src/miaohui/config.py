"""Build configuration: what changes the compiled graph, with ``compute_hash()`` for build keys.

Shape profiles use TensorRT's min/opt/max vocabulary. The CLI syntax is
``input_ids:1x1,8x64,32x128`` (min, opt, max); several inputs are separated by ``;``.
Inputs that share named dynamic axes with a given input (``attention_mask`` shares
``batch`` and ``sequence`` with ``input_ids``) inherit its ranges.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miaohui.errors import ConfigError

Backend = Literal["onnxruntime", "tensorrt", "tensorrt-rtx", "inductor", "torch"]
Precision = Literal["fp32", "fp16", "bf16", "int8"]
CalibrationMethod = Literal["minmax", "entropy", "percentile"]
Int8Mode = Literal["static", "dynamic"]

BACKENDS: tuple[str, ...] = ("onnxruntime", "tensorrt", "tensorrt-rtx", "inductor", "torch")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class VersionPolicy(BaseModel):
    """Which versions are served: the ``latest`` N, ``all``, or ``specific`` ones."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["latest", "all", "specific"] = "latest"
    latest: int = Field(default=1, ge=1)
    """How many of the newest versions to serve when policy is ``latest``."""
    versions: list[int] = Field(default_factory=list)
    """The versions to serve when policy is ``specific``."""

    @model_validator(mode="after")
    def _specific(self) -> VersionPolicy:
        if self.policy == "specific" and not self.versions:
            raise ConfigError("version_policy 'specific' lists no versions", "add versions: [1, 2] or use latest")
        return self

    def select(self, available: list[int]) -> list[int]:
        if self.policy == "all":
            return sorted(available)
        if self.policy == "specific":
            return sorted(v for v in available if v in self.versions)
        return sorted(available)[-self.latest :]


class ShadowConfig(BaseModel):
    """Shadow mode: requests answered by the primary version are also run, off the response path, on a
    candidate version; the two outputs are compared (``GET /v1/shadow/<model>``, ``miaohui_shadow_drift``).
    An encoder's ``config.yaml`` and a chat model's ``generation.yaml`` take the same section.

    The candidate must be served too (``version_policy``: ``all``, or ``specific`` listing both versions);
    the primary is then the newest served version other than the candidate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1)
    """The candidate version (a folder of this model in the repository)."""
    sample_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of primary requests also run on the candidate (0 = shadowing paused)."""
    window: int = Field(default=1000, ge=1, le=1_000_000)
    """Request pairs the figures are computed over (the most recent ones)."""
    max_pending: int = Field(default=64, ge=1)
    """Shadow runs in flight at most; a sampled request beyond it is skipped (and counted as dropped)."""
    max_drift: float = Field(default=0.05, ge=0.0, le=1.0)
    """Intent disagreement (encoders), or a keyword's frequency difference between the two versions' answers
    (chat models), above this marks the report as failing (figure ``passed`` = 0). 5 %: a shift a reviewer of
    a few hundred answers would notice."""
    keywords: tuple[str, ...] = ("拒绝", "接受", "折中")
    """Chat models: each keyword's frequency (share of answers that contain it) is compared between the primary's
    and the candidate's answers. The default is the negotiation coach's stances (reject / accept / compromise):
    a fine-tune that starts refusing more often shows there first."""


def check_shadow_served(policy: VersionPolicy, shadow: ShadowConfig | None) -> None:
    """ConfigError unless ``policy`` serves the candidate of ``shadow`` next to a primary."""
    if shadow is not None and policy.policy == "specific" and shadow.version not in policy.versions:
        raise ConfigError(
            f"shadow.version {shadow.version} is not among version_policy.versions {policy.versions}",
            f"add {shadow.version} to version_policy.versions so that the candidate is loaded",
        )
    if shadow is not None and policy.policy == "latest" and policy.latest < 2:
        raise ConfigError(
            f"shadow.version {shadow.version} needs two served versions, but version_policy is latest: {policy.latest}",
            "use version_policy {policy: specific, versions: [PRIMARY, CANDIDATE]} or {policy: all}",
        )


def primary_of(served: Iterable[int], shadow: ShadowConfig | None) -> int | None:
    """The version that answers requests naming none: the newest served one that is not the shadow candidate
    (the newest of all when only the candidate is served; None when none is)."""
    versions = sorted(served)
    if not versions:
        return None
    live = [v for v in versions if shadow is None or v != shadow.version]
    return (live or versions)[-1]


class InputRange(Frozen):
    """min/opt/max shape of one input (an optimization profile entry)."""

    min: tuple[int, ...]
    """Smallest shape a request may have."""
    opt: tuple[int, ...]
    """Shape the builder tunes for."""
    max: tuple[int, ...]
    """Largest shape a request may have; larger requests are rejected with a clear error."""

    @model_validator(mode="after")
    def _consistent(self) -> InputRange:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ConfigError(
                f"shape profile ranks differ: min={_fmt(self.min)} opt={_fmt(self.opt)} max={_fmt(self.max)}",
                "give min, opt and max with the same number of dimensions, e.g. 1x1,8x64,32x128",
            )
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if lo < 1:
                raise ConfigError(
                    f"shape profile has a dimension {lo} < 1 in min={_fmt(self.min)}",
                    "every dimension must be at least 1",
                )
            if not lo <= mid <= hi:
                raise ConfigError(
                    f"shape profile is not ordered: min={_fmt(self.min)} opt={_fmt(self.opt)} max={_fmt(self.max)}",
                    "each dimension must satisfy min <= opt <= max",
                )
        return self

    def contains(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for s, lo, hi in zip(shape, self.min, self.max, strict=True)
        )

    def __str__(self) -> str:
        return f"{_fmt(self.min)},{_fmt(self.opt)},{_fmt(self.max)}"


def _fmt(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _parse_dims(text: str, where: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ConfigError(
            f"cannot read shape {text!r} in {where!r}", "write shapes as NxM, e.g. input_ids:1x1,8x64,32x128"
        ) from None
    return dims


def parse_shapes(spec: str) -> dict[str, InputRange]:
    """Parse ``name:min,opt,max[;name:min,opt,max]`` into per-input ranges."""
    ranges: dict[str, InputRange] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, rest = part.partition(":")
        pieces = rest.split(",") if sep else []
        if not sep or not name or len(pieces) != 3:
            raise ConfigError(
                f"cannot read shape profile {part!r}",
                "use NAME:MIN,OPT,MAX, e.g. input_ids:1x1,8x64,32x128 (several inputs separated by ';')",
            )
        lo, mid, hi = (_parse_dims(p, part) for p in pieces)
        ranges[name.strip()] = InputRange(min=lo, opt=mid, max=hi)
    if not ranges:
        raise ConfigError(f"empty shape profile {spec!r}", "give at least one NAME:MIN,OPT,MAX")
    return ranges


def format_shapes(ranges: dict[str, InputRange]) -> str:
    return ";".join(f"{name}:{r}" for name, r in ranges.items())


class CalibrationConfig(Frozen):
    """INT8 calibration: which statistic sets each tensor's range, and on how much text."""

    method: CalibrationMethod = "percentile"
    """``minmax`` (absolute range), ``entropy`` (KL-divergence threshold, TensorRT's classic choice)
    or ``percentile`` (clip outliers at ``percentile``)."""
    percentile: float = Field(default=99.999, gt=50.0, le=100.0)
    """Percentile of |x| kept when method is ``percentile``."""
    num_samples: int = Field(default=256, ge=8, le=100_000)
    """Representative texts fed through the model to collect ranges."""
    per_channel: bool = True
    """Per-output-channel weight scales (more accurate; supported by ORT and TensorRT)."""
    keep_fp32: tuple[str, ...] = ()
    """Regular expressions over node names whose MatMuls stay fp32 (mixed precision for sensitive layers),
    e.g. ``layer\\.\\d+/output/dense`` keeps BERT's FFN down-projections (long-tailed GELU inputs) in fp32."""
    fp32_fallback: int = Field(default=0, ge=0, le=1000)
    """Dynamic int8: also keep in fp32 the N weight MatMuls whose inputs lose most to per-tensor run-time
    quantization on the calibration text (ranked in fp32 by noise-to-signal ratio, see
    ``compile.quantize.activation_sensitivity``)."""
    smooth: int = Field(default=0, ge=0, le=1000)
    """Dynamic int8: give the next N most sensitive weight MatMuls (after the fp32 fallbacks) a SmoothQuant input
    scale instead of keeping them fp32: their activation outliers move into the weights (``compile.smooth``)."""
    smooth_alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """SmoothQuant's migration strength: 0 leaves the activations as they are, 1 moves all their range."""
    mode: Int8Mode = "static"
    """``static``: explicit QDQ with calibrated activation ranges (the graph TensorRT also takes).
    ``dynamic`` (ONNX Runtime only): int8 weights, activation ranges measured per batch at run time, with
    ORT's fused int8 attention — no calibration; ORT's recommendation for transformers on CPU."""

    @model_validator(mode="after")
    def _dynamic_only(self) -> CalibrationConfig:
        used = [f"--{k.replace('_', '-')} {getattr(self, k)}" for k in ("fp32_fallback", "smooth") if getattr(self, k)]
        if used and self.mode != "dynamic":
            raise ConfigError(
                f"{' and '.join(used)} with --int8-mode {self.mode}: they rank MatMuls by run-time quantization error",
                "add --int8-mode dynamic, or use --keep-fp32 REGEX with static int8",
            )
        return self


_INDUCTOR_ONLY: dict[str, tuple[str, str]] = {
    "inductor_format": ("--inductor-format", "the artifact format is an inductor option"),
    "gpu_kernels": ("--gpu-kernels", "the GPU kernel choice is an inductor option"),
    "static_shapes": ("--static-shapes", "static programs per bucket are an inductor option"),
}
"""BuildConfig fields that only the ``inductor`` backend reads → (CLI flag, what the field is): another backend with
a value other than the default is refused, naming the fix."""


class BuildConfig(Frozen):
    """Everything that changes the compiled graph. Its hash is part of the build key."""

    backend: Backend = "onnxruntime"
    """Which engine builder to use."""
    precision: Precision = "fp32"
    """Numeric precision of the graph."""
    shapes: dict[str, InputRange] = Field(default_factory=dict)
    """Dynamic shape profile per input; empty means the export spec's defaults."""
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    """INT8 only: calibration settings."""
    target: str | None = None
    """GPU target for TensorRT builds, e.g. ``sm86`` (A10) or ``sm89`` (L4); None = this machine."""
    opt_level: int = Field(default=3, ge=0, le=5)
    """Builder optimization level (TensorRT builder level; ORT: >=1 basic, >=2 extended, >=3 all)."""
    autotune: bool = False
    """inductor: Inductor's max-autotune GEMM selection. Off by default: on the H200 its Triton templates lost to
    cuBLAS at the encoder's shapes and it made the build minutes long."""
    inductor_format: Literal["auto", "fast-graphs", "aoti-package", "exported-program"] = "auto"
    """inductor: the artifact's format. ``fast-graphs``: miaohui's fast encoder (its weights, and the Triton kernels
    its tuned ops compiled at build) run as captured CUDA graphs, with no Dynamo or Inductor at load: ready in
    seconds on a fresh machine, 2–5 % slower per batch than the compiled program (BERT-base, H200). ``auto``: that,
    on a GPU, for every model miaohui's encoder covers (BERT, RoBERTa / XLM-R, DistilBERT, ELECTRA); otherwise the
    AOTInductor package when a fresh process loads and runs it at build time, else the exported program + Inductor
    cache. ``aoti-package``: fail the build instead of falling back; ``exported-program``: the compiled program
    (fastest per batch; Dynamo traces it again at load, 10–25 s). torch 2.11's AOTInductor loader segfaults on the
    H200 image for every CUDA package, so there ``auto`` never ends with a package."""
    gpu_kernels: Literal["tuned", "library"] = "tuned"
    """inductor on a GPU, fp16: ``tuned`` runs, for each shape the GPU's tuning file (:mod:`miaohui.models.tuning`,
    matched by GPU name, compute capability and the torch / Triton / cuBLASLt versions it was measured with) measured
    faster than the library, miaohui's kernels: skinny split-K GEMMs with the LayerNorms fused into their reduce, the
    encoder's attention kernel, cuBLASLt algorithms picked by timing, and Inductor's own kernels launched as
    programmatic dependents; the library kernels everywhere else. The artifact is then the exported program (the
    kernels are Python custom ops, which an AOTInductor package cannot hold), and the tuning file's digest is part of
    the build key. ``library``: cuBLAS and SDPA only (the reference, and the AOTInductor package). The default is
    ``tuned`` because each entry is there only where it measured faster; a GPU or library versions without a file
    build the same graph as ``library``, and on the CPU both do."""

    static_shapes: tuple[tuple[int, int], ...] = ()
    """inductor: (batch, sequence) buckets that get a program of their own, compiled for exactly that shape
    (static sizes in every kernel), next to the dynamic-shape program every other bucket runs. Each must be a
    bucket of the profile (batch a power of two or the profile's largest, sequence one of 8, 16, 32, 48, 64, 96,
    128, … or the longest). A static program's kernels need no size arithmetic (a few percent at small shapes); each
    costs a compile at build and a Dynamo trace at load. Given as ``"1x16,1x128"`` or pairs."""

    @field_validator("static_shapes", mode="before")
    @classmethod
    def _static_shapes(cls, v: object) -> object:
        if isinstance(v, str):
            v = [p for p in v.replace(" ", "").split(",") if p]
        if not isinstance(v, list | tuple):
            return v
        out = set()
        for item in v:
            if isinstance(item, str):
                parts = item.lower().split("x")
                if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
                    raise ConfigError(f"static shape {item!r} is not BATCHxSEQUENCE", "write it like 1x128")
                item = (int(parts[0]), int(parts[1]))
            out.add(tuple(item))
        return tuple(sorted(out))

    @field_validator("target")
    @classmethod
    def _target(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.lower().replace(".", "")
        if v.startswith("sm"):
            v = v[2:]
        if not v.isdigit() or len(v) not in (2, 3):
            raise ConfigError(f"unknown target {v!r}", "use a compute capability such as sm80, sm86, sm89 or sm120")
        return f"sm{v}"

    @model_validator(mode="after")
    def _cross(self) -> BuildConfig:
        if self.backend == "onnxruntime" and self.precision in ("fp16", "bf16"):
            raise ConfigError(
                f"precision {self.precision} with backend onnxruntime (CPU)",
                "ONNX Runtime's CPU kernels are fp32/int8; use --precision int8 or fp32, "
                "or a GPU backend (tensorrt, tensorrt-rtx, inductor) for fp16/bf16",
            )
        if self.backend != "inductor":
            for name, (flag, what) in _INDUCTOR_ONLY.items():
                value = getattr(self, name)
                if value != type(self).model_fields[name].default:
                    shown = f"{name} {value}" if isinstance(value, str) else name
                    raise ConfigError(
                        f"{shown} with backend {self.backend}", f"{what}: drop {flag} or use --backend inductor"
                    )
        if self.backend in ("tensorrt", "tensorrt-rtx") and self.precision == "bf16":
            # TensorRT supports bf16 from 9.0 on; kept explicit so the error is ours if the library refuses.
            pass
        if self.target is not None and self.backend not in ("tensorrt", "tensorrt-rtx"):
            raise ConfigError(
                f"--target {self.target} with backend {self.backend}",
                "a target is chosen only for TensorRT builds; other backends build for this machine",
            )
        if self.precision == "int8" and self.calibration.mode == "dynamic" and self.backend != "onnxruntime":
            raise ConfigError(
                f"--int8-mode dynamic with backend {self.backend}",
                "dynamic int8 is an ONNX Runtime CPU mode; TensorRT needs static QDQ (--int8-mode static)",
            )
        if self.backend == "inductor" and self.precision == "int8":
            raise ConfigError(
                "precision int8 with backend inductor",
                "use fp16 or bf16 on the GPU (int8 is the CPU / TensorRT path)",
            )
        return self

    def compute_hash(self) -> str:
        """Digest of exactly the fields that change the compiled graph."""
        fields = self.model_dump(mode="json")
        if self.precision != "int8":
            fields.pop("calibration")
        elif self.calibration.mode == "dynamic":  # no calibration happens: only what shapes the graph counts
            kept: tuple[str, ...] = ("mode", "per_channel", "keep_fp32", "fp32_fallback")
            if self.calibration.smooth:
                kept += ("smooth", "smooth_alpha")
            if self.calibration.fp32_fallback or self.calibration.smooth:  # ranked / scaled on calibration text
                kept += ("num_samples",)
            fields["calibration"] = {k: fields["calibration"][k] for k in kept}
        if not self.static_shapes:  # keeps the build keys of artifacts built before the option existed
            fields.pop("static_shapes")
        if self.backend != "inductor":
            fields.pop("autotune")
            fields.pop("inductor_format")
            fields.pop("gpu_kernels")
        return digest_json(fields)


def digest_json(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()
