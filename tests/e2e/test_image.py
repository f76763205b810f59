"""The CPU serving image, built and run for real (``make image-test``): podman builds the project's Dockerfile from a
locally made Debian base and a wheelhouse (scripts/image/build.sh), with a small repository of prebuilt engines (a
tiny intent classifier on ONNX Runtime, SmolLM2's shipped Q4_1 GGUF on llama.cpp). The container runs read-only as
the image's non-root user; checked with real clients: ready, ``/v1/intent``, ``/v1/chat/completions`` streamed by
the ``openai`` client, ``/metrics``, a ``build`` command that names the missing build extra, and SIGTERM during a
stream: the stream finishes and the server exits 0.

``IMAGE=name`` tests an image you built instead (``make image`` → ``miaohui:0.1.0-cpu``). Skipped only where podman
cannot be installed. Image size and time to ready go to ``var/image/image-test.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config
from miaohui.zoo.smollm import smollm_gguf_path

pytestmark = pytest.mark.slow  # the image build: ~2–4 min on 2 cores (the base image and pip's cache are reused)

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "scripts" / "image" / "containers.conf"
TEST_TAG = "miaohui:test-cpu"


def _podman() -> str:
    if shutil.which("podman") is None:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "image" / "install_podman.sh")], capture_output=True)
        if done.returncode != 0 or shutil.which("podman") is None:
            pytest.skip(f"podman is not installed and could not be: {done.stderr.decode()[-300:]}")
    return "podman"


def _env() -> dict[str, str]:
    return os.environ | {"CONTAINERS_CONF": str(CONF)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def image(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    engine = _podman()
    given = os.environ.get("IMAGE")
    if given:
        yield given
        return
    repo = tmp_path_factory.mktemp("image-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), repo, log=lambda m: None)
    write_model_config(
        repo / "intent" / "config.yaml", ModelConfig(threads=1, warmup=[WarmupShape(batch=1, sequence=8)])
    )
    cmd = [sys.executable, "-m", "miaohui.cli", "build-llm", str(smollm_gguf_path()), "--name", "smol"]
    subprocess.run([*cmd, "--backend", "llamacpp", "-r", str(repo)], check=True, capture_output=True, cwd=ROOT)
    env = _env() | {"TAG": TEST_TAG, "REPOSITORY": str(repo), "VENV": str(Path(sys.executable).parent.parent)}
    built = subprocess.run(
        ["bash", "scripts/image/build.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    print(built.stdout.splitlines()[-1])
    yield TEST_TAG
    subprocess.run([engine, "rmi", "-f", TEST_TAG], env=_env(), capture_output=True)
    # the build's stage images are left untagged; without this every run keeps ~1 GB more
    subprocess.run([engine, "image", "prune", "-f"], env=_env(), capture_output=True)


class Container:
    def __init__(self, image: str) -> None:
        self.name = f"miaohui-test-{os.getpid()}"
        self.port, self.grpc_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        subprocess.run(["podman", "rm", "-f", self.name], env=_env(), capture_output=True)
        args = ["--repository", "/opt/miaohui/repository", "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--grpc-port", str(self.grpc_port)]
        self.started = time.monotonic()
        # read-only root, the image's non-root user, writable scratch only where the deployment mounts emptyDirs
        run = ["podman", "run", "-d", "--name", self.name, "--read-only", "--network", "host"]
        run += ["--tmpfs", "/var/miaohui:rw,mode=1777", "--tmpfs", "/tmp:rw,mode=1777"]
        subprocess.run([*run, image, "serve", *args], env=_env(), check=True, capture_output=True)

    def logs(self) -> str:
        return subprocess.run(["podman", "logs", self.name], env=_env(), capture_output=True, text=True).stderr

    def wait_ready(self, timeout_s: float = 180) -> float:
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            state = subprocess.run(
                ["podman", "inspect", "-f", "{{.State.Running}}", self.name], env=_env(), capture_output=True, text=True
            )
            if state.stdout.strip() == "false":
                pytest.fail(f"the container exited:\n{self.logs()}")
            time.sleep(0.2)
        pytest.fail(f"not ready after {timeout_s} s:\n{self.logs()}")

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "-f", self.name], env=_env(), capture_output=True)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[tuple[Container, float]]:
    box = Container(image)
    try:
        ready_s = box.wait_ready()
        yield box, ready_s
    finally:
        box.remove()


def test_the_image_serves_intent_chat_and_metrics(container: tuple[Container, float], image: str) -> None:
    box, ready_s = container
    user = subprocess.run(["podman", "exec", box.name, "id", "-u"], env=_env(), capture_output=True, text=True)
    assert user.stdout.strip() == "10001"
    touch = subprocess.run(["podman", "exec", box.name, "touch", "/opt/x"], env=_env(), capture_output=True, text=True)
    assert "Read-only file system" in touch.stderr
    r = httpx.post(box.url + "/v1/intent", json={"text": "你好"}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "intent", r.text
    client = OpenAI(base_url=box.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    metrics = httpx.get(box.url + "/metrics", timeout=10).text
    assert 'miaohui_requests_total{code="200",model="intent"' in metrics
    size = subprocess.run(
        ["podman", "image", "inspect", image, "--format", "{{.Size}}"], env=_env(), capture_output=True, text=True
    )
    record = {"image": image, "size_bytes": int(size.stdout.strip()), "ready_s": round(ready_s, 2)}
    out = ROOT / "var" / "image" / "image-test.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))


def test_a_build_command_in_the_image_names_the_missing_extra(image: str, container: tuple[Container, float]) -> None:
    done = subprocess.run(
        ["podman", "run", "--rm", "--read-only", image, "build", "/opt/miaohui/repository/intent/1"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "which the serving install leaves out" in done.stderr
    assert "pip install 'miaohui[build]'" in done.stderr


def test_sigterm_lets_a_running_stream_finish_then_exits_0(container: tuple[Container, float]) -> None:
    box, _ = container
    client = OpenAI(base_url=box.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=48, stream=True
    )
    first = next(iter(stream))  # the stream is running
    stopper = threading.Timer(0.05, subprocess.run, args=(["podman", "kill", "--signal", "TERM", box.name],))
    stopper.kwargs = {"env": _env(), "capture_output": True}
    stopper.start()
    rest = list(stream)
    stopper.join()
    assert first.choices[0].delta is not None
    assert rest[-1].choices[0].finish_reason in ("length", "stop")
    code = subprocess.run(["podman", "wait", box.name], env=_env(), capture_output=True, text=True, timeout=60)
    assert code.stdout.strip() == "0", box.logs()
