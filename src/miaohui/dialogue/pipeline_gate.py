"""``miaohui validate --pipeline NAME --engine CANDIDATE [--reference REF]``: the pipeline compliance gate
(:func:`miaohui.dialogue.gate.run_pipeline_gate`) with engine artifacts.

The gate's dialogues (the packaged ``pipeline_gate.jsonl`` or ``--data FILE``) of pipeline NAME (``all``: of
every pipeline) run once with the reference classifier and once with the candidate. The reference is the
candidate's source model in PyTorch fp32 (``torch``, the default) or another artifact. A candidate that
makes any reply lose a required disclaimer or alter a number fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from miaohui.dialogue.config import PIPELINE_NAMES
from miaohui.dialogue.gate import PipelineGateReport, load_gate_dialogues, run_pipeline_gate
from miaohui.engines.store import read_manifest, resolve_artifact
from miaohui.errors import ArtifactError, ConfigError
from miaohui.validate.comparator import ArtifactClassifier, TorchClassifier

__all__ = ["GateRun", "run_gate"]


@dataclass(frozen=True)
class GateRun:
    """A gate verdict with the names of what ran."""

    report: PipelineGateReport
    candidate: str
    reference: str
    pipelines: list[str]


def run_gate(
    pipeline: str,
    candidate: str,
    repository: Path,
    reference: str = "torch",
    data: Path | None = None,
    min_intent_agreement: float | None = None,
) -> GateRun:
    """Run the gate (module docstring); the caller decides what a failure does (``report.passed``)."""
    dialogues = load_gate_dialogues(data)
    if pipeline != "all":
        if pipeline not in PIPELINE_NAMES:
            raise ConfigError(f"unknown pipeline {pipeline!r}", f"use one of {', '.join(PIPELINE_NAMES)} or 'all'")
        dialogues = [d for d in dialogues if d.pipeline == pipeline]
        if not dialogues:
            present = sorted({d.pipeline for d in load_gate_dialogues(data)})
            raise ConfigError(
                f"the gate test set has no dialogues of pipeline {pipeline!r}",
                f"add some to it, or pick one of {present}",
            )
    cand_path = resolve_artifact(candidate, repository)
    with contextlib.ExitStack() as stack:
        cand = stack.enter_context(ArtifactClassifier.open(cand_path))
        if reference == "torch":
            source = read_manifest(cand_path).extra.get("source_model")
            if not source or not Path(source).is_dir():
                raise ArtifactError(
                    f"the source model {source!r} of {cand.name} is not available as the reference",
                    "pass --reference with another artifact (e.g. the fp32 build), or restore the model directory",
                )
            ref: ArtifactClassifier | TorchClassifier = TorchClassifier(Path(source))
        else:
            ref = stack.enter_context(ArtifactClassifier.open(resolve_artifact(reference, repository)))
        report = asyncio.run(run_pipeline_gate(dialogues, ref, cand, min_intent_agreement=min_intent_agreement))
    return GateRun(report, cand.name, ref.name, sorted({d.pipeline for d in dialogues}))
