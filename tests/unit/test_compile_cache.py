"""The causal-LM compile cache's load path: a missing, corrupt or mismatched file is not used, says why, and never
fails the start (the round trip itself compiles, minutes on a CPU: lab/notes/2026-12-04-own-decoder-gpu.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

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
    assert got.endswith("; the engine compiles at load")


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
        f"not used: made under other versions (torch '0.0.1' at build, {here!r} here); compiling at load "
        "(rebuild on this machine)"
    )


def test_a_corrupt_file_with_a_matching_digest_falls_back(tmp_path: Path) -> None:
    (tmp_path / CACHE_FILE).write_bytes(b"not a torch cache")
    got = load_compile_cache(tmp_path, _info(b"not a torch cache"))
    assert got == (
        f"not used: torch could not read {tmp_path / CACHE_FILE} (its warning above says why); compiling at load"
    )
