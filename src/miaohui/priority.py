"""What the API key gate (:mod:`miaohui.server.auth`) knows of the request being served, as context variables.

* :data:`PRIORITY`: its class; the dynamic batcher and the generation scheduler read it when a request is queued
  (interactive requests are queued ahead of bulk ones). Requests without a key (an open server) are
  ``interactive``. In the engine process of ``--shared-engine`` it is set from the class the worker's message
  carries.
* :data:`CALLER`: its tenant (a :class:`Caller`): the metrics count a refusal after the gate (429, 503, 504) under
  its name, and generation charges its tokens to the tenant's tokens-per-minute budget. None on an open server.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal, Protocol

__all__ = ["CALLER", "PRIORITY", "Caller", "Priority"]

Priority = Literal["interactive", "bulk"]
PRIORITY: ContextVar[Priority] = ContextVar("miaohui_priority", default="interactive")


class Caller(Protocol):
    """The tenant a request's key names, as the code behind the gate sees it."""

    name: str
    """The tenant's name (metrics and logs; never the key)."""

    def charge(self, tokens: int) -> None:
        """Count ``tokens`` (prompt + completion) against the tenant's tokens-per-minute budget."""
        ...


CALLER: ContextVar[Caller | None] = ContextVar("miaohui_caller", default=None)
