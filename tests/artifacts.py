"""Test helpers for built artifacts."""

from __future__ import annotations

import shutil
from pathlib import Path

from miaohui.engines.store import read_manifest, versions, write_manifest
from miaohui.serving.model_config import ensure_model_config


def install_version(version_dir: Path, repo: Path, name: str) -> Path:
    """Copy a built version into ``repo/name`` as its next version (the manifest's name and version follow)."""
    model_dir = repo / name
    version = (versions(model_dir) or [0])[-1] + 1
    dest = model_dir / str(version)
    shutil.copytree(version_dir, dest)
    manifest = read_manifest(dest)
    write_manifest(dest, manifest.model_copy(update={"name": name, "version": version}))
    ensure_model_config(model_dir, manifest.backend)
    return dest
