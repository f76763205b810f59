"""The causal-LM compile cache's load path: a missing, corrupt or mismatched file is not used, says why, and never
fails the start (the round trip itself compiles, minutes on a CPU: lab/notes/2026-12-04-own-decoder-gpu.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from miaohui.generation.build.compile_cache import CACHE_FILE, CompileCacheInfo, load_compile_cache, machine_facts


def _info(data: bytes, **facts: str) -> CompileCacheInfo:
    return CompileCacheInfo(
        sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), facts=machine_facts() | facts, compile_seconds=1.0
    )


def test_no_cache_built() -> None:
    assert load_compile_cache(Path("."), None) == "none built (the engine compiles at load)"


def test_missing_file(tmp_path: Path) -> None:
    got = load_compile_cache(tmp_path, _info(b"x"))
    assert got.startswith(f"not used: cannot read {tmp_path / CACHE_FILE}")
    assert got.endswith("; compiling at load")


def test_a_changed_file_fails_its_digest(tmp_path: Path) -> None:
    info = _info(b"what the build wrote")
    (tmp_path / CACHE_FILE).write_bytes(b"something else")
    got = load_compile_cache(tmp_path, info)
    assert got == (
        f"not used: {tmp_path / CACHE_FILE} has sha256 {hashlib.sha256(b'something else').hexdigest()[:12]}…, "
        f"the build wrote {info.sha256[:12]}…; compiling at load"
    )


def test_another_machine_or_library_is_not_used(tmp_path: Path) -> None:
    (tmp_path / CACHE_FILE).write_bytes(b"data")
    got = load_compile_cache(tmp_path, _info(b"data", torch="0.0.1"))
    here = machine_facts()["torch"]
    assert got == (
        f"not used: made under other versions (torch '0.0.1' at build, {here!r} here; rebuild on this machine); "
        "compiling at load"
    )


def test_a_corrupt_file_with_a_matching_digest_falls_back(tmp_path: Path) -> None:
    (tmp_path / CACHE_FILE).write_bytes(b"not a torch cache")
    got = load_compile_cache(tmp_path, _info(b"not a torch cache"))
    assert got == (
        f"not used: torch could not read {tmp_path / CACHE_FILE} (its warning above says why); compiling at load"
    )


def test_the_builds_triton_kernels_are_restored_with_their_groups_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``triton-cache.tar`` (what the build's warm-up compiled) goes into this process's Triton cache, its group
    files pointing at the new place; a tar whose digest is not the build's is not used."""
    import json

    from miaohui.engines.fast_graphs import pack
    from miaohui.generation.build.compile_cache import TRITON_FILE, restore_triton

    built = tmp_path / "built" / "abc"
    built.mkdir(parents=True)
    (built / "kernel.cubin").write_bytes(b"\x7fELF")
    (built / "__grp__kernel.json").write_text(
        json.dumps({"child_paths": {"kernel.cubin": str(built / "kernel.cubin")}})
    )
    version = tmp_path / "version"
    version.mkdir()
    assert pack(tmp_path / "built", version / TRITON_FILE) == 2
    digest = hashlib.sha256((version / TRITON_FILE).read_bytes()).hexdigest()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    info = _info(b"x").model_copy(update={"triton_file": TRITON_FILE, "triton_sha256": digest, "triton_files": 2})
    assert restore_triton(version, info).startswith("2 Triton files restored in ")
    group = json.loads((tmp_path / "fresh" / "abc" / "__grp__kernel.json").read_text())
    assert group["child_paths"]["kernel.cubin"] == str(tmp_path / "fresh" / "abc" / "kernel.cubin")
    wrong = info.model_copy(update={"triton_sha256": "0" * 64})
    assert restore_triton(version, wrong).startswith("Triton kernels not used: ")
    assert restore_triton(version, _info(b"x")) == "no Triton kernels saved"


def test_a_build_with_no_inductor_cache_still_keeps_its_triton_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build whose graphs are all precompiled records no Inductor cache artifacts (``standalone_compile`` writes
    none), but miaohui's own kernels still compiled during its warm-up: they are saved and restored at load. The
    warm-up here writes a kernel file into the build's Triton cache as Triton would (no Triton on a CPU)."""
    import os

    from miaohui.generation.build.compile_cache import TRITON_FILE, save_compile_cache

    def warmup() -> float:
        kernel = Path(os.environ["TRITON_CACHE_DIR"]) / "abc" / "decode.cubin"
        kernel.parent.mkdir(parents=True)
        kernel.write_bytes(b"\x7fELF")
        return 1.5

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "machine"))
    version = tmp_path / "version"
    version.mkdir()
    (version / CACHE_FILE).write_bytes(b"an earlier build's")
    info = save_compile_cache(version, warmup)
    assert info is not None and info.file is None and info.triton_files == 1
    assert not (version / CACHE_FILE).exists()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    got = load_compile_cache(version, info)
    assert got.startswith("no Inductor cache saved (the engine compiles at load); 1 Triton files restored in ")
    assert (tmp_path / "fresh" / "abc" / "decode.cubin").read_bytes() == b"\x7fELF"
    assert save_compile_cache(version, lambda: 0.0) is None and not (version / TRITON_FILE).exists()
