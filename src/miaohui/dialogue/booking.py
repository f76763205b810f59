"""Meeting-room bookings: an in-memory booking table and the two dialogue actions that use it.

:class:`BookingTable` holds bookings per room with conflict detection (half-open intervals: a meeting
ending at 10:00 does not conflict with one starting at 10:00). It is pure Python and single-threaded:
methods never await, so under asyncio every call is atomic.

:func:`book_action` (intent ``book_meeting_room``) and :func:`cancel_action` (``cancel_booking``, which
also changes a booking's time or room) read the turn's slots and the session's memory and return an
:class:`ActionResult`: the template variant and fields (like a knowledge-base answer), memory updates,
and whether the action is still *pending* — waiting for a time or a room, so that the next turn ("青松厅吧",
"改到下午三点") continues it. A booking is filled across turns: date/time, room, attendees and duration
are remembered until the booking is made.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field

from miaohui.dialogue.answers import AnswerContext, KbAnswer, MemoryValue
from miaohui.dialogue.knowledge import KnowledgeBase, Lang, MeetingRoom
from miaohui.errors import QueueFullError
from miaohui.nlp.normalize import cn_to_number

__all__ = [
    "ACTION_VARIANTS",
    "ActionResult",
    "Booking",
    "BookingSlots",
    "BookingTable",
    "book_action",
    "cancel_action",
    "continues_booking",
    "rule_slots",
]


class Booking(BaseModel):
    """One booking of a room by a session."""

    model_config = ConfigDict(frozen=True)

    id: str
    """Booking number (``B`` + 4 digits)."""
    room_id: str
    """Room id."""
    start: datetime
    """Start time (inclusive)."""
    end: datetime
    """End time (exclusive)."""
    owner: str
    """Session id of who booked it; only the owner may cancel or change it."""


class BookingTable:
    """Bookings of the knowledge base's rooms, bounded to ``max_bookings`` (ended ones are pruned first)."""

    def __init__(self, kb: KnowledgeBase, max_bookings: int = 10_000) -> None:
        self.kb = kb
        self.max_bookings = max_bookings
        self._bookings: dict[str, Booking] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._bookings)

    def conflicts(self, room_id: str, start: datetime, end: datetime, exclude: str | None = None) -> list[Booking]:
        """Bookings of ``room_id`` overlapping [start, end), other than ``exclude``."""
        found = [
            b
            for b in self._bookings.values()
            if b.room_id == room_id and b.id != exclude and b.start < end and start < b.end
        ]
        return sorted(found, key=lambda b: b.start)

    def free_rooms(self, start: datetime, end: datetime, min_capacity: int = 1) -> list[MeetingRoom]:
        """Rooms free over [start, end) with at least ``min_capacity`` seats, smallest first."""
        rooms = [r for r in self.kb.rooms if r.capacity >= min_capacity and not self.conflicts(r.id, start, end)]
        return sorted(rooms, key=lambda r: (r.capacity, r.id))

    def book(self, room_id: str, start: datetime, end: datetime, owner: str, now: datetime) -> Booking:
        """Add a booking; the caller checked :meth:`conflicts` (this method checks again and raises)."""
        if self.conflicts(room_id, start, end):
            raise ValueError(f"room {room_id} is taken over {start}–{end}")
        if len(self._bookings) >= self.max_bookings:
            self.prune(now)
        if len(self._bookings) >= self.max_bookings:
            raise QueueFullError(
                f"the booking table is full ({self.max_bookings} upcoming bookings)",
                "cancel old bookings or raise max_bookings in the pipeline's booking settings",
            )
        booking = Booking(id=f"B{next(self._ids):04d}", room_id=room_id, start=start, end=end, owner=owner)
        self._bookings[booking.id] = booking
        return booking

    def get(self, booking_id: str) -> Booking | None:
        return self._bookings.get(booking_id)

    def owned_by(self, owner: str) -> list[Booking]:
        """The bookings of ``owner``, earliest first."""
        return sorted((b for b in self._bookings.values() if b.owner == owner), key=lambda b: b.start)

    def cancel(self, booking_id: str) -> Booking | None:
        """Remove a booking; the removed booking, or None if there was none."""
        return self._bookings.pop(booking_id, None)

    def replace(self, booking: Booking) -> None:
        """Store a changed booking under its id (the caller checked for conflicts)."""
        self._bookings[booking.id] = booking

    def prune(self, now: datetime) -> int:
        """Drop bookings that ended before ``now``; how many were dropped."""
        ended = [k for k, b in self._bookings.items() if b.end <= now]
        for k in ended:
            del self._bookings[k]
        return len(ended)


class ActionResult(KbAnswer):
    """A booking action's outcome: a template variant with fields, plus dialogue state changes."""

    pending: bool = False
    """True while the action waits for more information (the next turn may continue it)."""
    remember: dict[str, MemoryValue] = Field(default_factory=dict)
    """Memory entries to set."""
    forget: list[str] = Field(default_factory=list)
    """Memory entries to drop (applied after ``remember``: a rejected time or room is not kept)."""
    booking: Booking | None = None
    """The booking made, changed or cancelled by this turn."""


# ---------------------------------------------------------------------------------------------- parsing

_CN_NUM = "[零一二两三四五六七八九十百]+"
_ATTENDEES_RE = re.compile(
    rf"(\d+|{_CN_NUM})\s*(?:个|位)?\s*(?:人|同事|位)|(\d+)\s*(?:people|persons|attendees|participants|of us)",
    re.I,
)
_DURATION_RE = re.compile(
    rf"(?P<h>\d+(?:\.\d+)?|{_CN_NUM})\s*个?(?P<half>半)?\s*(?:小时|钟头)|(?P<half_only>半)\s*(?:个)?\s*小时"
    rf"|(?P<m>\d+|{_CN_NUM})\s*分钟|(?P<eh>\d+(?:\.\d+)?)\s*(?:hours?|hrs?)\b|(?P<em>\d+)\s*(?:minutes?|mins?)\b",
    re.I,
)
_BOOKING_ID_RE = re.compile(r"(?<![A-Za-z0-9])B\d{4}(?!\d)", re.I)
_CHANGE_RE = re.compile(r"改|换|调整|调到|推迟|提前|挪|延后|change|move|reschedule|switch|shift", re.I)
_CANCEL_RE = re.compile(r"取消|不要了|不用了|不订了|cancel|call off", re.I)
_TODAY_RE = re.compile(r"今天|今日|今儿|今晚|今早|today|tonight", re.I)


def _num(text: str) -> float | None:
    return float(text) if text.replace(".", "", 1).isdigit() else cn_to_number(text)


def _attendees(text: str) -> int | None:
    m = _ATTENDEES_RE.search(text)
    if not m:
        return None
    value = _num(m.group(1) or m.group(2))
    return int(value) if value and value >= 1 else None


def _duration_min(text: str) -> int | None:
    m = _DURATION_RE.search(text)
    if not m:
        return None
    if m["half_only"]:
        return 30
    if m["h"] or m["eh"]:
        hours = _num(m["h"] or m["eh"]) or 0.0
        return int(hours * 60 + (30 if m["half"] else 0)) or None
    minutes = _num(m["m"] or m["em"])
    return int(minutes) if minutes else None


def _datetimes(ctx: AnswerContext) -> list[tuple[datetime, bool]]:
    """This turn's datetime slots as (value, has_clock_time), in order."""
    out: list[tuple[datetime, bool]] = []
    for slot in ctx.slots:
        if slot.name == "datetime" and isinstance(slot.value, str):
            value = datetime.fromisoformat(slot.value)
            if value.tzinfo is None and ctx.now.tzinfo is not None:
                value = value.replace(tzinfo=ctx.now.tzinfo)
            out.append((value, "T" in slot.value))
    return out


def _when(start: datetime, end: datetime) -> str:
    return f"{start:%Y-%m-%d %H:%M}–{end:%H:%M}"


def _room_line(room: MeetingRoom, lang: Lang) -> str:
    if lang == "zh":
        return f"{room.name.zh}（{room.floor}楼，{room.capacity}人）"
    return f"{room.name.en} (floor {room.floor}, {room.capacity} seats)"


def _rooms_text(rooms: list[MeetingRoom], lang: Lang) -> str:
    if not rooms:
        return "无" if lang == "zh" else "none"
    return ("、" if lang == "zh" else ", ").join(_room_line(r, lang) for r in rooms)


def continues_booking(kb: KnowledgeBase, ctx: AnswerContext) -> bool:
    """True if the turn carries something a pending booking action can use (time, room, people, length)."""
    return bool(
        _datetimes(ctx)
        or kb.find_room(ctx.text)
        or _attendees(ctx.text)
        or _duration_min(ctx.text)
        or _BOOKING_ID_RE.search(ctx.text)
    )


# ---------------------------------------------------------------------------------------------- actions


def _start_end(ctx: AnswerContext) -> tuple[datetime | None, datetime | None, datetime | None]:
    """(start, end, date_only) from this turn's datetimes and the memory of earlier turns."""
    found = _datetimes(ctx)
    timed = [v for v, has_time in found if has_time]
    dates = [v for v, has_time in found if not has_time]
    remembered = ctx.memory.get("booking_date") or ctx.memory.get("booking_start")
    if timed and not dates and isinstance(remembered, str) and not _TODAY_RE.search(ctx.text):
        day = datetime.fromisoformat(remembered).date()  # "十点" after "订明天的会议室" keeps 明天
        if timed[0].date() == ctx.now.date():
            timed = [t.replace(year=day.year, month=day.month, day=day.day) for t in timed]
    if not timed:
        start_mem = ctx.memory.get("booking_start")
        if isinstance(start_mem, str) and not dates:
            timed = [datetime.fromisoformat(start_mem)]
            end_mem = ctx.memory.get("booking_end")
            if isinstance(end_mem, str):
                timed.append(datetime.fromisoformat(end_mem))
    if not timed:
        return None, None, dates[0] if dates else None
    start = timed[0]
    end = timed[1] if len(timed) > 1 else None
    if end is not None and end <= start and end + timedelta(hours=12) > start:
        end += timedelta(hours=12)  # "下午两点到四点": the second time inherits 下午
    if end is None or end <= start:
        minutes = _duration_min(ctx.text) or ctx.memory.get("booking_minutes") or 60
        end = start + timedelta(minutes=float(minutes))
    return start, end, None


def _check_time(kb: KnowledgeBase, ctx: AnswerContext, start: datetime, end: datetime) -> ActionResult | None:
    if start < ctx.now:
        return ActionResult(variant="past", fields={"when": _when(start, end)}, pending=True)
    if start.hour < kb.open_hour or end.date() != start.date() or end.hour * 60 + end.minute > kb.close_hour * 60:
        hours = {
            "open": f"{kb.open_hour:02d}:00",
            "close": f"{kb.close_hour:02d}:00",
            "when": _when(start, end),
        }
        return ActionResult(variant="closed", fields=hours, pending=True)
    return None


@dataclass(frozen=True)
class BookingSlots:
    """What a booking turn gives the action: the rules' reading of the turn and the memory
    (:func:`rule_slots`), or a chat model's call of the booking function over them
    (:mod:`miaohui.dialogue.tool_call`)."""

    room: MeetingRoom | None = None
    attendees: float | None = None
    minutes: int | None = None
    """Length the turn asks for (None: not said this turn)."""
    start: datetime | None = None
    end: datetime | None = None
    date_only: datetime | None = None
    """A day without a clock time (``订明天的会议室``), when there is no start."""


def rule_slots(kb: KnowledgeBase, ctx: AnswerContext) -> BookingSlots:
    """The booking slots the rules read from this turn (regular expressions, the slot extractor) and the memory."""
    room = kb.find_room(ctx.text)
    if room is None and isinstance(ctx.memory.get("room"), str):
        room = kb.room(str(ctx.memory["room"]))
    people = _attendees(ctx.text) or ctx.memory.get("attendees")
    start, end, date_only = _start_end(ctx)
    return BookingSlots(
        room=room,
        attendees=float(people) if people is not None else None,
        minutes=_duration_min(ctx.text),
        start=start,
        end=end,
        date_only=date_only,
    )


def book_action(
    table: BookingTable, kb: KnowledgeBase, ctx: AnswerContext, owner: str, slots: BookingSlots | None = None
) -> ActionResult:
    """Book a room from ``slots`` (default: :func:`rule_slots`); ask for what is missing."""
    slots = slots if slots is not None else rule_slots(kb, ctx)
    remember: dict[str, MemoryValue] = {}
    room, people, minutes = slots.room, slots.attendees, slots.minutes
    if room is not None:
        remember["room"] = room.id
    if people is not None:
        remember["attendees"] = float(people)
    if minutes:
        remember["booking_minutes"] = float(minutes)
    start, end, date_only = slots.start, slots.end, slots.date_only
    if start is None or end is None:
        if date_only is not None:
            remember["booking_date"] = date_only.date().isoformat()
        sep = "，" if ctx.lang == "zh" else ", "
        fields = {"room_clause": sep + _room_line(room, ctx.lang) if room else ""}
        return ActionResult(variant="need_time", fields=fields, pending=True, remember=remember)
    remember.update(booking_start=start.isoformat(), booking_end=end.isoformat())
    bad_time = _check_time(kb, ctx, start, end)
    if bad_time is not None:
        return bad_time.model_copy(update={"remember": remember, "forget": ["booking_start", "booking_end"]})
    need = int(float(people)) if people is not None else 1
    when = _when(start, end)
    free = table.free_rooms(start, end, need)
    if room is None:
        if not free:
            return ActionResult(variant="none_free", fields={"when": when}, pending=True, remember=remember)
        fields = {"when": when, "free_rooms": _rooms_text(free, ctx.lang)}
        return ActionResult(variant="need_room", fields=fields, pending=True, remember=remember)
    name = room.name.get(ctx.lang)
    if room.capacity < need:
        fields = {"room": name, "capacity": str(room.capacity), "attendees": str(need),
                  "free_rooms": _rooms_text(free, ctx.lang)}  # fmt: skip
        return ActionResult(variant="too_small", fields=fields, pending=True, remember=remember, forget=["room"])
    busy = table.conflicts(room.id, start, end)
    if busy:
        fields = {"room": name, "when": when, "busy": _when(busy[0].start, busy[0].end),
                  "free_rooms": _rooms_text(free, ctx.lang)}  # fmt: skip
        return ActionResult(variant="conflict", fields=fields, pending=True, remember=remember, forget=["room"])
    booking = table.book(room.id, start, end, owner, ctx.now)
    fields = {"room": name, "floor": str(room.floor), "capacity": str(room.capacity), "when": when,
              "booking_id": booking.id}  # fmt: skip
    drop = ["room", "attendees", "booking_minutes", "booking_start", "booking_end", "booking_date"]
    return ActionResult(fields=fields, remember={"last_booking": booking.id}, forget=drop, booking=booking)


def _target(table: BookingTable, ctx: AnswerContext, owner: str) -> Booking | None:
    mine = table.owned_by(owner)
    m = _BOOKING_ID_RE.search(ctx.text)
    if m:
        return next((b for b in mine if b.id == m.group().upper()), None)
    last = ctx.memory.get("last_booking")
    by_last = next((b for b in mine if b.id == last), None)
    return by_last or (mine[-1] if mine else None)


def cancel_action(table: BookingTable, kb: KnowledgeBase, ctx: AnswerContext, owner: str) -> ActionResult:
    """Cancel the session's booking, or change its time/room when the user asks for a change."""
    target = _target(table, ctx, owner)
    if target is None:
        return ActionResult(variant="no_booking")
    room = kb.room(target.room_id)
    old = {"booking_id": target.id, "room": room.name.get(ctx.lang), "when": _when(target.start, target.end)}
    changing = bool(ctx.memory.get("changing")) and not _CANCEL_RE.search(ctx.text)
    if not _CHANGE_RE.search(ctx.text) and not changing:
        table.cancel(target.id)
        return ActionResult(variant="cancelled", fields=old, booking=target, forget=["last_booking", "changing"])
    new_room = kb.find_room(ctx.text) or room
    found = _datetimes(ctx)
    timed = [v for v, has_time in found if has_time]
    if not timed and found:  # "改到后天": a new day, same clock time
        day = found[0][0]
        timed = [target.start.replace(year=day.year, month=day.month, day=day.day)]
    elif timed and len(found) == len(timed) and timed[0].date() == ctx.now.date() and not _TODAY_RE.search(ctx.text):
        day = target.start  # "改到下午四点": a new time, same day
        timed = [t.replace(year=day.year, month=day.month, day=day.day) for t in timed]
    if not timed and new_room.id == room.id:
        return ActionResult(variant="change_need", fields=old, pending=True, remember={"changing": 1.0})
    length = target.end - target.start
    start = timed[0] if timed else target.start
    end = timed[1] if len(timed) > 1 and timed[1] > start else start + length
    bad_time = _check_time(kb, ctx, start, end)
    if bad_time is not None:
        return bad_time.model_copy(update={"remember": {"changing": 1.0}})
    busy = table.conflicts(new_room.id, start, end, exclude=target.id)
    if busy:
        free = table.free_rooms(start, end)
        fields = {
            "room": new_room.name.get(ctx.lang),
            "when": _when(start, end),
            "busy": _when(busy[0].start, busy[0].end),
            "free_rooms": _rooms_text(free, ctx.lang),
        }
        return ActionResult(variant="conflict", fields=fields, pending=True, remember={"changing": 1.0})
    changed = target.model_copy(update={"room_id": new_room.id, "start": start, "end": end})
    table.replace(changed)
    fields = {**old, "new_room": new_room.name.get(ctx.lang), "new_when": _when(start, end)}
    return ActionResult(variant="changed", fields=fields, booking=changed, forget=["changing"])


_F = frozenset
#: The booking actions' variants and fields (templates in meeting_assistant.yaml are checked against them).
ACTION_VARIANTS: dict[str, Mapping[str, frozenset[str]]] = {
    "book": {
        "default": _F({"room", "floor", "capacity", "when", "booking_id"}),
        "need_time": _F({"room_clause"}),
        "need_room": _F({"when", "free_rooms"}),
        "none_free": _F({"when"}),
        "past": _F({"when"}),
        "closed": _F({"open", "close", "when"}),
        "too_small": _F({"room", "capacity", "attendees", "free_rooms"}),
        "conflict": _F({"room", "when", "busy", "free_rooms"}),
    },
    "cancel": {
        "no_booking": _F(),
        "cancelled": _F({"booking_id", "room", "when"}),
        "change_need": _F({"booking_id", "room", "when"}),
        "changed": _F({"booking_id", "room", "when", "new_room", "new_when"}),
        "past": _F({"when"}),
        "closed": _F({"open", "close", "when"}),
        "conflict": _F({"room", "when", "busy", "free_rooms"}),
    },
}
