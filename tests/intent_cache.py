"""The real e5-small intent model the slow tests share, trained once with the default recipe (a few CPU minutes) and
cached under var/test-cache, keyed by the code and data that produce it.

``python -m tests.intent_cache`` trains it in a process of its own: ``make test``'s pytest starts one at the
beginning of the run (:func:`start_background_training`, from ``tests/conftest.py``), so the training overlaps the
other test files instead of a test worker waiting for it; the files that need the model are run last. The process
holds the cache's file lock while it trains, so a fixture that asks earlier waits for it (and trains itself if the
process died)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "var" / "test-cache"
LOCK_NAME = "intent-e5"


def cache_lock(name: str) -> FileLock:
    """A lock on ``var/test-cache/<name>``: two test processes never build the same cached artifact at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    return FileLock(str(CACHE / f".{name}.lock"))


def digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.rglob("*.py") if p.is_dir() else [p]):
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def intent_model_path() -> Path:
    src = ROOT / "src" / "miaohui"
    key = digest(src / "models", src / "zoo", src / "nlp", src / "zoo" / "data" / "intents_train.jsonl")
    return CACHE / f"intent-e5-{key}"


def _train_unlocked(path: Path) -> None:
    from miaohui.models.checkpoint import META_NAME
    from miaohui.models.train import TrainConfig, train_intent

    if (path / META_NAME).is_file():
        return
    for old in CACHE.glob("intent-e5-*"):
        shutil.rmtree(old, ignore_errors=True)
    train_intent(TrainConfig(), path, progress=False)


def ensure_intent_model() -> Path:
    """The cached model, trained here unless it is there (waiting for a process that trains it)."""
    path = intent_model_path()
    with cache_lock(LOCK_NAME):
        _train_unlocked(path)
    return path


def is_cached() -> bool:
    from miaohui.models.checkpoint import META_NAME

    return (intent_model_path() / META_NAME).is_file()


def start_background_training(log: Path) -> subprocess.Popen[bytes] | None:
    """Start ``python -m tests.intent_cache`` unless the model is cached; returns once the process holds the lock
    (so no test can start training first). None when nothing needs training or the process failed to start."""
    if is_cached():
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.intent_cache"], cwd=ROOT, stdout=subprocess.PIPE, stderr=out
        )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"locked":  # it exited (or printed something else): the fixtures train
        proc.wait()
        return None
    return proc


def main() -> None:
    with cache_lock(LOCK_NAME):
        print("locked", flush=True)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed later goes to the log, not the pipe
        _train_unlocked(intent_model_path())


if __name__ == "__main__":
    main()
