"""The decoder gate: ``miaohui validate NAME`` on a causal-LM version, against its fp32 source in PyTorch.

On the committed prompt set (``validate/data/decoder_prompts.yaml``: chat prompts in English and Chinese, rendered
with the version's own chat template) the fp32 HF model the version was exported from (``causal_lm.json``'s
``source_path``) generates greedily up to :attr:`DecoderGateConfig.new_tokens` tokens. The candidate is the built
version on its own engine (ONNX Runtime, the GPU static-KV engine, or llama.cpp for a ``llamacpp`` GGUF version),
and three figures are measured:

* **exact match**: the share of prompts whose first ``new_tokens`` greedy tokens (up to a stop token) equal the
  reference's token for token;
* **teacher-forced top-1 agreement**: the reference continuation is fed to the candidate one token at a time; the
  share of positions where the candidate's argmax is the reference's next token (free-running text diverges for
  good at the first near-tie; this figure shows whether it was a near-tie or a broken model);
* **factual**: on prompts with an expected word (``expect``, alternatives split by ``|``), the candidate's
  free-running answer must contain it wherever the reference's does.

Any figure under its threshold fails the gate (exit 1, the reasons printed).

An ``inductor`` version is also measured a second time with its engine's int8 batch-1 weights
(``SlotEngineOptions.int8_batch1``): the same prompts, the same fp32 reference, the thresholds of int8 weights
(:meth:`DecoderGateConfig.for_int8_batch1`). The gate's candidate decodes one stream greedily, which is exactly the
path int8 at batch 1 changes: every decoded token reads the int8 copy (the prompt's prefill keeps the model-dtype
weights, as in serving). The result is stored as ``validation["int8_batch1"]`` (:class:`Int8GateResult`); serve turns
``int8_batch1`` on by default only where it passed
(:func:`~miaohui.generation.executors.slot_defaults.int8_gate_passed`). Its failure does not fail the gate:
the version is served, without int8 at batch 1. A run that cannot run on the machine is stored as failed, with why.
"""

from __future__ import annotations

import importlib.resources
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from miaohui.config import Frozen
from miaohui.errors import ConfigError, MiaohuiError, ModelNotFoundError
from miaohui.generation.build.artifact import (
    MARKER_NAME,
    CausalLMInfo,
    is_causal_lm_dir,
    latest_version,
    read_info,
)
from miaohui.paths import write_text_atomic
from miaohui.validate.comparator import DecoderRunner, SlotDecoder, open_decoder, source_decoder


class DecoderGateConfig(Frozen):
    """Thresholds of the decoder gate; :meth:`for_precision` picks them by the version's precision."""

    new_tokens: int = Field(default=32, ge=1, le=256)
    """Greedy tokens compared per prompt: 32 covers a short answer (the factual prompts' answers fit in it) and
    keeps the gate at seconds per model on a CPU."""
    min_exact_match: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of prompts whose greedy tokens must equal the reference's. fp32: 1.0 — the same math in the same
    precision must give the same text; a single difference is an export bug."""
    min_teacher_forced: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of teacher-forced positions whose top-1 must agree. fp32: 1.0 (as exact match)."""
    min_factual: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of factual prompts (those the reference answers with the expected word) the candidate must answer with
    it too. 1.0 at every precision: a served model that loses a fact its source knows is not acceptable."""

    @classmethod
    def for_precision(cls, precision: str) -> DecoderGateConfig:
        """fp32: exact (1.0 / 1.0 / 1.0). Reduced precision (int8 weights, bf16, fp16): a near-tie may flip one
        greedy token and the text then diverges for good, so exact match is 0.5 (half the prompts); teacher-forced
        top-1 0.95 (one flipped position in twenty: broken weights or activations score far lower); facts 1.0."""
        if precision == "fp32":
            return cls()
        return cls(min_exact_match=0.5, min_teacher_forced=0.95)

    def for_int8_batch1(self) -> DecoderGateConfig:
        """The thresholds of the int8 batch-1 run: int8 weights are reduced precision whatever the version's own
        precision, so those of an int8 version (:meth:`for_precision`), never stricter than this config's; the same
        ``new_tokens``."""
        reduced = DecoderGateConfig.for_precision("int8")
        return self.model_copy(
            update={
                "min_exact_match": min(self.min_exact_match, reduced.min_exact_match),
                "min_teacher_forced": min(self.min_teacher_forced, reduced.min_teacher_forced),
                "min_factual": min(self.min_factual, reduced.min_factual),
            }
        )


class GatePrompt(BaseModel):
    id: str
    lang: Literal["en", "zh"]
    text: str
    expect: str | None = None
    """Factual prompts: the word a correct answer contains (alternatives split by ``|``)."""


class PromptResult(BaseModel):
    id: str
    lang: str
    exact: bool
    teacher_forced: list[int]
    """``[agreeing positions, positions]``."""
    reference_text: str
    candidate_text: str
    expect: str | None = None
    reference_has_fact: bool | None = None
    candidate_has_fact: bool | None = None


class Int8GateResult(BaseModel):
    """``validation["int8_batch1"]`` in ``causal_lm.json``: the gate run with the engine's int8 batch-1 weights."""

    passed: bool
    """Whether serve may turn ``int8_batch1`` on by default for this version
    (:func:`~miaohui.generation.executors.slot_defaults.int8_gate_passed` reads it)."""
    figures: dict[str, Any] | None
    """``exact_match``, ``teacher_forced``, ``factual``, ``factual_counted``, the thresholds (``min_*``),
    ``new_tokens``, ``differs_on`` (prompts whose greedy text differs), ``engine`` (the kernels and device) and
    ``seconds``; ``None`` when the run could not run."""
    failures: list[str]


class DecoderGateReport(BaseModel):
    model: str
    version: int
    backend: str
    precision: str
    reference: str
    config: DecoderGateConfig
    exact_match: float
    teacher_forced: float
    factual: float | None
    """Share of the factual prompts the reference gets right that the candidate gets right too (``None``: the
    reference gets none right, e.g. a random test model)."""
    factual_counted: int
    results: list[PromptResult]
    failures: list[str]
    seconds: float
    int8_batch1: Int8GateResult | None = None
    """An ``inductor`` version: the same gate with int8 batch-1 weights (``None``: other backends, not run)."""

    @property
    def passed(self) -> bool:
        return not self.failures


def load_prompts(path: Path | None = None) -> list[GatePrompt]:
    """The committed prompt set (or ``path``, a YAML of the same shape: ``chat`` and ``factual`` lists)."""
    if path is None:
        text = (importlib.resources.files("miaohui.validate") / "data" / "decoder_prompts.yaml").read_text("utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    return [GatePrompt.model_validate(p) for key in ("chat", "factual") for p in raw.get(key) or []]


def resolve_causal_lm(spec: str, repository: Path) -> Path | None:
    """The version folder ``spec`` names (``NAME``, ``NAME:VERSION`` or a folder) when it is a causal LM, else None."""
    path = Path(spec)
    if is_causal_lm_dir(path):
        return path
    name, _, version = spec.partition(":")
    model_dir = repository / name
    newest = latest_version(model_dir) if name and "/" not in name else None
    if newest is None:
        return None
    if not version:
        return model_dir / str(newest) if is_causal_lm_dir(model_dir / str(newest)) else None
    if not version.isdigit() or not (model_dir / version).is_dir():
        if is_causal_lm_dir(model_dir / str(newest)):
            raise ModelNotFoundError(f"model {name!r} has no version {version!r}", f"the newest is {newest}")
        return None
    return model_dir / version if is_causal_lm_dir(model_dir / version) else None


def _has(text: str, expect: str) -> bool:
    return any(word.lower() in text.lower() for word in expect.split("|"))


# ---- the gate ----------------------------------------------------------------------------------------------


def run_decoder_gate(
    folder: Path,
    config: DecoderGateConfig | None = None,
    prompts: Sequence[GatePrompt] | None = None,
    int8_batch1: bool | None = None,
) -> DecoderGateReport:
    """Run the gate on the causal-LM version ``folder``; the report (``passed``, ``failures``) is also stored in its
    ``causal_lm.json`` (``validation``). ``int8_batch1`` (default: for an ``inductor`` version): also run it with the
    engine's int8 batch-1 weights (:attr:`DecoderGateReport.int8_batch1`, stored as ``validation["int8_batch1"]``)."""
    started = time.perf_counter()
    info = read_info(folder)
    config = config or DecoderGateConfig.for_precision(info.precision)
    prompts = list(prompts) if prompts is not None else load_prompts()
    if not prompts:
        raise ConfigError("the decoder gate has no prompts", "give a YAML with `chat` and `factual` lists")
    with open_decoder(folder) as candidate:
        reference = _references(candidate, source_decoder(folder, candidate.eos), prompts, config.new_tokens)
        results = _compare(candidate, reference, prompts, config.new_tokens)
    report = _report(info, config, results, time.perf_counter() - started)
    if info.backend == "inductor" if int8_batch1 is None else int8_batch1:
        report.int8_batch1 = _run_int8_batch1(folder, info, config.for_int8_batch1(), prompts, reference)
    info.validation = report.model_dump(mode="json")
    write_text_atomic(folder / MARKER_NAME, info.model_dump_json(indent=2))
    return report


def _run_int8_batch1(
    folder: Path,
    info: CausalLMInfo,
    config: DecoderGateConfig,
    prompts: Sequence[GatePrompt],
    reference: list[tuple[list[int], list[int]]],
) -> Int8GateResult:
    """The gate's second run, on the engine with ``int8_batch1``; a run that cannot run is a failure with its reason
    (never a pass)."""
    started = time.perf_counter()
    try:
        with open_decoder(folder, int8_batch1=True) as candidate:
            results = _compare(candidate, reference, prompts, config.new_tokens)
            engine = candidate.engine_label if isinstance(candidate, SlotDecoder) else candidate.name
    except Exception as exc:  # whatever stops it, the stamp says it did not pass, and why
        reason = exc.message if isinstance(exc, MiaohuiError) else f"{type(exc).__name__}: {exc}"
        return Int8GateResult(passed=False, figures=None, failures=[f"the int8 batch-1 run could not run: {reason}"])
    report = _report(info, config, results, time.perf_counter() - started)
    figures = {
        "exact_match": report.exact_match, "teacher_forced": report.teacher_forced, "factual": report.factual,
        "factual_counted": report.factual_counted, "min_exact_match": config.min_exact_match,
        "min_teacher_forced": config.min_teacher_forced, "min_factual": config.min_factual,
        "new_tokens": config.new_tokens, "differs_on": [r.id for r in results if not r.exact], "engine": engine,
        "seconds": report.seconds,
    }  # fmt: skip
    return Int8GateResult(passed=report.passed, figures=figures, failures=report.failures)


def _references(
    candidate: DecoderRunner, reference: DecoderRunner, prompts: Sequence[GatePrompt], new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """Per prompt, (its ids encoded by the candidate: the version's tokenizer, which its source shares, the
    reference's greedy tokens)."""
    out = []
    for p in prompts:
        ids = candidate.prompt_ids([{"role": "user", "content": p.text}])
        out.append((ids, reference.greedy(ids, new_tokens)))
    return out


def _compare(
    candidate: DecoderRunner,
    reference: Sequence[tuple[list[int], list[int]]],
    prompts: Sequence[GatePrompt],
    new_tokens: int,
) -> list[PromptResult]:
    """Each prompt through the candidate, against the reference's tokens (:func:`_references`)."""
    results = []
    for p, (ids, ref) in zip(prompts, reference, strict=True):
        got = candidate.greedy(ids, new_tokens)
        agree = len(ref) if got == ref else candidate.teacher_forced(ids, ref)
        ref_text, got_text = candidate.tokenizer.decode(ref), candidate.tokenizer.decode(got)
        results.append(
            PromptResult(
                id=p.id, lang=p.lang, exact=got == ref, teacher_forced=[agree, len(ref)], reference_text=ref_text,
                candidate_text=got_text, expect=p.expect,
                reference_has_fact=_has(ref_text, p.expect) if p.expect else None,
                candidate_has_fact=_has(got_text, p.expect) if p.expect else None,
            )
        )  # fmt: skip
    return results


def _report(
    info: CausalLMInfo, config: DecoderGateConfig, results: list[PromptResult], seconds: float
) -> DecoderGateReport:
    exact = sum(r.exact for r in results) / len(results)
    tf = sum(r.teacher_forced[0] for r in results) / max(1, sum(r.teacher_forced[1] for r in results))
    counted = [r for r in results if r.reference_has_fact]
    factual = sum(bool(r.candidate_has_fact) for r in counted) / len(counted) if counted else None
    failures = []
    if exact < config.min_exact_match:
        bad = [r.id for r in results if not r.exact]
        failures.append(
            f"greedy exact match {exact:.1%} < {config.min_exact_match:.0%} (differs on {', '.join(bad[:6])})"
        )
    if tf < config.min_teacher_forced:
        failures.append(f"teacher-forced top-1 agreement {tf:.1%} < {config.min_teacher_forced:.0%}")
    if factual is not None and factual < config.min_factual:
        for r in counted:
            if not r.candidate_has_fact:
                failures.append(
                    f"{r.id}: the fp32 source answers {r.reference_text.strip()!r} (with {r.expect!r}); "
                    f"the candidate answers {r.candidate_text.strip()!r}"
                )
    return DecoderGateReport(
        model=info.name, version=info.version, backend=info.backend, precision=info.precision,
        reference=f"fp32 {info.architecture or 'HF'} in PyTorch ({info.source_path})", config=config,
        exact_match=exact, teacher_forced=tf, factual=factual, factual_counted=len(counted), results=results,
        failures=failures, seconds=round(seconds, 2),
    )  # fmt: skip


def print_report(report: DecoderGateReport, console: Any) -> None:
    """The gate's figures as a rich table (one row per prompt, then the totals against the thresholds)."""
    from rich.table import Table

    c = report.config
    table = Table(
        "prompt", "exact", "teacher-forced", "fact", "candidate (start)",
        title=f"{report.model} v{report.version} ({report.backend} {report.precision}) vs {report.reference}",
    )  # fmt: skip
    for r in report.results:
        fact = (
            ""
            if r.expect is None
            else f"{'✓' if r.candidate_has_fact else '✗'} (ref {'✓' if r.reference_has_fact else '✗'})"
        )
        table.add_row(
            r.id, "✓" if r.exact else "✗", f"{r.teacher_forced[0]}/{r.teacher_forced[1]}", fact,
            r.candidate_text.strip().replace("\n", " ")[:48],
        )  # fmt: skip
    console.print(table)
    factual = "n/a (the reference states none)" if report.factual is None else f"{report.factual:.0%}"
    console.print(
        f"greedy exact match {report.exact_match:.1%} (min {c.min_exact_match:.0%}) · teacher-forced top-1 "
        f"{report.teacher_forced:.1%} (min {c.min_teacher_forced:.0%}) · factual {factual} of "
        f"{report.factual_counted} (min {c.min_factual:.0%}) · {c.new_tokens} tokens · {report.seconds:.0f}s"
    )


def int8_summary(result: Int8GateResult) -> str:
    """One line on the int8 batch-1 run: its figures against the thresholds, and what serve does with it."""
    f = result.figures
    if f is None:
        figures = "did not run"
    else:
        factual = "n/a" if f["factual"] is None else f"{f['factual']:.0%}"
        figures = (
            f"greedy exact match {f['exact_match']:.1%} (min {f['min_exact_match']:.0%}) · teacher-forced top-1 "
            f"{f['teacher_forced']:.1%} (min {f['min_teacher_forced']:.0%}) · factual {factual} of "
            f"{f['factual_counted']} (min {f['min_factual']:.0%}) · {f['engine']} · {f['seconds']:.0f}s"
        )
    verdict = (
        "passed: serve turns int8_batch1 on by default for this version"
        if result.passed
        else "failed: serve keeps int8_batch1 off by default for this version"
    )
    return f"int8 batch-1 weights: {figures} — {verdict}"
