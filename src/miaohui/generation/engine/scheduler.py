"""Iteration-level (continuous) batching for generation. Pure Python: no torch, no numpy.

Each engine step is ``schedule() → runner.execute(output) → update(runner_output)``:

* :meth:`Scheduler.schedule` puts every running sequence in the step's *decode* list (one token each)
  and then admits waiting sequences, oldest first, into the *prefill* list while there is a free slot
  (``max_running_seqs``), the step's token budget (``max_batched_tokens``) holds them and fewer than
  ``max_prefill_seqs`` were admitted in this step. New requests
  therefore join between decode steps and never wait for a batch to drain. Admission stops at the first
  request that does not fit (FIFO, so a long prompt is never starved by short ones).
* The CPU engines left-pad a prefill batch, so the budget counts what is computed: one token per decode
  plus ``rows × longest prompt`` for the prefill batch. A prompt longer than the budget could never run
  and is rejected by :meth:`Scheduler.add`.
* :meth:`Scheduler.update` appends each sampled token and finishes a sequence on an end-of-sequence or
  stop token (reason ``stop``), a stop string in its text (``stop``; the text is cut before it), or
  ``max_tokens`` / the context length (``length``). Finished sequences leave at once: their slot is free
  for the next :meth:`schedule`.
* :meth:`Scheduler.abort` (client went away) frees the slot immediately, even while a step that includes
  the sequence is computing; that step's token for it is dropped.
* Async scheduling: :meth:`schedule` may be called again before the previous step's tokens were advanced (the
  engine loop launches step N+1 while step N computes). A sequence then has a token *in flight*: its decode item
  carries no token (``token_id=None``: the engine feeds its own greedy pick), and it is left out of the next step
  when the in-flight token reaches its length. One that ends on an end-of-sequence token decodes one step too
  many; that token is dropped.

One frozen dataclass crosses each boundary: :class:`SchedulerOutput` to the runner (which may run in
another thread while the scheduler keeps changing, hence snapshots), :class:`RunnerOutput` back, and a
:class:`SequenceUpdate` per sequence to the streaming layer.
"""

from __future__ import annotations

import enum
import itertools
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
from pydantic import Field, model_validator

from miaohui.config import Frozen
from miaohui.errors import ConfigError, InputError, QueueFullError
from miaohui.generation.engine.params import SamplingParams
from miaohui.priority import PRIORITY

if TYPE_CHECKING:
    from miaohui.generation.engine.logprobs import TokenLogprobs

FinishReason = Literal["stop", "length", "abort", "error"]


class Detokenizer(Protocol):
    """Incremental text of a sequence's tokens (see :mod:`miaohui.generation.engine.detok`)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


DetokenizerFactory = Callable[[Seq[int]], Detokenizer]


def find_stop(text: str, new_chars: int, stop: Seq[str], max_stop_len: int) -> int | None:
    """Where the first stop string in ``text`` begins, looking only where the last ``new_chars`` characters could
    have completed one (``max_stop_len``: the longest stop string); None when there is none."""
    start = max(0, len(text) - new_chars - max_stop_len + 1)
    hits = [i for i in [text.find(s, start) for s in stop] if i >= 0]
    return min(hits) if hits else None


class SchedulerConfig(Frozen):
    """Limits of the continuous-batching scheduler (one per model instance)."""

    max_running_seqs: int = Field(default=16, ge=1)
    """Most sequences in the running batch (each holds a KV cache row)."""
    max_batched_tokens: int = Field(default=2048, ge=1)
    """Token budget of one step: running sequences (1 each) + padded prefill tokens. Bounds a step's
    latency, hence the inter-token latency other streams see while a prompt is prefilled."""
    max_waiting: int = Field(default=256, ge=1)
    """Most requests waiting for a slot; more are rejected with QueueFullError (HTTP 429)."""
    max_model_len: int = Field(default=2048, ge=2)
    """Longest prompt + output of a sequence (the context window the engine is run with)."""
    async_scheduling: bool = False
    """The async engine loop schedules and launches step N+1 before it reads step N's tokens, and makes step N's
    text while N+1 computes, so the device never waits for the host between steps (vLLM's async scheduling). Needs
    an engine that feeds greedy picks on the device (the GPU engine) and only chains while every running sequence is
    greedy. Off by default: on the H200 it gave +13–34 % tokens/s but longer TTFT/ITL tails (docs/gpu.md)."""

    prefill_min_prompts: int = Field(default=1, ge=1)
    """While sequences are decoding, hold new prompts until this many wait (or the oldest has waited
    ``prefill_max_wait_ms``, or no more could fit), then prefill them together: a prefill reads every weight once,
    so n prompts in one prefill cost far less than n prefills. Trades TTFT (at most ``prefill_max_wait_ms``) for
    tokens/s. 1 (the default) admits every prompt at the next step: holding prompts raised tokens/s little on the
    H200 and lengthened the TTFT tail."""
    prefill_max_wait_ms: float = Field(default=0.0, ge=0.0)
    """The longest a prompt is held for ``prefill_min_prompts`` (measured from its arrival)."""
    max_prefill_seqs: int | None = Field(default=None, ge=1)
    """Most prompts prefilled in one step (None: as many as ``max_batched_tokens`` holds); the rest wait for the
    next step. Prompts that arrive together (e.g. streams of equal output length that finished in the same step)
    are otherwise prefilled together, finish together and come back together: such groups persist and merge,
    and each group's prefill is one long step for every other stream. A cap spreads a group over consecutive steps
    (with 1, no two sequences share a prefill step); it also keeps a static-prefill engine inside its largest
    prefill graph (``SlotEngineOptions.prefill_batch_buckets``; more prompts are prefilled eagerly) — unset, the
    engine's ``max_prefill_prompts`` (that largest bucket) is taken (``LLMEngine``): on the H200 the TTFT tails came
    from prefills of more prompts than that."""
    prefix_cache_mb: float = Field(default=256.0, ge=0.0)
    """Memory for the prefix cache (MiB; 0 turns it off): the KV of recent prompts and answers, in blocks of
    ``prefix_block_size`` tokens shared by every request, so a prompt that starts like an earlier one (a conversation's
    next turn, a common system prompt) computes only what follows. Least recently used blocks are evicted beyond it.
    256 MiB holds ~5,800 tokens of SmolLM2-135M's fp32 KV (46 KB a token): a few dozen conversations' recent turns,
    a small share of a server's memory. The ONNX Runtime engine uses it, and the GPU slot engine (``inductor``) as a
    block pool of this size allocated on its device beside the slots (llama.cpp keeps its own per-slot cache)."""
    prefix_block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per prefix-cache block: prompts share cached KV in whole blocks (a prompt reuses at most the blocks
    that match it in full, and all but its last token). 16 as vLLM: small enough that a new turn recomputes little
    past the point where it departs from the cached text, large enough that lookups and copies stay cheap."""

    @model_validator(mode="after")
    def _budget(self) -> SchedulerConfig:
        if self.prefill_min_prompts > 1 and self.prefill_max_wait_ms <= 0:
            raise ConfigError(
                f"prefill_min_prompts={self.prefill_min_prompts} holds prompts but prefill_max_wait_ms is 0",
                "set prefill_max_wait_ms (e.g. 10) to bound the wait, or prefill_min_prompts back to 1",
            )
        if self.max_prefill_seqs is not None and self.prefill_min_prompts > self.max_prefill_seqs:
            raise ConfigError(
                f"prefill_min_prompts={self.prefill_min_prompts} > max_prefill_seqs={self.max_prefill_seqs}",
                "a step cannot prefill more prompts than max_prefill_seqs: lower prefill_min_prompts to it",
            )
        if self.max_batched_tokens < self.max_running_seqs:
            raise ConfigError(
                f"max_batched_tokens={self.max_batched_tokens} < max_running_seqs={self.max_running_seqs}",
                "a decode step needs one token per running sequence: raise max_batched_tokens to at least "
                f"{self.max_running_seqs} or lower max_running_seqs",
            )
        return self


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's generation state. Owned by the scheduler; other code reads it."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text: str = ""
    """Generated text so far (stop strings cut off), when a detokenizer is attached."""
    emitted: int = 0
    """How many characters of ``text`` were handed out in updates."""
    detokenizer: Detokenizer | None = None
    bulk: bool = False
    """Queued under a bulk-class API key (:mod:`miaohui.priority`)."""
    in_flight: int = 0
    """Tokens scheduled whose results :meth:`Scheduler.advance` has not seen yet (async scheduling: at most one
    when :meth:`Scheduler.schedule` runs)."""
    max_stop_len: int = field(init=False, repr=False)
    """``params.max_stop_len``, kept (every emitted token of a request with stop strings needs it)."""

    def __post_init__(self) -> None:
        self.max_stop_len = self.params.max_stop_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class PrefillItem:
    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    queued_s: float = 0.0
    """How long the request waited between its arrival and the step that prefills it (the scheduler's clock)."""


# The per-token records below (DecodeItem, Advanced, SequenceUpdate) are made for every sequence of every step, in the
# engine thread's host time between device steps: their __init__ is written out because the one a frozen dataclass
# generates sets each field through object.__setattr__, twice as slow. They stay frozen (no assignment after __init__).


@dataclass(frozen=True)
class DecodeItem:
    seq_id: int
    token_id: int | None
    """The sequence's last token, fed to this decode step; None: still in flight (the engine feeds its own greedy
    pick of the previous step)."""
    params: SamplingParams

    def __init__(self, seq_id: int, token_id: int | None, params: SamplingParams) -> None:
        d = self.__dict__
        d["seq_id"] = seq_id
        d["token_id"] = token_id
        d["params"] = params


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes: scheduler → runner. Immutable snapshots, safe to read in another thread."""

    step: int
    prefill: tuple[PrefillItem, ...]
    decode: tuple[DecodeItem, ...]
    finished_ids: tuple[int, ...]
    """Sequences that left since the previous step; the runner frees their KV rows."""
    num_batched_tokens: int
    """Decode tokens + padded prefill tokens of this step (what the budget counted)."""

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(frozen=True)
class RunnerOutput:
    """Runner → scheduler: the token sampled for each sequence of the step."""

    step: int
    token_ids: dict[int, int]
    logprobs: dict[int, TokenLogprobs] | None = None
    """The sampled tokens' log-probabilities, for the sequences that asked (``SamplingParams.logprobs``)."""


@dataclass(frozen=True)
class Advanced:
    """One token appended by :meth:`Scheduler.advance`, its text still to come from :meth:`Scheduler.emit`."""

    seq: Sequence
    token: int
    reason: FinishReason | None
    """Set when the token finished the sequence (end-of-sequence / stop token, or its length)."""
    num_output_tokens: int
    logprobs: TokenLogprobs | None

    def __init__(
        self,
        seq: Sequence,
        token: int,
        reason: FinishReason | None,
        num_output_tokens: int,
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        d = self.__dict__
        d["seq"] = seq
        d["token"] = token
        d["reason"] = reason
        d["num_output_tokens"] = num_output_tokens
        d["logprobs"] = logprobs


@dataclass(frozen=True)
class SequenceUpdate:
    """Scheduler → streaming layer: one new token of one sequence (and the text it completes)."""

    seq_id: int
    token_id: int | None
    """None for a finish without a token (abort, error)."""
    text: str
    """New text to show: held back while it could still become a stop string; may be empty."""
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None
    """The token's log-probabilities when the request asked for them."""

    def __init__(
        self,
        seq_id: int,
        token_id: int | None,
        text: str,
        num_output_tokens: int,
        finish_reason: FinishReason | None = None,
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        d = self.__dict__
        d["seq_id"] = seq_id
        d["token_id"] = token_id
        d["text"] = text
        d["num_output_tokens"] = num_output_tokens
        d["finish_reason"] = finish_reason
        d["logprobs"] = logprobs


def _checked_ids(ids: Seq[int], vocab: int) -> list[int]:
    """``ids`` as a list of ``int``; InputError naming the ids that are not integers in ``[0, vocab)``. Checked at C
    speed (an ``array`` of int64 and numpy's min and max): the common case, on every turn of a conversation whatever
    its length (a 2,000-token history's took 0.16 ms in Python's ``min``/``max``/``map`` on a 2-core CPU, 33 µs so)."""
    try:
        packed = array("q", ids)  # TypeError for anything that is not an integer, OverflowError past int64
        view = np.frombuffer(packed, dtype=np.int64)
        if not packed or (int(view.min()) >= 0 and int(view.max()) < vocab):
            return packed.tolist()
    except (TypeError, OverflowError):
        pass
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
    raise InputError(
        f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}", "encode the prompt with this model's tokenizer"
    )


def check_prompt(
    prompt_ids: Seq[int], config: SchedulerConfig, vocab: int | None, *, step_budget: bool = True
) -> list[int]:
    """The one prompt check of every engine (the scheduler's and llama.cpp's): InputError unless the prompt is
    non-empty, its ids are integers in ``[0, vocab)``, it leaves room for an answer in ``max_model_len`` and (with
    ``step_budget``: miaohui's scheduler prefills a prompt in one step) fits one step's ``max_batched_tokens``.
    Returns the prompt as a list of ``int``."""
    ids = _checked_ids(prompt_ids, vocab) if vocab is not None else list(map(int, prompt_ids))
    if not prompt_ids:
        raise InputError("the prompt has no tokens", "send a non-empty prompt")
    if len(prompt_ids) >= config.max_model_len:
        raise InputError(
            f"the prompt has {len(prompt_ids)} tokens; the context length is {config.max_model_len}",
            f"shorten the prompt below {config.max_model_len} tokens (room is needed for the answer)",
        )
    if step_budget and len(prompt_ids) > config.max_batched_tokens:
        raise InputError(
            f"the prompt has {len(prompt_ids)} tokens, more than max_batched_tokens="
            f"{config.max_batched_tokens} (one step's budget)",
            f"shorten the prompt to {config.max_batched_tokens} tokens or raise max_batched_tokens",
        )
    return ids


def check_queue(waiting: int, config: SchedulerConfig, more: str) -> None:
    """QueueFullError once ``max_waiting`` requests wait; ``more``: the other way to make room."""
    if waiting >= config.max_waiting:
        raise QueueFullError(
            f"{waiting} requests are waiting (max_waiting={config.max_waiting})",
            f"retry later, or raise max_waiting / {more}",
        )


class Scheduler:
    """Continuous-batching scheduler; see the module docstring for the contract of each call."""

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int] = (),
        detokenizer_factory: DetokenizerFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab: int | None = None,
    ) -> None:
        self.config = config
        self.vocab = vocab
        """Prompt token ids must be in ``[0, vocab)`` (None: not checked, a scheduler test without a model)."""
        self._clock = clock
        """Arrival times and prompt holds (``prefill_min_prompts``) read it; tests pass a fake one."""
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._detok = detokenizer_factory
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._finished_since_step: list[int] = []
        self._ids = itertools.count()
        self._step = 0

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def all_greedy(self) -> bool:
        """Whether every running sequence decodes greedily (async scheduling needs that)."""
        return all(s.params.greedy for s in self._running)

    def seq_ids(self) -> list[int]:
        """Ids of the unfinished (waiting and running) sequences."""
        return list(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence by id (finished ones are forgotten)."""
        return self._seqs.get(seq_id)

    def new_seq_id(self) -> int:
        return next(self._ids)

    # ---- requests ------------------------------------------------------------------------------------
    def add(self, prompt_ids: Seq[int], params: SamplingParams, seq_id: int | None = None) -> Sequence:
        """Queue a request. Raises InputError (bad prompt, :func:`check_prompt`) or QueueFullError (``max_waiting``
        reached)."""
        ids = check_prompt(prompt_ids, self.config, self.vocab)
        check_queue(len(self._waiting), self.config, "add instances")
        sid = self.new_seq_id() if seq_id is None else seq_id
        if sid in self._seqs:
            raise InputError(f"sequence id {sid} is already in use", "use a new id or let the scheduler pick")
        seq = Sequence(sid, ids, params, self._clock(), detokenizer=self._detok(ids) if self._detok else None)
        seq.bulk = PRIORITY.get() == "bulk"  # the API key's class: interactive requests wait ahead of bulk ones
        ahead = next((i for i, s in enumerate(self._waiting) if s.bulk), None) if not seq.bulk else None
        if ahead is None:
            self._waiting.append(seq)
        else:
            self._waiting.insert(ahead, seq)
        self._seqs[sid] = seq
        return seq

    def abort(self, seq_id: int, reason: FinishReason = "abort") -> SequenceUpdate | None:
        """Finish a sequence now and free its slot; None if it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
        self._finish(seq, reason)
        return SequenceUpdate(seq_id, None, "", len(seq.output_ids), reason)

    # ---- steps ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's decode and prefill sequences (see the module docstring)."""
        cfg = self.config
        max_len = cfg.max_model_len
        items: list[DecodeItem] = []
        for s in self._running:
            in_flight = s.in_flight
            if in_flight:  # its last token is in flight: it decodes after it unless that token reaches its length
                made = len(s.output_ids) + in_flight
                if made >= s.params.max_tokens or len(s.prompt_ids) + made >= max_len:
                    continue
                items.append(DecodeItem(s.seq_id, None, s.params))
            else:
                items.append(DecodeItem(s.seq_id, s.output_ids[-1] if s.output_ids else s.prompt_ids[-1], s.params))
            s.in_flight = in_flight + 1
        decode = tuple(items)
        budget = cfg.max_batched_tokens - len(decode)
        admitted: list[Sequence] = []
        longest = 0
        cap = cfg.max_running_seqs if cfg.max_prefill_seqs is None else cfg.max_prefill_seqs
        while (
            self._waiting
            and len(self._running) + len(admitted) < cfg.max_running_seqs
            and len(admitted) < cap
            and not (decode and not admitted and self._hold_prompts())
        ):
            seq = self._waiting[0]
            width = max(longest, seq.prompt_len)
            if width * (len(admitted) + 1) > budget:
                break
            longest = width
            admitted.append(self._waiting.popleft())
        for seq in admitted:
            seq.status = SequenceStatus.RUNNING
            seq.in_flight = 1
            self._running.append(seq)
        self._step += 1
        finished, self._finished_since_step = tuple(self._finished_since_step), []
        now = self._clock() if admitted else 0.0
        return SchedulerOutput(
            step=self._step,
            prefill=tuple(PrefillItem(s.seq_id, tuple(s.prompt_ids), s.params, now - s.arrival_time) for s in admitted),
            decode=decode,
            finished_ids=finished,
            num_batched_tokens=len(decode) + longest * len(admitted),
        )

    def _hold_prompts(self) -> bool:
        """Whether this step admits no prompt (``prefill_min_prompts``): fewer wait than the minimum, more could
        still fit, and the oldest has waited less than ``prefill_max_wait_ms``."""
        cfg, waiting = self.config, len(self._waiting)
        if waiting >= cfg.prefill_min_prompts or cfg.max_running_seqs - len(self._running) <= waiting:
            return False
        return (self._clock() - self._waiting[0].arrival_time) * 1000.0 < cfg.prefill_max_wait_ms

    def update(self, output: RunnerOutput) -> list[SequenceUpdate]:
        """Append the step's tokens; finish sequences that are done. Tokens of aborted ones are dropped.
        The same as :meth:`emit` of :meth:`advance`."""
        return self.emit(self.advance(output))

    def advance(self, output: RunnerOutput) -> list[Advanced]:
        """The cheap half of :meth:`update`, all a next :meth:`schedule` needs: append each token and finish the
        sequences that end on an end-of-sequence / stop token or their length. Their texts (detokenization, stop
        strings) come from :meth:`emit`, which an engine loop may run while the next step computes; a stop
        string found there finishes its sequence one step later than this would (that step's token is dropped)."""
        advanced: list[Advanced] = []
        seqs, running = self._seqs, SequenceStatus.RUNNING
        logprobs = output.logprobs
        for seq_id, token in output.token_ids.items():
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not running:
                continue
            advanced.append(self._advance(seq, int(token), logprobs.get(seq_id) if logprobs else None))
        return advanced

    def emit(self, advanced: Iterable[Advanced]) -> list[SequenceUpdate]:
        """Texts of :meth:`advance` d tokens (stop strings may finish a sequence here); one update per token of a
        sequence that was not aborted meanwhile."""
        updates: list[SequenceUpdate] = []
        for a in advanced:
            up = self._emit(a)
            if up is not None:
                updates.append(up)
        return updates

    # ---- internals -----------------------------------------------------------------------------------
    def _advance(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> Advanced:
        p = seq.params
        seq.in_flight -= 1
        output_ids = seq.output_ids
        output_ids.append(token)
        made = len(output_ids)
        reason: FinishReason | None = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif made >= p.max_tokens or len(seq.prompt_ids) + made >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            self._running.remove(seq)
            self._finish(seq, reason)
        return Advanced(seq, token, reason, made, logprobs)

    def _emit(self, a: Advanced) -> SequenceUpdate | None:
        seq, reason = a.seq, a.reason
        if reason is None and seq.status is SequenceStatus.FINISHED:  # aborted between advance and emit: its
            return None  # stream has ended
        stop = seq.params.stop
        detok = seq.detokenizer
        cut = False
        if detok is not None and reason != "stop":  # an end/stop token adds no text
            delta = detok.push(a.token)
            if delta:
                text = seq.text = seq.text + delta
                if stop:
                    hit = find_stop(text, len(delta), stop, seq.max_stop_len)
                    if hit is not None:
                        seq.text = text[:hit]
                        cut = True
                        if reason is None:
                            self._running.remove(seq)
                            self._finish(seq, "stop")
                        reason = seq.finish_reason = "stop"
        if reason is not None:
            if not cut and detok is not None:  # an incomplete character still held
                seq.text += detok.flush()
            end = len(seq.text)
        elif stop:  # the tail that could still become a stop string is held back
            end = len(seq.text) - max(0, seq.max_stop_len - 1)
        else:
            end = len(seq.text)
        emitted = seq.emitted
        if end > emitted:
            seq.emitted = end
            return SequenceUpdate(seq.seq_id, a.token, seq.text[emitted:end], a.num_output_tokens, reason, a.logprobs)
        return SequenceUpdate(seq.seq_id, a.token, "", a.num_output_tokens, reason, a.logprobs)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._finished_since_step.append(seq.seq_id)
