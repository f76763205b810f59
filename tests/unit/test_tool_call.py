"""The meeting assistant's booking slots from a chat model's function call, and the fallback to the rule slots.

``ScriptedCaller`` stands in for the chat model: a model decoding under the schema cannot send invalid arguments
or fail on demand, so the faults (a schema violation, a date that is no calendar day, an engine error) are
scripted here; tests/e2e/test_dialogue.py drives the same route with SmolLM2 on a real server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.unit.test_pipeline import NOW, FakeClassifier, FakeGenerator

from miaohui.dialogue import ChatMessage, Pipeline
from miaohui.dialogue.engine_adapters import ChatFunctionGenerator
from miaohui.dialogue.tool_call import NO_MODEL, NO_TOOLS
from miaohui.errors import ConfigError

ARGS = {"date": "2026-03-05", "start_time": "14:00", "duration_minutes": 90, "attendees": 8, "room": "R301"}


class ScriptedCaller(FakeGenerator):
    """A generator that answers tool calls with scripted calls (or raises a scripted error)."""

    def __init__(self, *calls: Any) -> None:
        super().__init__("unused")
        self.scripted = list(calls)
        self.tool_calls: list[tuple[list[ChatMessage], dict[str, Any], int]] = []

    async def call_tool(self, messages: list[ChatMessage], tool: dict[str, Any], max_tokens: int) -> Any:
        self.tool_calls.append((messages, tool, max_tokens))
        call = self.scripted[(len(self.tool_calls) - 1) % len(self.scripted)]
        if isinstance(call, Exception):
            raise call
        return call


def meeting(generator: FakeGenerator | None) -> Pipeline:
    return Pipeline.from_name("meeting_assistant", FakeClassifier(), generator, clock=lambda: NOW)


async def test_the_booking_comes_from_the_model_call() -> None:
    caller = ScriptedCaller({"name": "book_meeting", "arguments": ARGS})
    r = await meeting(caller).run_turn("帮我订个会议室", "m")
    assert r.text == "已为您预订青松厅（3楼，可容纳12人），时间2026-03-05 14:00–15:30，预订号B0001。"
    assert r.tool_call is not None and r.tool_call.model_dump() == {
        "function": "book_meeting",
        "source": "model",
        "arguments": ARGS,
        "fallback": None,
    }
    messages, tool, max_tokens = caller.tool_calls[0]
    assert [m["role"] for m in messages] == ["system", "user"] and max_tokens == 128
    assert messages[1]["content"] == "帮我订个会议室\n（现在是2026-03-03 10:00 Tuesday）"
    params = tool["function"]["parameters"]
    assert tool["function"]["name"] == "book_meeting" and params["required"] == list(ARGS)
    assert params["properties"]["room"]["enum"] == ["R301", "R302", "R501", "R502", "R801", None]


async def test_null_arguments_come_from_the_rules_and_the_prompt_grows() -> None:
    nulls = dict.fromkeys(ARGS)
    caller = ScriptedCaller({"name": "book_meeting", "arguments": nulls})
    pipe = meeting(caller)
    first = await pipe.run_turn("帮我订明天上午九点的会议室", "n")
    assert (first.variant, first.tool_call.source) == ("need_room", "model")  # type: ignore[union-attr]
    second = await pipe.run_turn("那就订青松厅", "n")
    assert second.text == "已为您预订青松厅（3楼，可容纳12人），时间2026-03-04 09:00–10:00，预订号B0001。"
    one, two = caller.tool_calls[0][0], caller.tool_calls[1][0]
    assert two[:2] == [*one[:1], {"role": "user", "content": "帮我订明天上午九点的会议室"}]
    assert two[2] == {"role": "assistant", "content": first.text}


@pytest.mark.parametrize(
    ("call", "fallback"),
    [
        (
            {"name": "book_meeting", "arguments": {**ARGS, "date": "2026-02-31"}},
            "the model's call failed validation: date '2026-02-31' is not a calendar date",
        ),
        (
            {"name": "book_meeting", "arguments": {**ARGS, "attendees": 0}},
            "the model's call failed validation: attendees: 0 is less than the minimum of 1",
        ),
        (
            {"name": "book_meeting", "arguments": {k: v for k, v in ARGS.items() if k != "room"}},
            "the model's call failed validation: arguments: 'room' is a required property",
        ),
        (
            {"name": "cancel", "arguments": ARGS},
            "the model's call failed validation: it is not a call of book_meeting with arguments: "
            "{'name': 'cancel', 'arguments': {'date': '2026-03-05', 'start_time': '14:00', 'duration_minutes': 90, "
            "'attendees': 8, 'room': 'R301'}}",
        ),
        (ValueError("the call is not complete JSON after 128 tokens: '{\"date'"),
         "the model's call failed: the call is not complete JSON after 128 tokens: '{\"date'"),
    ],
)  # fmt: skip
async def test_a_call_that_fails_validation_falls_back_to_the_rules(call: Any, fallback: str) -> None:
    r = await meeting(ScriptedCaller(call)).run_turn("订明天上午九点的青松厅", "f")
    assert r.text == "已为您预订青松厅（3楼，可容纳12人），时间2026-03-04 09:00–10:00，预订号B0001。"
    assert r.tool_call is not None and (r.tool_call.source, r.tool_call.fallback) == ("rules", fallback)


@pytest.mark.parametrize(("generator", "fallback"), [(None, NO_MODEL), (FakeGenerator("text"), NO_TOOLS)])
async def test_without_a_model_that_calls_functions_the_rules_answer(
    generator: FakeGenerator | None, fallback: str
) -> None:
    r = await meeting(generator).run_turn("订明天上午九点的青松厅", "r")
    assert r.booking is not None and r.booking.room_id == "R301"
    assert r.tool_call is not None and r.tool_call.model_dump() == {
        "function": "book_meeting",
        "source": "rules",
        "arguments": None,
        "fallback": fallback,
    }


async def test_a_chat_function_is_asked_for_the_named_call() -> None:
    seen: dict[str, Any] = {}

    async def create(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        fn = {"name": "book_meeting", "arguments": '{"date": null, "start_time": "09:00", "duration_minutes": null, '
              '"attendees": null, "room": "R502"}'}  # fmt: skip
        return {"choices": [{"message": {"content": None, "tool_calls": [{"type": "function", "function": fn}]}}]}

    r = await meeting(ChatFunctionGenerator(create, "smollm2")).run_turn("订明天的会议室", "c")  # type: ignore[arg-type]
    assert seen["tool_choice"] == {"type": "function", "function": {"name": "book_meeting"}}
    assert r.text == "已为您预订明月轩（5楼，可容纳4人），时间2026-03-04 09:00–10:00，预订号B0001。"


def test_tool_call_only_on_the_booking_action(tmp_path: Path) -> None:
    text = Path(__file__).parents[2].joinpath("src/miaohui/dialogue/pipelines/meeting_assistant.yaml").read_text()
    bad = text.replace("    lookup: cancel\n", "    lookup: cancel\n    tool_call: {function: f, description: {zh: 订, en: b},"
                       " system_prompt: {zh: 订, en: b}}\n")  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        Pipeline.from_name(path, FakeClassifier())
    assert str(err.value) == (
        "pipeline 'meeting_assistant' routes.cancel_booking: tool_call is set on a route with strategy 'action' and "
        "lookup 'cancel' — set tool_call only on the action route with lookup book (the booking function)"
    )
