"""Shared fixtures. Real models and engines are built once per test run (and cached between local runs under
var/test-cache, keyed by the code and data that produce them). ``make test`` runs the suite in two pytest-xdist
workers (``--dist loadfile``): what a session fixture builds for both is built by the first under a file lock and read
by the other (:func:`shared_dir`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "var" / "test-cache"


def cache_lock(name: str) -> FileLock:
    """A lock on ``var/test-cache/<name>``: two test workers never build the same cached artifact at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    return FileLock(str(CACHE / f".{name}.lock"))


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory of this test run that every xdist worker sees (the workers' temp roots share a parent); a
    worker-private one without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    return root / name


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.rglob("*.py") if p.is_dir() else [p]):
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never touch the user's var/: MIAOHUI_HOME points at a session temp dir."""
    os.environ["MIAOHUI_HOME"] = str(tmp_path_factory.mktemp("miaohui-home"))


@pytest.fixture(scope="session")
def intent_model() -> Path:
    """The real e5-small intent classifier, trained with the default recipe (a few CPU minutes)."""
    from miaohui.models.checkpoint import META_NAME
    from miaohui.models.train import TrainConfig, train_intent

    src = ROOT / "src" / "miaohui"
    key = _digest(src / "models", src / "zoo", src / "nlp", src / "zoo" / "data" / "intents_train.jsonl")
    path = CACHE / f"intent-e5-{key}"
    with cache_lock("intent-e5"):
        if not (path / META_NAME).is_file():
            for old in CACHE.glob("intent-e5-*"):
                shutil.rmtree(old, ignore_errors=True)
            train_intent(TrainConfig(), path, progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight BERT intent model with the real MiniLM tokenizer (fast serving tests)."""
    from miaohui.models.tiny import save_tiny_intent

    return save_tiny_intent(tmp_path_factory.mktemp("tiny") / "tiny-intent")


@pytest.fixture(scope="session")
def calib_texts() -> list[str]:
    from miaohui.zoo.intents import load_split

    return [x.text for x in load_split("train")]


@pytest.fixture(scope="session")
def intent_engines(
    intent_model: Path, calib_texts: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The intent model's fp32 and default int8 (ONNX Runtime) versions, built once per session into a private
    repository; modules take copies (:func:`tests.artifacts.install_version`), so what one module writes (validation stamps, configs)
    stays out of the others. Saves ~100 s of builds per CI run."""
    from miaohui.config import BuildConfig
    from miaohui.engines.store import build_artifact
    from miaohui.prepare import default_config

    repo = shared_dir(tmp_path_factory, "session-engines")
    done = repo / "built.json"
    repo.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(repo) + ".lock"):  # the first worker builds, the other reads
        if not done.is_file():
            repo.mkdir(exist_ok=True)
            quiet = {"log": lambda m: None}
            fp32 = build_artifact(intent_model, "fp32", BuildConfig(), repo, **quiet)  # type: ignore[arg-type]
            int8 = build_artifact(
                intent_model, "int8", default_config("onnxruntime", "int8"), repo, calib_texts=calib_texts, **quiet
            )  # type: ignore[arg-type]
            done.write_text(json.dumps({"fp32": str(fp32.path), "int8": str(int8.path)}))
    return {name: Path(p) for name, p in json.loads(done.read_text()).items()}
