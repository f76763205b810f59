"""The dialogue knowledge base: a fund catalogue, deposit and loan rates, FAQ answers, 12345 hotline
procedures and the office's meeting rooms.

The data is the project's own EXAMPLE DATA (invented but plausible figures), packaged as YAML in
``miaohui/dialogue/data/{bank,hotline,office}.yaml``; :func:`load_knowledge` reads and validates it
(or another directory with the same three files). Every figure a knowledge-base reply quotes comes from
here, which is what the compliance rule "numbers must come from the user or the knowledge base" checks.

Lookups are plain methods: :meth:`KnowledgeBase.find_funds` (suitability by risk level, closeness to a
target return), :meth:`~KnowledgeBase.deposit_rate`, :meth:`~KnowledgeBase.procedure`,
:meth:`~KnowledgeBase.find_room` ...; :mod:`miaohui.dialogue.answers` turns intent + slots into template
fields through them.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from miaohui.errors import ConfigError
from miaohui.zoo.intents import LABELS

__all__ = [
    "FUND_TYPES",
    "RISK_LEVELS",
    "Bilingual",
    "DepositRate",
    "Fund",
    "Hotline",
    "KnowledgeBase",
    "Lang",
    "LoanRate",
    "MeetingRoom",
    "Procedure",
    "load_knowledge",
]

Lang = Literal["zh", "en"]
RiskLevel = Literal["保守型", "稳健型", "平衡型", "成长型", "进取型"]
FundType = Literal["货币", "债券", "混合", "股票", "黄金ETF"]

#: The five investor risk levels (C1–C5) from the least to the most risk-tolerant.
RISK_LEVELS: tuple[str, ...] = ("保守型", "稳健型", "平衡型", "成长型", "进取型")
RISK_LEVELS_EN: dict[str, str] = {
    "保守型": "Conservative",
    "稳健型": "Cautious",
    "平衡型": "Balanced",
    "成长型": "Growth",
    "进取型": "Aggressive",
}
FUND_TYPES: tuple[str, ...] = ("货币", "债券", "混合", "股票", "黄金ETF")
FUND_TYPES_EN: dict[str, str] = {
    "货币": "money market",
    "债券": "bond",
    "混合": "hybrid",
    "股票": "equity",
    "黄金ETF": "gold ETF",
}
#: ``product`` slot values (miaohui.nlp.slots) → the fund types they ask for.
PRODUCT_FUND_TYPES: dict[str, tuple[str, ...]] = {
    "货币基金": ("货币",),
    "债券基金": ("债券",),
    "债券": ("债券",),
    "国债": ("债券",),
    "混合型基金": ("混合",),
    "股票型基金": ("股票",),
    "指数基金": ("股票",),
    "股票": ("股票",),
    "黄金": ("黄金ETF",),
}
_FILES = ("bank.yaml", "hotline.yaml", "office.yaml")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Bilingual(_Frozen):
    """A text in Chinese and English."""

    zh: str = Field(min_length=1)
    """Chinese text."""
    en: str = Field(min_length=1)
    """English text."""

    def get(self, lang: Lang) -> str:
        return self.zh if lang == "zh" else self.en


class Fund(_Frozen):
    """One fund of the (invented) catalogue."""

    code: str = Field(pattern=r"^MH\d{4}$")
    """Product code (``MH`` + 4 digits, so that it is never read as a number or mistaken for a real fund)."""
    name: Bilingual
    """Display name."""
    aliases: tuple[str, ...] = ()
    """Other names a customer may use (matched case-insensitively)."""
    type: FundType
    """Fund type."""
    risk_level: RiskLevel
    """The least risk-tolerant investor level the fund is suitable for (R1–R5 mapped to C1–C5)."""
    return_range: tuple[float, float]
    """Historical annualized return range in percent (low, high); past figures, not a promise."""
    min_purchase: float = Field(ge=0)
    """Minimum purchase in yuan."""
    redemption_days: int = Field(ge=0, le=10)
    """Working days from redemption to cash (T+N)."""

    @field_validator("return_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] > v[1]:
            raise ConfigError(f"fund return_range {list(v)} is not ordered", "write [low, high] with low <= high")
        return v

    @property
    def risk_rank(self) -> int:
        return RISK_LEVELS.index(self.risk_level)


class DepositRate(_Frozen):
    """The annual rate of one deposit term."""

    term: str = Field(min_length=1)
    """Term key in Chinese (活期, 3个月, 1年, 大额存单3年, ...)."""
    en: str = Field(min_length=1)
    """English name of the term."""
    rate: float = Field(ge=0, le=20)
    """Annual rate in percent."""
    min_amount: float = Field(default=0, ge=0)
    """Smallest deposit in yuan."""


class LoanRate(_Frozen):
    """One reference loan rate (example data, LPR-style)."""

    name: Bilingual
    """What the rate is."""
    rate: float = Field(ge=0, le=36)
    """Annual rate in percent."""


class Hotline(_Frozen):
    """A service phone number."""

    name: Bilingual
    """Who answers."""
    number: str = Field(pattern=r"^[0-9-]{3,15}$")
    """The number, as dialled."""


class Procedure(_Frozen):
    """How the 12345 hotline answers one intent: steps, documents to bring, numbers to call."""

    title: Bilingual
    """Topic."""
    steps: tuple[Bilingual, ...] = Field(min_length=1)
    """What to do, in order."""
    documents: tuple[Bilingual, ...] = ()
    """What to bring."""
    hotlines: tuple[Hotline, ...] = Field(min_length=1)
    """Numbers to call."""


class MeetingRoom(_Frozen):
    """A bookable meeting room."""

    id: str = Field(pattern=r"^R\d{3}$")
    """Room id (``R`` + floor + number)."""
    name: Bilingual
    """Display name."""
    aliases: tuple[str, ...] = ()
    """Other names (matched case-insensitively)."""
    floor: int = Field(ge=-5, le=200)
    """Floor."""
    capacity: int = Field(ge=1, le=1000)
    """Seats."""
    equipment: Bilingual
    """What is in the room."""

    def mentions(self) -> tuple[str, ...]:
        """Every string that names this room, longest first."""
        return tuple(sorted({self.id, self.name.zh, self.name.en, *self.aliases}, key=len, reverse=True))


class KnowledgeBase(_Frozen):
    """Everything the pipelines' template answers may quote."""

    funds: tuple[Fund, ...] = Field(min_length=1)
    """The fund catalogue."""
    deposit_rates: tuple[DepositRate, ...] = Field(min_length=1)
    """Deposit rates by term."""
    loan_rates: tuple[LoanRate, ...] = Field(min_length=1)
    """Reference loan rates."""
    faq: dict[str, Bilingual] = Field(default_factory=dict)
    """One FAQ answer per intent label."""
    procedures: dict[str, Procedure] = Field(default_factory=dict)
    """12345 procedures per intent label."""
    rooms: tuple[MeetingRoom, ...] = Field(min_length=1)
    """Meeting rooms."""
    open_hour: int = Field(default=8, ge=0, le=23)
    """First bookable hour of the day."""
    close_hour: int = Field(default=21, ge=1, le=24)
    """Bookings must end by this hour."""

    @model_validator(mode="after")
    def _consistent(self) -> KnowledgeBase:
        for kind, keys in (
            ("fund code", [f.code for f in self.funds]),
            ("room id", [r.id for r in self.rooms]),
        ):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            if dup:
                raise ConfigError(f"duplicate {kind}(s) {dup} in the knowledge base", f"give every {kind} once")
        unknown = sorted(set(self.faq) - set(LABELS)) + sorted(set(self.procedures) - set(LABELS))
        if unknown:
            raise ConfigError(
                f"knowledge base has entries for unknown intent label(s) {unknown}",
                "key faq/procedures by the 24 labels of shared/INTENTS.md",
            )
        if self.open_hour >= self.close_hour:
            raise ConfigError(
                f"open_hour={self.open_hour} is not before close_hour={self.close_hour}",
                "set open_hour < close_hour, e.g. 8 and 21",
            )
        return self

    # ------------------------------------------------------------------------------------------ funds

    def find_funds(
        self,
        risk_level: str | None = None,
        target_return: float | None = None,
        fund_types: tuple[str, ...] = (),
        limit: int = 3,
    ) -> list[Fund]:
        """Funds suitable for ``risk_level`` (fund level ≤ investor level; all funds when None), of
        ``fund_types`` if given, best first: those whose historical range holds ``target_return`` (in
        percent), then the nearest ranges; without a target, the levels closest to the investor's first.
        """
        if risk_level is not None and risk_level not in RISK_LEVELS:
            raise ConfigError(f"unknown risk level {risk_level!r}", f"use one of {', '.join(RISK_LEVELS)}")
        top = RISK_LEVELS.index(risk_level) if risk_level else len(RISK_LEVELS) - 1
        pool = [f for f in self.funds if f.risk_rank <= top and (not fund_types or f.type in fund_types)]

        def gap(f: Fund) -> float:
            lo, hi = f.return_range
            return 0.0 if target_return is None else max(lo - target_return, target_return - hi, 0.0)

        pool.sort(key=lambda f: (gap(f), top - f.risk_rank, f.code))
        return pool[:limit]

    def find_fund_in_text(self, text: str) -> Fund | None:
        """The fund that ``text`` names (code, name or alias), or None."""
        low = text.lower()
        for fund in self.funds:
            names = (fund.code, fund.name.zh, fund.name.en, *fund.aliases)
            if any(n.lower() in low for n in names):
                return fund
        return None

    # ------------------------------------------------------------------------------------------ rates

    def deposit_rate(self, term: str) -> DepositRate | None:
        """The rate of ``term`` (a key such as ``3年`` or ``大额存单1年``), or None."""
        return next((d for d in self.deposit_rates if d.term == term), None)

    # -------------------------------------------------------------------------------------- procedures

    def procedure(self, intent: str) -> Procedure | None:
        """The 12345 procedure for ``intent``, or None."""
        return self.procedures.get(intent)

    def faq_answer(self, intent: str) -> Bilingual | None:
        """The FAQ answer for ``intent``, or None."""
        return self.faq.get(intent)

    # ------------------------------------------------------------------------------------------ rooms

    def find_room(self, text: str) -> MeetingRoom | None:
        """The meeting room ``text`` names (id, name or alias; the longest mention wins), or None."""
        low = text.lower()
        best: tuple[int, MeetingRoom] | None = None
        for room in self.rooms:
            for mention in room.mentions():
                if mention.lower() in low and (best is None or len(mention) > best[0]):
                    best = (len(mention), room)
        return best[1] if best else None

    def room(self, room_id: str) -> MeetingRoom:
        """The room with id ``room_id``."""
        for room in self.rooms:
            if room.id == room_id:
                return room
        raise ConfigError(f"no meeting room with id {room_id!r}", f"use one of {[r.id for r in self.rooms]}")


def _read_yaml(source: Traversable | Path, name: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"knowledge file {name} not found",
            "give a directory holding bank.yaml, hotline.yaml, office.yaml",
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"knowledge file {name} is not valid YAML: {exc}", "fix the YAML syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"knowledge file {name} must hold a mapping", "write top-level keys such as funds:")
    data.pop("example_data", None)
    return data


def _build(sources: dict[str, Traversable | Path], where: str) -> KnowledgeBase:
    merged: dict[str, Any] = {}
    for name, src in sources.items():
        merged.update(_read_yaml(src, f"{where}/{name}"))
    try:
        return KnowledgeBase.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(
            f"invalid knowledge base in {where}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}",
            "fix that entry (see miaohui/dialogue/knowledge.py for the fields)",
        ) from exc


@lru_cache(maxsize=1)
def _packaged() -> KnowledgeBase:
    data = resources.files("miaohui.dialogue").joinpath("data")
    return _build({n: data.joinpath(n) for n in _FILES}, "miaohui/dialogue/data")


def load_knowledge(directory: str | Path | None = None) -> KnowledgeBase:
    """The packaged knowledge base (cached), or the one in ``directory`` (bank/hotline/office.yaml)."""
    if directory is None:
        return _packaged()
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"knowledge directory not found: {d}", "pass a directory with the three YAML files")
    return _build({n: d / n for n in _FILES}, str(d))
