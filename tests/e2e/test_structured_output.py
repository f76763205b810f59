"""Structured output, tool calls and log-probabilities on the real SmolLM2-135M-Instruct (fp32 ONNX decoder, the
CPU default path): 100 constrained answers that all parse and validate against their schema, ``json_object``
answers counted honestly (``stop`` ones parse, ``length`` ones are reported as cut), tools through the real
``openai`` client against a real server (``required``, a named function, ``auto``, ``none``; plain and streamed),
and log-probabilities equal to transformers' log-softmax on the fp32 source model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tests.prebuild import SMOLLM_CACHE, ensure_llm_repository
from tests.servers import UvicornThread

from miaohui.generation.build.artifact import ChatTokenizer, read_info
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.openai_api import create_openai_app
from miaohui.serving.chat import ChatDefaults
from miaohui.serving.repository import ModelManager

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 512
ROOMS = ["Room A", "Room B", "Room 3", "Boardroom"]
BOOKING = {
    "type": "object",
    "properties": {
        "room": {"enum": ROOMS},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    },
    "required": ["room", "hour"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "book_room", "description": "Book a meeting room", "parameters": BOOKING},
    },
    {
        "type": "function",
        "function": {
            "name": "cancel_booking",
            "description": "Cancel a booking",
            "parameters": {
                "type": "object",
                "properties": {"room": {"enum": ROOMS}},
                "required": ["room"],
                "additionalProperties": False,
            },
        },
    },
]
ASKS = [
    f"Please book {room} {when} at {hour} o'clock{video}."
    for room in ("room A", "room B", "room 3", "the boardroom", "a small room")
    for when in ("tomorrow", "on Monday", "today", "next Friday")
    for hour, video in ((9, ""), (14, " with video"), (11, ", no video"), (16, " for a call"), (8, ""))
]


@pytest.fixture(scope="module")
def llm_repository() -> Path:
    return ensure_llm_repository()


@pytest.fixture(scope="module")
def engine(llm_repository: Path) -> Iterator[tuple[LLMEngine, ChatTokenizer]]:
    from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

    path = llm_repository / MODEL / "1"
    tok = ChatTokenizer.from_dir(path, read_info(path))
    sched = SchedulerConfig(max_running_seqs=100, max_batched_tokens=8192, max_model_len=MAX_MODEL_LEN)
    with OrtCausalLMEngine(path) as ort:
        yield LLMEngine(ort, tok.tokenizer, sched), tok


def test_a_hundred_constrained_answers_parse_and_validate(engine: tuple[LLMEngine, ChatTokenizer]) -> None:
    llm, tok = engine
    assert len(ASKS) == 100
    prompts = [tok.encode_chat([{"role": "user", "content": f"{ask} Answer in JSON."}]) for ask in ASKS]
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=7, json_schema=json.dumps(BOOKING))
    results = llm.generate(prompts, params)
    # the schema's longest document is ~16 tokens: the grammar closes every one before max_tokens
    assert [reason for _, _, reason in results] == ["stop"] * 100
    for _, text, _ in results:
        jsonschema.validate(json.loads(text), BOOKING)


def test_json_object_answers_parse_or_are_reported_cut(engine: tuple[LLMEngine, ChatTokenizer]) -> None:
    llm, tok = engine
    prompts = [tok.encode_chat([{"role": "user", "content": f"{ask} Reply as JSON."}]) for ask in ASKS[:8]]
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, json_schema='{"type": "object"}'))
    for _, text, reason in results:
        assert reason in ("stop", "length")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


@pytest.fixture(scope="module")
def client(llm_repository: Path) -> Iterator[openai.OpenAI]:
    metrics = Metrics()
    sched = SchedulerConfig(max_running_seqs=4, max_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN)
    service = ModelManager(
        llm_repository, chat_observer_factory=chat_observers(metrics), chat_defaults=ChatDefaults(sched)
    )
    with (
        UvicornThread(create_openai_app(service, metrics)) as srv,
        openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=60) as c,
    ):
        yield c


MSG = [{"role": "user", "content": "Book room 3 tomorrow at 9."}]


def test_response_format_json_schema_through_the_openai_client(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "booking", "schema": BOOKING, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), BOOKING)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MSG, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        )
    assert (
        info.value.body["message"]
        == "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
    )  # type: ignore[index]


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"book_room", "cancel_booking"}),
        ({"type": "function", "function": {"name": "book_room"}}, {"book_room"}),
    ],
)
def test_forced_tool_calls_plain_and_streamed(client: openai.OpenAI, choice: Any, names: set[str]) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=40, temperature=0, tools=TOOLS, tool_choice=choice
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)

    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=40, temperature=0, tools=TOOLS, tool_choice=choice, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [  # type: ignore[union-attr]
        (0, call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def answer_keys(client: openai.OpenAI, model: str) -> set[str]:
    """The keys of sampled answers to a schema that lists one key and does not say whether others may appear (closed
    by default, as llama.cpp's grammars and xgrammar's default; OpenAI's ``strict`` must say it explicitly)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    keys: set[str] = set()
    for seed in range(8):
        r = client.chat.completions.create(
            model=model, messages=MSG, max_tokens=24, temperature=1.0, seed=seed, response_format=fmt
        )
        if r.choices[0].finish_reason == "stop":
            keys |= set(json.loads(r.choices[0].message.content or ""))
    return keys


def test_a_schema_that_lists_its_keys_gets_only_those_keys(client: openai.OpenAI) -> None:
    assert answer_keys(client, MODEL) == {"a"}


def test_auto_and_none_tool_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0, tools=TOOLS)
    choice = r.choices[0]
    # a 135M model without a tool format answers in text or a call: whichever it is, the shape is OpenAI's
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    none = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none"
    )
    plain = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content  # none: the tools are left out


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' fp32 SmolLM2 (the source the engine was exported from)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(SMOLLM_CACHE), dtype=torch.float32).eval()


def reference_logprobs(model: Any, prompt: list[int], generated: list[int]) -> Any:
    import torch

    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1)


def one_id(tok: ChatTokenizer, text: str) -> int:
    """The id of a token from its text (the answers carry texts; each of these encodes to one token)."""
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def test_logprobs_equal_transformers_log_softmax(client: openai.OpenAI, reference: Any, llm_repository: Path) -> None:
    path = llm_repository / MODEL / "1"
    tok = ChatTokenizer.from_dir(path, read_info(path))
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    generated = [one_id(tok, entry.token) for entry in content]
    ref = reference_logprobs(reference, tok.encode_chat(MSG), generated)
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(ref[i, generated[i]]), abs=2e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref[i].topk(3).values.tolist(), abs=2e-3)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the sampled token is the best

    prompt = "The capital of France is"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, stream=True)
    tokens, values, offsets, text = [], [], [], ""
    for chunk in stream:
        lp = chunk.choices[0].logprobs
        if lp is not None and lp.tokens:
            tokens += lp.tokens
            values += lp.token_logprobs or []
            offsets += lp.text_offset or []
        text += chunk.choices[0].text
    assert "".join(tokens) == text and offsets[0] == 0 and len(values) == 4
    ids = tok.encode(prompt)
    gen = [one_id(tok, t) for t in tokens]
    ref = reference_logprobs(reference, ids, gen)
    assert values == pytest.approx([float(ref[i, t]) for i, t in enumerate(gen)], abs=2e-3)
