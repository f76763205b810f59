"""CLI commands of the dialogue checks, as plain typer-compatible functions the main CLI registers:

* :func:`compare_command` — ``miaohui compare OLD NEW`` (:mod:`miaohui.dialogue.compare`).
* :func:`validate_pipeline_command` — ``miaohui validate --pipeline NAME --engine CANDIDATE`` (the pipeline
  compliance gate, :mod:`miaohui.dialogue.pipeline_gate`).

Exit status: 0 passed, 1 the check failed (each reason printed), 2 the command could not run (bad
arguments, missing artifacts: the error and its fix printed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from miaohui.cli_output import console, err_console, fail
from miaohui.dialogue.config import PIPELINE_NAMES
from miaohui.errors import MiaohuiError
from miaohui.validate.consistency import DriftReport

__all__ = ["compare_command", "validate_pipeline_command"]


RepoOpt = Annotated[
    Path | None,
    typer.Option("--repository", "-r", help="Model repository (default $MIAOHUI_HOME/repository)."),
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")]


def _repo(repository: Path | None) -> Path:
    from miaohui.paths import repository_dir

    return repository or repository_dir()


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if pct else f"{value:.4g}"


def _drift_row(table: Table, name: str, inputs: str, r: DriftReport) -> None:
    table.add_row(
        name,
        inputs,
        _fmt(r.intent_agreement, pct=True),
        f"{_fmt(r.logit_max_abs_error)} / {_fmt(r.logit_mean_abs_error)}",
        _fmt(r.text_exact_match, pct=True),
        _fmt(r.text_similarity),
        _fmt(r.keyword_drift),
        "[green]ok[/]" if r.passed else "[red]FAIL[/]",
    )


def compare_command(
    old: Annotated[str, typer.Argument(help="Old: a version folder or NAME[:VERSION] (encoder or causal LM).")],
    new: Annotated[str, typer.Argument(help="New engine, the same kind as OLD.")],
    data: Annotated[str, typer.Option(help="'dev' (the dev split), a labelled JSONL or a .txt file.")] = "dev",
    pipelines: Annotated[
        str, typer.Option(help="Pipelines to replay the gate dialogues through: 'all', 'none' or a comma list.")
    ] = "all",
    max_drift: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Largest intent disagreement / keyword drift (0..1).")
    ] = 0.05,
    max_logit_error: Annotated[float | None, typer.Option(help="Fail above this max |logit difference|.")] = None,
    min_text_similarity: Annotated[
        float | None, typer.Option(help="Fail below this mean reply similarity (0..1).")
    ] = None,
    repository: RepoOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Run the same inputs through OLD and NEW: intent agreement, logit error, reply agreement, keyword
    drift; exit 1 when a threshold is crossed (default: more than 5% drift)."""
    from miaohui.dialogue.compare import compare_engines
    from miaohui.validate.consistency import DriftThresholds

    names = list(PIPELINE_NAMES) if pipelines == "all" else [] if pipelines == "none" else pipelines.split(",")
    try:
        thresholds = DriftThresholds(
            max_drift=max_drift, max_logit_error=max_logit_error, min_text_similarity=min_text_similarity
        )
        report = compare_engines(old, new, _repo(repository), data, thresholds, [n.strip() for n in names])
    except MiaohuiError as exc:
        fail(exc)
        return
    table = Table(
        "section",
        "inputs",
        "intent agreement",
        "logit err max / mean",
        "text exact",
        "text similarity",
        "keyword drift",
        "",
        title=f"{report.old} → {report.new} (max drift {max_drift:.0%})",
    )
    for s in report.sections:
        _drift_row(table, s.name, s.inputs, s.report)
    console.print(table)
    if json_out:
        json_out.write_text(report.model_dump_json(indent=1), encoding="utf-8")
    if not report.passed:
        for failure in report.failures():
            err_console.print(f"[bold red]drift:[/] {failure}", soft_wrap=True)
        err_console.print(f"[bold red]compare failed:[/] {report.new} drifts from {report.old}", soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]compare passed[/]")


def validate_pipeline_command(
    pipeline: Annotated[str, typer.Option(help="Pipeline whose gate dialogues run ('all': every pipeline).")],
    engine: Annotated[str, typer.Option(help="Candidate intent engine: artifact dir or model name[:version].")],
    reference: Annotated[
        str, typer.Option(help="'torch' (the candidate's source model in fp32) or another artifact.")
    ] = "torch",
    data: Annotated[
        Path | None, typer.Option(help="Gate dialogues (JSONL); default: the packaged pipeline_gate.jsonl.")
    ] = None,
    min_intent_agreement: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="Also fail below this intent agreement.")
    ] = None,
    repository: RepoOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """The pipeline compliance gate: a candidate engine that makes any reply lose a required disclaimer or
    alter a number fails (exit 1)."""
    from miaohui.dialogue.pipeline_gate import run_gate

    try:
        run = run_gate(pipeline, engine, _repo(repository), reference, data, min_intent_agreement)
    except MiaohuiError as exc:
        fail(exc)
        return
    r = run.report
    table = Table("", "candidate", "reference", title=f"pipeline gate: {', '.join(run.pipelines)}")
    table.add_row("engine", run.candidate, run.reference)
    table.add_row("intent accuracy", f"{r.candidate_intent_accuracy:.2%}", f"{r.reference_intent_accuracy:.2%}")
    table.add_row("intent agreement", f"{r.intent_agreement:.2%}", "")
    table.add_row("dialogues / turns", f"{r.dialogues} / {r.turns}", "")
    console.print(table)
    if json_out:
        doc = {"candidate": run.candidate, "reference": run.reference, "report": r.model_dump(mode="json")}
        json_out.write_text(json.dumps(doc, ensure_ascii=False, indent=1), encoding="utf-8")
    if not r.passed:
        for message in r.messages():
            err_console.print(f"[bold red]gate failed:[/] {message}", soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"[green]pipeline gate passed[/] ({r.turns} turns, disclaimers and numbers kept)")
