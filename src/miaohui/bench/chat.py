"""The ``chat`` target: one streamed OpenAI ``/v1/chat/completions`` (or ``/v1/completions``) request per prompt,
against any OpenAI-compatible server (miaohui, vLLM, llama.cpp's server, ...), over ``httpx`` on asyncio.

Each request ends as ``"ok"`` or an error label, as every target's (:mod:`miaohui.bench.targets`), and leaves a
:class:`StreamRecord` — what the report needs from one stream: time to the first content, the gaps between content
chunks, the output tokens (the server's ``usage`` where it sends one: ``stream_options.include_usage`` is asked for;
else the content chunks counted) and, for an error, the server's message. The records travel from each client
process to the parent inside the load runner's :class:`~miaohui.bench.load.RawRun` (a typed, picklable message).

Labels beyond the HTTP status of a rejected request: ``"stream_error"`` (a 200 whose stream carried an error
object), ``"bad_body"`` (a stream that ended without ``[DONE]``, or a chunk that is not JSON), ``"connection"`` and
``"timeout"`` (no end within the client timeout).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from miaohui.bench.targets import Target, TargetSpec
from miaohui.errors import ConfigError

Endpoint = Literal["chat", "completions"]
ENDPOINTS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

DIALOGUE_PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
    "What should I consider before buying a government bond?",
    "Give me three tips for a salary negotiation.",
    "How do I reset my online banking password?",
    "Summarize the benefits of regular exercise.",
    "Describe a calm morning routine for a busy office worker.",
    "我想查询一下我的社保缴费记录，应该怎么办？",
    "请用两句话解释什么是定期存款。",
    "帮我写一封请假邮件，说明明天要去医院体检。",
    "公积金提取需要准备哪些材料？",
)
"""The built-in prompts (``--texts`` not given): the dialogue questions of the generation benchmarks, in English
and Chinese, so prompt lengths vary as a service's do."""


@dataclass
class StreamRecord:
    """One measured request, as the client saw it. Times in seconds from the moment the request was sent."""

    status: str
    latency_s: float
    ttft_s: float | None = None
    """To the first chunk with content (text)."""
    decode_s: float = 0.0
    """First content chunk to the last one."""
    content_chunks: int = 0
    usage_tokens: int | None = None
    """``usage.completion_tokens`` as the server reported it (None when it sent no usage)."""
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    gaps_s: list[float] = field(default_factory=list)
    """Between consecutive content chunks (a server may put several tokens into one chunk)."""
    error: str | None = None
    """The server's error message (rejected or failed requests)."""

    @property
    def output_tokens(self) -> int:
        """The server's count where it reported one, else the content chunks."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks


class ChatTarget(Target):
    """Streamed completions on a pool of keep-alive connections (one ``httpx.AsyncClient`` per client process)."""

    def __init__(self, spec: TargetSpec) -> None:
        parts = urlsplit(spec.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"bench URL {spec.url!r} is not an http(s)://host:port URL", "give e.g. --url http://127.0.0.1:8000"
            )
        if spec.endpoint not in ENDPOINTS:
            raise ConfigError(f"unknown --endpoint {spec.endpoint!r}", f"use one of {', '.join(ENDPOINTS)}")
        base = spec.url.rstrip("/")
        self.url = base.removesuffix("/v1") + ENDPOINTS[spec.endpoint]
        self.spec = spec
        self.extra = parse_extra_body(spec.extra_body)
        self._bodies: dict[str, bytes] = {}
        self._client: Any = None

    def body(self, text: str) -> bytes:
        raw = self._bodies.get(text)
        if raw is None:
            spec = self.spec
            req: dict[str, Any] = {"model": spec.model, "max_tokens": spec.max_tokens, "temperature": 0.0}
            if spec.endpoint == "chat":
                req["messages"] = [{"role": "user", "content": text}]
            else:
                req["prompt"] = text
            req |= {"stream": True, "stream_options": {"include_usage": True}}
            if spec.ignore_eos:
                req["ignore_eos"] = True
            req |= self.extra
            raw = self._bodies[text] = json.dumps(req, ensure_ascii=False).encode()
        return raw

    async def open(self) -> None:
        import httpx

        n = max(1, self.spec.max_connections)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.spec.timeout_s),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def send(self, text: str) -> str:
        return (await self.send_detailed(text))[0]

    async def send_detailed(self, text: str) -> tuple[str, StreamRecord]:
        import httpx

        start = time.perf_counter()
        rec = StreamRecord(status="ok", latency_s=0.0)
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                async with self._client.stream("POST", self.url, content=self.body(text)) as resp:
                    if resp.status_code != 200:
                        rec.status, rec.error = str(resp.status_code), error_message(await resp.aread())
                    else:
                        rec.status = await self._read_stream(resp, rec, start)
        except (TimeoutError, httpx.TimeoutException):
            rec.status, rec.error = "timeout", f"no end within {self.spec.timeout_s:g} s"
        except (httpx.HTTPError, OSError) as exc:
            rec.status, rec.error = "connection", f"{type(exc).__name__}: {exc}"
        rec.latency_s = time.perf_counter() - start
        return rec.status, rec

    async def _read_stream(self, resp: Any, rec: StreamRecord, start: float) -> str:
        """Read the SSE stream into ``rec``; the request's label."""
        chat, first, last = self.spec.endpoint == "chat", start, start
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return "ok"
            now = time.perf_counter()
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                rec.error = f"a stream chunk is not JSON: {payload[:200]}"
                return "bad_body"
            if "error" in chunk:
                rec.error = error_message(payload.encode())
                return "stream_error"
            usage = chunk.get("usage")
            if usage:
                rec.usage_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if content:
                    if rec.ttft_s is None:
                        rec.ttft_s, first = now - start, now
                    else:
                        rec.gaps_s.append(now - last)
                    last, rec.decode_s = now, now - first
                    rec.content_chunks += 1
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        rec.error = "the stream ended without 'data: [DONE]'"
        return "bad_body"


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body (``{"error": {"message": ...}}``), else the body's start."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace")
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


def parse_extra_body(raw: str | None) -> dict[str, Any]:
    """``--extra-body`` (a JSON object merged into every request body)."""
    if not raw:
        return {}
    fix = """write e.g. --extra-body '{"top_k": 1}'"""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-body {raw!r} is not JSON ({exc.msg})", fix) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--extra-body {raw!r} is not a JSON object", fix)
    return doc
