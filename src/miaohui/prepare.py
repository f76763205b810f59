"""``miaohui prepare`` / ``make run``: make the default engines if they are missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from miaohui.config import BuildConfig, CalibrationConfig
from miaohui.engines.store import build_artifact
from miaohui.models.checkpoint import META_NAME
from miaohui.paths import models_dir
from miaohui.serving.model_config import ensure_model_config
from miaohui.zoo.intents import load_split

DEFAULT_MODEL = "intent-e5-small"
BERT_FFN_DOWN = (r"layer\.\d+/output/dense",)
"""BERT's FFN down-projections (inputs: long-tailed GELU outputs), the layers static int8 keeps fp32
(`--keep-fp32`): all-int8 static QDQ agreed with fp32 on only 97.0 % of the dev split, below the 98 % gate;
with these 12 MatMuls in fp32 it agrees on 98.8 % (docs/benchmarks.md)."""

INT8_SMOOTH = 2
"""The default int8 engine is ONNX Runtime *dynamic* int8, every weight MatMul int8, with a SmoothQuant input scale
(``compile.smooth``) on the two MatMuls whose inputs suffer most from per-tensor run-time quantization on the
calibration text (for the e5-small intent model: the FFN down-projections of layers 4 and 0; noise-to-signal
1.3e-2 and 1.2e-2, 8x the median). On the dev split: all-dynamic without it agreed with fp32 on 97.85 % (gate:
98 %); with those two MatMuls kept fp32 instead (the previous default, ``fp32_fallback=2``) 98.84 %; smoothed
99.17 %, at all-int8 speed (``intent_cpu_int8_smooth.json``: 6.3x eager at 1x16 against 5.6x). Smoothing more
layers did not help (1: 98.51 %, 3: 98.51 %, 4: 98.18 %, 8: 97.69 %; alpha 0.75: 98.84 %, 0.3: 96.70 %)."""


def default_config(backend: str, precision: str) -> BuildConfig:
    """The build configuration of a default engine."""
    calibration = (
        CalibrationConfig(mode="dynamic", smooth=INT8_SMOOTH)
        if precision == "int8" and backend == "onnxruntime"
        else CalibrationConfig(keep_fp32=BERT_FFN_DOWN)
        if precision == "int8"
        else CalibrationConfig()
    )
    return BuildConfig.model_validate({"backend": backend, "precision": precision, "calibration": calibration})


DEFAULT_LLM: tuple[str, str] = ("onnxruntime", "int4")
"""Backend and precision of the ``smollm2`` version ``make run`` serves: ``build-llm --precision int4`` on ONNX
Runtime — the layers' weights in 4-bit blocks (llama.cpp's Q4_1 layout), the LM head in 8-bit blocks, every product
in fp32 (:mod:`miaohui.generation.build.weight_blocks`), one stream's decode on that graph and prefills and batched
steps on the fp32 graph. It passes the decoder gate (100 % exact match, 100 % teacher-forced, facts 3/3: the shipped
SmolLM2 is a Q4_1 GGUF, so its weights lie on these grids and only fp32 summation order differs) and is the fastest
recipe that does at one stream and at eight (``benchmarks/bench_peers_cpu.py`` → ``peers_generation_cpu.json``;
gates from ``decoder_recipes_cpu.json``). The other recipes that pass: ONNX Runtime fp32 and llama.cpp F16. Those that
fail: llama.cpp's Q4_1 and Q8_0 and ONNX Runtime int8 (exact match 29–47 %), whose kernels round the activations to
8 bits; all of them answer "What is the capital of France?" without "Paris". A team's own fp32 model is not on a
4-bit grid: ``miaohui validate`` decides for it."""


def prepare_llm(repository: Path, log: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the default ``smollm2`` version and run the decoder gate on it once (the verdict is kept in
    its ``causal_lm.json``); a failing gate is reported, not fatal (kernels differ between CPUs)."""
    from miaohui.generation.build.artifact import build_causal_lm, read_info
    from miaohui.validate.decoder_gate import run_decoder_gate

    backend, precision = DEFAULT_LLM
    version = build_causal_lm(repository, "smollm2", precision, backend=backend, log=log)  # type: ignore[arg-type]
    if read_info(version).validation is None:
        report = run_decoder_gate(version)
        verdict = "passed" if report.passed else "FAILED: " + "; ".join(report.failures)
        log(
            f"decoder gate on smollm2 v{report.version}: exact match {report.exact_match:.0%}, teacher-forced "
            f"{report.teacher_forced:.1%}, {verdict}"
        )
    return version


# (repository name, backend, precision): the int8 engine serves as `intent`; fp32 is kept for comparison.
DEFAULT_ENGINES = (("intent", "onnxruntime", "int8"), ("intent-fp32", "onnxruntime", "fp32"))


def prepare_defaults(repository: Path, quick: bool = False, log: Callable[[str], None] = print) -> Path:
    """Train the intent model if there is none, then build (or reuse) the default engines."""
    model = models_dir() / DEFAULT_MODEL
    if not (model / META_NAME).is_file():
        from miaohui.models.train import TrainConfig, train_intent

        log(f"no intent model at {model}: training one (e5-small, a few CPU minutes)")
        _, report = train_intent(TrainConfig(epochs=2 if quick else 8), model)
        log(f"dev accuracy {report.accuracy:.2%}")
    texts = [x.text for x in load_split("train")]
    prepare_llm(repository, log)  # reused while its build key holds
    for name, backend, precision in DEFAULT_ENGINES:
        built = build_artifact(model, name, default_config(backend, precision), repository, calib_texts=texts, log=log)
        ensure_model_config(built.path.parent, backend)
    return model
