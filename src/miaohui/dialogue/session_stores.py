"""Session stores that several processes share: SQLite (one host) and Redis (several hosts).

Both keep a session as JSON (:func:`~miaohui.dialogue.session.session_to_json`) under its pipeline and id with
a version number and its last use (wall-clock seconds: every process reads the same clock). A turn reads the
session, runs, and writes it back only over the version it read (compare-and-set): two turns of one session
racing in two processes cannot both win; the loser answers 409 (:class:`~miaohui.errors.ConflictError`).
Within one process the turns of a session also wait for each other (an asyncio lock per session id).

Bounds, as :class:`~miaohui.dialogue.session.SessionConfig` gives them: a session unused for ``ttl_s`` is gone
(SQLite: found expired and deleted on the next read or write; Redis: the key's own expiry); beyond
``max_sessions`` sessions of a pipeline the least recently used are deleted when a new one is stored; a session
keeps its last ``max_turns`` turns.

A store that cannot be reached (Redis down or frozen past ``socket_timeout``, the SQLite file unwritable)
answers 503 (:class:`~miaohui.errors.UnavailableError`) naming the store: the conversation is neither restarted
nor answered without its state. :func:`open_session_store` makes the store a server's ``--session-store``
names.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miaohui.dialogue.session import (
    Session,
    SessionBackend,
    SessionConfig,
    SessionStats,
    SessionStore,
    check_session_id,
    session_from_json,
    session_to_json,
)
from miaohui.errors import ConfigError, ConflictError, UnavailableError

__all__ = ["RedisSessionStore", "SqliteSessionStore", "open_session_store", "store_kind"]

REDIS_TIMEOUT_S = 2.0
"""Seconds a Redis call may take before the turn answers 503 (a frozen or unreachable server)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    pipeline TEXT NOT NULL,
    id TEXT NOT NULL,
    data TEXT NOT NULL,
    version INTEGER NOT NULL,
    last_used REAL NOT NULL,
    PRIMARY KEY (pipeline, id)
);
CREATE INDEX IF NOT EXISTS sessions_by_use ON sessions (pipeline, last_used);
"""


def _conflict(session_id: str) -> ConflictError:
    return ConflictError(
        f"session {session_id!r} was changed by another turn while this one ran",
        "send the turns of one session one after the other (wait for each reply), then resend this turn",
    )


class _SharedStore(SessionBackend):
    """What the SQLite and Redis stores share: the per-process lock of a session id and the turn protocol."""

    def __init__(self, pipeline: str, config: SessionConfig, clock: Callable[[], float]) -> None:
        self.pipeline = pipeline
        self.config = config
        self._clock = clock
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._created = self._expired = self._evicted = 0

    @contextlib.asynccontextmanager
    async def _locked(self, sid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(sid) or (asyncio.Lock(), 0)
        self._locks[sid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[sid]
            if users == 1:
                del self._locks[sid]
            else:
                self._locks[sid] = (lock, users - 1)

    @contextlib.asynccontextmanager
    async def turn(self, session_id: str | None) -> AsyncIterator[tuple[Session, bool]]:
        sid = check_session_id(session_id)
        async with self._locked(sid):
            now = self._clock()
            found = await self._load(sid, now)
            if found is None:
                session, created = Session(id=sid, max_turns=self.config.max_turns, last_used=now), True
            else:
                session, created = found, False
            yield session, created
            session.last_used = self._clock()
            await self._store(session, created)
            if created:
                self._created += 1

    def _unavailable(self, exc: BaseException) -> UnavailableError:
        return UnavailableError(
            f"the session store {self.where} cannot be reached ({type(exc).__name__}: {exc})",
            "the conversation was kept as it was, not restarted; retry the turn once the store is back",
        )

    async def _load(self, sid: str, now: float) -> Session | None:
        raise NotImplementedError

    async def _store(self, session: Session, created: bool) -> None:
        raise NotImplementedError


SQLITE_SETUP_TRIES = 50
"""How often opening the shared file is tried while another process holds it (switching it to WAL and creating the
table need the file alone for a moment: two workers' first turns arrive together), 0.1 s apart."""


def _open_sqlite(path: Path) -> sqlite3.Connection:
    """A connection to the shared session file in WAL mode with the table made; retried while another process is
    setting the file up (SQLite answers "database is locked" there without waiting for its busy timeout)."""
    for attempt in range(SQLITE_SETUP_TRIES):
        db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            if "locked" not in str(exc) or attempt == SQLITE_SETUP_TRIES - 1:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


class SqliteSessionStore(_SharedStore):
    """Sessions in a SQLite file in WAL mode: the processes of one host share them (readers never wait for the
    writer; a write holds the file's lock for one row)."""

    def __init__(
        self, path: Path, pipeline: str, config: SessionConfig | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(pipeline, config or SessionConfig(), clock)
        self.path = Path(path)
        self.where = f"sqlite:{self.path}"
        self._db: sqlite3.Connection | None = None

    @contextlib.contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            if self._db is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = _open_sqlite(self.path)
            yield self._db
        except (sqlite3.Error, OSError) as exc:
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._db = None
            raise self._unavailable(exc) from None

    async def _load(self, sid: str, now: float) -> Session | None:
        with self._conn() as db:
            row = db.execute(
                "SELECT data, version, last_used FROM sessions WHERE pipeline = ? AND id = ?", (self.pipeline, sid)
            ).fetchone()
            if row is None:
                return None
            data, version, last_used = row
            if now - last_used >= self.config.ttl_s:
                db.execute(
                    "DELETE FROM sessions WHERE pipeline = ? AND id = ? AND version = ?", (self.pipeline, sid, version)
                )
                self._expired += 1
                return None
        return session_from_json(sid, data, version, self.config.max_turns, last_used)

    async def _store(self, session: Session, created: bool) -> None:
        data, now = session_to_json(session), session.last_used
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                if created:
                    db.execute(
                        "DELETE FROM sessions WHERE pipeline = ? AND last_used <= ?",
                        (self.pipeline, now - self.config.ttl_s),
                    )
                    cur = db.execute(
                        "INSERT OR IGNORE INTO sessions VALUES (?, ?, ?, 1, ?)", (self.pipeline, session.id, data, now)
                    )
                    if cur.rowcount == 1:
                        self._evicted += self._trim(db)
                else:
                    cur = db.execute(
                        "UPDATE sessions SET data = ?, version = version + 1, last_used = ? "
                        "WHERE pipeline = ? AND id = ? AND version = ?",
                        (data, now, self.pipeline, session.id, session.version),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        if cur.rowcount != 1:
            raise _conflict(session.id)

    def _trim(self, db: sqlite3.Connection) -> int:
        (count,) = db.execute("SELECT COUNT(*) FROM sessions WHERE pipeline = ?", (self.pipeline,)).fetchone()
        extra = count - self.config.max_sessions
        if extra <= 0:
            return 0
        db.execute(
            "DELETE FROM sessions WHERE pipeline = ? AND id IN "
            "(SELECT id FROM sessions WHERE pipeline = ? ORDER BY last_used LIMIT ?)",
            (self.pipeline, self.pipeline, extra),
        )
        return int(extra)

    def stats(self) -> SessionStats:
        with self._conn() as db:
            (active,) = db.execute(
                "SELECT COUNT(*) FROM sessions WHERE pipeline = ? AND last_used > ?",
                (self.pipeline, self._clock() - self.config.ttl_s),
            ).fetchone()
        return SessionStats(active=active, created=self._created, expired=self._expired, evicted=self._evicted)

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


# Compare-and-set of one session, then the LRU bound. KEYS: the session's key, the pipeline's index (a sorted set
# of ids by last use). ARGV: expected version (0: new), data, ttl in ms, now, max sessions, id, key prefix.
# Returns -1 on a version conflict, else how many sessions the size bound evicted.
_STORE_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if current ~= tonumber(ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], 'v', current + 1, 'data', ARGV[2], 'used', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[3]) / 1000)
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
local evicted = 0
if extra > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], extra)
  for i = 1, #old, 2 do
    redis.call('DEL', ARGV[7] .. old[i])
    evicted = evicted + 1
  end
end
return evicted
"""


class RedisSessionStore(_SharedStore):
    """Sessions in Redis (``redis://host:port/db``): every server pointed at the same Redis shares them. A session
    is a hash (version, JSON, last use) that Redis expires ``ttl_s`` after its last write."""

    def __init__(
        self,
        url: str,
        pipeline: str,
        config: SessionConfig | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = REDIS_TIMEOUT_S,
    ) -> None:
        super().__init__(pipeline, config or SessionConfig(), clock)
        try:
            import redis.asyncio as aioredis
        except ImportError:  # pragma: no cover - a declared dependency
            raise ConfigError(
                "--session-store redis://... needs the redis package", "pip install 'redis>=5.2,<9'"
            ) from None
        parts = urlsplit(url)
        self.where = f"redis://{parts.hostname}:{parts.port or 6379}{parts.path}"  # no password in messages
        self._url, self._timeout = url, timeout_s
        self._client: Any = None
        self._redis = aioredis
        self.prefix = f"miaohui:session:{pipeline}:"
        self._index = f"miaohui:sessions:{pipeline}"

    def _conn(self) -> Any:
        if self._client is None:
            self._client = self._redis.Redis.from_url(
                self._url, socket_timeout=self._timeout, socket_connect_timeout=self._timeout, decode_responses=True
            )
            self._script = self._client.register_script(_STORE_LUA)
        return self._client

    @contextlib.asynccontextmanager
    async def _calls(self) -> AsyncIterator[None]:
        from redis.exceptions import RedisError

        try:
            yield
        except (TimeoutError, RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    async def _load(self, sid: str, now: float) -> Session | None:
        async with self._calls():
            found: dict[str, str] = await self._conn().hgetall(self.prefix + sid)
        if not found:
            return None
        return session_from_json(sid, found["data"], int(found["v"]), self.config.max_turns, float(found["used"]))

    async def _store(self, session: Session, created: bool) -> None:
        ttl_ms = int(self.config.ttl_s * 1000)
        args = [0 if created else session.version, session_to_json(session), ttl_ms, session.last_used]
        args += [self.config.max_sessions, session.id, self.prefix]
        async with self._calls():
            self._conn()
            evicted = int(await self._script(keys=[self.prefix + session.id, self._index], args=args))
        if evicted < 0:
            raise _conflict(session.id)
        self._evicted += evicted

    def stats(self) -> SessionStats:
        """This process's counters; ``active`` is -1 here (a Redis call: ask :meth:`active`)."""
        return SessionStats(active=-1, created=self._created, expired=self._expired, evicted=self._evicted)

    async def active(self) -> int:
        """Sessions of this pipeline in Redis (live ones: the index drops expired ids as sessions are written)."""
        async with self._calls():
            return int(await self._conn().zcount(self._index, self._clock() - self.config.ttl_s, "+inf"))

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None


def store_kind(url: str | None) -> str:
    """``memory``, ``sqlite`` or ``redis`` for a ``--session-store`` value; ConfigError for anything else."""
    if url is None or url == "memory":
        return "memory"
    if url.startswith("sqlite:"):
        return "sqlite"
    if url.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    raise ConfigError(
        f"unknown session store {url!r}",
        "use memory (one process), sqlite:/path/to/sessions.db (the processes of one host) or "
        "redis://host:6379/0 (several servers)",
    )


def open_session_store(url: str | None, pipeline: str, config: SessionConfig) -> SessionBackend:
    """The store ``url`` names (see :func:`store_kind`) for the sessions of ``pipeline``."""
    kind = store_kind(url)
    if kind == "memory" or url is None:
        return SessionStore(config)
    if kind == "sqlite":
        return SqliteSessionStore(Path(url.removeprefix("sqlite:").removeprefix("//")), pipeline, config)
    return RedisSessionStore(url, pipeline, config)
