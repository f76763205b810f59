"""The causal-LM engine interface (prefill / decode over an explicit KV cache) and the batched cache.

KV layout — batched, left-padded, numpy: one ``[batch, kv_heads, length, head_dim]`` float32 array per
layer for keys and one for values, plus ``mask [batch, length]`` (1 = real slot). Rows of different
lengths share ``length`` by padding on the left; each row's positions are its own (``mask.sum(1)`` is the
next position), so a row computes exactly what it would alone: padding slots are masked out of every
softmax. Why one batched cache rather than per-sequence arrays: a decode step then feeds the engine's
``present`` outputs straight back as the next ``past`` inputs with no copy, and the running batch only
changes shape when a sequence joins (rows appended, left-padded to the common length) or leaves (rows
dropped, then all-padding columns trimmed on the left). The cost is padding: a batch holding one long
and several short sequences computes attention over the long one's length for all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from miaohui.errors import InputError, ShapeError
from miaohui.generation.models.dims import DecoderDims

if TYPE_CHECKING:
    from miaohui.generation.cache.slot_prefix import SlotPrefixKV


def check_token_ids(ids: np.ndarray, vocab: int) -> None:
    """InputError unless every id is in ``[0, vocab)``."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(
            f"token ids must be in [0, {vocab}), got min {int(ids.min())} max {int(ids.max())}",
            "encode text with this model's tokenizer",
        )


@dataclass(frozen=True)
class KVCache:
    """Batched, left-padded KV cache (see the module docstring). Arrays are never modified in place (an int4 engine's
    one-row steps return views of a longer buffer and write only beyond their end:
    :mod:`~miaohui.generation.executors.ort_in_place`)."""

    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    mask: np.ndarray

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    @property
    def next_positions(self) -> np.ndarray:
        """[batch] int64: the position id of each row's next token (its number of real slots)."""
        return self.mask.sum(axis=1, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def select(self, rows: Sequence[int]) -> KVCache | None:
        """The cache of ``rows`` (in that order), left-trimmed; None when ``rows`` is empty."""
        if not rows:
            return None
        if list(rows) == list(range(self.batch)):
            return self
        idx = np.asarray(rows, dtype=np.int64)
        mask = self.mask[idx]
        start = int(np.argmax(mask.any(axis=0))) if mask.any() else mask.shape[1]
        return KVCache(
            tuple(k[idx, :, start:] for k in self.keys),
            tuple(v[idx, :, start:] for v in self.values),
            np.ascontiguousarray(mask[:, start:]),
        )

    @staticmethod
    def concat(caches: Sequence[KVCache | None]) -> KVCache | None:
        """Rows of several caches in one, each left-padded to the longest length."""
        parts = [c for c in caches if c is not None]
        if len(parts) <= 1:
            return parts[0] if parts else None
        width = max(c.length for c in parts)

        def pad(a: np.ndarray, axis: int) -> np.ndarray:
            extra = width - a.shape[axis]
            if extra == 0:
                return a
            widths = [(0, 0)] * a.ndim
            widths[axis] = (extra, 0)
            return np.pad(a, widths)

        layers = range(len(parts[0].keys))
        return KVCache(
            tuple(np.concatenate([pad(c.keys[i], 2) for c in parts]) for i in layers),
            tuple(np.concatenate([pad(c.values[i], 2) for c in parts]) for i in layers),
            np.concatenate([pad(c.mask, 1) for c in parts]),
        )


class CausalLMEngine(abc.ABC):
    """A loaded decoder. ``prefill`` and ``decode`` validate and lay out inputs; ``_forward`` computes.

    Both return ``(logits [batch, vocab] float32 of each row's last position, KVCache)``. Engines are
    context managers; ``close`` releases native resources.
    """

    name: str = "causal-lm"

    def __init__(self, dims: DecoderDims, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.dims = dims
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)

    @property
    def max_positions(self) -> int:
        return self.dims.max_positions

    def empty_past(self, batch: int) -> list[np.ndarray]:
        d = self.dims
        empty = np.zeros((batch, d.num_kv_heads, 0, d.head_dim), dtype=np.float32)
        return [empty] * (2 * d.num_layers)

    def prefill(self, prompts: Sequence[Sequence[int]], prefix: KVCache | None = None) -> tuple[np.ndarray, KVCache]:
        """Run the prompts (left-padded into one batch); logits of each prompt's last token and its cache.

        ``prefix``: one row per prompt holding the KV of tokens that come before it (a cached prefix; a row may have
        none). The prompts are then only the rest, positioned after their row's prefix; the returned cache holds
        prefix and prompt (a row's padding may then sit between the two: masked out like any padding)."""
        if not prompts:
            raise InputError("prefill got no prompts", "pass at least one list of token ids")
        width = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise InputError("a prompt has no tokens", "send non-empty prompts")
        start = np.zeros(len(prompts), dtype=np.int64) if prefix is None else prefix.next_positions
        if prefix is not None and prefix.batch != len(prompts):
            raise ShapeError(
                f"prefill got a prefix of {prefix.batch} rows for {len(prompts)} prompts", "pass one row per prompt"
            )
        longest = int(max(s + len(p) for s, p in zip(start, prompts, strict=True)))
        if longest > self.max_positions:
            raise InputError(
                f"a prompt has {longest} tokens; the model's context is {self.max_positions}",
                f"shorten the prompt to at most {self.max_positions} tokens",
            )
        ids = np.full((len(prompts), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        pos = np.zeros((len(prompts), width), dtype=np.int64)
        for r, p in enumerate(prompts):
            n = len(p)
            ids[r, width - n :] = p
            mask[r, width - n :] = 1
            pos[r, width - n :] = np.arange(start[r], start[r] + n)
        self._check_ids(ids)
        if prefix is None:
            past = self.empty_past(len(prompts))
        else:
            past = [a for pair in zip(prefix.keys, prefix.values, strict=True) for a in pair]
            mask = np.concatenate([prefix.mask, mask], axis=1)
        logits, present = self._forward(ids, mask, pos, past)
        return logits, self._cache(present, mask)

    def decode(self, tokens: Sequence[int], kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """One new token per row of ``kv``; logits for the following token and the grown cache."""
        if len(tokens) != kv.batch:
            raise ShapeError(
                f"decode got {len(tokens)} tokens for a cache of {kv.batch} rows", "pass one token per row"
            )
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        self._check_ids(ids)
        pos = kv.next_positions.reshape(-1, 1)
        if int(pos.max()) >= self.max_positions:
            raise InputError(
                f"a sequence reached the model's context of {self.max_positions} tokens",
                "finish the sequence (max_tokens / max_model_len) before the context is full",
            )
        mask = np.concatenate([kv.mask, np.ones((kv.batch, 1), dtype=np.int64)], axis=1)
        past = [a for pair in zip(kv.keys, kv.values, strict=True) for a in pair]
        logits, present = self._forward(ids, mask, pos, past)
        return logits, self._cache(present, mask)

    def _check_ids(self, ids: np.ndarray) -> None:
        check_token_ids(ids, self.dims.vocab)

    @staticmethod
    def _cache(present: Sequence[np.ndarray], mask: np.ndarray) -> KVCache:
        return KVCache(tuple(present[0::2]), tuple(present[1::2]), mask)

    @abc.abstractmethod
    def _forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(last-position logits [B, V], presents [k0, v0, k1, v1, ...]) for already-valid inputs."""

    def close(self) -> None:  # noqa: B027 — optional hook
        """Release native resources. Idempotent."""

    def __enter__(self) -> CausalLMEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StepLogits(abc.ABC):
    """Logits of one engine step, possibly still on the device: only what sampling needs comes back."""

    @abc.abstractmethod
    def argmax(self) -> list[int]:
        """Greedy token of every row (one small device → host copy)."""

    @abc.abstractmethod
    def rows(self, idx: Sequence[int]) -> np.ndarray:
        """float32 ``[len(idx), vocab]`` logits of the rows ``idx`` on the host (for sampled rows only)."""


class NumpyLogits(StepLogits):
    """Host logits as :class:`StepLogits`."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def argmax(self) -> list[int]:
        return [int(t) for t in np.argmax(np.nan_to_num(self.logits, nan=-np.inf), axis=-1)]

    def rows(self, idx: Sequence[int]) -> np.ndarray:
        return self.logits[np.asarray(idx, dtype=np.int64)]


class SlotCausalLMEngine(abc.ABC):
    """A decoder that owns a static KV cache of ``num_slots`` rows (the GPU engine).

    A sequence is prefilled into a free slot and decoded there until it finishes; the caller (the
    :class:`~miaohui.generation.engine.slot_runner.SlotModelRunner`) chooses slots and frees them. The engine
    keeps each slot's length. Logits come back as :class:`StepLogits`, so greedy rows never copy the
    vocabulary-wide logits to the host.
    """

    name: str = "slot-causal-lm"
    runs_async: bool = False
    """``decode``/``prefill`` return before the device has computed (CUDA); the logits' ``argmax`` waits."""
    feeds_tokens: bool = False
    """:meth:`decode` takes ``None`` for a slot's token: the greedy token the device picked for that slot in its
    previous step (decode or prefill), so a step can be launched before the previous one's tokens reach the host."""
    max_prefill_prompts: int | None = None
    """The most prompts one prefill runs at full speed (a static prefill's largest bucket, or the most prompts of a
    mixed step); more fall back to a slower path. :class:`~miaohui.generation.engine.engine_loop.LLMEngine` caps its
    scheduler's prefills there unless the scheduler config names its own ``max_prefill_seqs``. None: no such limit."""
    chaining: bool = False
    """Set (by :meth:`SlotModelRunner.enable_chaining`) when steps are launched before the previous one was read:
    each step's tokens must then be copied to the host right behind it, before a later step overwrites them."""

    def __init__(
        self, dims: DecoderDims, eos_token_ids: Sequence[int], pad_token_id: int, num_slots: int, max_len: int
    ) -> None:
        self.dims = dims
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.num_slots = int(num_slots)
        self.max_len = int(max_len)
        self.lengths = np.zeros(self.num_slots, dtype=np.int64)

    @property
    def max_positions(self) -> int:
        """Longest sequence (prompt + output) a slot holds."""
        return self.max_len

    def prefill(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> StepLogits:
        """Run ``prompts`` into ``slots`` (one each); logits of each prompt's last token. ``starts``: slot ``slots[i]``
        already holds the keys and values of the first ``starts[i]`` tokens of ``prompts[i]`` (a prefix loaded from
        the prefix cache, :meth:`prefix_cache`), so only the rest is computed."""
        if starts is not None and any(starts):
            if len(starts) != len(prompts) or any(not 0 <= s < len(p) for s, p in zip(starts, prompts, strict=True)):
                raise InputError(
                    f"prefill starts {list(starts)[:8]} for prompts of {[len(p) for p in prompts][:8]} tokens",
                    "report this (runner bug): one start per prompt, short of the prompt's length",
                )
            self._check_prompts(slots, prompts, starts)
            out = self._prefill_from(list(slots), [list(p) for p in prompts], list(starts))
        else:
            self._check_prompts(slots, prompts)
            out = self._prefill(list(slots), [list(p) for p in prompts])
        self.lengths[list(slots)] = [len(p) for p in prompts]
        return out

    def prefix_cache(self, block_size: int, budget_bytes: int) -> SlotPrefixKV | None:
        """A prefix cache over this engine's slots (``prefix_cache_mb``), or None where the engine has none."""
        return None

    def decode(self, slots: Sequence[int], tokens: Sequence[int | None]) -> StepLogits:
        """One new token per slot; logits for the following token. Grows each slot's length by one. A ``None``
        token (engines that :attr:`feeds_tokens`) is the slot's previous greedy pick, still on the device."""
        pos = self._decode_positions(slots, tokens)
        out = self._decode(list(slots), list(tokens), pos)
        self.lengths[list(slots)] += 1
        return out

    def decode_and_prefill(
        self,
        slots: Sequence[int],
        tokens: Sequence[int | None],
        new_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
    ) -> tuple[StepLogits, StepLogits] | None:
        """:meth:`decode` of ``slots`` and :meth:`prefill` of ``prompts`` into ``new_slots`` as one step where the
        engine runs them together (a *mixed* step; :mod:`miaohui.generation.models.mixed_step`); None where it does not
        (or not for these prompts): then call the two."""
        pos = self._decode_positions(slots, tokens)
        self._check_prompts(new_slots, prompts)
        if set(slots) & set(new_slots):
            raise InputError(
                f"slots {sorted(set(slots) & set(new_slots))} both decode and take a prompt", "report this (runner bug)"
            )
        out = self._mixed(list(slots), list(tokens), pos, list(new_slots), [list(p) for p in prompts])
        if out is not None:
            self.lengths[list(slots)] += 1
            self.lengths[list(new_slots)] = [len(p) for p in prompts]
        return out

    def _check_prompts(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> None:
        """InputError for prompts the slots cannot take. With ``starts`` only the ids past each start are checked:
        the tokens before it are a prefix-cache hit, equal to a prompt's whose ids were checked at its prefill (and
        a 2,000-token history's ids take ~35 µs to check on a 2-core CPU)."""
        if not prompts or len(slots) != len(prompts):
            raise InputError(f"prefill got {len(prompts)} prompts for {len(slots)} slots", "pass one slot per prompt")
        if min(len(p) for p in prompts) == 0:
            raise InputError("a prompt has no tokens", "send non-empty prompts")
        longest = max(len(p) for p in prompts)
        if longest > self.max_len:
            raise InputError(
                f"a prompt has {longest} tokens; this engine's slots hold {self.max_len}",
                f"shorten the prompt to at most {self.max_len} tokens",
            )
        self._check_slots(slots)
        for i, p in enumerate(prompts):
            self._check_ids(p[starts[i] :] if starts else p)

    def _decode_positions(self, slots: Sequence[int], tokens: Sequence[int | None]) -> np.ndarray:
        """Each slot's position for a decode of ``tokens`` (checked)."""
        if len(slots) != len(tokens) or not slots:
            raise ShapeError(f"decode got {len(tokens)} tokens for {len(slots)} slots", "pass one token per slot")
        self._check_slots(slots)
        known = [t for t in tokens if t is not None]
        if len(known) != len(tokens) and not self.feeds_tokens:
            raise InputError(f"decode got no token for a slot; {self.name} needs every token", "pass each token")
        self._check_ids(known)
        pos = self.lengths[list(slots)]
        if int(pos.min()) == 0:
            raise InputError("decode of a slot that holds no sequence", "prefill the slot first")
        if int(pos.max()) >= self.max_len:
            raise InputError(
                f"a sequence reached this engine's slot length of {self.max_len} tokens",
                "finish the sequence (max_tokens / max_model_len) before the slot is full",
            )
        return pos

    def release(self, slot: int) -> None:
        """The slot's sequence is gone (its cache rows are simply overwritten by the next prefill)."""
        self.lengths[slot] = 0

    def decode_rows(self, slots: Sequence[int]) -> int:
        """How many cache rows a :meth:`decode` of ``slots`` writes: rows ``0 .. n-1``, those that hold no sequence at
        position 0 (the engine pads its batch with them). Every slot unless an engine says less."""
        return self.num_slots

    def _check_slots(self, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots) or min(slots) < 0 or max(slots) >= self.num_slots:
            raise InputError(
                f"slots {list(slots)[:8]} must be distinct and in [0, {self.num_slots})", "report this (runner bug)"
            )

    def _check_ids(self, ids: Sequence[int]) -> None:
        check_token_ids(np.asarray(ids, dtype=np.int64), self.dims.vocab)

    @abc.abstractmethod
    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> StepLogits: ...

    @abc.abstractmethod
    def _decode(self, slots: list[int], tokens: list[int | None], positions: np.ndarray) -> StepLogits: ...

    def _mixed(
        self,
        slots: list[int],
        tokens: list[int | None],
        positions: np.ndarray,
        new_slots: list[int],
        prompts: list[list[int]],
    ) -> tuple[StepLogits, StepLogits] | None:
        """Engines with mixed steps override this; None: this engine (or these prompts) takes two steps."""
        return None

    def _prefill_from(self, slots: list[int], prompts: list[list[int]], starts: list[int]) -> StepLogits:
        """Engines with a :meth:`prefix_cache` override this (see :meth:`prefill`)."""
        raise NotImplementedError(f"{self.name} has no prefix cache; prefill whole prompts")

    def close(self) -> None:  # noqa: B027 — optional hook
        """Release device memory. Idempotent."""

    def __enter__(self) -> SlotCausalLMEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


AnyCausalLMEngine = CausalLMEngine | SlotCausalLMEngine
