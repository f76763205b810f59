"""The shared session stores with real backends: a SQLite file (WAL) and a real ``redis-server`` on a free localhost
port (skipped only when the binary is absent; ``scripts/install_redis.sh`` installs it).

Two :class:`~miaohui.dialogue.pipeline.Pipeline` objects with their own store objects over one backend stand in for
two processes (the end-to-end test with ``miaohui serve --workers 2`` and two servers is tests/e2e/test_sessions.py).
Checked: the three-turn booking alternating between them keeps its state; TTL; the size bound; two turns of one
session racing (409); a store that cannot be reached (Redis frozen with SIGSTOP, Redis killed, a SQLite path that
cannot be made) answers 503 naming the store, and after a freeze the conversation continues where it was.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.redis_server import RedisServer, redis_server
from tests.unit.test_pipeline import NOW, FakeClassifier

from miaohui.dialogue.config import load_pipeline_config
from miaohui.dialogue.pipeline import Pipeline
from miaohui.dialogue.session import SessionBackend, SessionConfig
from miaohui.dialogue.session_stores import RedisSessionStore, SqliteSessionStore, open_session_store
from miaohui.errors import ConfigError, ConflictError, UnavailableError

BOOKING = ("帮我订个会议室", "明天上午九点", "8个人，两个小时")


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def stores(
    kind: str, where: Path, redis: RedisServer | None, config: SessionConfig, n: int = 2
) -> list[SessionBackend]:
    if kind == "sqlite":
        return [SqliteSessionStore(where / "sessions.db", "meeting_assistant", config) for _ in range(n)]
    assert redis is not None
    prefix = f"t{time.monotonic_ns()}"  # a fresh pipeline name per test: one Redis serves the module
    return [RedisSessionStore(redis.url, prefix, config) for _ in range(n)]


@pytest.fixture(params=["sqlite", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def backend_redis(kind: str, request: pytest.FixtureRequest) -> RedisServer | None:
    return request.getfixturevalue("redis") if kind == "redis" else None


async def test_booking_alternating_between_two_processes_keeps_its_state(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cfg = load_pipeline_config("meeting_assistant")
    a, b = (
        Pipeline(cfg, FakeClassifier(), clock=lambda: NOW, sessions=s)
        for s in stores(kind, tmp_path, backend_redis(kind, request), cfg.session)
    )
    for n in range(3):
        sid = f"conv-{n}"
        replies = [await (a, b)[(i + n) % 2].run_turn(text, sid) for i, text in enumerate(BOOKING)]
        assert [r.turn for r in replies] == [1, 2, 3]
        assert [r.new_session for r in replies] == [True, False, False]
        assert [r.intent for r in replies] == ["book_meeting_room"] * 3
        last = replies[2]  # the date from turn 2, the size from turn 3: only rooms for 8 are offered
        assert last.variant == "need_room" and last.memory["booking_start"] == "2026-03-04T09:00:00+08:00"
        assert (last.memory["attendees"], last.memory["booking_minutes"]) == (8.0, 120.0)
    await a.sessions.close()
    await b.sessions.close()


async def test_ttl_and_size_bound_sqlite(tmp_path: Path) -> None:
    clock = Clock()
    store = SqliteSessionStore(tmp_path / "s.db", "p", SessionConfig(ttl_s=60, max_sessions=2), clock=clock)
    async with store.turn("a") as (s, created):
        s.memory["x"] = 1.0
    clock.t += 59
    async with store.turn("a") as (s, created):
        assert not created and s.memory == {"x": 1.0}
    clock.t += 60
    async with store.turn("a") as (s, created):
        assert created and s.memory == {}
    for sid in ("b", "c"):
        clock.t += 1
        async with store.turn(sid):
            pass
    assert store.stats().model_dump() == {"active": 2, "created": 4, "expired": 1, "evicted": 1}
    async with store.turn("a") as (s, created):  # the least recently used went first
        assert created


async def test_ttl_and_size_bound_redis(redis: RedisServer) -> None:
    store = RedisSessionStore(redis.url, f"p{time.monotonic_ns()}", SessionConfig(ttl_s=0.2, max_sessions=2))
    async with store.turn("a") as (s, created):
        s.memory["x"] = 1.0
    async with store.turn("a") as (s, created):
        assert not created and s.memory == {"x": 1.0}
    time.sleep(0.4)  # Redis expires the key itself
    async with store.turn("a") as (s, created):
        assert created and s.memory == {}
    big = RedisSessionStore(redis.url, f"p{time.monotonic_ns()}", SessionConfig(max_sessions=2))
    for sid in ("a", "b", "c"):
        async with big.turn(sid):
            pass
    assert await big.active() == 2 and big.stats().evicted == 1
    async with big.turn("a") as (s, created):
        assert created
    await store.close()
    await big.close()


async def test_racing_turns_of_one_session_conflict(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    a, b = stores(kind, tmp_path, backend_redis(kind, request), SessionConfig())
    async with a.turn("s"):
        pass
    with pytest.raises(ConflictError) as exc:
        async with a.turn("s") as (sa, _):
            async with b.turn("s") as (sb, _):  # another process's turn of the same session finishes first
                sb.memory["who"] = "b"
            sa.memory["who"] = "a"
    assert str(exc.value) == (
        "session 's' was changed by another turn while this one ran — send the turns of one session one after the "
        "other (wait for each reply), then resend this turn"
    )
    async with a.turn("s") as (s, created):
        assert s.memory == {"who": "b"} and not created
    await a.close()
    await b.close()


async def test_frozen_or_dead_redis_is_a_503_and_the_conversation_survives_a_freeze(
    tmp_path: Path, redis: RedisServer
) -> None:
    cfg = load_pipeline_config("meeting_assistant")
    store = RedisSessionStore(redis.url, f"p{time.monotonic_ns()}", cfg.session, timeout_s=0.3)
    pipe = Pipeline(cfg, FakeClassifier(), clock=lambda: NOW, sessions=store)
    assert (await pipe.run_turn(BOOKING[0], "x")).turn == 1
    os.kill(redis.proc.pid, signal.SIGSTOP)  # a real fault: the server stops answering
    try:
        with pytest.raises(UnavailableError) as exc:
            await pipe.run_turn(BOOKING[1], "x")
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    assert str(exc.value).startswith(f"the session store redis://127.0.0.1:{redis.port}/0 cannot be reached (")
    assert str(exc.value).endswith(
        " — the conversation was kept as it was, not restarted; retry the turn once the store is back"
    )
    await store.close()  # the timed-out connection
    again = await pipe.run_turn(BOOKING[1], "x")
    assert (again.turn, again.new_session, again.intent) == (2, False, "book_meeting_room")
    dead = RedisSessionStore("redis://:secret@127.0.0.1:1/0", "p", cfg.session, timeout_s=0.3)
    with pytest.raises(UnavailableError) as exc:
        async with dead.turn("x"):
            pass
    assert str(exc.value).startswith("the session store redis://127.0.0.1:1/0 cannot be reached (ConnectionError")
    assert "secret" not in str(exc.value)


async def test_sqlite_that_cannot_be_opened_is_a_503(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = SqliteSessionStore(tmp_path / "file" / "sessions.db", "p")
    with pytest.raises(UnavailableError) as exc:
        async with store.turn("x"):
            pass
    assert str(exc.value).startswith(f"the session store sqlite:{tmp_path}/file/sessions.db cannot be reached (")


def test_unknown_store() -> None:
    with pytest.raises(ConfigError) as exc:
        open_session_store("mysql://x", "p", SessionConfig())
    assert str(exc.value) == (
        "unknown session store 'mysql://x' — use memory (one process), sqlite:/path/to/sessions.db (the processes "
        "of one host) or redis://host:6379/0 (several servers)"
    )
