"""The one load tool every server gets (project venv): closed-loop intent requests over aiohttp, and OpenAI
chat streams through the ``openai`` client.

Intent: ``concurrency`` workers each send one text per request, the next as soon as the answer arrives, cycling
through the same texts, for ``seconds`` after a warm-up; req/s = answered requests / wall time. Generation:
``streams`` chat completions at once (the prompts cycled), greedy, ``max_tokens`` each; a token is a streamed
chunk with content; TTFT = request start → first token, TPOT = the gaps between a stream's tokens. Every request
opens with a system line of its own (:func:`system_line`, numbered per request), so no server's prompt cache can
skip the prefill of a prompt it saw in the warm-up or an earlier round: the prompts repeat otherwise, and miaohui's
backends reuse cached prefixes by default where the llama.cpp peer runs with ``cache_prompt: false``.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms) if ms else float("nan"),
    }


# ---- intent ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IntentTarget:
    """How to ask one server for one text's intent: ``protocol`` is ``kserve`` (v2 JSON, TEXT BYTES), ``intent``
    (miaohui's ``/v1/intent``) or ``litserve`` (``/predict``); ``kserve_shape`` is TEXT's shape ([1] or, for a
    Triton model with a batch dimension, [1, 1])."""

    url: str
    protocol: str
    model: str = "intent"
    kserve_shape: tuple[int, ...] = (1,)

    def request(self, text: str) -> tuple[str, dict[str, Any]]:
        if self.protocol == "kserve":
            body = {"inputs": [{"name": "TEXT", "shape": list(self.kserve_shape), "datatype": "BYTES", "data": [text]}]}
            return f"{self.url}/v2/models/{self.model}/infer", body
        if self.protocol == "intent":
            return f"{self.url}/v1/intent", {"text": text}
        if self.protocol == "litserve":
            return f"{self.url}/predict", {"text": text}
        raise ValueError(f"unknown protocol {self.protocol!r}")

    @staticmethod
    def intent_of(protocol: str, answer: dict[str, Any]) -> str:
        """The predicted intent in a server's answer (to check that every server agrees)."""
        if protocol == "kserve":
            out = {o["name"]: o["data"] for o in answer["outputs"]}
            value = out["INTENT"][0]
            return value if isinstance(value, str) else str(value)
        return str(answer["intent"])


async def _intent_async(target: IntentTarget, texts: list[str], concurrency: int, seconds: float, warmup: int) -> dict:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors: list[str] = []
    counter = itertools.count()
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(text: str) -> tuple[float, dict[str, Any] | None]:
            url, body = target.request(text)
            start = time.perf_counter()
            async with session.post(url, json=body) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200:
                    errors.append(f"{resp.status}: {str(answer)[:200]}")
                    return time.perf_counter() - start, None
            return time.perf_counter() - start, answer

        await asyncio.gather(*(one(texts[i % len(texts)]) for i in range(max(warmup, concurrency))))
        errors.clear()
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                seconds_taken, answer = await one(texts[next(counter) % len(texts)])
                if answer is not None:
                    latencies.append(seconds_taken)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "req_per_s": len(latencies) / wall,
        "latency_ms": stats_ms(latencies),
        "wall_s": wall,
    }


def intent_load(target: IntentTarget, texts: list[str], concurrency: int, seconds: float, warmup: int = 16) -> dict:
    return asyncio.run(_intent_async(target, texts, concurrency, seconds, warmup))


def intent_answers(target: IntentTarget, texts: list[str]) -> list[str]:
    """One request per text, in turn: the intents the server predicts (the smoke check)."""

    async def run() -> list[str]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            out = []
            for text in texts:
                url, body = target.request(text)
                async with session.post(url, json=body) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}: {answer}")
                out.append(IntentTarget.intent_of(target.protocol, answer))
            return out

    return asyncio.run(run())


# ---- generation ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatTarget:
    """An OpenAI-compatible server: base URL (…/v1), the model name it expects, extra request fields."""

    base_url: str
    model: str
    extra_body: dict[str, Any] | None = None


def system_line(request: int) -> str:
    """The system message of the ``request``-th request of a load: its number comes first, so two requests' prompts
    part after a few tokens and a prompt cache has nothing of one to give the other."""
    return f"{request}: you are a helpful assistant."


async def _stream(
    client: Any, target: ChatTarget, question: str, max_tokens: int, request: int
) -> tuple[float, list[float], str]:
    start = time.perf_counter()
    times: list[float] = []
    text = []
    stream = await client.chat.completions.create(
        model=target.model,
        messages=[{"role": "system", "content": system_line(request)}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=target.extra_body,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return start, times, "".join(text)


class _Tally:
    """One server's streamed requests over the rounds of a level: TTFT, the gaps between tokens, tokens, wall."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.wall = 0.0
        self.texts: list[str] = []

    def add(self, results: list[tuple[float, list[float], str]], wall: float) -> None:
        self.wall += wall
        for start, times, text in results:
            if times:
                self.ttft.append(times[0] - start)
                self.gaps += [b - a for a, b in itertools.pairwise(times)]
            self.tokens += len(times)
            self.texts.append(text)

    def summary(self, streams: int) -> dict[str, Any]:
        return {
            "streams": streams,
            "ttft_ms": stats_ms(self.ttft),
            "tpot_ms": stats_ms(self.gaps),
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.wall if self.wall else float("nan"),
            "wall_s": self.wall,
            "first_answer": self.texts[0][:200] if self.texts else "",
        }


async def _generation_async(
    targets: dict[str, ChatTarget], questions: list[str], streams: int, max_tokens: int, runs: int
) -> dict[str, dict[str, Any]]:
    import httpx
    from openai import AsyncOpenAI

    # a connection per request: llama.cpp's server closes idle keep-alive connections, and a request sent on one it
    # has just closed fails (no retries here, so that no retry hides in a latency); a localhost connect is ~0.2 ms
    clients = {
        name: AsyncOpenAI(
            base_url=target.base_url,
            api_key="none",
            timeout=600,
            max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600),
        )
        for name, target in targets.items()
    }
    batch = [questions[i % len(questions)] for i in range(streams)]
    numbers = itertools.count()  # every request's own system line (module docstring)
    warm = batch[: min(streams, 2)]
    tallies = {name: _Tally() for name in targets}
    names = list(targets)
    for name in names:  # warm-up
        await asyncio.gather(*(_stream(clients[name], targets[name], q, max_tokens, next(numbers)) for q in warm))
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each server first in turn
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(_stream(clients[name], targets[name], q, max_tokens, next(numbers)) for q in batch)
            )
            tallies[name].add(results, time.perf_counter() - t0)
    for client in clients.values():
        await client.close()
    return {name: tally.summary(streams) for name, tally in tallies.items()}


def generation_load(target: ChatTarget, questions: list[str], streams: int, max_tokens: int, runs: int = 1) -> dict:
    return asyncio.run(_generation_async({"one": target}, questions, streams, max_tokens, runs))["one"]


def generation_rounds(
    targets: dict[str, ChatTarget], questions: list[str], streams: int, max_tokens: int, runs: int
) -> dict[str, dict[str, Any]]:
    """:func:`generation_load` of several servers, all running, round by round in turn (each first in turn): a
    machine whose speed drifts between minutes then moves every server's rounds alike, and a ratio compares
    rounds taken seconds apart rather than minutes."""
    return asyncio.run(_generation_async(targets, questions, streams, max_tokens, runs))
