"""Where miaohui keeps what it makes. Resolved when called, never at import time."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from miaohui.errors import InputError

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def home() -> Path:
    """Root of miaohui's working data: ``$MIAOHUI_HOME`` or ``./var``."""
    return Path(os.environ.get("MIAOHUI_HOME", "var")).resolve()


def models_dir() -> Path:
    """Trained PyTorch checkpoints (the sources engines are built from)."""
    return home() / "models"


def engines_dir() -> Path:
    """Engine artifacts: ``engines/<name>/<build-key>/``."""
    return home() / "engines"


def repository_dir() -> Path:
    """The serving model repository (``<model>/config.yaml`` + ``<model>/<version>/``)."""
    return home() / "repository"


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Write a directory atomically: yield a temp sibling; on success it replaces ``out_dir``, on failure it
    is removed — readers never see a half-written directory."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (a temp sibling, then a rename): a reader sees the old file or the new one, and
    a file hard-linked elsewhere (a repository copied with links) is replaced here, never rewritten for both."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def is_model_name(name: str) -> bool:
    """A plain folder name: letters, digits, ``_ . -``, starting with a letter or digit, no ``..``."""
    return bool(_MODEL_NAME.fullmatch(name)) and ".." not in name


def check_model_name(name: str) -> str:
    if not is_model_name(name):
        raise InputError(f"model name {name!r} is not a plain name", "use the model's folder name in the repository")
    return name
