"""The priority class of the request being served, as a context variable: the API key gate sets it
(:mod:`miaohui.server.auth`); the dynamic batcher and the generation scheduler read it when a request is queued
(interactive requests are queued ahead of bulk ones). Requests without a key (an open server) are ``interactive``."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal

__all__ = ["PRIORITY", "Priority"]

Priority = Literal["interactive", "bulk"]
PRIORITY: ContextVar[Priority] = ContextVar("miaohui_priority", default="interactive")
