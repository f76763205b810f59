"""A new chat-model version swapped in under load, with the real server (``miaohui serve``) and the ``openai``
client, in one process and through ``--workers 2 --shared-engine``: a stream runs on version 1 (SmolLM2-135M, slow
enough to be running), version 2 (a tiny random decoder with SmolLM2's tokenizer) is added to the repository and
loaded over ``POST /v2/repository/models/<m>/load``; version 1's stream completes on version 1, the next request is
answered by version 2, and no request fails.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from tests.e2e.test_openai import llm_repository  # noqa: F401 (the fixture: SmolLM2 built once per cache key)
from tests.e2e.test_workers import Served, serve_workers
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.generation.build.artifact import build_causal_lm, latest_version
from miaohui.generation.engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow  # the server processes load SmolLM2

MODEL = "smollm2"
LONG = 160
"""Version 1's stream: long enough to be running while version 2 loads (a tiny decoder: about a second)."""


@pytest.fixture(scope="module")
def tiny_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 2, built once into a staging repository: a random 2-layer Qwen2 with SmolLM2's tokenizer."""
    staging = tmp_path_factory.mktemp("chat-v2")
    source = save_tiny_decoder("qwen2", staging / "hf", smollm_tokenizer())
    return build_causal_lm(staging / "repo", MODEL, "fp32", source=source, log=lambda m: None)


@pytest.fixture(scope="module", params=[(), ("--workers", "2", "--shared-engine")], ids=["one-process", "shared"])
def server(
    request: pytest.FixtureRequest,
    llm_repository: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("chat-versions")
    source = llm_repository / MODEL
    (root / MODEL).mkdir()
    (root / MODEL / "1").symlink_to(source / str(latest_version(source)))
    sched = SchedulerConfig(max_running_seqs=2, max_batched_tokens=512, max_model_len=512)
    (root / MODEL / "generation.yaml").write_text(yaml.safe_dump({"scheduler": sched.model_dump(mode="json")}))
    yield from serve_workers(root, *request.param, models=MODEL)


def _stream(client: openai.OpenAI, out: dict[str, Any], first: threading.Event) -> None:
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about savings accounts."}],  # type: ignore[arg-type]
        max_tokens=LONG, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text: list[str] = []
    for chunk in chunks:
        first.set()
        out.setdefault("fingerprint", chunk.system_fingerprint)
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            out["finish"] = chunk.choices[0].finish_reason or out.get("finish")
        if chunk.usage is not None:
            out["tokens"] = chunk.usage.completion_tokens
    out["text"] = "".join(text)


def test_a_new_version_swaps_in_without_dropping_a_stream(server: Served, tiny_version: Path) -> None:
    root = server.log.parent
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=900) as client:
        out: dict[str, Any] = {}
        first = threading.Event()
        streaming = threading.Thread(target=_stream, args=(client, out, first))
        streaming.start()
        first.wait()
        shutil.copytree(tiny_version, root / MODEL / ".2.tmp")
        (root / MODEL / ".2.tmp").rename(root / MODEL / "2")  # added whole, as build-llm adds a version
        r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/load", timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"name": MODEL, "versions": [2], "state": "READY"}
        running = streaming.is_alive()  # version 1 was still streaming when version 2 took over
        streaming.join()  # however slow the machine: the stream must end by itself, on version 1
        assert running
        assert out["fingerprint"].startswith(f"miaohui-{MODEL}-v1-")
        assert (out["finish"], out["tokens"]) == ("length", LONG)  # finished on version 1, nothing cut
        answers = [
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Hi {i}"}],
                max_tokens=4,
                temperature=0,  # type: ignore[arg-type]
            )
            for i in range(4)  # with two workers, whichever worker answers: the engine process serves version 2
        ]
    assert {a.system_fingerprint for a in answers} == {f"miaohui-{MODEL}-v2-fp32"}
    assert all(a.usage is not None and a.usage.completion_tokens <= 4 for a in answers)
    if "--shared-engine" not in server.proc.args:  # type: ignore[operator]  (the worker that loaded it knows)
        assert httpx.get(f"{server.url}/v2/models/{MODEL}/versions/2/ready").status_code == 200
        assert httpx.get(f"{server.url}/v2/models/{MODEL}/versions/1/ready").status_code == 404
    assert "retired" in server.log.read_text()
