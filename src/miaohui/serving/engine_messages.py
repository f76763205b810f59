"""The messages between the HTTP workers and the engine process of ``--shared-engine``
(:mod:`miaohui.serving.engine_process`), one type per kind.

They are typed, immutable records (``NamedTuple``), one class per kind. The tokens inside a :class:`TokenBatch` are
plain rows (:data:`TokenRow`), so the per-token frames of generation cost what untyped tuples cost to pickle.

Worker → engine: :class:`Infer`, :class:`Cancel`, :class:`Status`, :class:`LlmStatus`, :class:`Generate`,
:class:`Abort`, :class:`Load`, :class:`Unload`.
Engine → worker: :class:`Ok` or :class:`Err` (a reply to the request with the same ``rid``), and
:class:`TokenBatch` (the generation events of one event-loop turn: :data:`TokenRow` tokens, :class:`StreamError`
failures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import FinishReason
from miaohui.priority import Priority

__all__ = [
    "Abort",
    "Cancel",
    "ChatFacts",
    "ChatStatus",
    "EngineReply",
    "EngineRequest",
    "Err",
    "Generate",
    "Infer",
    "ItemSink",
    "LlmStatus",
    "Load",
    "Ok",
    "OkValue",
    "RemoteError",
    "Status",
    "StreamError",
    "StreamItem",
    "TokenBatch",
    "TokenRow",
    "Unload",
]


class RemoteError(NamedTuple):
    """An error as it crosses the socket: the miaohui error class name (``RuntimeError`` for any other), its
    message and its fix."""

    kind: str
    message: str
    fix: str | None


class Infer(NamedTuple):
    """Run ``rows`` (token ids) through ``model`` version ``version``; ``timeout_ms`` is the time left."""

    rid: int
    model: str
    version: int
    rows: list[list[int]]
    timeout_ms: float | None
    priority: Priority = "interactive"
    """The class of the request's API key (:mod:`miaohui.priority`): the engine process's batcher queues the rows
    of interactive requests ahead of bulk ones, as a single-process server does."""


class Cancel(NamedTuple):
    """The worker's client went away: drop request ``rid`` (no reply)."""

    rid: int


class Status(NamedTuple):
    """Which versions are ready, by model (reply: :class:`Ok` with ``{model: [versions]}``)."""

    rid: int


class LlmStatus(NamedTuple):
    """The chat versions the engine process serves (reply: :class:`Ok` with a :data:`ChatStatus`)."""

    rid: int


class ChatFacts(NamedTuple):
    """What a worker needs to know of a chat version the engine process serves."""

    vocab: int
    max_model_len: int


ChatStatus = dict[str, dict[int, ChatFacts]]
"""Ready chat versions by model and version."""


class Load(NamedTuple):
    """Load (or reload) ``model`` per its version policy in the engine process (reply: :class:`Ok` once its new
    versions are warm and serving)."""

    rid: int
    model: str


class Unload(NamedTuple):
    """Unload ``model`` in the engine process (reply: :class:`Ok` once its running streams finished)."""

    rid: int
    model: str


class Generate(NamedTuple):
    """Admit generation request ``sid`` on ``model``'s serving version, or on ``version`` when one is named (a
    shadow candidate's run); reply: :class:`Ok` with that version once admitted; its tokens follow in
    :class:`TokenBatch` frames."""

    rid: int
    sid: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    version: int | None = None
    priority: Priority = "interactive"
    """The class of the request's API key: the engine process's scheduler queues a waiting interactive request ahead
    of bulk ones, as a single-process server does."""


class Abort(NamedTuple):
    """Stop generation request ``sid`` (no reply)."""

    sid: int


OkValue = np.ndarray | dict[str, list[int]] | ChatStatus | int | None
"""An :class:`Infer`'s output rows, a :class:`Status`, a :class:`LlmStatus`, the version a :class:`Generate` went to,
or nothing (:class:`Load`, :class:`Unload`)."""


class Ok(NamedTuple):
    """Request ``rid`` succeeded with ``value``."""

    rid: int
    value: OkValue


class Err(NamedTuple):
    """Request ``rid`` failed."""

    rid: int
    error: RemoteError


TokenRow = tuple[int, int | None, str, int, FinishReason | None, int, int]
"""One generated token: (sid, token_id, text, generated so far, finish_reason, prompt_tokens, completion_tokens), the
fields of :class:`~miaohui.generation.engine.engine_loop.TokenEvent` for request ``sid``. A plain tuple on purpose:
frames carry one per token per decode step, and a tuple of a class of its own costs ~8x more to pickle and unpickle."""


class StreamError(NamedTuple):
    """Generation request ``sid`` failed."""

    sid: int
    error: RemoteError


StreamItem = TokenRow | StreamError
"""What a generation request's sink receives."""

ItemSink = Callable[[StreamItem], None]
"""A worker's receiver of one generation request's items."""


class TokenBatch(NamedTuple):
    """The generation events of one event-loop turn of the engine process (one frame per decode step): the tokens,
    then the requests that failed (a failure ends its request, so it follows that request's tokens)."""

    tokens: list[TokenRow]
    errors: list[StreamError]


EngineRequest = Infer | Cancel | Status | LlmStatus | Generate | Abort | Load | Unload
EngineReply = Ok | Err | TokenBatch
REQUEST_TYPES = (Infer, Cancel, Status, LlmStatus, Generate, Abort, Load, Unload)
REPLY_TYPES = (Ok, Err, TokenBatch)
