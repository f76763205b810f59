"""The model runner for engines with a static slot KV cache (:class:`SlotCausalLMEngine`, the GPU engine).

Same contract as :class:`~miaohui.generation.engine.runner.ModelRunner` (``execute`` / ``reset`` /
``last_timing``), but the cache lives in the engine: the runner maps sequences to slots. A new sequence
gets the *lowest* free slot, so the decode batch (padded to cover the highest slot in use) stays small;
a sequence that left frees its slot before the step runs.

With a prefix cache (:mod:`miaohui.generation.cache.slot_prefix`) a new prompt's longest cached prefix is copied into
its slot and only the rest is prefilled, from that position; the blocks of a prompt are cached right after its
prefill, and those of its prompt + answer when its sequence leaves (when the engine loop goes idle, or at the
start of the next step, before its slot is reused). A free slot still holds what its last sequence left, until a
step writes it: a prompt that continues it (a conversation's next turn) takes that slot rather than the lowest free
one, and only the cached blocks the slot lacks are copied.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from miaohui.errors import InternalError
from miaohui.generation.cache.prefix_cache import Block, shared_blocks
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.runner import Collect, SeededRows, StepTiming
from miaohui.generation.engine.sampling import sample
from miaohui.generation.engine.scheduler import RunnerOutput, SchedulerOutput
from miaohui.generation.executors.base import SlotCausalLMEngine, StepLogits

if TYPE_CHECKING:
    # torch: imported where an engine makes one
    from miaohui.generation.cache.slot_prefix import PoolBlock, SlotPrefixKV


def sample_step(logits: StepLogits, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator]) -> list[int]:
    """One token per row: greedy rows from one device argmax, sampled rows on the host (seeded numpy)."""
    tokens = logits.argmax()
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if hot:
        rows = logits.rows(hot)
        for j, i in enumerate(hot):
            tokens[i] = sample(rows[j], params[i], rngs[i])
    return tokens


class SlotModelRunner(SeededRows):
    """Runs scheduler steps on a slot engine; not thread-safe (one worker thread calls it).

    ``chains``: the engine feeds a slot's previous greedy pick to its next decode on the device, so a step whose
    decode items carry no token (``token_id=None``) can be launched before the previous step was collected
    (:class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine`'s async scheduling). On a GPU :meth:`launch` returns
    while the step computes."""

    def __init__(self, engine: SlotCausalLMEngine, prefix_cache: SlotPrefixKV | None = None) -> None:
        self.engine = engine
        self.chains = engine.feeds_tokens
        self.prefix_cache = prefix_cache
        self._slot: dict[int, int] = {}
        self._free = list(range(engine.num_slots))
        self._rngs: dict[int, np.random.Generator] = {}
        self._tokens: dict[int, list[int]] = {}
        """Each sequence's prompt and sampled tokens, when there is a prefix cache (its slot holds the KV of the
        first ``engine.lengths[slot]`` of them)."""
        self._chain_end: dict[int, int] = {}
        """Each sequence's last cached prompt block (``SlotPrefixKV.chain_end``): its release stores the prompt and
        the answer from there without hashing the prompt's blocks again, before the next request's prefill."""
        self._held: dict[int, tuple[list[Block[PoolBlock]], tuple[int, ...]]] = {}
        """Free slots → the cached chain whose KV they still hold (what their last sequence stored when it left) and
        the tokens that sequence stored. Forgotten where a step writes the slot: it is given to a prompt, or a decode
        step pads its batch with it."""
        self._hits = (0, 0, 0)
        """(prompt tokens looked up, tokens reused, of those the tokens their slot held) of the step being launched."""
        self.last_timing = StepTiming(0.0, 0.0, 0, 0)

    def enable_chaining(self) -> None:
        """The loop launches steps before it reads the previous ones (async scheduling)."""
        self.engine.chaining = True

    @property
    def rows(self) -> list[int]:
        return list(self._slot)

    def reset(self) -> None:
        """Forget every sequence (after an engine error the cache cannot be trusted: the prefix cache is emptied)."""
        for slot in self._slot.values():
            self.engine.release(slot)
        self._slot, self._rngs, self._tokens, self._chain_end, self._held = {}, {}, {}, {}, {}
        self._free = list(range(self.engine.num_slots))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _release(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id)
        tokens = self._tokens.pop(seq_id, None)
        after = self._chain_end.pop(seq_id, None)
        if self.prefix_cache is not None and tokens is not None:
            stored = tuple(tokens[: int(self.engine.lengths[slot])])
            self.prefix_cache.store(stored, slot, after)
            if self.prefix_cache.chain:
                self._held[slot] = (self.prefix_cache.chain, stored)
        self.engine.release(slot)
        heapq.heappush(self._free, slot)
        self._rngs.pop(seq_id, None)

    def idle(self) -> None:
        """No sequence runs (the engine loop has no work): release the slots of those that finished (stored in the
        prefix cache, held for their conversation's next turn) now rather than at the next step."""
        for seq_id in list(self._slot):
            self._release(seq_id)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.launch(out)()

    def launch(self, out: SchedulerOutput) -> Collect:
        """Queue the step's decode and prefill on the engine and return at once (on a GPU both are in flight,
        back to back, when this returns); the returned call samples their tokens, waiting for the device."""
        decode_ids = {d.seq_id for d in out.decode}
        for sid in [s for s in self._slot if s not in decode_ids]:
            self._release(sid)
        for sid in out.finished_ids:
            self._rngs.pop(sid, None)
        missing = sorted(decode_ids - set(self._slot))
        if missing:
            self.reset()
            raise RuntimeError(f"decode step {out.step} names sequences {missing} that hold no slot")
        t0 = time.perf_counter()
        decode: _Rows | None = None
        prefill: _Rows | None = None
        slots = [self._slot[d.seq_id] for d in out.decode]
        tokens = [d.token_id for d in out.decode]
        prompts = [p.prompt_ids for p in out.prefill]
        new_slots: list[int] = []
        held: list[int] = []
        if out.prefill:
            if len(out.prefill) > len(self._free):
                raise InternalError(
                    f"{len(out.prefill)} new sequences but {len(self._free)} free KV slots",
                    f"set max_running_seqs <= {self.engine.num_slots} (the engine's num_slots)",
                )
            new_slots, held = self._take_slots(prompts)
            for p, slot in zip(out.prefill, new_slots, strict=True):
                self._slot[p.seq_id] = slot
                self._seed(p.seq_id, p.params)
        starts = self._reuse(prompts)
        mixable = slots and prompts and not any(starts)  # a mixed step starts its prompts at position 0
        both = self.engine.decode_and_prefill(slots, tokens, new_slots, prompts) if mixable else None
        if out.decode:
            if both is None:  # a mixed step's padding rows write the scratch row; a decode's write free slots
                self._forget_padded(self.engine.decode_rows(slots), new_slots, held)
            logits = both[0] if both else self.engine.decode(slots, tokens)
            decode = _Rows([d.seq_id for d in out.decode], [d.params for d in out.decode], logits)
        if out.prefill:
            if both:
                logits = both[1]
            else:  # prefixes are loaded after the decode, which pads its batch with free slots (writing position 0)
                kept = self._load(prompts, new_slots, starts, held)
                self._hits = (*self._hits[:2], kept)
                logits = self.engine.prefill(new_slots, prompts, starts)
            prefill = _Rows([p.seq_id for p in out.prefill], [p.params for p in out.prefill], logits)
            self._store(out, new_slots)
        hits = self._hits
        return lambda: self._collect(out.step, t0, decode, prefill, both is not None, hits)

    def _reuse(self, prompts: list[tuple[int, ...]]) -> list[int]:
        """How many leading tokens of each prompt come from the prefix cache (0 each without one). A prompt that
        reuses a prefix computes the step's widest rest (it takes back the end of its prefix where that is longer
        than its own rest), so no row's padding runs past its prompt's end, i.e. past the slot's length."""
        cache = self.prefix_cache
        self._hits = (0, 0, 0)
        if cache is None or not prompts:
            return [0] * len(prompts)
        cached = [cache.cached(p) for p in prompts]
        width = max(len(p) - n for p, n in zip(prompts, cached, strict=True))
        starts = [max(0, len(p) - width) for p in prompts]
        total = sum(len(p) for p in prompts)
        if 2 * sum(starts) < total:
            # reusing less than half the step's prompt tokens (a common chat-template start, say) is not worth
            # leaving the captured paths (mixed steps, static prefill graphs), which start prompts at position 0
            starts = [0] * len(prompts)
        self._hits = (total, sum(starts), 0)
        return starts

    def _take_slots(self, prompts: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
        """A free slot for each new prompt, and how many leading blocks of the prompt's cached chain that slot still
        holds: the free slot whose held chain shares the most blocks with the prompt's (the slot its conversation's
        last turn left) where those are at least half the prompt (as llama.cpp's ``--slot-prompt-similarity`` 0.5;
        less would not be reused, :meth:`_reuse`), else the lowest free slot (which keeps the decode batch small)."""
        slots, held = [], []
        for prompt in prompts:
            slot, best = -1, 0
            if self._held and self.prefix_cache is not None:
                slot, best = self._held_slot(prompt, self.prefix_cache)
            if slot < 0:
                slot = heapq.heappop(self._free)
            else:
                self._free.remove(slot)
                heapq.heapify(self._free)
            self._held.pop(slot, None)
            slots.append(slot)
            held.append(best)
        return slots, held

    def _held_slot(self, prompt: tuple[int, ...], pool: SlotPrefixKV) -> tuple[int, int]:
        """The free slot whose held chain shares the most blocks with ``prompt``'s lookup, and that count, where it is
        at least half the prompt; else (-1, 0). The lookup starts after the chain of a slot whose stored tokens
        ``prompt`` continues (a conversation's next turn: two tuple compares), so it hashes the blocks past the
        history (:meth:`PrefixCache.match`'s ``start``), not the history's again."""
        b = pool.block_size
        start: list[Block[PoolBlock]] = []
        for blocks, stored in self._held.values():
            n = len(blocks) * b
            # the last block's tokens first: for one short compare they tell most other slots apart
            if len(blocks) > len(start) and prompt[n - b : n] == blocks[-1].tokens and prompt[:n] == stored[:n]:
                start = blocks
        chain = pool.cache.match(prompt, start)  # the lookup that follows reuses this walk
        least = max(1, -(-len(prompt) // (2 * b)))
        slot, best = -1, 0
        for s, (blocks, _) in self._held.items() if len(chain) >= least else ():
            # the chains share `least` blocks exactly when they share the last of them: one check per slot
            if len(blocks) >= least and blocks[least - 1] is chain[least - 1]:
                k = shared_blocks(blocks, chain)
                if k > best:
                    slot, best = s, k
        return slot, best

    def _forget_padded(self, rows: int, new_slots: list[int], held: list[int]) -> None:
        """A decode step is about to write position 0 of its padding rows, the free slots below ``rows`` (the new
        prompts' slots too, which are free to the engine until their prefill): none holds its chain after it."""
        for slot in [s for s in self._held if s < rows]:
            del self._held[slot]
        for i, slot in enumerate(new_slots):
            if slot < rows:
                held[i] = 0

    def _load(self, prompts: list[tuple[int, ...]], slots: list[int], starts: list[int], held: list[int]) -> int:
        """Load the prompts' cached prefixes into their slots; the tokens their slots already held (not copied)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        return sum(cache.load(p, n, slot, k) for p, slot, n, k in zip(prompts, slots, starts, held, strict=True))

    def _store(self, out: SchedulerOutput, slots: list[int]) -> None:
        """Cache the blocks of the prompts just prefilled (queued behind the prefill on the device)."""
        if self.prefix_cache is not None:
            for p, slot in zip(out.prefill, slots, strict=True):
                self._tokens[p.seq_id] = list(p.prompt_ids)
                self.prefix_cache.store(p.prompt_ids, slot)
                self._chain_end[p.seq_id] = self.prefix_cache.chain_end

    def _collect(
        self,
        step: int,
        t0: float,
        decode: _Rows | None,
        prefill: _Rows | None,
        mixed: bool,
        hits: tuple[int, int, int] = (0, 0, 0),
    ) -> RunnerOutput:
        """Sample the launched rows (decode first). ``decode_s``: launch until the decode tokens are on the host;
        on a GPU the prefill was queued behind the decode on the same stream, so in a step with both this includes
        the prefill's GPU time and ``prefill_s`` is what is left (sampling its rows). ``hits``: the prefill's (prompt
        tokens looked up, tokens reused from the prefix cache, of those the tokens their slots held)."""
        tokens: dict[int, int] = {}
        if decode is not None:
            tokens.update(self._sample(decode))
        t1 = time.perf_counter()
        if prefill is not None:
            tokens.update(self._sample(prefill))
        t2 = time.perf_counter()
        longest = int(self.engine.lengths.max()) if self._slot else 0
        self.last_timing = StepTiming(t1 - t0, t2 - t1, len(self._slot), longest, mixed, *hits)
        for sid, tok in tokens.items():
            held = self._tokens.get(sid)
            if held is not None:
                held.append(tok)
        return RunnerOutput(step, tokens)

    def _sample(self, rows: _Rows) -> zip[tuple[int, int]]:
        rngs = [self._rng(i, p) for i, p in zip(rows.ids, rows.params, strict=True)]
        return zip(rows.ids, sample_step(rows.logits, rows.params, rngs), strict=True)


@dataclass(frozen=True)
class _Rows:
    """Launched rows of one kind (decode or prefill): their sequences, parameters and device logits."""

    ids: list[int]
    params: list[SamplingParams]
    logits: StepLogits
