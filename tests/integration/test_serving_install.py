"""The serving install needs no training framework: ``miaohui serve`` on a repository of prebuilt ONNX Runtime and
llama.cpp artifacts never imports torch, transformers, onnx or matplotlib.

Every server process (the supervisor, two HTTP workers and the engine process of ``--workers 2 --shared-engine``)
starts with a ``sitecustomize`` that refuses those packages as if they were not installed and writes down every
attempt, so an import that some ``try``/``except`` would swallow still fails the test. The repository: a tiny
intent classifier (ONNX Runtime fp32), a tiny random Qwen2 decoder (ONNX Runtime) and SmolLM2's shipped Q4_1 GGUF
(llamacpp). Real clients: httpx and the ``openai`` client, streaming.

The image (``make image-test``) checks the same with the packages really absent; this test runs on every CI machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from tests.e2e.test_workers import Served, serve_workers
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config
from miaohui.zoo.smollm import smollm_gguf_path

pytestmark = pytest.mark.slow  # three builds and two servers: ~40 s on 2 cores

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ("torch", "transformers", "sentence_transformers", "onnx", "onnxscript", "matplotlib", "triton")
"""What a serving process must never import (``onnx`` the package; ``onnxruntime`` is the runtime and allowed)."""

SITECUSTOMIZE = '''
import os, sys
_BLOCK = {block!r}
_LOG = {log!r}


class _Absent:
    """Answers an import of a framework package as if it were not installed, and writes the attempt down."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in _BLOCK:
            with open(_LOG, "a") as out:
                out.write(f"{{os.getpid()}} {{name}}\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def _env(site: Path) -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", ""), str(ROOT / "src"), str(ROOT)])
    return env


@pytest.fixture(scope="module")
def framework_free(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A folder with the refusing ``sitecustomize.py`` and the file it logs attempts to."""
    site = tmp_path_factory.mktemp("site")
    log = site / "attempts.txt"
    log.write_text("")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(block=FRAMEWORK, log=str(log)))
    return site, log


@pytest.fixture(scope="module")
def repository(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three kinds of prebuilt artifact a CPU serving image holds (built here, with the full install)."""
    root = tmp_path_factory.mktemp("serving-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    write_model_config(
        root / "intent" / "config.yaml", ModelConfig(threads=1, warmup=[WarmupShape(batch=1, sequence=8)])
    )
    qwen = save_tiny_decoder("qwen2", tmp_path_factory.mktemp("src") / "tiny-qwen", smollm_tokenizer())
    cli = [sys.executable, "-m", "miaohui.cli", "build-llm"]
    for args in ([str(qwen), "--name", "qwen"], [str(smollm_gguf_path()), "--name", "smol", "--backend", "llamacpp"]):
        subprocess.run([*cli, *args, "-r", str(root)], check=True, capture_output=True, cwd=ROOT)
    return root


@pytest.fixture(scope="module", params=[(), ("--workers", "2", "--shared-engine")], ids=["one-process", "workers"])
def server(request: pytest.FixtureRequest, repository: Path, framework_free: tuple[Path, Path]) -> Iterator[Served]:
    site, log = framework_free
    log.write_text("")
    saved = os.environ.copy()
    os.environ.update(_env(site))
    try:
        yield from serve_workers(repository, *request.param, models="intent,qwen,smol")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_serving_never_imports_the_framework(server: Served, framework_free: tuple[Path, Path]) -> None:
    r = httpx.post(server.url + "/v1/intent", json={"text": "你好"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "intent"
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for model in ("qwen", "smol"):
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop"), model
        assert {c.model for c in chunks} == {model}
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'miaohui_requests_total{code="200",model="intent"' in metrics
    _, log = framework_free
    assert log.read_text() == "", f"a serving process tried to import the framework:\n{log.read_text()}"


def test_a_build_command_without_the_build_extra_says_what_to_install(
    tiny_model: Path, framework_free: tuple[Path, Path], tmp_path: Path
) -> None:
    site, _ = framework_free
    result = subprocess.run(
        [sys.executable, "-m", "miaohui.cli", "build", str(tiny_model), "-r", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(site) | {"COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "which the serving install leaves out" in result.stderr
    assert "pip install 'miaohui[build]'" in result.stderr
