"""The model runner: executes one :class:`SchedulerOutput` on a :class:`CausalLMEngine`.

It owns the running batch's KV cache (rows ↔ sequence ids) and each sequence's random generator, and is
the only code that touches them; it runs in the engine loop's worker thread, one step at a time. A step:

1. drop the rows of sequences that are no longer decoding (finished or aborted since the last step);
2. decode one token for every remaining row (a single engine call for the whole batch);
3. prefill the newly admitted prompts (one left-padded engine call) and append their rows;
4. sample every row with its own parameters and generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from miaohui.generation.engine.sampling import make_rng, sample_batch
from miaohui.generation.engine.scheduler import RunnerOutput, SchedulerOutput
from miaohui.generation.executors.base import CausalLMEngine, KVCache


@dataclass(frozen=True)
class StepTiming:
    decode_s: float
    prefill_s: float
    batch_rows: int
    kv_length: int
    mixed: bool = False
    """The step's prefill ran as extra rows of its decode step (a mixed step; then ``prefill_s`` is sampling only)."""


class SeededRows:
    """Each sequence's own random generator (made from its seed at prefill, fresh entropy otherwise)."""

    _rngs: dict[int, np.random.Generator]

    def _rng(self, seq_id: int) -> np.random.Generator:
        rng = self._rngs.get(seq_id)
        if rng is None:
            rng = self._rngs[seq_id] = make_rng(None)
        return rng


Collect = Callable[[], RunnerOutput]
"""What ``launch`` returns: call it for the step's sampled tokens (waits for the device where it runs async)."""


class ModelRunner(SeededRows):
    """Runs scheduler steps on one engine; not thread-safe (one worker thread calls it)."""

    chains = False
    """Whether a step can be launched before the previous one's tokens are on the host (see
    :class:`~miaohui.generation.engine.slot_runner.SlotModelRunner`); this runner needs every token."""

    def __init__(self, engine: CausalLMEngine) -> None:
        self.engine = engine
        self._kv: KVCache | None = None
        self._rows: list[int] = []
        self._rngs: dict[int, np.random.Generator] = {}
        self.last_timing = StepTiming(0.0, 0.0, 0, 0)

    @property
    def rows(self) -> list[int]:
        return list(self._rows)

    def reset(self) -> None:
        """Forget every sequence (after an engine error the cache cannot be trusted)."""
        self._kv, self._rows, self._rngs = None, [], {}

    def launch(self, out: SchedulerOutput) -> Collect:
        """Run the step (synchronously: the CPU engines compute in the call)."""
        result = self.execute(out)
        return lambda: result

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        decode_ids = {d.seq_id for d in out.decode}
        for sid in out.finished_ids:
            self._rngs.pop(sid, None)
        keep = [i for i, sid in enumerate(self._rows) if sid in decode_ids]
        if len(keep) != len(self._rows):
            self._kv = self._kv.select(keep) if self._kv is not None else None
            self._rows = [self._rows[i] for i in keep]
        if set(self._rows) != decode_ids:
            missing = sorted(decode_ids - set(self._rows))
            self.reset()
            raise RuntimeError(f"decode step {out.step} names sequences {missing} that have no KV rows")
        tokens: dict[int, int] = {}
        t0 = time.perf_counter()
        if out.decode:
            by_id = {d.seq_id: d for d in out.decode}
            items = [by_id[sid] for sid in self._rows]
            if self._kv is None:
                raise RuntimeError(f"decode step {out.step} has sequences but no KV cache")
            fed = [d.token_id for d in items]
            if None in fed:
                self.reset()
                raise RuntimeError(f"decode step {out.step} lacks a sequence's token; this runner cannot chain steps")
            logits, self._kv = self.engine.decode([t for t in fed if t is not None], self._kv)
            sampled = sample_batch(logits, [d.params for d in items], [self._rng(d.seq_id) for d in items])
            tokens.update(zip(self._rows, sampled, strict=True))
        t1 = time.perf_counter()
        if out.prefill:
            for p in out.prefill:
                self._rngs[p.seq_id] = make_rng(p.params.seed)
            logits, kv = self.engine.prefill([p.prompt_ids for p in out.prefill])
            ids = [p.seq_id for p in out.prefill]
            sampled = sample_batch(logits, [p.params for p in out.prefill], [self._rng(i) for i in ids])
            tokens.update(zip(ids, sampled, strict=True))
            self._kv = KVCache.concat([self._kv, kv])
            self._rows += ids
        t2 = time.perf_counter()
        length = self._kv.length if self._kv is not None else 0
        self.last_timing = StepTiming(t1 - t0, t2 - t1, len(self._rows), length)
        return RunnerOutput(out.step, tokens)
