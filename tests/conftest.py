"""Shared fixtures. Real models and engines are built once per test run (and cached between local runs under
var/test-cache, keyed by the code and data that produce them). ``make test`` runs the suite in two pytest-xdist
workers (``--dist loadfile``): what a session fixture builds for both is built by the first under a file lock and read
by the other (:func:`shared_dir`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from filelock import FileLock

from tests.prebuild import CACHE, ROOT, ensure_intent_model, start_background_builds

INTENT_FIXTURES = ("intent_model", "intent_engines")
PREBUILT_FIXTURES = (*INTENT_FIXTURES, "llm_repository")
_background: list[subprocess.Popen[bytes]] = []


def _wants_prebuilt(config: pytest.Config) -> bool:
    """Whether this run includes tests that need the prebuilt models (:mod:`tests.prebuild`): a path argument (none:
    all of tests/) that holds a test file using one, and slow tests not deselected."""
    if "not slow" in (config.option.markexpr or ""):
        return False
    users = [p for p in (ROOT / "tests").rglob("test_*.py") if any(f in p.read_text() for f in PREBUILT_FIXTURES)]
    args = [Path(a.split("::")[0]).resolve() for a in config.args] or [ROOT / "tests"]
    return any(u == a or a in u.parents for u in users for a in args)


def pytest_configure(config: pytest.Config) -> None:
    """In the process that runs the session (the xdist controller, or pytest alone): start building the shared models
    in the background when the run will need them and they are not cached (see :mod:`tests.prebuild`)."""
    if hasattr(config, "workerinput") or not _wants_prebuilt(config):
        return
    proc = start_background_builds(CACHE / "prebuild.log")
    if proc is not None:
        _background.append(proc)


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in _background:
        if proc.poll() is None:  # the run ended before it finished (-x, a deselection): no half model is kept
            proc.terminate()
            proc.wait(30)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files run in this order (xdist's ``loadfile`` hands them out in collection order): slow files first (the
    long jobs spread over the workers before the short ones fill the gaps), then the rest, then the files that need
    the SmolLM2 repository, then those that need the trained intent model (by then built in the background, in that
    order, see :func:`pytest_configure`)."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(group: list[pytest.Item]) -> int:
        if any(f in item.fixturenames for item in group for f in INTENT_FIXTURES):
            return 3
        if any("llm_repository" in item.fixturenames for item in group):
            return 2
        return 0 if any(item.get_closest_marker("slow") for item in group) else 1

    ordered = sorted(by_file.values(), key=rank)  # stable: the collection order within each group
    items[:] = [item for group in ordered for item in group]


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory of this test run that every xdist worker sees (the workers' temp roots share a parent); a
    worker-private one without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    return root / name


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never touch the user's var/: MIAOHUI_HOME points at a session temp dir."""
    os.environ["MIAOHUI_HOME"] = str(tmp_path_factory.mktemp("miaohui-home"))


@pytest.fixture(scope="session")
def intent_model() -> Path:
    """The real e5-small intent classifier, trained with the default recipe (:mod:`tests.prebuild`)."""
    return ensure_intent_model()


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


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """With ``MIAOHUI_TEST_RSS_LOG=FILE``: append each test's id, this worker's resident memory after it and its peak
    so far (MB), to find the tests that leave a worker large (CI machines have 24 GB for two workers and the servers
    they start). Under xdist the controller writes lines too (``main``); only the workers' lines measure tests."""
    path = os.environ.get("MIAOHUI_TEST_RSS_LOG")
    if path:
        import resource

        import psutil

        rss = psutil.Process().memory_info().rss >> 20
        # the worker's peak so far: where it jumps, that test made it
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {rss} {peak} {nodeid}\n")
