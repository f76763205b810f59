"""Per-token overhead of constrained decoding on the CPU: xgrammar, llguidance and outlines-core side by side.

For each tokenizer (SmolLM2's 49k vocabulary; Gemma-3's 262k when its GGUF package is installed) and each
constraint (a small JSON schema, and ``json_object``: any JSON object), each engine drives a decode of a fixed
target document: per token it computes the allowed-token mask, applies it to a [vocab] float32 logits row (the
engine's own numpy/torch helper where it has one) and consumes the target token. The per-token time is that whole
cycle; grammar compile time and tokenizer set-up are reported apart. All engines decode the same token sequence
(the target's tokenization), so the figures are comparable; a token an engine refuses is counted (``rejected``).

What each supports is probed, not copied from docs: JSON schema, ``json_object`` (any JSON), regex, EBNF/Lark.

    PYTHONPATH=src python benchmarks/bench_structured_cpu.py --repeats 30

The machine is shared: absolute figures are noisy, ratios within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.bench.report import environment, git_commit

RESULTS = Path(__file__).parent / "results"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "room": {"type": "string", "maxLength": 20},
        "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 50},
        "video": {"type": "boolean"},
    },
    "required": ["room", "start", "attendees", "video"],
    "additionalProperties": False,
}
TARGET = '{"room": "Meeting Room 3", "start": "09:00", "attendees": 6, "video": true}'
OBJECT_TARGET = '{"intent": "book_room", "slots": {"date": "tomorrow", "time": [9, 0]}, "confidence": 0.92}'
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
LARK = 'start: "yes" | "no"'


def hf_tokenizers() -> dict[str, Any]:
    """Tokenizers available offline: SmolLM2's from the test cache / zoo, Gemma-3's from its GGUF package."""
    from transformers import PreTrainedTokenizerFast

    out: dict[str, Any] = {}
    for d in (Path("var/test-cache/smollm2-135m"), Path("/work/main/var/test-cache/smollm2-135m")):
        if (d / "tokenizer.json").is_file():
            out["smollm2-135m (49k)"] = PreTrainedTokenizerFast(
                tokenizer_file=str(d / "tokenizer.json"), eos_token="<|im_end|>"
            )
            break
    try:
        from miaohui.zoo.gemma import gemma_available, gemma_gguf_path

        if gemma_available():
            from transformers import AutoTokenizer

            gguf = gemma_gguf_path()
            out["gemma3-270m (262k)"] = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # the optional package is absent or its tokenizer does not convert
        print(f"gemma tokenizer skipped: {exc}")
    return out


class Engine:
    """One library: set up for a tokenizer, compile a constraint, run a decode."""

    name = ""
    setup_s = 0.0

    def setup(self, tok: Any, vocab: int) -> None: ...

    def compile(self, kind: str, spec: str) -> Any: ...

    def run(self, compiled: Any, ids: list[int], logits: np.ndarray) -> tuple[list[float], int]:
        """Per-token seconds and the number of target tokens refused; ``self.setup_s``: the per-request matcher."""
        raise NotImplementedError


class XGrammar(Engine):
    name = "xgrammar"

    def setup(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = vocab
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        c = self.compiler
        if kind == "schema":
            return c.compile_json_schema(spec, any_whitespace=True)
        if kind == "object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar('root ::= "yes" | "no"')

    def run(self, compiled: Any, ids: list[int], logits: np.ndarray) -> tuple[list[float], int]:
        import torch

        xgr = self.xgr
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiled)
        self.setup_s = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, self.vocab)
        times, rejected = [], 0
        row = torch.from_numpy(logits[:1])  # shares memory: the mask lands in the numpy row
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(row, mask)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            rejected += not ok
        return times, rejected


class LLGuidance(Engine):
    name = "llguidance"

    def setup(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.lnp = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, kind: str, spec: str) -> Any:
        m = self.llg.LLMatcher
        if kind == "schema":
            grammar = m.grammar_from_json_schema(spec)
        elif kind == "object":
            grammar = m.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = m.grammar_from_regex(spec)
        else:
            grammar = m.grammar_from_lark(spec)
        error = m.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def run(self, compiled: Any, ids: list[int], logits: np.ndarray) -> tuple[list[float], int]:
        t0 = time.perf_counter()
        m = self.llg.LLMatcher(self.tok, compiled)
        self.setup_s = time.perf_counter() - t0
        mask = self.lnp.allocate_token_bitmask(1, self.vocab)
        times, rejected = [], 0
        for t in ids:
            t0 = time.perf_counter()
            self.lnp.fill_next_token_bitmask(m, mask, 0)
            self.lnp.apply_token_bitmask_inplace(logits[:1], mask)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            rejected += not ok
        return times, rejected


class OutlinesCore(Engine):
    name = "outlines-core"

    def setup(self, tok: Any, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocab = vocab
        eos = int(tok.eos_token_id)
        table: dict[str, list[int]] = {}
        for piece, tid in tok.get_vocab().items():
            if tid == eos or tid >= vocab:
                continue
            text = tok.convert_tokens_to_string([piece])
            if text:
                table.setdefault(text, []).append(int(tid))
        self.vocabulary = outlines_core.Vocabulary(eos, table)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "schema":
            regex = self.oc.json_schema.build_regex_from_schema(spec)
        elif kind == "regex":
            regex = spec
        else:
            raise NotImplementedError(f"outlines-core compiles regular languages only; no {kind}")
        return self.oc.Index(regex, self.vocabulary)

    def run(self, compiled: Any, ids: list[int], logits: np.ndarray) -> tuple[list[float], int]:
        t0 = time.perf_counter()
        guide = self.oc.Guide(compiled)
        self.setup_s = time.perf_counter() - t0
        mask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        bits = np.zeros(self.vocab, dtype=bool)
        times, rejected = [], 0
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            bits[:] = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
            logits[0, ~bits] = -np.inf
            ok = bool(bits[t])
            if ok:
                guide.advance(t)
            times.append(time.perf_counter() - t0)
            rejected += not ok
            if not ok:
                break
        return times, rejected


class Miaohui(Engine):
    """What miaohui's runner does per constrained row: llguidance's mask through
    :class:`~miaohui.generation.engine.structured.TokenMasks` (unpacked with ``np.unpackbits`` into a masked copy)."""

    name = "miaohui (llguidance)"

    def setup(self, tok: Any, vocab: int) -> None:
        from miaohui.generation.engine.structured import TokenMasks

        self.masks = TokenMasks(tok.backend_tokenizer, vocab, [int(tok.eos_token_id)])
        self.masks._ll_tokenizer()

    def compile(self, kind: str, spec: str) -> Any:
        if kind not in ("schema", "object"):
            raise NotImplementedError("miaohui serves JSON schemas (json_object is {'type': 'object'})")
        return spec if kind == "schema" else '{"type": "object"}'

    def run(self, compiled: Any, ids: list[int], logits: np.ndarray) -> tuple[list[float], int]:
        t0 = time.perf_counter()
        self.masks.start(0, compiled)
        self.setup_s = time.perf_counter() - t0
        times, rejected = [], 0
        for t in ids:
            t0 = time.perf_counter()
            self.masks.mask(logits[:1], [0])
            try:
                self.masks.consume(0, t)
            except RuntimeError:
                rejected += 1
                break
            times.append(time.perf_counter() - t0)
        self.masks.drop(0)
        return times, rejected


ENGINES: list[Callable[[], Engine]] = [XGrammar, LLGuidance, OutlinesCore, Miaohui]


def measure(engine: Engine, tok: Any, vocab: int, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine.setup(tok, vocab)
    out: dict[str, Any] = {"tokenizer_setup_ms": (time.perf_counter() - t0) * 1e3, "constraints": {}}
    cases = {
        "json_schema": ("schema", json.dumps(SCHEMA), TARGET),
        "json_object": ("object", "", OBJECT_TARGET),
        "regex": ("regex", REGEX, "2026-12-05"),
        "ebnf_or_lark": ("grammar", LARK, "yes"),
    }
    rng = np.random.default_rng(0)
    for case, (kind, spec, target) in cases.items():
        row: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            compiled = engine.compile(kind, spec)
            row["compile_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as exc:  # a constraint this library does not support
            row["supported"] = False
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            out["constraints"][case] = row
            continue
        row["supported"] = True
        ids = list(tok.encode(target, add_special_tokens=False))
        if case in ("json_schema", "json_object"):
            per_token: list[float] = []
            setups: list[float] = []
            rejected = 0
            for _ in range(repeats):
                logits = rng.standard_normal((1, vocab), dtype=np.float32)
                times, rej = engine.run(compiled, ids, logits)
                per_token += times[1:] if len(times) > 1 else times  # the first mask of a matcher warms its caches
                rejected = max(rejected, rej)
                setups.append(engine.setup_s)
            per_token.sort()
            row.update(
                tokens=len(ids),
                rejected=rejected,
                per_token_us_median=statistics.median(per_token) * 1e6,
                per_token_us_p99=per_token[int(0.99 * (len(per_token) - 1))] * 1e6,
                per_token_us_mean=statistics.fmean(per_token) * 1e6,
                matcher_per_request_ms=statistics.median(setups) * 1e3,
            )
        out["constraints"][case] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    toks = list(result["tokenizers"])
    fig, axes = plt.subplots(1, len(toks), figsize=(6 * len(toks), 4), squeeze=False)
    for ax, tname in zip(axes[0], toks, strict=True):
        engines = result["tokenizers"][tname]
        names = list(engines)
        for j, case in enumerate(("json_schema", "json_object")):
            vals = [engines[n]["constraints"][case].get("per_token_us_median", 0.0) for n in names]
            ax.bar(np.arange(len(names)) + j * 0.4, vals, width=0.4, label=case)
        ax.set_xticks(np.arange(len(names)) + 0.2, names)
        ax.set_ylabel("µs per token (mask + apply + consume), median")
        ax.set_title(tname)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30, help="decodes of the target per engine and constraint")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_cpu.json")
    args = ap.parse_args()
    tokenizers = hf_tokenizers()
    result: dict[str, Any] = {
        "benchmark": "structured output: per-token overhead of grammar engines",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit() or "unknown",
        "command": f"PYTHONPATH=src python benchmarks/bench_structured_cpu.py --repeats {args.repeats}",
        "environment": environment(),
        "libraries": {p: metadata.version(p) for p in ("xgrammar", "llguidance", "outlines-core")},
        "schema": SCHEMA,
        "targets": {"json_schema": TARGET, "json_object": OBJECT_TARGET},
        "note": "shared 2-core machine: absolute figures are noisy; compare engines within this run",
        "tokenizers": {},
    }
    for tname, tok in tokenizers.items():
        vocab = max(len(tok), int(tok.vocab_size))
        result["tokenizers"][tname] = {}
        for make in ENGINES:
            engine = make()
            print(f"{tname}: {engine.name} ...", flush=True)
            result["tokenizers"][tname][engine.name] = measure(engine, tok, vocab, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot(result, args.out.with_suffix(".png"))
    for tname, engines in result["tokenizers"].items():
        for name, r in engines.items():
            for case, row in r["constraints"].items():
                med = row.get("per_token_us_median")
                shown = f"{med:8.1f} µs/token" if med is not None else ("supported" if row["supported"] else "NO")
                print(
                    f"{tname:22} {name:14} {case:13} {shown}  compile {row.get('compile_ms', 0):.1f} ms "
                    f"rejected {row.get('rejected', '-')}"
                )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
