"""The real models several test files share, built once and cached under var/test-cache, keyed by the code and data
that produce them: SmolLM2-135M built into a repository (fp32 ONNX), and the e5-small intent model trained with the
default recipe (a few CPU minutes).

``python -m tests.prebuild`` builds both in a process of its own: ``make test``'s pytest starts one at the
beginning of the run (:func:`start_background_builds`, from ``tests/conftest.py``), so the builds overlap the other
test files instead of a test worker waiting for them; the files that need them run after the others. The process
holds each artifact's file lock until that artifact is built, so a fixture that asks earlier waits for it (and builds
it itself if the process died)."""

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
LLM_LOCK_NAME = "llm-repo"
LLM_MODEL = "smollm2"
SMOLLM_CACHE = CACHE / "smollm2-135m"
"""The converted fp32 SmolLM2 (keyed inside by the GGUF's digest)."""


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
    # one thread: in the background of a test run the two test workers have the cores (the recipe is the default)
    train_intent(TrainConfig(threads=1), path, progress=False)


def ensure_intent_model() -> Path:
    """The cached model, trained here unless it is there (waiting for a process that trains it)."""
    path = intent_model_path()
    with cache_lock(LOCK_NAME):
        _train_unlocked(path)
    return path


def llm_repository_path() -> Path:
    h = hashlib.sha256()
    src = ROOT / "src" / "miaohui"
    for rel in ("generation/build/export.py", "generation/build/graph_cse.py", "generation/models/llama.py", "generation/models/dims.py", "generation/build/artifact.py", "zoo/smollm.py"):  # fmt: skip
        h.update((src / rel).read_bytes())
    return CACHE / f"llm-repo-{h.hexdigest()[:12]}"


def _build_llm_unlocked(repo: Path) -> Path:
    from miaohui.generation.build.artifact import build_causal_lm

    for old in CACHE.glob("llm-repo-*"):
        if old != repo:
            shutil.rmtree(old, ignore_errors=True)
    path = build_causal_lm(repo, LLM_MODEL, "fp32", source_cache=SMOLLM_CACHE)  # reused when the build key is equal
    for old in path.parent.iterdir():
        if old != path:  # an older version (the source model or a library changed)
            shutil.rmtree(old, ignore_errors=True)
    return repo


def ensure_llm_repository() -> Path:
    """A repository holding SmolLM2-135M-Instruct (``smollm2``, fp32 ONNX), built here unless it is there."""
    with cache_lock(LLM_LOCK_NAME):
        return _build_llm_unlocked(llm_repository_path())


def _llm_cached() -> bool:
    from miaohui.generation.build.artifact import latest_version

    model = llm_repository_path() / LLM_MODEL
    return model.is_dir() and latest_version(model) is not None


def is_cached() -> bool:
    from miaohui.models.checkpoint import META_NAME

    return (intent_model_path() / META_NAME).is_file() and _llm_cached()


def start_background_builds(log: Path) -> subprocess.Popen[bytes] | None:
    """Start ``python -m tests.prebuild`` unless both artifacts are cached; returns once the process holds their
    locks (so no test starts building first). None when nothing needs building or the process failed to start."""
    if is_cached():
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.prebuild"], cwd=ROOT, stdout=subprocess.PIPE, stderr=out)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"locked":  # it exited (or printed something else): the fixtures train
        proc.wait()
        return None
    return proc


def main() -> None:
    import torch

    torch.set_num_threads(1)  # beside the two test workers: one core's worth, not a third pool as wide as the machine
    intent_lock, llm_lock = cache_lock(LOCK_NAME), cache_lock(LLM_LOCK_NAME)
    with intent_lock:
        with llm_lock:
            print("locked", flush=True)
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed later goes to the log, not the pipe
            _build_llm_unlocked(llm_repository_path())
        _train_unlocked(intent_model_path())


if __name__ == "__main__":
    main()
