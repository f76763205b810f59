"""Conversations that survive scale-out, end to end: the three-turn meeting booking ("帮我订个会议室", "明天上午九点",
"8个人，两个小时") over HTTP, 100 conversations each

* on ``miaohui serve --workers 2`` with no session option (the workers share a SQLite file of the run); every turn
  on a fresh connection, so the kernel hands turns to either worker (responses name the worker);
* alternating between two ``miaohui serve`` instances sharing one real ``redis-server`` (``--session-store``).

Every conversation must keep its state every time: turn numbers 1, 2, 3, the booking continued on turns 2 and 3
(not "我是会议室预订助手，只能帮您..."), the date of turn 2 still there on turn 3. The real e5-small intent model (an fp32 ONNX Runtime engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.artifacts import scratch_dir
from tests.e2e.test_workers import Served, ready_workers, serve_workers
from tests.redis_server import RedisServer, redis_server

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, write_model_config

pytestmark = pytest.mark.slow  # four server processes load the intent model

BOOKING = ("帮我订个会议室", "明天上午九点", "8个人，两个小时")
CONVERSATIONS = 100
CONCURRENCY = 8


@pytest.fixture(scope="module")
def repo(intent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with scratch_dir(tmp_path_factory, "sessions-repo") as root:
        build_artifact(intent_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
        write_model_config(root / "intent" / "config.yaml", ModelConfig(threads=1))
        yield root


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def serve(repo: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *options: str) -> Iterator[Served]:
    root = tmp_path_factory.mktemp(name)
    (root / "intent").symlink_to(repo / "intent")
    yield from serve_workers(root, *options)


async def converse(urls: list[str], index: int, sem: asyncio.Semaphore) -> list[dict[str, Any]]:
    """One booking conversation, turn i going to ``urls[(i + index) % len(urls)]`` on a fresh connection."""
    replies: list[dict[str, Any]] = []
    session: str | None = None
    async with sem:
        for i, text in enumerate(BOOKING):
            async with httpx.AsyncClient(timeout=60) as client:  # a new connection per turn
                body = {"text": text} | ({"session_id": session} if session else {})
                r = await client.post(f"{urls[(i + index) % len(urls)]}/v1/dialogue/meeting_assistant", json=body)
            assert r.status_code == 200, r.text
            replies.append(r.json())
            session = replies[-1]["session_id"]
    return replies


def kept(replies: list[dict[str, Any]]) -> bool:
    return (
        [r["turn"] for r in replies] == [1, 2, 3]
        and [r["new_session"] for r in replies] == [True, False, False]
        and [r["intent"] for r in replies] == ["book_meeting_room"] * 3
        and replies[2]["memory"].get("booking_start") == replies[1]["memory"].get("booking_start") is not None
        and replies[2]["memory"].get("attendees") == 8.0
    )


def run_all(urls: list[str]) -> list[list[dict[str, Any]]]:
    async def main() -> list[list[dict[str, Any]]]:
        sem = asyncio.Semaphore(CONCURRENCY)
        return list(await asyncio.gather(*(converse(urls, i, sem) for i in range(CONVERSATIONS))))

    return asyncio.run(main())


def test_booking_across_two_workers(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    for served in serve(repo, tmp_path_factory, "two-workers", "--workers", "2"):
        ready_workers(served.url)  # both workers accept connections
        conversations = run_all([served.url])
        assert sum(kept(c) for c in conversations) == CONVERSATIONS, [c for c in conversations if not kept(c)][:2]
        crossed = sum(len({r["worker"] for r in c}) > 1 for c in conversations)
        print(f"--workers 2: {CONVERSATIONS} of {CONVERSATIONS} conversations kept, {crossed} crossed workers")
        assert crossed >= 1  # the kernel spread the turns over both workers


def test_booking_across_two_servers_sharing_redis(
    repo: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = ("--session-store", redis.url)
    for a in serve(repo, tmp_path_factory, "server-a", *store):
        for b in serve(repo, tmp_path_factory, "server-b", *store):
            conversations = run_all([a.url, b.url])
            assert sum(kept(c) for c in conversations) == CONVERSATIONS, [c for c in conversations if not kept(c)][:2]
            print(f"two servers, one Redis: {CONVERSATIONS} of {CONVERSATIONS} conversations kept")
