"""``miaohui bench``: the typer command (registered by ``miaohui.cli``: ``app.command("bench")(bench_command)``)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from miaohui.cli_output import console, err_console, fail
from miaohui.errors import ConfigError, MiaohuiError

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "": 1.0}


def parse_seconds(value: str, option: str) -> float:
    """``10``, ``10s``, ``500ms``, ``2m`` → seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|)\s*", value)
    if not m:
        raise ConfigError(f"{option} {value!r} is not a duration", f"write e.g. {option} 10s, 500ms or 2m")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_levels(value: str, option: str, integer: bool) -> list[float]:
    try:
        levels = [float(int(x)) if integer else float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"{option} {value!r} is not a comma-separated list of numbers", f"write e.g. {option} 1,8,32"
        ) from None
    if not levels or any(v <= 0 for v in levels):
        raise ConfigError(f"{option} {value!r} needs positive values", f"write e.g. {option} 1,8,32")
    return levels


def parse_token_range(value: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not m:
        raise ConfigError(f"--tokens {value!r} is not a range", "write e.g. --tokens 8-64")
    return int(m.group(1)), int(m.group(2))


def bench_command(
    target: Annotated[
        str,
        typer.Option(
            help="http (/v1/intent) | v2-http (KServe JSON) | grpc (KServe) | engine (no server) | "
            "chat (streamed OpenAI completions, any OpenAI-compatible server)"
        ),
    ] = "http",
    url: Annotated[
        str, typer.Option(help="Server HTTP base URL (also where /metrics is scraped).")
    ] = "http://127.0.0.1:8000",
    grpc_url: Annotated[str, typer.Option(help="Server gRPC host:port.")] = "127.0.0.1:8001",
    model: Annotated[
        str,
        typer.Option(
            help="Model name, honoured by every target: the requests' model, the engine target's artifact in "
            "--repository (without --engine), the /metrics label. Target chat: the name the server serves."
        ),
    ] = "intent",
    engine: Annotated[
        Path | None, typer.Option(help="Engine artifact dir: the 'engine' target, and the tokenizer for --tokens.")
    ] = None,
    concurrency: Annotated[
        str, typer.Option(help="Closed loop: concurrent requests; a list sweeps, e.g. 1,8,32,64.")
    ] = "1,8,32",
    rate: Annotated[
        str | None, typer.Option(help="Open loop instead: Poisson arrivals per second; a list sweeps.")
    ] = None,
    duration: Annotated[
        str | None, typer.Option(help="Measured time per level, e.g. 10s (default 10s unless --requests).")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(min=1, help="Measured requests per level (ends the level first).")
    ] = None,
    warmup: Annotated[str, typer.Option(help="Load before measuring, excluded from results.")] = "2s",
    timeout: Annotated[
        str | None,
        typer.Option(help="Client timeout per request (counts as a 'timeout' error); default 30s, chat 300s."),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Load-generator processes (when one client core is not enough); default 1, chat 2 "
            "(one process streams up to ~8k tokens/s).",
        ),
    ] = None,
    max_connections: Annotated[int, typer.Option(min=1, help="Open loop: connection pool size per process.")] = 512,
    texts: Annotated[
        Path | None,
        typer.Option(
            help="Texts to send (.txt lines or .jsonl 'text'); default the dev split, for chat the built-in "
            "dialogue prompts (each text is a user message, or the prompt of --endpoint completions)."
        ),
    ] = None,
    endpoint: Annotated[
        str, typer.Option(help="Target chat: chat (/v1/chat/completions) or completions (/v1/completions).")
    ] = "chat",
    max_tokens: Annotated[int, typer.Option(min=1, help="Target chat: max_tokens of every request.")] = 64,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            help="Target chat: send ignore_eos (miaohui, vLLM, llama.cpp) so every answer is max_tokens long; "
            "--no-ignore-eos for servers that reject the field."
        ),
    ] = True,
    extra_body: Annotated[
        str | None, typer.Option(help="Target chat: a JSON object merged into every request body.")
    ] = None,
    tokens: Annotated[
        str | None, typer.Option(help="Only texts of MIN-MAX tokens, e.g. 8-64 (composed from short ones if needed).")
    ] = None,
    repository: Annotated[
        Path | None,
        typer.Option(
            "--repository", "-r", help="Where --model is found (engine target, --tokens) when --engine is not given."
        ),
    ] = None,
    engine_threads: Annotated[int | None, typer.Option(min=1, help="Engine target: intra-op threads.")] = None,
    scrape: Annotated[
        bool, typer.Option(help="Scrape the server's /metrics around each level (server-side breakdown).")
    ] = True,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the PNG (latency vs throughput) here.")] = None,
) -> None:
    """Load a server (HTTP, KServe HTTP/gRPC, any OpenAI-compatible chat server) or a bare engine; report latency
    percentiles, throughput and errors (chat: TTFT, inter-token latency, tokens/s per request and in all); every
    request sent is counted as answered or as an error."""
    try:
        doc = _run(locals())
    except MiaohuiError as exc:
        fail(exc)
    if out is not None:
        from miaohui.bench.report import to_json

        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_json(doc) + "\n", encoding="utf-8")
        console.print(f"wrote {out}")
    if plot is not None:
        from miaohui.bench.chat_report import plot_chat
        from miaohui.bench.plot import plot_points

        console.print(f"wrote {(plot_chat if target == 'chat' else plot_points)(doc, plot)}")
    if any(p["lost"] for p in doc["points"]):
        err_console.print("[bold red]requests lost:[/] sent != answered + errors")
        raise typer.Exit(1)
    if target == "chat" and _chat_errors(doc):
        raise typer.Exit(1)


def _chat_errors(doc: dict[str, Any]) -> bool:
    """Print the servers' messages for each error label; True when no request at all was answered."""
    from miaohui.bench.report import level_label

    for point in doc["points"]:
        for label, text in point["chat"]["error_messages"].items():
            err_console.print(
                f"[yellow]{level_label(point)}: {point['errors'][label]} × {label}:[/] {text}", highlight=False
            )
    if sum(p["answered"] for p in doc["points"]):
        return False
    err_console.print(
        f"[bold red]error:[/] no request was answered (model {doc['config']['model']!r} at {doc['config']['url']})"
    )
    err_console.print("[yellow]fix:[/] check --model against the server's GET /v1/models, and --url")
    return True


def _run(opts: dict[str, Any]) -> dict[str, Any]:
    from miaohui.bench.load import LoadPlan
    from miaohui.bench.report import level_label, make_document
    from miaohui.bench.sweep import fit_token_range, load_texts, run_sweep, tokenizer_counter
    from miaohui.bench.targets import TARGETS, TargetSpec

    if opts["target"] not in TARGETS:
        raise ConfigError(f"unknown --target {opts['target']!r}", f"use one of {', '.join(TARGETS)}")
    chat = opts["target"] == "chat"
    if chat and opts["tokens"]:
        raise ConfigError("--tokens is for the encoder targets", "leave --tokens out with --target chat")
    processes = opts["processes"] or (2 if chat else 1)
    timeout = opts["timeout"] or ("300s" if chat else "30s")
    open_loop = opts["rate"] is not None
    levels = (
        parse_levels(opts["rate"], "--rate", False)
        if open_loop
        else parse_levels(opts["concurrency"], "--concurrency", True)
    )
    duration = parse_seconds(opts["duration"], "--duration") if opts["duration"] else None
    if duration is None and opts["requests"] is None:
        duration = 10.0
    if chat and opts["texts"] is None:
        from miaohui.bench.chat import DIALOGUE_PROMPTS

        texts = list(DIALOGUE_PROMPTS)
    else:
        texts = load_texts(opts["texts"])
    engine = opts["engine"]
    if opts["target"] == "engine" and engine is None:
        engine = _tokenizer_artifact(opts)  # --model in --repository
    if opts["tokens"]:
        lo, hi = parse_token_range(opts["tokens"])
        texts = fit_token_range(texts, tokenizer_counter(_tokenizer_artifact(opts)), lo, hi, opts["seed"])
    spec = TargetSpec(
        kind=opts["target"],
        url=opts["url"],
        grpc_url=opts["grpc_url"],
        model=opts["model"],
        engine=str(engine) if engine else None,
        engine_threads=opts["engine_threads"],
        timeout_s=parse_seconds(timeout, "--timeout"),
        max_connections=opts["max_connections"] if open_loop else 1,
        endpoint=opts["endpoint"],
        max_tokens=opts["max_tokens"],
        ignore_eos=opts["ignore_eos"],
        extra_body=opts["extra_body"],
    )
    if chat:
        from miaohui.bench.chat import ChatTarget

        ChatTarget(spec)  # checks --url, --endpoint and --extra-body before any process starts
    plans = [
        LoadPlan(
            mode="open" if open_loop else "closed",
            level=lv,
            warmup_s=parse_seconds(opts["warmup"], "--warmup"),
            duration_s=duration,
            requests=opts["requests"],
            seed=opts["seed"],
            processes=processes,
        )
        for lv in levels
    ]
    config = {
        "target": spec.kind,
        "url": spec.url,
        "grpc_url": spec.grpc_url,
        "model": spec.model,
        "engine": spec.engine,
        "mode": plans[0].mode,
        "levels": levels,
        "duration_s": duration,
        "requests": opts["requests"],
        "warmup_s": plans[0].warmup_s,
        "timeout_s": spec.timeout_s,
        "processes": processes,
        "texts": str(opts["texts"] or ("built-in dialogue prompts" if chat else "dev split")),
        "n_texts": len(texts),
        "tokens": opts["tokens"],
        "seed": opts["seed"],
    }
    if chat:
        config |= {k: opts[k] for k in ("endpoint", "max_tokens", "ignore_eos", "extra_body")}
    console.print(
        f"[dim]bench {spec.kind} · {plans[0].mode} loop · levels {', '.join(f'{v:g}' for v in levels)} · "
        f"{len(texts)} texts · {duration or '-'} s / {opts['requests'] or '-'} requests per level[/]"
    )
    table = _table(chat)
    metrics_url = spec.url if opts["scrape"] and spec.kind not in ("engine", "chat") else None

    def show(point: dict[str, Any]) -> None:
        table.add_row(*(_chat_row(point) if chat else _row(point)))
        client = point["client"]
        if client["saturated"] or client["contended"]:
            err_console.print(f"[yellow]warning ({level_label(point)}):[/] {client['note']}")

    points = run_sweep(spec, texts, plans, metrics_url, on_point=show)
    console.print(table, width=max(console.width, 120))
    command = "miaohui " + shlex.join(sys.argv[1:]) if sys.argv[0].endswith("miaohui") else shlex.join(sys.argv)
    return make_document(command, config, points)


def _tokenizer_artifact(opts: dict[str, Any]) -> Path:
    if opts["engine"] is not None:
        return Path(opts["engine"])
    from miaohui.engines.store import resolve_artifact
    from miaohui.paths import repository_dir

    return resolve_artifact(opts["model"], opts["repository"] or repository_dir())


def _table(chat: bool = False) -> Table:
    if chat:
        from miaohui.bench.chat_report import CHAT_COLUMNS

        title = "miaohui bench chat (ms; ITL: inter-token latency per request; tok/s/req: each request's tokens/s)"
        table = Table(*CHAT_COLUMNS, title=title)
        for col in table.columns[1:]:
            col.justify = "right"
        return table
    cols = ("level", "sent", "ok", "errors", "req/s", "p50", "p90", "p99", "max", "queue", "compute", "batch")
    table = Table(*cols, title="miaohui bench (latency ms; queue/compute/batch: server means)")
    for col in table.columns[1:]:
        col.justify = "right"
    return table


def _chat_row(p: dict[str, Any]) -> list[str]:
    from miaohui.bench.chat_report import chat_row
    from miaohui.bench.report import level_label

    return chat_row(p, level_label(p))


def _row(p: dict[str, Any]) -> list[str]:
    from miaohui.bench.report import level_label

    lat, srv = p["latency_ms"], p.get("server") or {}
    errs = " ".join(f"{k}:{v}" for k, v in p["errors"].items()) or "0"

    def mean(key: str) -> str:
        part = srv.get(key)
        return _num(part["mean"]) if part else "-"

    return [
        level_label(p),
        str(p["sent"]),
        str(p["answered"]),
        errs,
        f"{p['throughput_rps']:.0f}",
        *(_num(lat[q]) for q in ("p50", "p90", "p99", "max")),
        mean("queue_ms"),
        mean("compute_ms_per_batch"),
        mean("batch_size"),
    ]


def _num(x: float) -> str:
    if x != x:  # NaN: no successes
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"
