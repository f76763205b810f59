"""``miaohui prepare`` / ``make run``: make the default engines if they are missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.models.checkpoint import META_NAME
from miaohui.paths import models_dir
from miaohui.zoo.intents import load_split

DEFAULT_MODEL = "intent-e5-small"
# (repository name, backend, precision): the int8 engine serves as `intent`; fp32 is kept for comparison.
DEFAULT_ENGINES = (("intent", "onnxruntime", "int8"), ("intent-fp32", "onnxruntime", "fp32"))


def prepare_defaults(repository: Path, quick: bool = False, log: Callable[[str], None] = print) -> Path:
    """Train the intent model if there is none, then build (or reuse) the default engines."""
    model = models_dir() / DEFAULT_MODEL
    if not (model / META_NAME).is_file():
        from miaohui.models.train import TrainConfig, train_intent

        log(f"no intent model at {model}: training one (e5-small, a few CPU minutes)")
        _, report = train_intent(TrainConfig(epochs=2 if quick else 8), model)
        log(f"dev accuracy {report.accuracy:.2%}")
    texts = [x.text for x in load_split("train")]
    for name, backend, precision in DEFAULT_ENGINES:
        cfg = BuildConfig(backend=backend, precision=precision)  # type: ignore[arg-type]
        build_artifact(model, name, cfg, repository, calib_texts=texts, log=log)
    return model
