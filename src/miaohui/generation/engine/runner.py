"""The model runner: executes one :class:`SchedulerOutput` on a :class:`CausalLMEngine`.

It owns the running batch's KV cache (rows ↔ sequence ids) and each sequence's random generator, and is
the only code that touches them; it runs in the engine loop's worker thread, one step at a time. A step:

1. drop the rows of sequences that are no longer decoding (finished or aborted since the last step);
2. decode one token for every remaining row (a single engine call for the whole batch);
3. prefill the newly admitted prompts (one left-padded engine call) and append their rows;
4. sample every row with its own parameters and generator (a constrained row's logits masked first by its
   grammar, :mod:`~miaohui.generation.engine.structured`; log-probabilities taken from the unmasked logits where asked).

With a prefix cache (:mod:`miaohui.generation.cache.prefix_kv`) step 3 prefills only what follows each prompt's longest
cached prefix, and the blocks of a row's tokens are cached after its prefill and when it leaves (step 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from miaohui.generation.cache.prefix_kv import PrefixKV
from miaohui.generation.engine.logprobs import TokenLogprobs, token_logprobs
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.sampling import make_rng, sample_batch
from miaohui.generation.engine.scheduler import RunnerOutput, SchedulerOutput
from miaohui.generation.engine.structured import TokenMasks
from miaohui.generation.executors.base import CausalLMEngine, KVCache


@dataclass(frozen=True)
class StepTiming:
    decode_s: float
    prefill_s: float
    batch_rows: int
    kv_length: int
    mixed: bool = False
    """The step's prefill ran as extra rows of its decode step (a mixed step; then ``prefill_s`` is sampling only)."""
    prompt_tokens: int = 0
    """Prompt tokens this step's prefill looked up in the prefix cache (0 without a prefix cache)."""
    cached_tokens: int = 0
    """Of those, the tokens whose KV came from the prefix cache (not computed)."""
    kept_tokens: int = 0
    """Of those, the tokens their slot still held from the sequence before it (nothing copied; the GPU slot engine)."""


_GREEDY_ROWS = np.random.default_rng(0)
"""What greedy rows are given as their generator: an argmax draws nothing from it."""


class SeededRows:
    """Each sampled sequence's own random generator (made from its seed at prefill, fresh entropy otherwise). A greedy
    sequence has none: making one costs 7 µs seeded and 15 µs from the OS's entropy, on every request's first token."""

    _rngs: dict[int, np.random.Generator]

    def _seed(self, seq_id: int, params: SamplingParams) -> None:
        """At a sequence's prefill: its generator, where it samples."""
        if not params.greedy:
            self._rngs[seq_id] = make_rng(params.seed)

    def _rng(self, seq_id: int, params: SamplingParams) -> np.random.Generator:
        if params.greedy:
            return _GREEDY_ROWS
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

    def __init__(
        self, engine: CausalLMEngine, masks: TokenMasks | None = None, prefix_cache: PrefixKV | None = None
    ) -> None:
        self.engine = engine
        self.masks = masks
        """Constrained sequences' grammars (None: the engine has no tokenizer, no request may be constrained)."""
        self.prefix_cache = prefix_cache
        self._kv: KVCache | None = None
        self._rows: list[int] = []
        self._fed: list[list[int]] = []
        """Each row's tokens, whose KV it holds (prompt + the tokens decoded), when there is a prefix cache."""
        self._hits = (0, 0)
        """(prompt tokens looked up, tokens reused) of the step's prefill."""
        self._rngs: dict[int, np.random.Generator] = {}
        self.last_timing = StepTiming(0.0, 0.0, 0, 0)

    @property
    def rows(self) -> list[int]:
        return list(self._rows)

    def reset(self) -> None:
        """Forget every sequence (after an engine error the cache cannot be trusted)."""
        self._kv, self._rows, self._rngs, self._fed = None, [], {}, []
        if self.masks is not None:
            self.masks.reset()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def idle(self) -> None:
        """No sequence runs (the engine loop has no work): store the rows of those that finished in the prefix cache
        (and retain them) now rather than at the next step, and free their KV."""
        self._keep_rows([])

    def launch(self, out: SchedulerOutput) -> Collect:
        """Run the step (synchronously: the CPU engines compute in the call)."""
        result = self.execute(out)
        return lambda: result

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        decode_ids = {d.seq_id for d in out.decode}
        for sid in out.finished_ids:
            self._rngs.pop(sid, None)
            if self.masks is not None:
                self.masks.drop(sid)
        self._keep_rows([i for i, sid in enumerate(self._rows) if sid in decode_ids])
        if set(self._rows) != decode_ids:
            missing = sorted(decode_ids - set(self._rows))
            self.reset()
            raise RuntimeError(f"decode step {out.step} names sequences {missing} that have no KV rows")
        tokens: dict[int, int] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        self._hits = (0, 0)
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
            fed_ids = [t for t in fed if t is not None]
            logits, self._kv = self.engine.decode(fed_ids, self._kv)
            if self.prefix_cache is not None:
                for row, t in zip(self._fed, fed_ids, strict=True):
                    row.append(t)
            self._pick(logits, self._rows, [d.params for d in items], tokens, logprobs)
        t1 = time.perf_counter()
        if out.prefill:
            for p in out.prefill:
                self._seed(p.seq_id, p.params)
                if p.params.json_schema is not None:
                    self._masks().start(p.seq_id, p.params.json_schema)
            prompts = [p.prompt_ids for p in out.prefill]
            logits, kv = self._prefill(prompts)
            ids = [p.seq_id for p in out.prefill]
            self._pick(logits, ids, [p.params for p in out.prefill], tokens, logprobs)
            self._kv = KVCache.concat([self._kv, kv])
            self._rows += ids
        t2 = time.perf_counter()
        length = self._kv.length if self._kv is not None else 0
        self.last_timing = StepTiming(t1 - t0, t2 - t1, len(self._rows), length, False, *self._hits)
        return RunnerOutput(out.step, tokens, logprobs or None)

    def _masks(self) -> TokenMasks:
        if self.masks is None:
            raise RuntimeError("a constrained request reached a runner without a tokenizer")
        return self.masks

    def _pick(
        self,
        logits: np.ndarray,
        seq_ids: list[int],
        params: list[SamplingParams],
        tokens: dict[int, int],
        logprobs: dict[int, TokenLogprobs],
    ) -> None:
        """Sample one token per row into ``tokens`` (constrained rows masked, their matchers advanced) and the
        log-probabilities of the rows that asked into ``logprobs``."""
        masks = self.masks
        masked = masks.mask(logits, seq_ids) if masks else logits
        sampled = sample_batch(masked, params, [self._rng(s, p) for s, p in zip(seq_ids, params, strict=True)])
        tokens.update(zip(seq_ids, sampled, strict=True))
        if masks:
            for sid, tok in zip(seq_ids, sampled, strict=True):
                masks.consume(sid, tok)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            rows = token_logprobs(logits[asked], [sampled[i] for i in asked], [params[i].logprobs or 0 for i in asked])
            logprobs.update((seq_ids[i], lp) for i, lp in zip(asked, rows, strict=True))

    def _prefill(self, prompts: list[tuple[int, ...]]) -> tuple[np.ndarray, KVCache]:
        """The engine's prefill of ``prompts``, from their cached prefixes where there are some (then their blocks
        are cached)."""
        cache = self.prefix_cache
        if cache is None:
            return self.engine.prefill(prompts)
        cached = [cache.cached(p) for p in prompts]
        # every prompt with a cached prefix computes the batch's full width (it takes back the end of its prefix
        # where that is longer than its own rest), so no row has padding between its prefix and the rest: padding
        # only ever sits on the left, which sliding-window layers need (they count cache slots)
        width = max(len(p) - n for p, n in zip(prompts, cached, strict=True))
        reuse = [max(0, len(p) - width) for p in prompts]
        self._hits = (sum(len(p) for p in prompts), sum(reuse))
        if any(reuse):
            empty = _empty_row(self.engine)
            rows = [cache.prefix(p, n) if n else empty for p, n in zip(prompts, reuse, strict=True)]
            rest = [p[n:] for p, n in zip(prompts, reuse, strict=True)]
            logits, kv = self.engine.prefill(rest, KVCache.concat(rows))
        else:
            logits, kv = self.engine.prefill(prompts)
        for r, p in enumerate(prompts):
            cache.store(p, kv, r)
        self._fed += [list(p) for p in prompts]
        return logits, kv

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep rows ``keep`` of the cache (in order); the others leave, stored in the prefix cache first."""
        if len(keep) != len(self._rows):
            self._store_leaving(keep)
            self._kv = self._kv.select(keep) if self._kv is not None else None
            self._rows = [self._rows[i] for i in keep]

    def _store_leaving(self, keep: list[int]) -> None:
        """Cache the blocks of the rows that leave (all but ``keep``): their prompt and the answer so far."""
        if self.prefix_cache is None or self._kv is None:
            return
        kept = set(keep)
        for r, tokens in enumerate(self._fed):
            if r not in kept:
                self.prefix_cache.store(tokens, self._kv, r)
                row = self._kv.select([r])
                if row is not None and row.length == len(tokens):  # holds exactly its tokens (no padding)
                    self.prefix_cache.retain(tokens, row)
        self._fed = [self._fed[i] for i in keep]


def _empty_row(engine: CausalLMEngine) -> KVCache:
    """A one-row cache holding no token (a prompt with no cached prefix among prompts that have one)."""
    past = engine.empty_past(1)
    return KVCache(tuple(past[0::2]), tuple(past[1::2]), np.zeros((1, 0), dtype=np.int64))
