"""Where miaohui keeps what it makes. Resolved when called, never at import time."""

from __future__ import annotations

import os
from pathlib import Path


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
