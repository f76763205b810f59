"""Structured output and log-probabilities on the ``llamacpp`` backend, for real: llama.cpp's own ``json_schema``
grammar behind miaohui's admission (the shipped SmolLM2 Q4_1 GGUF, llama.cpp's server in-process). 100 constrained
answers all parse and validate; a forced tool call through the ``openai`` client; ``logprobs`` are llama.cpp's
log-softmax of the raw logits (the greedy token is the most likely one).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import yaml
from tests.e2e.test_structured_output import ASKS, BOOKING, TOOLS, answer_keys
from tests.integration.conftest import SMOLLM_CACHE
from tests.servers import UvicornThread

from miaohui.generation.build.artifact import ChatTokenizer, build_causal_lm, read_info
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.openai_api import create_openai_app
from miaohui.serving.repository import ModelManager

pytestmark = pytest.mark.slow

pytest.importorskip("xllamacpp", reason="the llamacpp extra: pip install 'miaohui[llamacpp]'")

MODEL = "smol-q4"
SCHED = SchedulerConfig(max_running_seqs=8, max_waiting=128, max_batched_tokens=256, max_model_len=256)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("llamacpp-structured")
    build_causal_lm(repo, MODEL, "gguf", backend="llamacpp", source="smollm2", source_cache=SMOLLM_CACHE)
    config = {"scheduler": SCHED.model_dump(mode="json"), "threads": 2}
    (repo / MODEL / "generation.yaml").write_text(yaml.safe_dump(config))
    return repo


def test_a_hundred_constrained_answers_parse_and_validate(repository: Path) -> None:
    from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine

    version = repository / MODEL / "1"
    tok = ChatTokenizer.from_dir(version, read_info(version))
    prompts = [tok.encode_chat([{"role": "user", "content": f"{ask} Answer in JSON."}]) for ask in ASKS]
    params = SamplingParams(max_tokens=32, temperature=0.7, seed=7, json_schema=json.dumps(BOOKING), logprobs=1)

    async def run() -> list[tuple[str, str | None, list[float], list[float]]]:
        engine = LlamaCppLLMEngine(version, SCHED, threads=2)
        await engine.start(warmup=False)
        try:

            async def one(ids: list[int]) -> tuple[str, str | None, list[float], list[float]]:
                events = [e async for e in engine.generate(ids, params)]
                lps = [e.logprobs for e in events if e.logprobs is not None]
                return (
                    "".join(e.text for e in events),
                    events[-1].finish_reason,
                    [lp.logprob for lp in lps],
                    [lp.top[0][1] for lp in lps],
                )

            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await engine.stop()

    results = asyncio.run(run())
    assert len(results) == 100
    assert [reason for _, reason, _, _ in results] == ["stop"] * 100
    for text, _, values, best in results:
        jsonschema.validate(json.loads(text), BOOKING)
        assert values and all(v <= b + 1e-6 for v, b in zip(values, best, strict=True))  # never above the best


@pytest.fixture(scope="module")
def client(repository: Path) -> Iterator[openai.OpenAI]:
    metrics = Metrics()
    service = ModelManager(repository, chat_observer_factory=chat_observers(metrics))
    with (
        UvicornThread(create_openai_app(service, metrics)) as srv,
        openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=120) as c,
    ):
        yield c


def test_forced_tool_call_and_greedy_logprobs_through_the_openai_client(client: openai.OpenAI) -> None:
    msg = [{"role": "user", "content": "Book room 3 tomorrow at 9."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=msg,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "book_room"}},
    )
    call = (r.choices[0].message.tool_calls or [])[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "book_room"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), BOOKING)  # type: ignore[union-attr]
    r = client.chat.completions.create(
        model=MODEL,
        messages=msg,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content[0].top_logprobs) == 2
    assert [e.logprob for e in content] == [e.top_logprobs[0].logprob for e in content]  # greedy: the best token


def test_a_schema_that_lists_its_keys_gets_only_those_keys(client: openai.OpenAI) -> None:
    assert answer_keys(client, MODEL) == {"a"}
