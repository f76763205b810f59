"""What machine is this? CPU ISA flags and CUDA GPU facts, for manifests and load-time checks."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from miaohui.engines.base import Target

# ISA extensions that change which kernels ONNX Runtime / oneDNN pick (and that an optimized graph may assume).
RELEVANT_CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "sve",
)


_core_share: int | None = None


def set_core_share(cores: int | None) -> None:
    """Cores this process should use (a worker of ``miaohui serve --workers N`` gets its share from its
    ``ServeSpec``); None: every core it may run on."""
    global _core_share
    if cores is not None and cores < 1:
        raise ValueError(f"a core share must be at least 1, got {cores}")
    _core_share = cores


def affinity_cores() -> int:
    """The cores this process may run on (``sched_getaffinity``: a container's or taskset's limit); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def usable_cores() -> int:
    """Cores this process should size its thread pools for: its share (:func:`set_core_share`) when set, else
    :func:`affinity_cores`."""
    return _core_share if _core_share is not None else affinity_cores()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, ...]:
    """The relevant ISA flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return tuple(f for f in RELEVANT_CPU_FLAGS if f in present)
    return ()


INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimd"})
"""ISA extensions whose int8 dot products accumulate u8 × s8 without overflow (VNNI, AMX, Arm's dot products)."""


def int8_reduce_range(flags: tuple[str, ...] | list[str] | None = None) -> bool:
    """Whether int8 weights should use 7 bits on this CPU (``reduce_range``): ONNX Runtime's U8S8 kernels on x86
    without VNNI multiply with ``vpmaddubsw``, whose int16 pair sums saturate when activations and weights are both
    large, ONNX Runtime's own guidance for such CPUs. On this project's AVX2-only machine the full-range int8 intent
    model fell 1.3 points below fp32 and failed the accuracy gate."""
    present = set(cpu_flags() if flags is None else flags)
    return bool(present) and not (present & INT8_DOT_FLAGS)


def cpu_target() -> Target:
    return Target(device="cpu", cpu_flags=list(cpu_flags()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_target() -> Target | None:
    """The current CUDA GPU, or None when torch sees none."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return Target(
        device="cuda",
        gpu_name=torch.cuda.get_device_name(),
        compute_capability=f"sm{major}{minor}",
        cuda_version=torch.version.cuda,
    )


def target_key(target: Target) -> str:
    """The part of a target that goes into the build key."""
    if target.device == "cpu":
        return "cpu:" + ",".join(sorted(target.cpu_flags))
    return f"cuda:{target.compute_capability}:{target.gpu_name}"


def check_target(built: Target, engine_desc: str, backend: str) -> None:
    """Refuse an artifact built for other hardware, telling the user to rebuild."""
    from miaohui.errors import ArtifactError

    if built.device == "cpu":
        missing = sorted(set(built.cpu_flags) - set(cpu_flags()))
        if missing:
            raise ArtifactError(
                f"{engine_desc} was built for a CPU with {', '.join(missing)}, which this CPU lacks",
                "rebuild it on this machine with `miaohui build`",
            )
        return
    here = cuda_target()
    if here is None:
        raise ArtifactError(
            f"{engine_desc} was built for {built.describe()} and this machine has no CUDA GPU",
            "run it on that GPU, or build a CPU engine with --backend onnxruntime",
        )
    if here.compute_capability != built.compute_capability:
        raise ArtifactError(
            f"{engine_desc} was built for {built.describe()}; this GPU is {here.describe()}",
            f"rebuild it here with `miaohui build ... --backend {backend}`",
        )
