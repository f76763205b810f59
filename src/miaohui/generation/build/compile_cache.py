"""The compile cache of an ``inductor`` causal-LM version: what Inductor compiled for every bucket at build, as torch's
portable cache artifacts (``torch.compiler.save_cache_artifacts``: Inductor's FX-graph entries with their Triton
kernels, AOTAutograd entries, autotuning results), loaded before the engine compiles at serve.

``compile-cache.bin`` sits in the version folder; :class:`CompileCacheInfo` (its sha256, size and the machine facts it
was made under) goes into ``static_decoder.json``. A file that is missing, corrupt or made under other GPU / library
versions is not used: the engine then compiles at load, and the log says why and how long that took. Loading never
fails the start.

Measured on a CPU (tiny random Qwen2 decoder, eager engine with ``compile=True``): the round trip gives an FX-graph
cache hit for each of the 7 compiled graphs (``lab/notes/2026-12-04-own-decoder-gpu.md``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from miaohui.engines.precompiled import INDEX_FILE, CompileFn, Precompiled, Recorder, read_index
from miaohui.models.tuning import digest as file_sha256

log = logging.getLogger(__name__)

CACHE_FILE = "compile-cache.bin"
TRITON_FILE = "triton-cache.tar"


class CompileCacheInfo(BaseModel):
    """What ``static_decoder.json`` records about ``compile-cache.bin``."""

    file: str | None = CACHE_FILE
    """``compile-cache.bin``; None where torch recorded no cache artifacts (a build whose graphs are all
    precompiled: ``standalone_compile`` records none) and only the Triton kernels below were saved."""
    sha256: str | None = None
    bytes: int = 0
    facts: dict[str, str]
    """:func:`machine_facts` at build: a load under other facts does not use the file."""
    compile_seconds: float
    """The build's warm-up that compiled every bucket."""
    triton_file: str | None = None
    """``triton-cache.tar``: every Triton kernel the build's warm-up compiled in this process — miaohui's own
    kernels (decode and prompt attention, the int8 one-row kernels), whose launch parameters differ per bucket, so
    each bucket compiles its own variants at its first call. Restored into the process's Triton cache before the
    warm-up; without it a fresh machine compiles them again while it captures the graphs."""
    triton_sha256: str | None = None
    triton_files: int = 0


def machine_facts() -> dict[str, str]:
    """The GPU and the library versions compiled code depends on (also part of the build key)."""
    import torch

    facts = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "device": "cpu"}
    try:
        from importlib.metadata import version

        facts["triton"] = version("triton")
    except Exception:  # a CPU torch without Triton
        facts["triton"] = "none"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        facts["device"] = f"{torch.cuda.get_device_name()} sm{major}{minor}"
    return facts


def _other_facts(built: dict[str, str]) -> str:
    """How this machine's :func:`machine_facts` differ from those a file was ``built`` under ("" when they do not)."""
    here = machine_facts()
    differ = {k: (v, here.get(k)) for k, v in built.items() if here.get(k) != v}
    return ", ".join(f"{k} {a!r} at build, {b!r} here" for k, (a, b) in sorted(differ.items()))


def save_compile_cache(folder: Path, compile_all: Callable[[], float]) -> CompileCacheInfo | None:
    """Run ``compile_all`` (an engine's warm-up over every bucket; returns seconds) and write what it compiled into
    ``folder / compile-cache.bin`` and the Triton kernels it compiled into ``triton-cache.tar``, each where there is
    something to write (a build whose graphs are precompiled records no Inductor cache, but its own kernels still
    compiled); None when neither was."""
    import torch
    from torch.compiler._cache import CacheArtifactManager

    from miaohui.engines.fast_graphs import pack, private_triton_cache

    torch.compiler.reset()
    CacheArtifactManager.clear()  # only this engine's artifacts are recorded from here (reset() keeps them)
    triton: dict[str, object] = {}
    with private_triton_cache() as private:
        seconds = compile_all()
        files = pack(private, folder / TRITON_FILE)
        if files:
            digest = file_sha256(folder / TRITON_FILE)
            triton = {"triton_file": TRITON_FILE, "triton_files": files, "triton_sha256": digest}
        else:
            (folder / TRITON_FILE).unlink(missing_ok=True)
    saved = torch.compiler.save_cache_artifacts()
    cache: dict[str, object] = {"file": None}
    if saved is not None:
        data = saved[0]
        (folder / CACHE_FILE).write_bytes(data)
        cache = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    else:
        (folder / CACHE_FILE).unlink(missing_ok=True)
        if not triton:
            return None
    return CompileCacheInfo.model_validate(
        {**cache, "facts": machine_facts(), "compile_seconds": round(seconds, 2), **triton}
    )


def restore_triton(folder: Path, info: CompileCacheInfo) -> str:
    """Unpack the build's Triton kernels (``triton-cache.tar``) into this process's Triton cache; what happened."""
    if not info.triton_file:
        return "no Triton kernels saved"
    path = folder / info.triton_file
    try:
        found = file_sha256(path)
    except OSError as exc:
        return f"Triton kernels not used: cannot read {path} ({exc})"
    if found != info.triton_sha256:
        wrote = str(info.triton_sha256)[:12]
        return f"Triton kernels not used: {path} has sha256 {found[:12]}…, the build wrote {wrote}…"
    from miaohui.engines.fast_graphs import restore_triton_cache

    done = restore_triton_cache(path)
    return f"{done['triton_files_added']} Triton files restored in {done['seconds']:.2f}s"


def _checked_bytes(folder: Path, info: CompileCacheInfo) -> bytes | str:
    """``compile-cache.bin``'s bytes, or why they are not usable here (unreadable, not the build's, other versions)."""
    assert info.file is not None  # the caller restores only the Triton kernels of a build without the file
    path = folder / info.file
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"cannot read {path} ({exc})"
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        return f"{path} has sha256 {digest[:12]}…, the build wrote {str(info.sha256)[:12]}…"
    other = _other_facts(info.facts)
    if other:
        return f"made under other versions ({other}; rebuild on this machine)"
    return data


def load_compile_cache(folder: Path, info: CompileCacheInfo | None) -> str:
    """Load the version's compile cache into this process's Inductor caches; returns what happened, for the log
    (``"loaded ..."`` or why not). Never raises: a bad file only means the engine compiles at load."""
    if info is None:
        return "none built (the engine compiles at load)"
    if info.file is None:
        return f"no Inductor cache saved (the engine compiles at load); {restore_triton(folder, info)}"
    path = folder / info.file
    started = time.perf_counter()
    data = _checked_bytes(folder, info)
    if isinstance(data, str):
        return f"not used: {data}; compiling at load"
    import torch

    try:
        loaded = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # torch raises its own errors for a malformed file
        return f"not used: torch could not read {path} ({type(exc).__name__}: {exc}); compiling at load"
    if loaded is None:  # torch logs its own warning for a malformed file and returns None
        return f"not used: torch could not read {path} (its warning above says why); compiling at load"
    entries = sum(len(v) for v in loaded.artifacts.values())
    restored = restore_triton(folder, info)
    return f"loaded {entries} entries from {info.file}, {restored}, in {time.perf_counter() - started:.2f}s"


PRECOMPILED_DIR = "precompiled"


class PrecompiledInfo(BaseModel):
    """What ``static_decoder.json`` records about ``precompiled/`` (:mod:`miaohui.engines.precompiled`): the graphs
    serve calls without Dynamo."""

    folder: str = PRECOMPILED_DIR
    index_sha256: str
    """sha256 of ``precompiled/index.json``, which holds each graph file's own sha256."""
    graphs: int
    bytes: int
    facts: dict[str, str]
    """:func:`machine_facts` at build: a load under other facts compiles with ``torch.compile`` instead."""
    skipped: dict[str, str] = {}
    """Pieces not saved (serve compiles them) and why."""


def save_precompiled(folder: Path, recorder: Recorder) -> PrecompiledInfo | None:
    """Write what ``recorder`` (the build engine's compile function) compiled into ``folder / precompiled``."""
    import shutil

    target = folder / PRECOMPILED_DIR
    shutil.rmtree(target, ignore_errors=True)  # a rebuild's graphs only
    index = recorder.save(target)
    if not index.pieces:
        return None
    files = [target / v.file for p in index.pieces for v in p.variants]
    return PrecompiledInfo(
        index_sha256=file_sha256(target / INDEX_FILE), graphs=len(files), bytes=sum(f.stat().st_size for f in files),
        facts=machine_facts(), skipped=index.skipped,
    )  # fmt: skip


def load_precompiled(folder: Path, info: PrecompiledInfo | None, fallback: CompileFn) -> tuple[Precompiled | None, str]:
    """The compile function that loads the build's graphs (None when not usable) and what happened, for the log."""
    if info is None:
        return None, "none built (the engine compiles with torch.compile)"
    other = _other_facts(info.facts)
    if other:
        return None, f"not used: made under other versions ({other}); compiling at load (rebuild on this machine)"
    target = folder / info.folder
    try:
        digest = file_sha256(target / INDEX_FILE)
    except OSError as exc:
        return None, f"not used: cannot read {target / INDEX_FILE} ({exc}); compiling at load"
    if digest != info.index_sha256:
        return None, f"not used: {target / INDEX_FILE} is not the build's (sha256 {digest[:12]}…); compiling at load"
    index, why = read_index(target)
    if index is None:
        return None, f"not used: {why}; compiling at load"
    skipped = f"; not saved by the build (torch.compile if called): {', '.join(index.skipped)}" if index.skipped else ""
    return Precompiled(target, index, fallback), f"{info.graphs} graphs{skipped}"
