"""API keys beyond the gate, on a real ``miaohui serve --api-keys`` with the key file written by the real
``miaohui keys add``, a tiny random BERT intent model and a tiny random chat model (2 layers × 64, SmolLM2's
tokenizer and chat template, fp32 ONNX), the real ``openai`` client and httpx:

* tokens per minute: a key with 20 tokens a minute gets its first chat answer, then 429 with ``Retry-After`` (the
  seconds until its bucket holds a token again) and OpenAI's error shape, on chat and completions, streamed or
  not, and on a dialogue pipeline that generates (``--dialogue-llm``); another tenant is unaffected; the refusals
  are counted as ``token_rate_limited`` by tenant;
* a refusal after the gate (a passed deadline, 504) is counted in ``miaohui_rejected_requests_total`` under the
  request's tenant;
* ``--workers 2 --shared-engine``: the key's priority class reaches the engine process. One chat slot
  (``max_running_seqs=1``); while a long request holds it, the engine process is paused (SIGSTOP), a bulk request
  and then an interactive one are sent through the same worker, and the engine process continues: the interactive
  one is answered first although it was sent last (without the class both would queue as interactive, first come
  first served, and the bulk request's 300 tokens would go first).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from tests.e2e.test_shared_engine import engine_pid
from tests.e2e.test_workers import Served, scrape, serve_workers
from tests.integration.test_auth import add_key
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.generation.build.artifact import build_causal_lm
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

pytestmark = pytest.mark.slow  # spawned servers; the shared-engine one is three interpreters

CHAT = "tinychat"
TPM = 20
"""The metered keys' tokens per minute: less than one chat request's prompt (the chat template's system prompt)."""
HELLO = [{"role": "user", "content": "What is a bank deposit?"}]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    file = tmp_path_factory.mktemp("access-keys") / "keys.yaml"
    made = {
        "metered": add_key(file, "metered", "--tokens-per-minute", str(TPM)),
        "streamer": add_key(file, "streamer", "--tokens-per-minute", str(TPM)),
        "voice": add_key(file, "voice"),
        "batch": add_key(file, "batch", "--priority", "bulk"),
    }
    return file, made


@pytest.fixture(scope="module")
def chat_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    staging = tmp_path_factory.mktemp("access-chat")
    source = save_tiny_decoder("qwen2", staging / "hf", smollm_tokenizer())
    return build_causal_lm(staging / "repo", CHAT, "fp32", source=source, log=lambda m: None)


def repository(root: Path, tiny_model: Path, chat_version: Path) -> Path:
    """``intent`` (tiny BERT) and ``tinychat`` with one chat slot, a waiting list of 4 and 1024 tokens of context."""
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    write_model_config(
        root / "intent" / "config.yaml", ModelConfig(threads=1, warmup=[WarmupShape(batch=1, sequence=8)])
    )
    (root / CHAT).mkdir()
    (root / CHAT / "1").symlink_to(chat_version)
    sched = SchedulerConfig(max_running_seqs=1, max_waiting=4, max_batched_tokens=1024, max_model_len=1024)
    (root / CHAT / "generation.yaml").write_text(yaml.safe_dump({"scheduler": sched.model_dump(mode="json")}))
    return root


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, chat_version: Path, keys: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    root = repository(tmp_path_factory.mktemp("access-one"), tiny_model, chat_version)
    options = ("--api-keys", str(keys[0]), "--dialogue-llm", CHAT)  # the pipelines generate with it
    yield from serve_workers(root, *options, models=f"intent,{CHAT}")


def client(server: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def rejected(server: Served) -> dict[tuple[str, str, str], float]:
    rows = scrape(server.url).select("miaohui_rejected_requests_total")
    return {(dict(k)["tenant"], dict(k)["code"], dict(k)["reason"]): v for k, v in rows.items()}


def test_tokens_per_minute(server: Served, keys: tuple[Path, dict[str, str]]) -> None:
    made = keys[1]
    metered = client(server, made["metered"])
    first = metered.chat.completions.create(model=CHAT, messages=HELLO, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert first.usage is not None
    used = first.usage.total_tokens
    assert used > TPM and first.usage.completion_tokens >= 1
    with pytest.raises(openai.RateLimitError) as refused:
        metered.chat.completions.create(model=CHAT, messages=HELLO, max_tokens=8)  # type: ignore[arg-type]
    after = int(refused.value.response.headers["retry-after"])
    # the bucket held TPM, the first request took `used`: one token back takes (used - TPM + 1) / (TPM / 60) s,
    # less what refilled since (a third of a token a second)
    expected = (used - TPM + 1) * 60 // TPM
    assert expected - 6 <= after <= expected, (after, expected)
    assert refused.value.body == {
        "message": f"tenant 'metered' spent its {TPM} tokens per minute. Fix: retry after {after} s, or ask the "
        "operator for a higher tokens_per_minute",
        "type": "rate_limit_error",
        "param": None,
        "code": "token_rate_limited",
    }
    with pytest.raises(openai.RateLimitError):
        metered.completions.create(model=CHAT, prompt="Hello", max_tokens=2)
    coach = f"{server.url}/v1/dialogue/negotiation_coach"  # a pipeline that generates: the same budget
    turn = {"text": "对方要求我们降价两成"}
    r = httpx.post(coach, json=turn, headers={"Authorization": f"Bearer {made['metered']}"}, timeout=120)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"].startswith(f"tenant 'metered' spent its {TPM} tokens per minute. Fix: retry after ")
    r = httpx.post(coach, json=turn, headers={"Authorization": f"Bearer {made['voice']}"}, timeout=120)
    assert r.status_code == 200, r.text

    streamer = client(server, made["streamer"])  # a streamed answer is charged when it ends
    chunks = streamer.chat.completions.create(  # type: ignore[call-overload]
        model=CHAT, messages=HELLO, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[0].total_tokens > TPM
    with pytest.raises(openai.RateLimitError):
        streamer.chat.completions.create(model=CHAT, messages=HELLO, max_tokens=8)  # type: ignore[arg-type]

    other = client(server, made["voice"])  # no token limit, and the others' buckets are theirs
    for _ in range(3):
        answer = other.chat.completions.create(model=CHAT, messages=HELLO, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert answer.usage is not None and answer.usage.total_tokens == used

    counted = rejected(server)
    assert counted[("metered", "429", "token_rate_limited")] == 3
    assert counted[("streamer", "429", "token_rate_limited")] == 1
    assert not any(tenant == "voice" for tenant, _, _ in counted)


def test_a_refusal_after_the_gate_is_counted_by_tenant(server: Served, keys: tuple[Path, dict[str, str]]) -> None:
    """The key is valid and under its limits; the request's deadline (1 µs) passes before its rows are queued: 504,
    counted under the key's tenant."""
    headers = {"Authorization": f"Bearer {keys[1]['batch']}", "X-Request-Timeout-Ms": "0.001"}
    r = httpx.post(f"{server.url}/v1/intent", json={"text": "查社保"}, headers=headers, timeout=30)
    assert r.status_code == 504, r.text
    assert rejected(server)[("batch", "504", "deadline")] == 1
    ok = httpx.post(
        f"{server.url}/v1/intent", json={"text": "查社保"}, headers=headers | {"X-Request-Timeout-Ms": "30000"}
    )
    assert ok.status_code == 200 and ("batch", "504", "deadline") in rejected(server)


# ---------------------------------------------------------------------------------- across the engine process


@pytest.fixture(scope="module")
def shared(
    tiny_model: Path, chat_version: Path, keys: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    root = repository(tmp_path_factory.mktemp("access-shared"), tiny_model, chat_version)
    options = ("--workers", "2", "--shared-engine", "--api-keys", str(keys[0]))
    yield from serve_workers(root, *options, models=f"intent,{CHAT}")


def on_worker(url: str, worker: int, key: str) -> httpx.Client:
    """A client whose kept-alive connection is served by ``worker`` (the kernel spreads new connections)."""
    for _ in range(100):
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)
        if c.get("/v2/health/ready").json()["worker"] == worker:
            return c
        c.close()
    raise AssertionError(f"no connection reached worker {worker}")


def wait_until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_priority_class_reaches_the_engine_process(shared: Served, keys: tuple[Path, dict[str, str]]) -> None:
    made = keys[1]
    finished: list[str] = []
    codes: dict[str, int] = {}
    running = threading.Event()

    def hold() -> None:  # A: 1000 tokens on the one slot
        body = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {made['voice']}"}
        with httpx.stream("POST", f"{shared.url}/v1/completions", json=body, headers=headers, timeout=300) as r:
            codes["A"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    running.set()
        finished.append("A")

    def send(name: str, c: httpx.Client, max_tokens: int) -> None:
        body = {"model": CHAT, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
        codes[name] = c.post("/v1/completions", json=body).status_code
        finished.append(name)

    def in_flight() -> float:
        return scrape(shared.url).total("miaohui_inflight_requests", model="openai")

    bulk, interactive = on_worker(shared.url, 1, made["batch"]), on_worker(shared.url, 1, made["voice"])
    threads = [threading.Thread(target=hold)]
    threads[0].start()
    assert running.wait(120), shared.log.read_text()[-3000:]
    engine = engine_pid(shared)
    os.kill(engine, signal.SIGSTOP)  # A holds the slot; what arrives now waits in the engine process's list
    try:
        threads.append(threading.Thread(target=send, args=("B", bulk, 300)))
        threads[-1].start()
        wait_until(lambda: in_flight() == 2, "the bulk request in the worker")
        time.sleep(0.3)  # its Generate frame is on the socket before the interactive one's
        threads.append(threading.Thread(target=send, args=("C", interactive, 4)))
        threads[-1].start()
        wait_until(lambda: in_flight() == 3, "the interactive request in the worker")
        time.sleep(0.3)
    finally:
        os.kill(engine, signal.SIGCONT)
    for t in threads:
        t.join(300)
    bulk.close()
    interactive.close()
    assert codes == {"A": 200, "B": 200, "C": 200}
    assert finished.index("C") < finished.index("B"), finished  # interactive first, though sent after the bulk one
