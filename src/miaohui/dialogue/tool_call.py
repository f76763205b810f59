"""A booking action's slots from a chat model's function call, the rules' slots otherwise.

A route may name a function (``tool_call:`` in the pipeline YAML, the meeting assistant's ``book_meeting``). When
the pipeline has a chat model that can call functions (:class:`ToolCaller`: the server's own generator, or an
OpenAI-style chat callable), the turn's conversation goes to the model with the function forced
(``tool_choice`` naming it): the server's engine decodes the call under the function's JSON schema (constrained
decoding, llguidance), so the call is always ``{"name": ..., "arguments": {...}}`` of that shape unless
``max_tokens`` cuts it. The arguments are then validated against the same schema (a model served elsewhere may
not be constrained) and against the calendar (``2026-02-31`` matches the pattern). Arguments the call leaves
``null`` come from the rules (the turn's text and the session's memory).

The rules' slots (:func:`~miaohui.dialogue.booking.rule_slots`) answer when there is no chat model, when it cannot
call functions, when the call fails, or when its arguments fail validation; :class:`ToolCallTrace` in the
response says which happened.

The call's prompt is a growing prefix as the llm routes' is: the fixed system prompt, the session's history, and
only then this turn's words with the local time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from miaohui.dialogue.answers import AnswerContext
from miaohui.dialogue.booking import BookingSlots
from miaohui.dialogue.knowledge import Bilingual, KnowledgeBase

if TYPE_CHECKING:
    from miaohui.dialogue.pipeline import ChatMessage
    from miaohui.dialogue.session import Turn

__all__ = [
    "NO_MODEL",
    "NO_TOOLS",
    "ToolCallConfig",
    "ToolCallTrace",
    "ToolCaller",
    "booking_tool",
    "model_slots",
    "slots_from_model",
]

logger = logging.getLogger(__name__)

NO_MODEL = "no chat model is configured for the pipeline"
NO_TOOLS = "the chat model cannot call functions"
_DATE = r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
_TIME = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"


class ToolCallConfig(BaseModel):
    """A route whose action takes its slots from a chat model's call of ``function``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    function: str = Field(default="book_meeting", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    """Name of the function the model is made to call (the OpenAI tool's name)."""
    description: Bilingual
    """What the function does, per language (the tool's description in the prompt)."""
    system_prompt: Bilingual
    """System prompt of the call, per language."""
    max_tokens: int = Field(default=128, ge=16, le=1024)
    """Most tokens of the call; a complete call of the booking function takes about 60 (fewer cut the JSON and the
    rules answer)."""
    history_turns: int = Field(default=6, ge=0, le=100)
    """Earlier turns of the session sent with the call (a booking is often filled across turns)."""


class ToolCallTrace(BaseModel):
    """Where a turn's action slots came from."""

    function: str
    """The function the model was asked to call."""
    source: Literal["model", "rules"]
    """``model``: the model's validated call (its null arguments filled by the rules); ``rules``: the rule slots."""
    arguments: dict[str, Any] | None = None
    """The arguments the model sent (None when it was not asked or sent none)."""
    fallback: str | None = None
    """Why the rule slots answered (None when the model's call did)."""


@runtime_checkable
class ToolCaller(Protocol):
    """A chat model that can be made to call a function."""

    async def call_tool(self, messages: list[ChatMessage], tool: dict[str, Any], max_tokens: int) -> Any:
        """The model's call of ``tool`` (an OpenAI tool definition) as parsed JSON, ``{"name": ..., "arguments":
        {...}}``; raises when the model gives none (a cut or unparsable answer, an engine error)."""
        ...


def booking_tool(kb: KnowledgeBase, config: ToolCallConfig, lang: Literal["zh", "en"]) -> dict[str, Any]:
    """The booking function as an OpenAI tool: date, start time, length, attendees and room, each nullable."""
    rooms = "; ".join(f"{r.id} {r.name.get(lang)} ({r.capacity})" for r in kb.rooms)

    def nullable(schema: dict[str, Any], description: str) -> dict[str, Any]:
        return {"anyOf": [schema, {"type": "null"}], "description": description}

    params = {
        "type": "object",
        "properties": {
            "date": nullable({"type": "string", "pattern": _DATE}, "YYYY-MM-DD, null if not said"),
            "start_time": nullable({"type": "string", "pattern": _TIME}, "HH:MM, 24-hour clock, null if not said"),
            "duration_minutes": nullable({"type": "integer", "minimum": 15, "maximum": 720}, "null if not said"),
            "attendees": nullable({"type": "integer", "minimum": 1, "maximum": 500}, "null if not said"),
            "room": {"enum": [*(r.id for r in kb.rooms), None], "description": f"room id ({rooms}), null if not said"},
        },
        "required": ["date", "start_time", "duration_minutes", "attendees", "room"],
        "additionalProperties": False,
    }
    desc = config.description.get(lang)
    return {"type": "function", "function": {"name": config.function, "description": desc, "parameters": params}}


def call_messages(config: ToolCallConfig, ctx: AnswerContext, history: Iterable[Turn]) -> list[ChatMessage]:
    """The call's chat: system prompt, the last ``history_turns`` turns, this turn with the local time."""
    messages: list[ChatMessage] = [{"role": "system", "content": config.system_prompt.get(ctx.lang)}]
    turns = list(history)[-config.history_turns :] if config.history_turns else []
    for turn in turns:
        messages.append({"role": "user", "content": turn.user})
        messages.append({"role": "assistant", "content": turn.reply})
    now = f"{ctx.now:%Y-%m-%d %H:%M %A}"
    when = f"（现在是{now}）" if ctx.lang == "zh" else f"(It is now {now}.)"
    messages.append({"role": "user", "content": f"{ctx.text}\n{when}"})
    return messages


class _Invalid(ValueError):
    """The call's arguments fail validation (the message says how)."""


def model_slots(
    arguments: Mapping[str, Any], tool: Mapping[str, Any], kb: KnowledgeBase, ctx: AnswerContext, rules: BookingSlots
) -> BookingSlots:
    """The booking slots of a call's ``arguments`` (validated against ``tool``'s schema and the calendar), with the
    rules' slots where an argument is null; ValueError saying what is wrong."""
    schema = tool["function"]["parameters"]
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "arguments"
        raise _Invalid(f"{where}: {error.message}")
    date, clock = arguments["date"], arguments["start_time"]
    try:
        day = datetime.fromisoformat(date) if date else None
    except ValueError:
        raise _Invalid(f"date {date!r} is not a calendar date") from None
    room = kb.room(arguments["room"]) if arguments["room"] else rules.room
    minutes = arguments["duration_minutes"] or rules.minutes
    attendees = arguments["attendees"]
    slots = BookingSlots(
        room=room,
        attendees=float(attendees) if attendees is not None else rules.attendees,
        minutes=minutes,
        start=rules.start,
        end=rules.end,
        date_only=rules.date_only,
    )
    if clock is None:
        if day is None or rules.start is not None:
            return slots
        return replace(slots, date_only=day.replace(tzinfo=ctx.now.tzinfo))
    base = day or rules.start or rules.date_only or ctx.now
    hour, minute = (int(x) for x in clock.split(":"))
    start = base.replace(hour=hour, minute=minute, second=0, microsecond=0, tzinfo=ctx.now.tzinfo)
    length = minutes or ctx.memory.get("booking_minutes") or 60
    end = start + timedelta(minutes=float(length))
    return replace(slots, start=start, end=end, date_only=None)


async def slots_from_model(
    generator: object | None,
    config: ToolCallConfig,
    kb: KnowledgeBase,
    ctx: AnswerContext,
    history: Iterable[Turn],
    rules: BookingSlots,
) -> tuple[BookingSlots, ToolCallTrace]:
    """The turn's booking slots from ``generator``'s call when it makes a valid one, else ``rules``; and the trace."""
    name = config.function
    if generator is None:
        return rules, ToolCallTrace(function=name, source="rules", fallback=NO_MODEL)
    if not isinstance(generator, ToolCaller):
        return rules, ToolCallTrace(function=name, source="rules", fallback=NO_TOOLS)
    tool = booking_tool(kb, config, ctx.lang)
    try:
        call = await generator.call_tool(call_messages(config, ctx, history), tool, config.max_tokens)
    except Exception as exc:
        logger.warning("the %s call failed, the rule slots answer: %s", name, exc)
        return rules, ToolCallTrace(function=name, source="rules", fallback=f"the model's call failed: {exc}")
    arguments = call.get("arguments") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or call.get("name") != name or not isinstance(arguments, Mapping):
        detail = f"the model's call failed validation: it is not a call of {name} with arguments: {call!r}"
        return rules, ToolCallTrace(function=name, source="rules", fallback=detail[:300])
    try:
        slots = model_slots(arguments, tool, kb, ctx, rules)
    except ValueError as exc:
        args = dict(arguments)
        fallback = f"the model's call failed validation: {exc}"
        return rules, ToolCallTrace(function=name, source="rules", arguments=args, fallback=fallback)
    return slots, ToolCallTrace(function=name, source="model", arguments=dict(arguments))
