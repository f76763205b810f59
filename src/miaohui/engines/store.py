"""Build engine artifacts into a versioned repository: build keys, caching, atomic writes.

    <repository>/<name>/config.yaml          serving config (:mod:`miaohui.serving.model_config`)
    <repository>/<name>/<version>/           one artifact: manifest.json, engine file, tokenizer, ...

Same build key (source digest, options digest, backend version, target) ⇒ the existing version is
reused. Otherwise a new version (highest + 1) is written to a temp dir and renamed into place, so a
failed build leaves nothing behind and the previous version keeps serving.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miaohui import __version__
from miaohui.config import BuildConfig, InputRange, digest_json
from miaohui.engines.base import MANIFEST_NAME, BuildInfo, FileInfo, Manifest, Target
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.target import cpu_target, cuda_target, target_key
from miaohui.errors import ArtifactError, ConfigError, ModelNotFoundError
from miaohui.models import tuning
from miaohui.models.checkpoint import LoadedModel
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.paths import home, write_text_atomic
from miaohui.sources.detect import Source, load_source, open_source

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Log = Callable[[str], None]


@dataclass
class BuildOutcome:
    path: Path
    manifest: Manifest
    reused: bool


def default_shapes(max_length: int) -> dict[str, InputRange]:
    """Profile used when ``--shapes`` is not given: batch 1..64, sequence 1..max_length."""
    rng = InputRange(min=(1, 1), opt=(8, min(32, max_length)), max=(64, max_length))
    return {"input_ids": rng, "attention_mask": rng}


def resolve_shapes(cfg: BuildConfig, max_length: int) -> dict[str, InputRange]:
    """Fill inputs that share axes with a given input; check the profile against the model."""
    shapes = dict(cfg.shapes) or default_shapes(max_length)
    if "input_ids" in shapes and "attention_mask" not in shapes:
        shapes["attention_mask"] = shapes["input_ids"]
    if "attention_mask" in shapes and "input_ids" not in shapes:
        shapes["input_ids"] = shapes["attention_mask"]
    unknown = sorted(set(shapes) - {"input_ids", "attention_mask"})
    if unknown:
        raise ConfigError(
            f"--shapes names unknown input(s) {unknown}",
            "this model's inputs are input_ids and attention_mask",
        )
    if shapes["input_ids"] != shapes["attention_mask"]:
        raise ConfigError(
            f"input_ids ({shapes['input_ids']}) and attention_mask ({shapes['attention_mask']}) have different "
            "profiles but share the batch and sequence axes",
            "give both the same min,opt,max",
        )
    rng = shapes["input_ids"]
    if len(rng.min) != 2:
        raise ConfigError(
            f"input_ids profile {rng} has {len(rng.min)} dimensions", "give BATCHxSEQ, e.g. 1x1,8x64,32x128"
        )
    if rng.max[1] > max_length:
        raise ConfigError(
            f"--shapes max sequence {rng.max[1]} exceeds the model's max_length {max_length}",
            f"use a max sequence of at most {max_length}",
        )
    return shapes


def backend_version(backend: str) -> str:
    if backend == "onnxruntime":
        from miaohui.engines import onnxruntime

        return onnxruntime.backend_version()
    if backend in ("tensorrt", "tensorrt-rtx"):
        from miaohui.engines import tensorrt

        return tensorrt.backend_version(backend)  # type: ignore[arg-type]
    if backend in ("torch", "inductor"):
        from miaohui.engines import torch as torch_backend

        return torch_backend.backend_version()
    raise ConfigError(f"unknown backend {backend!r}", "choose onnxruntime, tensorrt, tensorrt-rtx, inductor or torch")


def planned_target(cfg: BuildConfig) -> Target:
    """The hardware the artifact will be built for (part of the build key)."""
    if cfg.backend == "tensorrt-rtx" and cfg.target:
        return Target(device="cuda", compute_capability=cfg.target)
    if cfg.backend in ("tensorrt", "inductor"):
        gpu = cuda_target()
        if gpu is not None:
            return gpu
        if cfg.backend == "inductor":
            return cpu_target()
        return Target(device="cuda", compute_capability=cfg.target)
    if cfg.backend == "torch":
        return cuda_target() or cpu_target()
    return cpu_target()


def build_key(source_digest: str, cfg: BuildConfig, target: Target) -> str:
    fields: dict[str, object] = {
        "source": source_digest,
        "options": cfg.compute_hash(),
        "backend": cfg.backend,
        "backend_version": backend_version(cfg.backend),
        "target": target_key(target),
    }
    if cfg.backend == "inductor" and target.device == "cuda":  # compiled kernels are only valid for these
        fields["gpu_libraries"] = gpu_library_versions()
    tuning_digest = tuning_key(cfg, target)
    if tuning_digest is not None:  # a tuned GPU build is rebuilt when its GPU's tuning file changes
        fields["tuning"] = tuning_digest
    return digest_json(fields)


def gpu_library_versions() -> dict[str, str | None]:
    """The versions an ``inductor`` GPU artifact's compiled kernels depend on: torch (with its CUDA) and Triton."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import torch

    return {"torch": str(torch.__version__), "cuda": torch.version.cuda, "triton": of("triton")}


def tuning_key(cfg: BuildConfig, target: Target) -> str | None:
    """The sha256 of the tuning file an ``inductor`` build with ``gpu_kernels tuned`` reads on ``target``'s GPU
    (:mod:`miaohui.models.tuning`); None for other builds, or where the GPU has no file."""
    if cfg.backend != "inductor" or cfg.gpu_kernels != "tuned" or target.device != "cuda" or not target.gpu_name:
        return None
    digits = (target.compute_capability or "").removeprefix("sm")
    if not digits.isdigit() or len(digits) < 2:
        return None
    return tuning.digest_for(target.gpu_name, (int(digits[:-1]), int(digits[-1])))


def versions(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _check_same_task(model_dir: Path, src: Source, log: Log) -> None:
    """ConfigError where ``model_dir``'s latest version serves another task than ``src`` (an embedding model built
    as a new version of an intent classifier would take over ``/v1/intent``: the default ``--name`` is ``intent``);
    a log line where an intent classifier's labels change (a retrained model may add one, the pipelines route by
    them)."""
    available = versions(model_dir)
    if not available:
        return
    latest = model_dir / str(available[-1])
    if (latest / MANIFEST_NAME).is_file():
        try:
            old = read_manifest(latest)
        except ArtifactError:  # a broken version: the new one may be what replaces it
            return
        task, labels = old.task, old.labels
    elif (latest / "causal_lm.json").is_file():  # generation.build.artifact's MARKER_NAME (generation imports engines)
        task, labels = "causal-lm", []
    else:
        return
    name = model_dir.name
    if task != src.task:
        raise ConfigError(
            f"model {name!r} v{available[-1]} in {model_dir.parent} has task {task!r} and {src.path} has task "
            f"{src.task!r}: as a new version of {name!r} it would replace the one serving",
            "give it its own name: --name NAME (see `miaohui build --help`)",
        )
    new = src.meta.labels if src.meta is not None else []
    if task == "intent" and new and labels and new != labels:
        added, gone = sorted(set(new) - set(labels)), sorted(set(labels) - set(new))
        log(
            f"note: {name} v{available[-1] + 1} changes the labels of v{available[-1]} "
            f"(added: {', '.join(added) or 'none'}; removed: {', '.join(gone) or 'none'}; or their order)"
        )


def resolve_artifact(spec: str, repository: Path) -> Path:
    """An artifact named by ``spec``: a directory with a manifest, or ``name[:version]`` in ``repository``
    (the latest version by default)."""
    path = Path(spec)
    if (path / MANIFEST_NAME).is_file():
        return path
    name, _, version = spec.partition(":")
    model_dir = repository / name
    available = versions(model_dir)
    if not available:
        known = sorted(p.name for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []
        raise ModelNotFoundError(
            f"no artifact {spec!r}: not a directory with {MANIFEST_NAME}, and no model {name!r} in {repository}",
            f"build it with `miaohui build ... --name {name}`" + (f" (known: {', '.join(known)})" if known else ""),
        )
    if version:
        if not version.isdigit() or int(version) not in available:
            raise ModelNotFoundError(
                f"model {name!r} has no version {version!r}",
                f"available versions: {', '.join(map(str, available))}",
            )
        return model_dir / version
    return model_dir / str(available[-1])


def read_manifest(path: Path) -> Manifest:
    file = Path(path) / MANIFEST_NAME
    if not file.is_file():
        raise ArtifactError(
            f"{path} has no {MANIFEST_NAME}", "it is not an engine artifact; build one with `miaohui build`"
        )
    try:
        return Manifest.model_validate_json(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ArtifactError(f"{file} is damaged: {str(exc).splitlines()[0]}", "rebuild the artifact") from exc


def write_manifest(path: Path, manifest: Manifest) -> None:
    write_text_atomic(Path(path) / MANIFEST_NAME, manifest.model_dump_json(indent=2))


def find_cached(model_dir: Path, key: str) -> Path | None:
    for version in reversed(versions(model_dir)):
        try:
            if read_manifest(model_dir / str(version)).build_key == key:
                return model_dir / str(version)
        except ArtifactError:
            continue
    return None


def file_info(path: Path) -> FileInfo:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return FileInfo(size=path.stat().st_size, sha256=h.hexdigest())


def exported_onnx(model: LoadedModel, log: Log, real_texts: list[str]) -> Path:
    """The fp32 ONNX export of ``model``, cached under ``$MIAOHUI_HOME/onnx`` by source digest."""
    from miaohui.compile.export import export_onnx

    path = home() / "onnx" / f"{model.meta.kind}-{model.digest[:16]}.onnx"
    if path.is_file():
        log(f"reusing ONNX export {path}")
        return path
    log("exporting to ONNX and checking it against PyTorch")
    eager = load_source(model.path, attn_implementation="eager")
    report = export_onnx(eager, path, real_texts=real_texts[:32])
    log(
        f"exported {path.name} in {report.seconds:.1f}s: max abs error {report.max_abs:.2e}, "
        f"max rel error {report.max_rel:.2e} over {len(report.cases)} checks"
    )
    return path


def _run_backend(ctx: BuildContext) -> BuiltEngine:
    backend = ctx.cfg.backend
    if backend == "onnxruntime":
        from miaohui.engines import onnxruntime_builder

        return onnxruntime_builder.build(ctx)
    if backend in ("tensorrt", "tensorrt-rtx"):
        from miaohui.engines import tensorrt_builder

        return tensorrt_builder.build(ctx)
    if backend == "torch":
        from miaohui.engines import torch as torch_backend

        return torch_backend.build(ctx)
    if backend == "inductor":
        from miaohui.engines import inductor

        return inductor.build(ctx)
    raise ConfigError(f"unknown backend {backend!r}", "choose onnxruntime, tensorrt, tensorrt-rtx, inductor or torch")


def build_artifact(
    source: Path,
    name: str,
    cfg: BuildConfig,
    repository: Path,
    *,
    calib_texts: list[str] | None = None,
    force: bool = False,
    log: Log = print,
    tokenizer: Path | None = None,
    labels: list[str] | None = None,
) -> BuildOutcome:
    """Build (or reuse) an engine for ``source`` into ``repository/name``: a miaohui checkpoint, a Hugging Face
    directory, or an ONNX file (with ``tokenizer`` and ``labels``), see :mod:`miaohui.sources`."""
    src = open_source(source, tokenizer, labels)
    meta = src.meta
    shapes = _source_shapes(src, cfg)
    cfg = cfg.model_copy(update={"shapes": shapes})
    target = planned_target(cfg)
    key = build_key(src.digest, cfg, target)
    model_dir = Path(repository) / name
    cached = None if force else find_cached(model_dir, key)
    if cached is not None:
        log(
            f"build key {key[:12]} unchanged: reusing {cached} (same model, options, "
            f"{cfg.backend} {backend_version(cfg.backend)} and target)"
        )
        return BuildOutcome(path=cached, manifest=read_manifest(cached), reused=True)

    _check_same_task(model_dir, src, log)
    if src.format == "onnx" and cfg.backend not in ("onnxruntime", "tensorrt", "tensorrt-rtx"):
        raise ConfigError(
            f"--backend {cfg.backend} compiles a PyTorch model; {source} is an ONNX file",
            "build an ONNX file with --backend onnxruntime, tensorrt or tensorrt-rtx",
        )
    if meta is None and cfg.precision == "int8":
        raise ConfigError(
            f"int8 calibrates on text; {source} is built as raw tensors (no --tokenizer)",
            "build it fp32, or give --tokenizer and --labels to make it a text model",
        )
    model = src.load()
    texts = list(calib_texts or [])
    if cfg.precision == "int8" and cfg.calibration.mode == "static" and not texts:
        raise ConfigError("int8 needs calibration text", "pass --calib-data FILE (JSONL with a text field, or .txt)")
    texts = texts[: cfg.calibration.num_samples]
    source_facts = src.record()
    if model is None:
        from miaohui.sources.onnx_file import check_runs

        log(f"checking {src.path.name} on ONNX Runtime at the profile's min and max shapes")
        source_facts["output_shapes"] = check_runs(src.path, src.onnx, shapes)
    tok_text = model.tokenizer if model is not None else _file_tokenizer(src)
    model_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".build-{name}-", dir=model_dir) as tmp_root:
        out_dir = Path(tmp_root) / "artifact"
        work_dir = Path(tmp_root) / "work"
        out_dir.mkdir()
        work_dir.mkdir()
        if model is None:
            onnx_path: Path | None = src.path
        elif cfg.backend in ("onnxruntime", "tensorrt", "tensorrt-rtx"):
            onnx_path = exported_onnx(model, log, texts)
        else:
            onnx_path = None
        ctx = BuildContext(
            name=name,
            cfg=cfg,
            out_dir=out_dir,
            work_dir=work_dir,
            model=model,
            onnx_path=onnx_path,
            shapes=shapes,
            calib_texts=texts,
            tokenizer=TextTokenizer(tok_text, meta.max_length) if tok_text is not None and meta else None,
            log=log,
            meta=meta,
        )
        built = _run_backend(ctx)
        if src.format == "miaohui":
            shutil.copyfile(src.path / "tokenizer.json", out_dir / "tokenizer.json")
        elif tok_text is not None:
            (out_dir / "tokenizer.json").write_text(tok_text.to_str(), encoding="utf-8")
        version = (versions(model_dir) or [0])[-1] + 1
        manifest = Manifest(
            name=name,
            version=version,
            task=src.task,
            backend=cfg.backend,
            backend_version=built.backend_version,
            precision=cfg.precision,
            engine_file=built.engine_file,
            inputs=built.inputs,
            outputs=built.outputs,
            source_digest=src.digest,
            options_digest=cfg.compute_hash(),
            build_key=key,
            build_config=cfg,
            target=built.target,
            build=BuildInfo(
                created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                seconds=round(time.perf_counter() - started, 2),
                host=platform.node(),
                miaohui_version=__version__,
            ),
            files={p.name: file_info(p) for p in sorted(out_dir.iterdir()) if p.is_file()},
            labels=meta.labels if meta else [],
            tokenizer_file="tokenizer.json" if tok_text is not None else None,
            max_length=meta.max_length if meta else None,
            extra=built.extra
            | {"source_model": str(src.path), "source_base": meta.base if meta else "onnx", "source": source_facts}
            | ({"decision": meta.decision.model_dump()} if meta is not None and meta.decision is not None else {}),
        )
        write_manifest(out_dir, manifest)
        final = model_dir / str(version)
        os.replace(out_dir, final)
    log(f"built {name} version {version} ({cfg.backend}, {cfg.precision}) in {manifest.build.seconds:.1f}s → {final}")
    return BuildOutcome(path=final, manifest=manifest, reused=False)


def _source_shapes(src: Source, cfg: BuildConfig) -> dict[str, InputRange]:
    if src.format != "onnx" and src.meta is not None:
        return resolve_shapes(cfg, src.meta.max_length)
    from miaohui.sources.onnx_file import DEFAULT_MAX_LENGTH, graph_shapes

    return graph_shapes(src.path, src.onnx, dict(cfg.shapes), src.meta.max_length if src.meta else DEFAULT_MAX_LENGTH)


def _file_tokenizer(src: Source) -> Tokenizer | None:
    """An ONNX text model's ``--tokenizer``; None for raw tensors."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(src.tokenizer_file)) if src.tokenizer_file is not None else None
