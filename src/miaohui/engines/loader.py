"""Open an artifact: check manifest, files and machine, then hand it to its backend. Never a crash:
a mismatch or damage is an :class:`ArtifactError` that says to rebuild."""

from __future__ import annotations

import functools
from pathlib import Path

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.store import backend_version, file_info, read_manifest
from miaohui.engines.target import check_target
from miaohui.errors import ArtifactError, BackendUnavailableError


def _same_release(built: str, here: str, backend: str) -> bool:
    """TensorRT plans need the exact version; others the same major.minor."""
    if backend in ("tensorrt", "tensorrt-rtx"):
        return built == here
    return built.split(".")[:2] == here.split(".")[:2]


def check_files(
    path: Path, manifest: Manifest, verify_checksums: bool = True, deferred: frozenset[str] = frozenset()
) -> None:
    """Every file of the manifest is there with its size and (``verify_checksums``) its sha256; the files in
    ``deferred`` get their size checked only — their owner calls :func:`check_checksum` before it reads them."""
    for name, info in manifest.files.items():
        file = path / name
        if not file.is_file():
            raise ArtifactError(f"{file} is missing", f"rebuild {manifest.name} with `miaohui build`")
        size = file.stat().st_size
        if size != info.size:
            raise ArtifactError(
                f"{file} is {size} bytes, the manifest says {info.size} (truncated or replaced)",
                f"rebuild {manifest.name} with `miaohui build`",
            )
        if verify_checksums and name not in deferred:
            check_checksum(path, manifest, name)


def check_checksum(path: Path, manifest: Manifest, name: str) -> None:
    if file_info(path / name).sha256 != manifest.files[name].sha256:
        raise ArtifactError(
            f"{path / name} does not match its sha256 in the manifest (corrupt)",
            f"rebuild {manifest.name} with `miaohui build`",
        )


def check_machine(manifest: Manifest) -> None:
    try:
        here = backend_version(manifest.backend)
    except (ImportError, BackendUnavailableError) as exc:
        raise ArtifactError(
            f"{manifest.name} v{manifest.version} needs backend {manifest.backend}, which is not available here: {exc}",
            "install it, or rebuild the model for --backend onnxruntime",
        ) from exc
    if not _same_release(manifest.backend_version, here, manifest.backend):
        raise ArtifactError(
            f"{manifest.name} v{manifest.version} was built with {manifest.backend} {manifest.backend_version}; "
            f"this machine has {here}",
            f"rebuild it here with `miaohui build ... --backend {manifest.backend}`",
        )
    check_target(manifest.target, f"{manifest.name} v{manifest.version} ({manifest.backend})", manifest.backend)


def _has_fast(path: Path) -> bool:
    from miaohui.models.fast_bert import has_fast  # torch: only inductor artifacts need it

    return has_fast(path)


def load_engine(
    path: Path,
    threads: int | None = None,
    verify_checksums: bool = True,
    spin_wait: bool = True,
    graph_copies: bool = True,
    fast_start: bool = False,
) -> Engine:
    """Load the artifact at ``path`` (a version directory). ``spin_wait``: ONNX Runtime threads busy-wait
    between runs (lowest latency on an otherwise idle machine; the server turns it off). ``graph_copies``: CUDA-graph
    engines capture a batch's copies in the graph (``ModelConfig.graph_copies``); ``fast_start``: an
    inductor exported program answers eagerly until its compiled graphs are in (``ModelConfig.fast_start``)."""
    path = Path(path)
    manifest = read_manifest(path)
    # fast_start reads the program only in its background upgrade: its sha256 is checked there, not on the way to
    # the first answer (~0.1 s per 130 MB hashed on this CPU: the e5 fp32 program)
    late = (
        manifest.backend == "inductor" and fast_start and _has_fast(path) and manifest.engine_file in manifest.files
        and manifest.extra.get("format") != "fast-graphs"  # its engine file is the fast model: read at once
    )  # fmt: skip
    deferred = frozenset({manifest.engine_file}) if late and verify_checksums else frozenset()
    check_files(path, manifest, verify_checksums, deferred)
    check_machine(manifest)
    backend = manifest.backend
    if backend == "onnxruntime":
        from miaohui.engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(manifest, path, threads=threads, spin_wait=spin_wait)
    if backend == "torch":
        from miaohui.engines.torch import TorchEngine

        return TorchEngine(manifest, path, threads=threads)
    if backend in ("tensorrt", "tensorrt-rtx"):
        from miaohui.engines.tensorrt_runtime import TensorRTEngine

        return TensorRTEngine(manifest, path)
    if backend == "inductor":
        from miaohui.engines.inductor_engine import InductorEngine

        program_check = functools.partial(check_checksum, path, manifest, manifest.engine_file) if deferred else None
        return InductorEngine(
            manifest, path, graph_copies=graph_copies, fast_start=fast_start, program_check=program_check
        )
    raise ArtifactError(f"{path} has unknown backend {backend!r}", "rebuild it with a current miaohui")
