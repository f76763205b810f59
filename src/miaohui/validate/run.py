"""Glue for ``miaohui validate``: load engine + reference, run, gate, save golden outputs and results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from miaohui.engines.loader import load_engine
from miaohui.engines.store import read_manifest, resolve_artifact, write_manifest
from miaohui.errors import ArtifactError, ConfigError
from miaohui.models.decision import IntentDecision
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.validate.accuracy import (
    GateConfig,
    ValidationReport,
    compare,
    engine_batch,
    engine_logits,
    load_golden,
    run_logits,
    save_golden,
)
from miaohui.validate.labels import decision_report, plot_confusion
from miaohui.zoo.intents import LABELS, LabelledText, load_split, load_user_jsonl

GOLDEN = "golden.npz"
CONFUSION = "confusion.png"


def load_data(data: str, labels: list[str] | None = None) -> list[LabelledText]:
    """``dev`` / ``train`` (the project's splits, for models with the project's labels) or a labelled JSONL file with
    any label set (a model trained on your own data is validated on your own dev file)."""
    if data in ("dev", "train") and not Path(data).exists():
        own = sorted(set(labels or ()) - set(LABELS))
        if own:
            raise ConfigError(
                f"this model has its own labels ({', '.join(own[:5])}{', ...' if len(own) > 5 else ''}), which the "
                f"project's {data} split does not have",
                'pass --data YOUR_DEV.jsonl (one {"text": ..., "intent": ...} a line, labels of this model)',
            )
        return [LabelledText.model_validate(x.model_dump()) for x in load_split(data)]  # type: ignore[arg-type]
    return load_user_jsonl(Path(data))


def reference_logits(
    reference: str, source_model: str | None, repository: Path, tok: TextTokenizer, texts: list[str]
) -> tuple[np.ndarray, str, list[str]]:
    """Logits of the reference on ``texts`` (each model with its own tokenizer), its name and labels."""
    if reference == "torch":
        if not source_model or not Path(source_model).is_dir():
            raise ArtifactError(
                f"the source model {source_model!r} of this artifact is not available",
                "pass --reference with another artifact, or restore the model directory",
            )
        import torch

        from miaohui.sources.detect import load_source  # a checkpoint or a Hugging Face directory

        loaded = load_source(Path(source_model))
        module = loaded.module

        def fn(feeds: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                return module(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()

        ref_tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
        return run_logits(fn, ref_tok, texts), f"torch fp32 ({source_model})", loaded.meta.labels
    path = resolve_artifact(reference, repository)
    with load_engine(path) as ref:
        m = ref.manifest
        ref_tok = TextTokenizer.from_file(path / (m.tokenizer_file or "tokenizer.json"), m.max_length or 512)
        return run_logits(engine_logits(ref), ref_tok, texts, engine_batch(ref)), f"{m.name} v{m.version}", m.labels


def run_validation(
    engine_spec: str,
    repository: Path,
    data: str,
    reference: str,
    max_drop: float,
    min_agreement: float,
    golden: str | None,
) -> tuple[ValidationReport, dict[str, Any] | None]:
    path = resolve_artifact(engine_spec, repository)
    manifest = read_manifest(path)
    examples = load_data(data, manifest.labels)
    texts = [x.text for x in examples]
    tok = TextTokenizer.from_file(path / (manifest.tokenizer_file or "tokenizer.json"), manifest.max_length or 512)
    with load_engine(path) as engine:
        logits = run_logits(engine_logits(engine), tok, texts, engine_batch(engine))
    ref, ref_name, ref_labels = reference_logits(reference, manifest.extra.get("source_model"), repository, tok, texts)
    gate = GateConfig(max_accuracy_drop=max_drop, min_agreement=min_agreement)
    report = compare(
        logits,
        ref,
        examples,
        manifest.labels,
        gate,
        (f"{manifest.name} v{manifest.version} ({manifest.backend} {manifest.precision})", ref_name, data),
        ref_labels=ref_labels,
    )
    found = manifest.extra.get("decision")
    report.answers = decision_report(
        logits, [x.intent for x in examples], manifest.labels, IntentDecision.model_validate(found) if found else None
    )
    title = f"{manifest.name} v{manifest.version} on {data} ({len(examples)} texts)"
    report.confusion_png = str(plot_confusion(report.answers, path / CONFUSION, title))
    drift = drift_against(golden, repository, texts, logits) if golden else None
    save_golden(path / GOLDEN, texts, logits)
    manifest.validation = {"report": report.model_dump(mode="json"), "drift": drift}
    write_manifest(path, manifest)
    return report, drift


def drift_against(golden: str, repository: Path, texts: list[str], logits: np.ndarray) -> dict[str, Any]:
    file = Path(golden)
    if not file.is_file():
        file = resolve_artifact(golden, repository) / GOLDEN
    if not file.is_file():
        raise ArtifactError(f"no golden outputs at {file}", "run `miaohui validate` on that version first")
    old_texts, old = load_golden(file)
    if old_texts != texts:
        raise ArtifactError(
            f"{file} was made on other inputs ({len(old_texts)} texts)",
            "validate both versions on the same --data",
        )
    return {
        "golden": str(file),
        "agreement": float((old.argmax(-1) == logits.argmax(-1)).mean()),
        "max_logit_error": float(np.abs(old - logits).max()),
        "mean_logit_error": float(np.abs(old - logits).mean()),
    }
