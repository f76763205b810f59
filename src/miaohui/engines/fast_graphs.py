"""The ``fast-graphs`` artifact format of the ``inductor`` backend: miaohui's fast encoder
(:mod:`miaohui.models.fast_bert`, with the tuned Triton / cuBLASLt ops the GPU's tuning file picks) run as is and
captured as one CUDA graph per bucket: no Dynamo, no Inductor, nothing compiled at load.

What a fresh machine would otherwise compile at load is made at build: every bucket is run once with Triton's cache
pointed at an empty folder of its own, and the kernels it compiled (cubins, launchers) are packed into
``triton-cache.tar`` in the version directory (its sha256 in the manifest, with the Triton version). At load
:func:`restore_triton_cache` unpacks them into this process's Triton cache before the first call, so the first calls
load kernels instead of compiling them (BERT-base on the H200: 12.2 s of first calls with an empty cache, measured).

Against the exported program compiled by Inductor the eager model runs a few more small kernels per batch (the
embedding sum, the mask, the pooling and head unfused): 0.367 vs 0.351 ms at 1×128, 1.597 vs 1.563 ms at 32×128
(BERT-base fp16, tuned kernels, H200, ``lab/probe_own_encoder_gpu.py``), while a load skips Dynamo's trace (10–25 s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from miaohui.engines.context import BuildContext
from miaohui.engines.encoder_buckets import batch_buckets, seq_buckets
from miaohui.models.fast_bert import save_fast, use_direct_ops

log = logging.getLogger(__name__)

TRITON_FILE = "triton-cache.tar"
"""The Triton kernels the build compiled, as Triton's cache holds them (one folder per kernel hash)."""


def buckets(lo: tuple[int, ...], hi: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (batch, sequence) bucket of a profile: what the engine captures (``InductorEngine.all_buckets``)."""
    return [(b, s) for b in batch_buckets(hi[0]) for s in seq_buckets(hi[1]) if b >= lo[0] and s >= lo[1]]


def triton_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:  # no Triton: a CPU torch
        return None


def triton_cache_dir() -> Path:
    """The folder Triton caches compiled kernels in, as Triton reads it now (``TRITON_CACHE_DIR`` or its default)."""
    from triton import knobs

    return Path(knobs.cache.dir)


@contextlib.contextmanager
def private_triton_cache() -> Iterator[Path]:
    """Triton compiles into an empty folder of its own while inside (so it holds exactly what this build compiled),
    merged into the machine's cache afterwards (a load here finds the kernels either way)."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    shared = triton_cache_dir()
    with tempfile.TemporaryDirectory(prefix="miaohui-triton-cache-") as private:
        os.environ["TRITON_CACHE_DIR"] = private
        try:
            yield Path(private)
        finally:
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous
        merge(Path(private), shared)


def relocate_group(data: bytes, folder: Path) -> bytes:
    """A Triton cache group file (``__grp__*.json``) pointing at ``folder``: Triton writes its members' absolute
    paths and counts a group whose paths are gone as a miss, so a cache moved to another folder (or machine)
    compiles every kernel again unless its group files are rewritten."""
    group = json.loads(data)
    paths = group.get("child_paths")
    if isinstance(paths, dict):
        group["child_paths"] = {name: str(folder / Path(str(path)).name) for name, path in paths.items()}
    return json.dumps(group).encode()


def pack(folder: Path, out: Path) -> int:
    """``folder``'s files into the tar ``out`` (no lock or temporary files); returns how many."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "lock" and ".pid_" not in str(p)]
    with tarfile.open(out, "w") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(folder)))
    return len(files)


def merge(src: Path, dest: Path) -> None:
    """Copy Triton cache ``src`` into ``dest``, its group files pointing at their new place."""
    for p in src.rglob("*"):
        if p.is_file() and p.name != "lock" and ".pid_" not in str(p):
            target = dest / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = p.read_bytes()
            target.write_bytes(relocate_group(data, target.parent) if p.name.startswith("__grp__") else data)


def restore_triton_cache(tar_file: Path) -> dict[str, Any]:
    """Unpack the build's Triton kernels into this process's Triton cache (files already there are kept: the cache
    is content-addressed). Returns what it did, for the load's log."""
    started = time.perf_counter()
    target = triton_cache_dir()
    added = 0
    with tarfile.open(tar_file) as tar:
        for member in tar.getmembers():
            if not member.isfile() or member.name.startswith(("/", "..")) or "/../" in member.name:
                continue
            dest = target / member.name
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:
                continue
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            with src:
                data = src.read()
            tmp.write_bytes(relocate_group(data, dest.parent) if dest.name.startswith("__grp__") else data)
            os.replace(tmp, dest)  # a concurrent reader sees the whole file or none
            added += 1
    return {"triton_files_added": added, "seconds": round(time.perf_counter() - started, 3)}


def build(ctx: BuildContext, model: torch.nn.Module, lo: tuple[int, ...], hi: tuple[int, ...]) -> dict[str, Any]:
    """Save the fast model (``model`` is :class:`~miaohui.engines.inductor.FloatLogits` around it, on the GPU in the
    build's precision) and the Triton kernels every bucket runs; returns the manifest's ``extra`` facts."""
    use_direct_ops(model)  # as the engine runs it (the saved spec does not keep the flag)
    shapes = buckets(lo, hi)
    ctx.log(f"fast-graphs: running {len(shapes)} buckets to compile their Triton kernels into the artifact")
    started = time.perf_counter()
    with private_triton_cache() as folder, torch.no_grad():
        for b, s in shapes:
            ids = torch.randint(5, 1000, (b, s), device="cuda")
            model(ids, torch.ones_like(ids))
        torch.cuda.synchronize()
        files = pack(folder, ctx.out_dir / TRITON_FILE)
    compiled_s = time.perf_counter() - started
    save_fast(model.get_submodule("module"), ctx.out_dir)
    ctx.log(f"fast-graphs: {files} Triton files for {len(shapes)} buckets in {compiled_s:.1f}s")
    return {
        "compile_seconds": round(compiled_s, 2),
        "buckets": len(shapes),
        "triton": triton_version(),
        "triton_cache": {"file": TRITON_FILE, "files": files},
        "aoti": {"ok": False, "reason": "not tried (fast-graphs: nothing is compiled at load)"},
    }
