"""What every slot rule produces: a :class:`Candidate` span in the folded text, and the tables they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miaohui.nlp.normalize import CN_DIGITS

SlotName = Literal["amount", "percent", "datetime", "product", "risk_level", "district", "card_tail"]

CN_D = "".join(CN_DIGITS)
"""The Chinese digit characters, for character classes."""


@dataclass(frozen=True)
class Candidate:
    """A candidate slot with offsets into the folded text."""

    name: SlotName
    start: int
    end: int
    value: str | float
    unit: str | None = None


def parse_table(table: str) -> dict[str, str]:
    """``canonical: a|b|c`` lines → {surface (lower-cased): canonical}."""
    mapping: dict[str, str] = {}
    for line in table.strip().splitlines():
        canonical, surfaces = line.split(":", 1)
        for surface in surfaces.split("|"):
            mapping[surface.strip().lower()] = canonical.strip()
    return mapping
