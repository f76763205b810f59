"""``datetime`` slots: dates, clock times and periods resolved to ISO-8601 against ``now``; the rules are
:mod:`miaohui.nlp.slots`'s docstring."""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta

from miaohui.nlp.normalize import cn_to_number
from miaohui.nlp.slots_base import CN_D, Candidate

_REL_DAYS = {
    "大前天": -3, "前天": -2, "昨天": -1, "昨日": -1, "今天": 0, "今日": 0, "今儿": 0, "今晚": 0, "今早": 0,
    "今夜": 0, "明天": 1, "明日": 1, "明儿": 1, "明早": 1, "明晚": 1, "后天": 2, "大后天": 3,
    "today": 0, "tonight": 0, "tomorrow": 1, "yesterday": -1,
    "day after tomorrow": 2, "the day after tomorrow": 2,
}  # fmt: skip
_REL_DAY_PERIOD = {
    "今晚": "晚上",
    "明晚": "晚上",
    "今夜": "晚上",
    "今早": "早上",
    "明早": "早上",
    "tonight": "pm",
}
_WEEKDAYS = {"一": 0, "二": 1, "三": 2, "四": 3, "五": 4, "六": 5, "日": 6, "天": 6, "末": 5}
_EN_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_EN_MONTHS = {
    "jan": 1, "feb": 2, "mar": 3, "apr": 4, "may": 5, "jun": 6,
    "jul": 7, "aug": 8, "sep": 9, "oct": 10, "nov": 11, "dec": 12,
}  # fmt: skip
_MONTH_OFFSETS = {"下下": 2, "下": 1, "这": 0, "本": 0, "上": -1}
_CN_SMALL = f"[{CN_D}十]"
_DAY_NOUN_GUARD = (
    r"楼|线|会议室|房|院|馆|厅|室|机|位|床|口|码|门|窗|车|桌|店|仓|库|柜|台|栋|单元|文件|令|选手|球|字|坑|病"
    r"|站|电池|箱|元|游|本|语|报|常|子|程|志|记|历|夜|均|内|益|趋|间|光|出|落|照|用|化|薪|息|利|渐"
)
_EN_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_DATE_RE = re.compile(
    rf"""
      (?P<iy>\d{{4}})[-/.](?P<im>\d{{1,2}})[-/.](?P<id>\d{{1,2}})(?!\d)
    | (?:(?P<cy>\d{{4}}|[{CN_D}]{{4}})年)?
      (?P<cm>\d{{1,2}}|{_CN_SMALL}{{1,3}})月(?P<cd>\d{{1,2}}|{_CN_SMALL}{{1,3}})[日号]
    | (?P<mrel>下下|下|这|本|上)个?月(?P<md>\d{{1,2}}|{_CN_SMALL}{{1,3}})[日号]
    | (?<![\d月{CN_D}十尾第几])(?P<dd>\d{{1,2}}|{_CN_SMALL}{{1,3}})[号日](?!{_DAY_NOUN_GUARD})
    | (?P<nd>\d{{1,3}}|{_CN_SMALL}{{1,3}})天(?:后|以后|之后)
    | (?<![\d{CN_D}个])(?P<wrel>下下个?|下个?|这个?|本|上个?)?(?:周|星期|礼拜)(?P<wd>[一二三四五六日天末])
    | (?P<rel>大后天|大前天|后天|前天|今天|今日|今儿|今晚|今早|今夜|明天|明日|明儿|明早|明晚|昨天|昨日)
    | \b(?P<erel>(?:the\s+)?day\s+after\s+tomorrow|tomorrow|today|tonight|yesterday)\b
    | \b(?:(?P<ewrel>next|this|coming)\s+)?(?P<ewd>monday|tuesday|wednesday|thursday|friday|saturday|sunday)\b
    | \b(?P<emon>{_EN_MONTH})\.?\s+(?P<emd>\d{{1,2}})(?:st|nd|rd|th)?(?:,?\s+(?P<emy>\d{{4}}))?\b
    | \b(?P<edm>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<emon2>{_EN_MONTH})(?:,?\s+(?P<emy2>\d{{4}}))?\b
    """,
    re.X | re.I,
)
_PERIODS = "凌晨|早上|早晨|清晨|上午|中午|下午|傍晚|晚上|夜里|夜间|半夜|深夜"
_TIME_RE = re.compile(
    rf"""
    (?:(?P<period>{_PERIODS}|早|晚)\s*)?
    (?:
        (?P<hh>\d{{1,2}})[:](?P<mm>\d{{2}})(?!\d)(?:\s*(?P<ampm1>[ap]\.?m\.?)(?![a-z]))?
      | (?P<h>\d{{1,2}}|[{CN_D}十]{{1,3}})\s*(?P<dian>点钟|点|时)
        (?P<m>半|一刻|三刻|整|\d{{1,2}}分?|[零〇一二三四五六七八九十]{{1,3}}分?)?
      | (?P<eh>\d{{1,2}})\s*(?:(?P<ampm2>[ap]\.?m\.?)(?![a-z])|o'clock)
      | \b(?P<noon>noon|midnight)\b
    )
    """,
    re.X | re.I,
)
_PERIOD_ONLY_RE = re.compile(
    rf"\s*(?:的)?\s*(?P<p>{_PERIODS}|(?:in\s+the\s+)?(?:morning|afternoon|evening|night))", re.I
)
_GAP_RE = re.compile(r"\s*(?:的|,|at|@|on)?\s*", re.I)
_EN_AT_HOUR_RE = re.compile(r"\s*at\s+(?P<h>\d{1,2})(?::(?P<m>\d{2}))?\b(?!\s*(?:%|percent|yuan|dollars))", re.I)
#: Nouns that make a bare ``两点`` "two points" rather than two o'clock.
_POINTS_NOUN_RE = re.compile(
    r"建议|意见|要求|原因|理由|看法|想法|注意|内容|好处|坏处|不足|问题|区别|说明|疑问|事项|经验|体会|感受|心得"
    r"|措施|方面|原则|规定|因素|优势|缺点|优点|特点|差别|不同|改进|补充|需要|希望|收获|结论|共识|主张|疑虑|顾虑"
)
_TIME_RANGE_GAP_RE = re.compile(r"\s*(?:到|至|-|~|—|–|to)\s*", re.I)
_EN_PERIOD = {"morning": "上午", "afternoon": "下午", "evening": "晚上", "night": "晚上"}


@dataclass(frozen=True)
class _Clock:
    """A parsed clock time: hour/minute after the period shift, plus a day offset (midnight rollover)."""

    end: int
    hour: int
    minute: int
    day_offset: int
    period: str | None


def _shift_hour(hour: int, period: str | None) -> tuple[int, int] | None:
    """Apply 上午/下午/晚上/... or am/pm to an hour; returns (hour, day offset) or None if invalid."""
    if period is None:
        return (hour, 0) if 0 <= hour <= 24 else None
    if hour > 12 or hour < 0:
        # 24-hour clock with a period ("晚上20点") is fine when they agree.
        return (hour, 0) if hour <= 23 and period in ("下午", "晚上", "傍晚", "pm", "夜里", "夜间", "深夜") else None
    if period in ("am", "凌晨", "早上", "早晨", "清晨", "上午", "早"):
        return (0, 0) if hour == 12 and period in ("am", "凌晨") else (hour, 0)
    if period == "pm":
        return (hour if hour == 12 else hour + 12), 0
    if period == "中午":
        return (hour + 12, 0) if 1 <= hour <= 3 else (hour, 0)
    if period in ("下午", "傍晚"):
        return (hour if hour == 12 else hour + 12), 0
    # 晚上 / 晚 / 夜里 / 夜间 / 半夜 / 深夜
    if hour == 12 or hour == 0:
        return 0, 1
    if hour <= 4:
        return hour, 1
    return hour + 12, 0


def _minute_value(raw: str | None) -> int | None:
    """Minutes from ``半``/``一刻``/``15``/``十五分``/``零五``; None if ``raw`` is not a clock minute."""
    if raw is None or raw == "整":
        return 0
    special = {"半": 30, "一刻": 15, "三刻": 45}
    if raw in special:
        return special[raw]
    body = raw.removesuffix("分")
    explicit = raw.endswith("分")
    looks_like_minute = len(body) == 2 if body.isdigit() else ("十" in body or body[0] in "零〇")
    ok = explicit or looks_like_minute
    value = cn_to_number(body)
    if not ok or value is None or not 0 <= value < 60:
        return None
    return int(value)


def _match_time(folded: str, pos: int, context: str | None, anchored: bool) -> _Clock | None:
    """Match a clock time at ``pos``; ``context`` is the period implied by the date (今晚 → 晚上)."""
    m = _TIME_RE.match(folded, pos)
    if m is None:
        return None
    period = m["period"] or context
    if m["noon"]:
        is_noon = m["noon"].lower() == "noon"
        return _Clock(m.end(), 12 if is_noon else 0, 0, 0 if is_noon else 1, None)
    if m["hh"] is not None:
        hour, minute = int(m["hh"]), int(m["mm"])
        ampm = m["ampm1"]
        period = ("am" if ampm.lower().startswith("a") else "pm") if ampm else period
        end = m.end()
    elif m["eh"] is not None:
        hour, minute, end = int(m["eh"]), 0, m.end()
        ampm = m["ampm2"]
        period = ("am" if ampm.lower().startswith("a") else "pm") if ampm else period
    else:
        parsed = _cn_clock(m, folded, anchored or period is not None)
        if parsed is None:
            return None
        hour, minute, end = parsed
    if not 0 <= minute < 60:
        return None
    shifted = _shift_hour(hour, period)
    if shifted is None:
        return None
    return _Clock(end, shifted[0], minute, shifted[1], period)


def _cn_clock(m: re.Match[str], folded: str, has_context: bool) -> tuple[int, int, int] | None:
    """Hour, minute and end of a ``九点半`` / ``15时30分`` match; None when it is not a clock time."""
    hour_value = cn_to_number(m["h"])
    if hour_value is None or hour_value != int(hour_value):
        return None
    start = m.start("h")
    if start > 0 and re.match(rf"[\d.{CN_D}十百千万亿个]", folded[start - 1]) and not m["period"]:
        return None
    minute = _minute_value(m["m"])
    end = m.end()
    if minute is None:  # "三点五" is a decimal, "三点五十" is a clock: only keep the hour with context
        if not has_context:
            return None
        minute, end = 0, m.end("dian")
    explicit_minute = m["m"] is not None and end == m.end()
    if not has_context and not explicit_minute:
        if m["dian"] == "时":
            return None
        after = folded[end : end + 4]
        if m["h"] in ("一", "幺") and m["dian"] == "点" and not after.startswith("左右"):
            return None  # "便宜一点", "晚一点"
        if m["dian"] == "点" and _POINTS_NOUN_RE.match(after):
            return None  # "有两点建议"
    if m["period"] in ("早", "晚") and m["h"] in ("一", "幺") and not explicit_minute:
        return None
    return int(hour_value), minute, end


def _add_months(day: date, months: int, day_of_month: int) -> date | None:
    """``day_of_month`` in the month ``months`` after ``day``'s month; None if that day does not exist."""
    index = day.year * 12 + day.month - 1 + months
    year, month = divmod(index, 12)
    if not 1 <= day_of_month <= calendar.monthrange(year, month + 1)[1]:
        return None
    return date(year, month + 1, day_of_month)


def _safe_date(year: int, month: int, day: int) -> date | None:
    """A date, or None if it does not exist."""
    try:
        return date(year, month, day)
    except ValueError:
        return None


def _next_day_of_month(today: date, day: int) -> date | None:
    """The next date on or after ``today`` whose day of month is ``day``."""
    if not 1 <= day <= 31:
        return None
    for months in range(13):
        candidate = _add_months(today, months, day)
        if candidate is not None and candidate >= today:
            return candidate
    return None


def _next_month_day(today: date, month: int, day: int, year: int | None) -> date | None:
    """``month``/``day`` in ``year``, or the next occurrence on or after ``today`` when no year is given."""
    if year is not None:
        return _safe_date(year, month, day)
    for y in (today.year, today.year + 1, today.year + 2, today.year + 3, today.year + 4):
        candidate = _safe_date(y, month, day)
        if candidate is not None and candidate >= today:
            return candidate
    return None


def _weekday_date(today: date, weekday: int, relation: str | None) -> date:
    """Resolve 周X / 下周X / 这周X / next Monday against ``today`` (weeks start on Monday)."""
    monday = today - timedelta(days=today.weekday())
    rel = (relation or "").lower().rstrip("个")
    weeks = {"下下": 2, "下": 1, "next": 1, "这": 0, "本": 0, "this": 0, "上": -1}.get(rel)
    if weeks is None:  # bare weekday / "coming": the next occurrence on or after today
        return today + timedelta(days=(weekday - today.weekday()) % 7)
    return monday + timedelta(weeks=weeks, days=weekday)


def _int(raw: str | None) -> int | None:
    """An integer from an Arabic or Chinese numeral (None if absent or not an integer)."""
    if raw is None:
        return None
    value = cn_to_number(raw)
    return int(value) if value is not None and value == int(value) else None


def _resolve_date(m: re.Match[str], today: date) -> tuple[date | None, str | None]:
    """The date a date match denotes and the period it implies (今晚 → 晚上)."""
    g = m.groupdict()
    if g["iy"]:
        return _safe_date(int(g["iy"]), int(g["im"]), int(g["id"])), None
    if g["cm"]:
        month, day = _int(g["cm"]), _int(g["cd"])
        if month is None or day is None:
            return None, None
        return _next_month_day(today, month, day, _int(g["cy"])), None
    if g["mrel"]:
        day = _int(g["md"])
        return (_add_months(today, _MONTH_OFFSETS[g["mrel"]], day) if day else None), None
    if g["dd"]:
        day = _int(g["dd"])
        return (_next_day_of_month(today, day) if day else None), None
    if g["nd"]:
        days = _int(g["nd"])
        return (today + timedelta(days=days) if days is not None else None), None
    if g["wd"]:
        return _weekday_date(today, _WEEKDAYS[g["wd"]], g["wrel"]), None
    if g["rel"]:
        return today + timedelta(days=_REL_DAYS[g["rel"]]), _REL_DAY_PERIOD.get(g["rel"])
    if g["erel"]:
        key = re.sub(r"\s+", " ", g["erel"].lower())
        return today + timedelta(days=_REL_DAYS[key]), _REL_DAY_PERIOD.get(key)
    if g["ewd"]:
        return _weekday_date(today, _EN_WEEKDAYS.index(g["ewd"].lower()), g["ewrel"]), None
    mon = g["emon"] or g["emon2"]
    day = _int(g["emd"] or g["edm"])
    year = _int(g["emy"] or g["emy2"])
    if mon and day:
        return _next_month_day(today, _EN_MONTHS[mon[:3].lower()], day, year), None
    return None, None


def _iso(day: date, clock: _Clock | None, now: datetime) -> str:
    """ISO-8601 text for a date, or a date plus clock time (in ``now``'s timezone)."""
    if clock is None:
        return day.isoformat()
    moment = datetime.combine(day + timedelta(days=clock.day_offset), time(clock.hour % 24, clock.minute))
    if clock.hour == 24:
        moment += timedelta(days=1)
    return moment.replace(tzinfo=now.tzinfo).isoformat()


def _date_with_time(folded: str, m: re.Match[str], day: date, period: str | None) -> tuple[int, _Clock | None]:
    """Extend a date match over a following period word and clock time; returns (end, clock)."""
    end = m.end()
    gap = _GAP_RE.match(folded, end)
    clock = _match_time(folded, gap.end() if gap else end, period, anchored=True)
    if clock is not None:
        return clock.end, clock
    p = _PERIOD_ONLY_RE.match(folded, end)
    if p is None:
        return end, None
    word = p["p"].lower().removeprefix("in the").strip()
    period = _EN_PERIOD.get(word, p["p"])
    gap = _GAP_RE.match(folded, p.end())
    clock = _match_time(folded, gap.end() if gap else p.end(), period, anchored=True)
    if clock is None:
        at = _EN_AT_HOUR_RE.match(folded, p.end())
        if at:
            shifted = _shift_hour(int(at["h"]), period)
            if shifted:
                clock = _Clock(at.end(), shifted[0], int(at["m"] or 0), shifted[1], period)
    return (clock.end, clock) if clock else (p.end(), None)


#: Every branch of ``_DATE_RE`` and ``_TIME_RE`` needs one of these (a digit, a date/time character, an English day
#: word): a text without any has no datetime, and the two large alternations are not run (most utterances).
_DATETIME_TRIGGER_RE = re.compile(r"[\d月日号天周期拜今明昨点时]|day|tonight|tomorrow|noon|midnight", re.I)


def datetimes(folded: str, now: datetime) -> list[Candidate]:
    """Dates, date+times and times, resolved against ``now``."""
    if _DATETIME_TRIGGER_RE.search(folded) is None:
        return []
    today = now.date()
    found: list[Candidate] = []
    taken: list[tuple[int, int]] = []
    for m in _DATE_RE.finditer(folded):
        day, period = _resolve_date(m, today)
        if day is None:
            continue
        end, clock = _date_with_time(folded, m, day, period)
        if clock is None and (m["erel"] or m["ewd"]) and end == m.end():
            at = _EN_AT_HOUR_RE.match(folded, end)  # "tomorrow at 9", "tonight at 8"
            if at and (shifted := _shift_hour(int(at["h"]), period)):
                clock = _Clock(at.end(), shifted[0], int(at["m"] or 0), shifted[1], None)
                end = at.end()
        found.append(Candidate("datetime", m.start(), end, _iso(day, clock, now)))
        taken.append((m.start(), end))
    found.extend(_standalone_times(folded, now, found, taken))
    return found


def _standalone_times(
    folded: str, now: datetime, dated: list[Candidate], taken: list[tuple[int, int]]
) -> list[Candidate]:
    """Clock times without a date before them: ``晚上8点`` (today), ``9am tomorrow``, ``两点到四点``."""
    found: list[Candidate] = []
    pos = 0
    while (m := _TIME_RE.search(folded, pos)) is not None:
        pos = m.end() if m.end() > m.start() else m.start() + 1
        if any(s < m.end() and m.start() < e for s, e in taken):
            continue
        day, period, anchored = now.date(), None, False
        previous = _previous_datetime(folded, m.start(), [*dated, *found])
        if previous is not None:
            day = date.fromisoformat(str(previous.value)[:10])
            period, anchored = _period_of(folded, previous), True
        elif m["period"] is None:
            period = _clause_period(folded, m.start())
        clock = _match_time(folded, m.start(), period, anchored=anchored)
        if clock is None:
            continue
        end = clock.end
        follow = _DATE_RE.match(folded, _GAP_RE.match(folded, end).end())  # type: ignore[union-attr]
        if follow is not None and previous is None:
            resolved, _ = _resolve_date(follow, now.date())
            if resolved is not None:
                day, end = resolved, follow.end()
        found.append(Candidate("datetime", m.start(), end, _iso(day, clock, now)))
        taken.append((m.start(), end))
        pos = max(pos, end)
    return found


def _previous_datetime(folded: str, start: int, candidates: list[Candidate]) -> Candidate | None:
    """The datetime that ends right before ``start`` with a range connector between (两点到四点)."""
    for cand in candidates:
        if cand.end <= start and _TIME_RANGE_GAP_RE.fullmatch(folded, cand.end, start):
            return cand
    return None


_CLAUSE_PERIOD_RE = re.compile(rf"({_PERIODS})[^,.;!?。；！？]{{0,8}}$")


def _clause_period(folded: str, start: int) -> str | None:
    """A period word earlier in the same clause (``晚上跳到十点`` → 晚上), if any."""
    m = _CLAUSE_PERIOD_RE.search(folded, max(0, start - 12), start)
    return m.group(1) if m else None


def _period_of(folded: str, cand: Candidate) -> str | None:
    """The period word (下午, 晚上, ...) inside an earlier datetime span, if any."""
    m = re.search(rf"{_PERIODS}|今晚|明晚|今早|明早|[ap]\.?m\.?", folded[cand.start : cand.end], re.I)
    if m is None:
        return None
    word = m.group().lower().replace(".", "")
    return {"今晚": "晚上", "明晚": "晚上", "今早": "早上", "明早": "早上"}.get(word, word)
