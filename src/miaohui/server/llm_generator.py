"""A served chat model as the dialogue pipelines' generator (:class:`LLMTextGenerator`): their llm replies and
forced tool calls run on the server's own generation engine, and their tokens are charged to the tenant of the
request's API key (its ``tokens_per_minute``) as the OpenAI routes charge theirs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from miaohui.generation.engine.client import TokenEvent
from miaohui.generation.engine.params import SamplingParams
from miaohui.priority import CALLER
from miaohui.server.openai_tools import call_schema, prompt_messages
from miaohui.serving.repository import ModelManager

if TYPE_CHECKING:
    from miaohui.dialogue.pipeline import ChatMessage

__all__ = ["LLMTextGenerator"]


class LLMTextGenerator:
    """A served chat model as the dialogue pipelines' ``TextGenerator`` (greedy by default) and ``ToolCaller``
    (a forced call decoded under the function's JSON schema, as ``tool_choice`` naming it does)."""

    def __init__(self, manager: ModelManager, model: str) -> None:
        self.manager, self.model = manager, model

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        llm = self.manager.chat(self.model)
        ids = llm.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        room = llm.max_model_len - len(ids)
        params = SamplingParams.create(max_tokens=max(1, min(max_tokens, room)), temperature=temperature)
        return await _text(llm.client.generate(ids, params), len(ids))

    async def call_tool(self, messages: list[ChatMessage], tool: dict[str, Any], max_tokens: int) -> Any:
        llm = self.manager.chat(self.model)
        tools = [tool]
        native = llm.tokenizer.supports_tools
        msgs = prompt_messages([dict(m) for m in messages], tools, native)
        ids = llm.tokenizer.encode_chat(msgs, tools=tools if native else None)
        room = max(1, min(max_tokens, llm.max_model_len - len(ids)))
        params = SamplingParams.create(max_tokens=room, temperature=0.0, json_schema=call_schema(tools))
        text = await _text(llm.client.generate(ids, params), len(ids))
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"the call is not complete JSON after {room} tokens: {text[:120]!r}") from None


async def _text(events: AsyncIterator[TokenEvent], prompt_tokens: int) -> str:
    """The text of a request's events; its prompt + completion tokens are charged to the request's tenant."""
    parts: list[str] = []
    generated = 0
    try:
        async for event in events:
            parts.append(event.text)
            generated = event.completion_tokens
    finally:
        caller = CALLER.get()
        if caller is not None:
            caller.charge(prompt_tokens + generated)
    return "".join(parts)
