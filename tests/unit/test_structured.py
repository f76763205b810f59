"""Structured output without a model: the OpenAI ``response_format`` / ``tools`` / ``tool_choice`` plan and its
errors, the tool-call parser, and llguidance's masks on SmolLM2's real tokenizer driven by random logits (every
document a random walk under the mask produces validates against its schema). The real model is in
tests/e2e/test_structured.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from tests.prebuild import SMOLLM_CACHE

from miaohui.generation.engine.logprobs import token_logprobs
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.structured import TokenMasks, check_supported, closed_objects
from miaohui.server.openai_schema import ChatRequest, OpenAIError
from miaohui.server.openai_tools import ANY_OBJECT, ChatPlan, plan, prompt_messages, tool_calls

USER = [{"role": "user", "content": "book room 3 at nine"}]
BOOK = {
    "type": "function",
    "function": {
        "name": "book_room",
        "description": "Book a meeting room",
        "parameters": {
            "type": "object",
            "properties": {"room": {"enum": ["A", "B", "C"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["room", "hour"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": USER, **fields})


def plan_error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        plan(chat(**fields))
    assert info.value.status == 400
    return info.value


def test_response_format_and_tool_choice_plans() -> None:
    assert plan(chat()) == ChatPlan()
    assert plan(chat(response_format={"type": "text"})) == ChatPlan()
    assert plan(chat(response_format={"type": "json_object"})).json_schema == ANY_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(plan(chat(response_format=fmt)).json_schema or "") == schema
    assert plan(chat(tools=[BOOK], tool_choice="none")) == ChatPlan()
    auto = plan(chat(tools=[BOOK, WEATHER]))
    assert (auto.json_schema, auto.forced, auto.names) == (None, False, {"book_room", "weather"})
    required = plan(chat(tools=[BOOK, WEATHER], tool_choice="required"))
    assert required.forced and [o["properties"]["name"] for o in json.loads(required.json_schema or "")["anyOf"]] == [
        {"const": "book_room"},
        {"const": "weather"},
    ]
    named = plan(chat(tools=[BOOK, WEATHER], tool_choice={"type": "function", "function": {"name": "book_room"}}))
    assert json.loads(named.json_schema or "")["properties"]["arguments"] == BOOK["function"]["parameters"]


def test_plan_errors_name_the_field() -> None:
    err = plan_error(response_format={"type": "xml"})
    assert (err.message, err.param) == (
        "response_format type 'xml' is not supported: use 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )
    err = plan_error(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert err.message == "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
    err = plan_error(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert err.param == "response_format.json_schema.schema" and err.code == "invalid_schema"
    assert err.message.startswith("'response_format.json_schema.schema': the JSON schema cannot be enforced: ")
    assert plan_error(tool_choice="required").message == "tool_choice needs tools: send the tools it may call"
    err = plan_error(tools=[BOOK], tool_choice={"type": "function", "function": {"name": "fly"}})
    assert (err.message, err.param) == ("tool_choice names 'fly', which is not among the tools", "tool_choice")
    assert plan_error(tools=[{"type": "function"}]).message == (
        "tools[0] must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"
    )
    assert plan_error(tools=[BOOK, BOOK]).message == "tools hold two functions of the same name"
    err = plan_error(tools=[BOOK], tool_choice="required", response_format={"type": "json_object"})
    assert err.message == "response_format json and tools in one request: send one of them"


def test_tool_calls_are_parsed_from_json_and_hermes_blocks() -> None:
    p = plan(chat(tools=[BOOK, WEATHER]))
    calls = tool_calls('{"name": "book_room", "arguments": {"room": "A", "hour": 9}}', p)
    assert calls is not None and len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "book_room", "arguments": '{"room": "A", "hour": 9}'}
    hermes = (
        '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call><tool_call>{"name": "book_room"}</tool_call>'
    )
    assert [c["function"]["name"] for c in tool_calls(hermes, p) or []] == ["weather", "book_room"]
    assert tool_calls("Sure, booked.", p) is None
    assert tool_calls('{"name": "fly", "arguments": {}}', p) is None  # not one of the tools: text
    assert tool_calls('{"name": "book_room"}', ChatPlan()) is None  # no tools offered


def test_tools_join_the_system_prompt_of_a_template_without_a_tool_format() -> None:
    msgs = prompt_messages([{"role": "system", "content": "Be brief."}, *USER], [BOOK], native=False)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\nYou can call these functions:")
    assert '"name": "book_room"' in msgs[0]["content"] and msgs[1] == USER[0]


def test_engines_without_masks_refuse_constraints_by_name() -> None:
    check_supported(SamplingParams(json_schema=ANY_OBJECT, logprobs=2), True, "x")
    with pytest.raises(Exception, match="^json_schema is not supported by the GPU engine — serve the model"):
        check_supported(SamplingParams(json_schema=ANY_OBJECT), False, "the GPU engine")
    with pytest.raises(Exception, match="^logprobs is not supported by the GPU engine"):
        check_supported(SamplingParams(logprobs=0), False, "the GPU engine")


def test_token_logprobs_are_the_log_softmax_and_its_top_k() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, np.nan]], dtype=np.float32)
    a, b = token_logprobs(logits, [2, 0], [3, 0])
    ref = logits[0].astype(np.float64) - np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert a.logprob == pytest.approx(ref[2], abs=1e-12)
    assert [t for t, _ in a.top] == [1, 3, 2]  # ties by the lower id
    assert (b.logprob, b.top) == (pytest.approx(np.log(1 / 3)), ())


@pytest.fixture(scope="module")
def masks() -> TokenMasks:
    from tokenizers import Tokenizer

    path = SMOLLM_CACHE / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the SmolLM2 tokenizer is built by tests.prebuild (run an e2e test once)")
    return TokenMasks(Tokenizer.from_file(str(path)), 49152, [2])


def walk(masks: TokenMasks, schema: str, rng: np.random.Generator, max_tokens: int) -> tuple[list[int], bool]:
    """Sample a document under the mask from random logits; (tokens, ended on end-of-sequence)."""
    masks.start(0, schema)
    ids: list[int] = []
    try:
        for _ in range(max_tokens):
            row = masks.mask(rng.standard_normal((1, 49152), dtype=np.float32) * 4, [0])
            tok = int(np.argmax(row[0]))
            masks.consume(0, tok)
            if tok == 2:
                return ids, True
            ids.append(tok)
        return ids, False
    finally:
        masks.drop(0)


def test_random_walks_under_the_mask_always_validate(masks: TokenMasks) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SMOLLM_CACHE / "tokenizer.json"))
    schema = {
        "type": "object",
        "properties": {
            "room": {"enum": ["A", "B", "Room 3"]},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "video": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["room", "hour", "video", "note"],
        "additionalProperties": False,
    }
    rng = np.random.default_rng(0)
    for _ in range(15):
        ids, ended = walk(masks, json.dumps(schema), rng, 96)
        assert ended, tok.decode(ids)
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
    # a wider grammar (any object) may run out of tokens: what ended parses as an object
    for _ in range(5):
        ids, ended = walk(masks, ANY_OBJECT, rng, 24)
        if ended:
            assert isinstance(json.loads(tok.decode(ids)), dict)


def test_objects_that_list_their_properties_are_closed_unless_they_say_otherwise() -> None:
    booking = {"type": "object", "properties": {"room": {"type": "string"}, "properties": {"type": "object"}}}
    closed = closed_objects({"type": "array", "items": booking, "$defs": {"b": booking}})
    assert closed["items"]["additionalProperties"] is False
    assert closed["$defs"]["b"]["additionalProperties"] is False
    # a property named "properties" is a name: its own schema lists no properties and stays open
    assert closed["items"]["properties"]["properties"] == {"type": "object"}
    assert "additionalProperties" not in booking  # the caller's schema is not changed
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object
    for open_ in ({"additionalProperties": True}, {"patternProperties": {"^x": {}}}, {"anyOf": [booking]}):
        out = closed_objects({**booking, **open_})
        assert out.get("additionalProperties", "unset") == open_.get("additionalProperties", "unset")
    assert closed_objects({"anyOf": [booking]})["anyOf"][0]["additionalProperties"] is False


def test_the_mask_refuses_a_key_the_schema_does_not_list(masks: TokenMasks) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SMOLLM_CACHE / "tokenizer.json"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}

    def refused(text: str) -> bool:
        masks.start(0, json.dumps(schema))
        try:
            for token in tok.encode(text).ids:
                allowed = masks.mask(np.zeros((1, masks._vocab), np.float32), [0])[0]
                if allowed[token] == -np.inf:
                    return True
                masks.consume(0, token)
            return False
        finally:
            masks.drop(0)

    assert not refused('{"a": 1, "b": 2}')
    assert refused('{"a": 1, "c": 2}')
    schema["additionalProperties"] = True  # an open schema says so
    assert not refused('{"a": 1, "c": 2}')
