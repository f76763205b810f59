"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) → prompt + :class:`SamplingParams`,
and the OpenAI error shape.

Unknown fields are errors ("Unrecognized request argument supplied: ...", as OpenAI answers), so a typo
is never silently ignored. Fields clients commonly send with their neutral value (``logprobs: false``,
``frequency_penalty: 0``, ``tools: []``, ...) are accepted; a value that would need a feature this server
does not have (log-probabilities, penalties, tools, JSON mode, ``n`` > 1, ``echo``, ``suffix``, ``best_of``)
is rejected with 400 naming the parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miaohui.errors import InputError, MiaohuiError
from miaohui.generation.engine.logprobs import MAX_TOP_LOGPROBS
from miaohui.generation.engine.params import SamplingParams

MAX_TOKENS_LIMIT = 32_768
"""``SamplingParams.max_tokens`` upper bound; a request without max_tokens gets min(this, room left)."""


class OpenAIError(MiaohuiError):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send a last chunk (``choices: []``) with the request's token usage."""
    include_obfuscation: bool | None = None
    """Accepted and ignored (OpenAI pads chunks against side channels; localhost needs none)."""


class _Common(BaseModel):
    """Fields of both endpoints. Defaults are OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    """vLLM's extension: keep generating past end-of-sequence (fixed-length benchmarks)."""
    # accepted only with their neutral values (see _unsupported)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    """Chat: true returns each token's log-probability; completions: an int, that many alternatives as well."""


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass(frozen=True)
class Prompt:
    """What to generate from: rendered chat messages, a text, or token ids."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None


def parse_request(cls: type[ChatRequest] | type[CompletionRequest], body: bytes) -> ChatRequest | CompletionRequest:
    """Parse and validate a request body; OpenAIError(400) naming the first bad parameter."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _unsupported(req)
    return req


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0]["loc"][:1]
    # a union reports one error per member: the deepest one (e.g. stop[1] of a list) is the informative one
    err = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
    loc = [str(p) for p in err["loc"]]
    # a union's errors carry the failing member type in loc (e.g. stop.str); keep the parameter path only
    param = ".".join(p for p in loc if p not in _TYPE_TAGS and "[" not in p)
    if err["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return OpenAIError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    value = err.get("input")
    shown = json.dumps(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return OpenAIError(400, f"Invalid value for '{param}': {shown}. {err['msg']}.", param=param, code="invalid_value")


def _reject(param: str, why: str) -> OpenAIError:
    return OpenAIError(
        400, f"'{param}' is not supported by this server: {why}", param=param, code="unsupported_parameter"
    )


def _unsupported(req: ChatRequest | CompletionRequest) -> None:
    if req.n not in (None, 1):
        raise OpenAIError(400, f"n={req.n} is not supported: only one choice per request (n=1)", param="n")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(
            400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise _reject(name, "penalties are not implemented; send 0 or leave it out")
    if req.logit_bias:
        raise _reject("logit_bias", "leave it out")
    if isinstance(req, ChatRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise OpenAIError(
                400, f"logprobs is {req.logprobs!r}: send true or false (and top_logprobs 0-20)", param="logprobs"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.functions or req.function_call not in (None, "none"):
            raise _reject("functions", "the legacy function calling is not implemented; send tools and tool_choice")
        if (
            req.max_tokens is not None
            and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens
        ):
            raise OpenAIError(
                400,
                f"max_tokens={req.max_tokens} and max_completion_tokens={req.max_completion_tokens} disagree; send one",
                param="max_completion_tokens",
            )
    else:
        if isinstance(req.logprobs, bool) or (req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS):
            raise OpenAIError(
                400,
                f"logprobs is {req.logprobs!r}: send the number of alternatives per token, 0-{MAX_TOP_LOGPROBS}",
                param="logprobs",
            )
        if req.echo:
            raise _reject("echo", "send false or leave it out")
        if req.suffix:
            raise _reject("suffix", "insertion is not implemented")
        if req.best_of not in (None, 1):
            raise _reject("best_of", "only best_of=1")


_ROLE_ALIASES = {"developer": "system"}


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI messages → ``[{"role", "content": str}]``: text content parts joined, ``developer`` taken as
    ``system``; 400 (param ``messages``) for anything else."""
    if not raw:
        raise OpenAIError(
            400, "messages is empty: send at least one {'role': 'user', 'content': ...}", param="messages"
        )
    out = []
    for i, msg in enumerate(raw):
        role = msg.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ("system", "user", "assistant"):
            raise OpenAIError(
                400,
                f"messages[{i}].role is {msg.get('role')!r}: use system, developer, user or assistant",
                param=f"messages[{i}].role",
            )
        out.append({"role": str(role), "content": _text_content(msg.get("content"), i)})
    return out


def _text_content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise OpenAIError(
                    400,
                    f"messages[{i}].content[{j}] is not a text part: only {{'type': 'text', 'text': ...}} is supported",
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(
        400, f"messages[{i}].content is {type(content).__name__}: send a string", param=f"messages[{i}].content"
    )


def completion_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> Prompt:
    """One prompt of ``/v1/completions``: a string or a token-id list (a list of one is unwrapped)."""
    one: object = prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise OpenAIError(400, f"{len(prompt)} prompts in one request: send one prompt per request", param="prompt")
        one = prompt[0]
    if isinstance(one, str):
        return Prompt(text=one)
    if not isinstance(one, list) or not one:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    return Prompt(token_ids=[int(t) for t in one])


def requested_logprobs(req: ChatRequest | CompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` of a request: None (none asked), else the number of alternatives."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return None if req.logprobs is None else int(req.logprobs)


def sampling_params(
    req: ChatRequest | CompletionRequest, prompt_tokens: int, max_model_len: int, json_schema: str | None = None
) -> SamplingParams:
    """SamplingParams for a prompt of ``prompt_tokens`` on a context of ``max_model_len``; 400 when they
    cannot fit (OpenAI's ``context_length_exceeded``). ``json_schema``: the constraint of the request's
    ``response_format`` / ``tool_choice`` (:mod:`miaohui.server.openai_tools`)."""
    where = "messages" if isinstance(req, ChatRequest) else "prompt"
    if prompt_tokens >= max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} resulted in "
            f"{prompt_tokens} tokens. Please reduce the length of the {where}.",
            param=where,
            code="context_length_exceeded",
        )
    asked = req.max_completion_tokens if isinstance(req, ChatRequest) and req.max_completion_tokens else req.max_tokens
    room = max_model_len - prompt_tokens
    if asked is not None and asked > room:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {where}, {asked} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams.create(
            max_tokens=asked if asked is not None else min(room, MAX_TOKENS_LIMIT),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=bool(req.ignore_eos),
            json_schema=json_schema,
            logprobs=requested_logprobs(req),
        )
    except InputError as exc:  # e.g. more than 16 stop strings, an empty stop string
        raise OpenAIError(400, str(exc), param="stop" if "stop" in exc.message else None) from None
