"""Test helpers for built artifacts."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from miaohui.engines.store import read_manifest, versions, write_manifest
from miaohui.serving.model_config import ensure_model_config


@contextmanager
def scratch_dir(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A module fixture's folder, removed when the module is done: a run builds several GB of engines, and a CI
    machine's disk may hold only part of them at once."""
    path = factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def link_tree(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` as hard links: a repository of several hundred MB costs no disk per test. Only for
    trees the test reads; a test that corrupts a file needs a real copy (a write would reach the shared file)."""
    shutil.copytree(src, dst, copy_function=_link_or_copy)
    return dst


def install_version(version_dir: Path, repo: Path, name: str) -> Path:
    """Copy a built version into ``repo/name`` as its next version (the manifest's name and version follow)."""
    model_dir = repo / name
    version = (versions(model_dir) or [0])[-1] + 1
    dest = model_dir / str(version)
    link_tree(version_dir, dest)  # the manifest below is replaced (write then rename), never written in place
    manifest = read_manifest(dest)
    write_manifest(dest, manifest.model_copy(update={"name": name, "version": version}))
    ensure_model_config(model_dir, manifest.backend)
    return dest
