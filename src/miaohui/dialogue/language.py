"""Which language a user writes in: Chinese (``zh``) or English (``en``)."""

from __future__ import annotations

import re

from miaohui.dialogue.knowledge import Lang

__all__ = ["detect_language"]

_CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN_WORD_RE = re.compile(r"[A-Za-z]{2,}|\b[AaI]\b")


def detect_language(text: str) -> Lang | None:
    """``zh`` when Chinese characters are at least as many as Latin words, ``en`` when Latin words win,
    None when the text has neither (digits, emoji, punctuation): the caller keeps the session's language.

    ``查一下我的ETF`` → zh (5 characters vs 1 word); ``I want to buy 黄金`` → en (2 vs 4).
    """
    cjk = len(_CJK_RE.findall(text))
    words = len(_LATIN_WORD_RE.findall(text))
    if cjk == 0 and words == 0:
        return None
    return "zh" if cjk >= words else "en"
