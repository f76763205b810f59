"""Multi-turn dialogue sessions kept server-side, bounded in time and size.

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
import re
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from miaohui.dialogue.answers import MemoryValue
from miaohui.dialogue.knowledge import Lang
from miaohui.errors import InputError

__all__ = ["Session", "SessionConfig", "SessionStats", "SessionStore", "Turn"]

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


class SessionStore:
    """Sessions by id with a TTL, an LRU size bound and a per-session turn bound."""

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
        if session_id is not None and not _SESSION_ID_RE.match(session_id):
            raise InputError(
                f"bad session id {session_id[:40]!r}",
                "use 1-128 characters from letters, digits and _ . : @ -, or omit it to start a new session",
            )
        now = self._clock()
        self._sweep(now)
        sid = session_id or uuid.uuid4().hex
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

    def drop(self, session_id: str) -> bool:
        """Forget a session; True if it existed."""
        return self._sessions.pop(session_id, None) is not None

    def stats(self) -> SessionStats:
        return SessionStats(active=len(self), created=self._created, expired=self._expired, evicted=self._evicted)
