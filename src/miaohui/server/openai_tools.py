"""OpenAI ``response_format``, ``tools`` / ``tool_choice`` and ``logprobs`` of a chat or completion request →
what the engine does (a JSON schema to constrain to, the prompt's tool block) and the answer's shape
(``tool_calls``, ``logprobs``).

* ``response_format``: ``json_object`` constrains to any JSON object, ``json_schema`` to its ``schema`` (strict
  or not, the schema is enforced); the text is the JSON.
* ``tools``: the tool definitions go into the prompt by the chat template's own tool format when it has one
  (HF templates take ``tools=``), else as a system block that asks for ``{"name": ..., "arguments": {...}}``.
  ``tool_choice`` ``required`` / a named function constrain the answer to such a call (one of the tools /
  that one, its ``arguments`` to the function's ``parameters`` schema); ``auto`` generates freely and an answer
  that is a call (a JSON object naming a tool, or Hermes-style ``<tool_call>{...}</tool_call>`` blocks) becomes
  ``tool_calls``; ``none`` leaves the tools out.
* A request with tools is answered when generation ends (its stream sends the call, or the text, in one delta):
  whether the answer is a call is known only then.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miaohui.generation.engine.logprobs import TokenLogprobs
from miaohui.server.openai_schema import ChatRequest, OpenAIError

ANY_OBJECT = '{"type": "object"}'
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request needs beyond plain generation."""

    json_schema: str | None = None
    """The schema the answer is constrained to (None: free text)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The tools the prompt offers (empty: none, or ``tool_choice`` ``none``)."""
    forced: bool = False
    """``required`` or a named function: the answer is a call."""

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, Mapping):
        raise OpenAIError(400, f"'{param}' must be a JSON schema object, got {type(schema).__name__}", param=param)
    from miaohui.errors import InputError
    from miaohui.generation.engine.structured import check_schema

    text = json.dumps(schema, ensure_ascii=False)
    try:
        check_schema(text)
    except InputError as exc:
        raise OpenAIError(400, f"'{param}': {exc}", param=param, code="invalid_schema") from None
    return text


def response_schema(fmt: Mapping[str, Any] | None) -> str | None:
    """The JSON schema of a ``response_format`` (None for text)."""
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise OpenAIError(
                400,
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format.json_schema",
            )
        return _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise OpenAIError(
        400,
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        param="response_format.type",
    )


def _check_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn: Any = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise OpenAIError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                param=f"tools[{i}]",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OpenAIError(
                400, f"tools[{i}].function.name {name!r} must match [a-zA-Z0-9_-]{{1,64}}", param=f"tools[{i}]"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _schema_text(params, f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    if len({t["function"]["name"] for t in out}) != len(out):
        raise OpenAIError(400, "tools hold two functions of the same name", param="tools")
    return out


def call_schema(tools: Sequence[dict[str, Any]]) -> str:
    """The schema of one call of any of ``tools``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options}, ensure_ascii=False)


def plan(req: ChatRequest) -> ChatPlan:
    """The request's :class:`ChatPlan`; OpenAIError(400) naming the bad field."""
    schema = response_schema(req.response_format)
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool_choice needs tools: send the tools it may call", param="tool_choice")
        return ChatPlan(json_schema=schema)
    tools = _check_tools(req.tools)
    if choice == "none":
        return ChatPlan(json_schema=schema)
    if schema is not None:
        raise OpenAIError(
            400, "response_format json and tools in one request: send one of them", param="response_format"
        )
    if choice in (None, "auto"):
        return ChatPlan(tools=tools)
    if choice == "required":
        return ChatPlan(json_schema=call_schema(tools), tools=tools, forced=True)
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if not (isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(name, str)):
        raise OpenAIError(
            400,
            f"tool_choice {choice!r} is not one of 'none', 'auto', 'required', "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ChatPlan(json_schema=call_schema(named), tools=tools, forced=True)


# ---- the prompt ---------------------------------------------------------------------------------------


def tool_system_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool instructions for a template without a tool format of its own."""
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return (
        "You can call these functions:\n"
        + "\n".join(lines)
        + '\nTo call one, answer with only a JSON object {"name": <function name>, "arguments": <its arguments>}.'
    )


def prompt_messages(raw: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], native: bool) -> list[Any]:
    """Chat messages for a request with tools. ``native``: the template renders tools and tool turns itself, so
    messages pass as sent (their text content joined); else the tool block joins the system message, assistant
    ``tool_calls`` become their JSON and ``tool`` results user turns."""
    from miaohui.server.openai_schema import chat_messages

    if native:
        out: list[dict[str, Any]] = []
        for msg in raw:
            m = dict(msg)
            if isinstance(m.get("content"), list):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, Mapping))
            if m.get("role") == "assistant" and m.get("tool_calls"):
                m["tool_calls"] = [_native_call(c) for c in m["tool_calls"]]
            out.append(m)
        return out
    msgs = chat_messages([dict(m) for m in raw])
    if tools:
        block = tool_system_block(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": f"{msgs[0]['content']}\n\n{block}"}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    return msgs


def _native_call(call: Any) -> Any:
    """HF templates take ``arguments`` as a dict; OpenAI sends a JSON string."""
    if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
        fn = dict(call["function"])
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(ValueError):
                fn["arguments"] = json.loads(fn["arguments"])
        return {**call, "function": fn}
    return call


# ---- the answer ---------------------------------------------------------------------------------------


def tool_calls(text: str, plan: ChatPlan) -> list[dict[str, Any]] | None:
    """The calls an answer makes (OpenAI ``tool_calls``), None when it is text."""
    if not plan.tools:
        return None
    found: list[Any] = []
    blocks = _HERMES.findall(text)
    for block in blocks or [text.strip()]:
        try:
            found.append(json.loads(block))
        except ValueError:
            return None
    calls = []
    for obj in found:
        if not (isinstance(obj, Mapping) and obj.get("name") in plan.names):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return calls or None


def logprob_entries(items: Sequence[tuple[int | None, TokenLogprobs | None]], token_text: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries of (token id, its log-probabilities); ``token_text(id)``: its text."""
    out = []
    for tid, lp in items:
        if tid is None or lp is None:
            continue
        text = token_text(tid)
        out.append(
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := token_text(i)), "logprob": v, "bytes": list(t.encode("utf-8"))} for i, v in lp.top
                ],
            }
        )
    return out


def completion_logprobs(
    items: Sequence[tuple[int | None, TokenLogprobs | None]], token_text: Any, offset: int
) -> dict[str, Any]:
    """Legacy ``/v1/completions`` ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, values, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp in items:
        if tid is None or lp is None:
            continue
        text = token_text(tid)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(i): v for i, v in lp.top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
