"""Multi-turn dialogue sessions kept server-side, bounded in time and size.

A pipeline answers a turn inside :meth:`SessionBackend.turn`: the session is found (or made), the turn runs
under the session's lock, and the changed session is stored when the turn succeeded (a failed turn leaves the
session as it was). Backends:

* :class:`SessionStore` (``memory``, the embedded default) — the sessions of one process, in its memory.
* :class:`~miaohui.dialogue.session_stores.SqliteSessionStore` — a SQLite file in WAL mode that the processes
  of one host share (``miaohui serve --workers N`` uses one in its run directory without any set-up).
* :class:`~miaohui.dialogue.session_stores.RedisSessionStore` — a Redis server that several hosts share.

The shared backends store a session as JSON (:func:`session_to_json`) with a version number; a turn's write
succeeds only over the version it read, so two turns of one session racing in two processes cannot both
win (the loser answers 409). A store that cannot be reached answers 503 and never starts the conversation
afresh.

:class:`SessionStore` maps session ids to :class:`Session` objects (history, slot memory, a pending action,
the session's language). Bounds:

* ``ttl_s`` — a session unused that long is gone: the next turn with its id starts afresh.
* ``max_sessions`` — when a new session would exceed it, the least recently used one is evicted (LRU).
* ``max_turns`` — a session keeps its last ``max_turns`` turns of history (older turns drop off; the slot
  memory is kept).

The store is pure Python with an injectable clock (``time.monotonic`` by default); access order equals
last-use order, so expired sessions are always at the front of the LRU order and a sweep stops at the
first live one (amortized O(1) per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miaohui.dialogue.answers import MemoryValue
from miaohui.dialogue.knowledge import Lang
from miaohui.errors import InputError

__all__ = [
    "Session",
    "SessionBackend",
    "SessionConfig",
    "SessionStats",
    "SessionStore",
    "Turn",
    "check_session_id",
    "session_from_json",
    "session_to_json",
]

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


class SessionConfig(BaseModel):
    """Bounds of a pipeline's session store (its YAML's ``session:`` block)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttl_s: float = Field(default=1800.0, gt=0.0)
    """Seconds a session lives after its last turn."""
    max_sessions: int = Field(default=10_000, ge=1)
    """Most sessions held; the least recently used is evicted beyond it."""
    max_turns: int = Field(default=20, ge=1)
    """Turns of history kept per session (the oldest drop off)."""


@dataclass(frozen=True)
class Turn:
    """One exchange of a session."""

    user: str
    reply: str
    intent: str
    prompt_user: str | None = None
    """The user message as the chat model saw it (the words with the turn's reference facts); None: ``user``."""
    prompt_reply: str | None = None
    """The chat model's own reply when compliance kept it (a disclaimer may follow it in ``reply``); None:
    ``reply``. The next turn's prompt repeats these two, so it starts with this turn's prompt and answer."""


@dataclass
class Session:
    """One conversation's server-side state."""

    id: str
    max_turns: int
    last_used: float
    lang: Lang | None = None
    memory: dict[str, MemoryValue] = field(default_factory=dict)
    """Slot memory: the latest value of each slot name, plus action state (room, booking date ...)."""
    pending: str | None = None
    """Intent of an action waiting for more information (e.g. a booking without a room)."""
    turns_total: int = 0
    version: int = 0
    """Stored version this session was read at (shared backends; 0: not stored yet)."""
    turns: deque[Turn] = field(init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held while a turn runs: turns of one session are answered one after the other."""

    def __post_init__(self) -> None:
        self.turns = deque(maxlen=self.max_turns)

    def add_turn(self, turn: Turn) -> None:
        self.turns.append(turn)
        self.turns_total += 1


class SessionStats(BaseModel):
    """Counters of a session store since it was made."""

    active: int
    created: int
    expired: int
    evicted: int


def check_session_id(session_id: str | None) -> str:
    """``session_id`` when well formed, a new random id for None; InputError otherwise."""
    if session_id is not None and not _SESSION_ID_RE.match(session_id):
        raise InputError(
            f"bad session id {session_id[:40]!r}",
            "use 1-128 characters from letters, digits and _ . : @ -, or omit it to start a new session",
        )
    return session_id or uuid.uuid4().hex


def session_to_json(session: Session) -> str:
    """The stored form of a session (what the shared backends keep)."""
    return json.dumps(
        {
            "lang": session.lang,
            "memory": session.memory,
            "pending": session.pending,
            "turns_total": session.turns_total,
            "turns": [[t.user, t.reply, t.intent, t.prompt_user, t.prompt_reply] for t in session.turns],
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )


def session_from_json(session_id: str, data: str, version: int, max_turns: int, last_used: float) -> Session:
    """The session stored as ``data`` (see :func:`session_to_json`) at ``version``."""
    raw: dict[str, Any] = json.loads(data)
    session = Session(id=session_id, max_turns=max_turns, last_used=last_used, version=version)
    session.lang = raw.get("lang")
    session.memory = dict(raw.get("memory") or {})
    session.pending = raw.get("pending")
    session.turns_total = int(raw.get("turns_total") or 0)
    session.turns.extend(Turn(*t) for t in raw.get("turns") or [])
    return session


class SessionBackend(ABC):
    """Where a pipeline's sessions live (see the module docstring)."""

    config: SessionConfig
    where: str = "memory"
    """What the store is, for messages and logs (never a password)."""

    @abstractmethod
    def turn(self, session_id: str | None) -> contextlib.AbstractAsyncContextManager[tuple[Session, bool]]:
        """``async with store.turn(sid) as (session, created)``: the session of ``sid`` (a new one for None, an
        unknown or an expired id) held for one turn; stored when the block ends without an exception."""

    @abstractmethod
    def stats(self) -> SessionStats:
        """Counters of this store (the shared backends: this process's, ``active`` from the store)."""

    async def close(self) -> None:  # noqa: B027 - nothing to release for most stores
        """Release connections (the server calls it at shutdown)."""


class SessionStore(SessionBackend):
    """Sessions by id with a TTL, an LRU size bound and a per-session turn bound, in this process's memory."""

    def __init__(self, config: SessionConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or SessionConfig()
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._created = self._expired = self._evicted = 0

    def __len__(self) -> int:
        self._sweep(self._clock())
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        self._sweep(self._clock())
        return session_id in self._sessions

    def _sweep(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used < self.config.ttl_s:
                return
            del self._sessions[oldest.id]
            self._expired += 1

    def get(self, session_id: str | None = None) -> tuple[Session, bool]:
        """The live session ``session_id`` (touched), or a new one; ``(session, created)``.

        ``None`` makes a new session with a random id; an unknown or expired id makes a new session with
        that id.
        """
        sid = check_session_id(session_id)
        now = self._clock()
        self._sweep(now)
        session = self._sessions.get(sid)
        if session is not None:
            session.last_used = now
            self._sessions.move_to_end(sid)
            return session, False
        while len(self._sessions) >= self.config.max_sessions:
            self._sessions.popitem(last=False)
            self._evicted += 1
        session = Session(id=sid, max_turns=self.config.max_turns, last_used=now)
        self._sessions[sid] = session
        self._created += 1
        return session, True

    @contextlib.asynccontextmanager
    async def turn(self, session_id: str | None) -> AsyncIterator[tuple[Session, bool]]:
        session, created = self.get(session_id)
        async with session.lock:
            yield session, created

    def drop(self, session_id: str) -> bool:
        """Forget a session; True if it existed."""
        return self._sessions.pop(session_id, None) is not None

    def stats(self) -> SessionStats:
        return SessionStats(active=len(self), created=self._created, expired=self._expired, evicted=self._evicted)
