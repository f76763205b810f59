"""miaohui side by side with the servers users would pick instead, on this CPU, one server at a time on 127.0.0.1.

    .venv/bin/python benchmarks/bench_peers_cpu.py                      # install peers, smoke, full run
    .venv/bin/python benchmarks/bench_peers_cpu.py --smoke              # every server answers, tiny loads
    .venv/bin/python benchmarks/bench_peers_cpu.py --part intent --intent-model var/models/intent-e5-small

* Peers are installed by ``scripts/peers.sh``, each into a venv of its own under var/peers/ (never the project's);
  what each needed and how long it took (var/peers/install.json) is copied into the results.
* Generation: miaohui's served chat model (``miaohui serve`` on SmolLM2-135M-Instruct built by ``build_causal_lm``
  as ``make run`` does, one repository per ``--miaohui-precision``) against llama.cpp's server (``xllamacpp``) on
  the same Q4_1 GGUF miaohui builds from, and ``transformers serve`` (fp32 PyTorch) as a reference. The same
  ``openai`` streaming client and 8 prompts, greedy, ``--new-tokens`` tokens (``ignore_eos`` where the server
  takes it); TTFT and TPOT p50/p99 and tokens/s at ``--streams``. With ``--interleave`` every server is up at once
  and each level's rounds are taken server by server in turn, so the machine's drift between minutes moves them
  alike (the ratio to publish); without it, one server at a time.
* Intent: the same int8 ONNX intent model (miaohui's default engine: ``prepare.default_config``) behind miaohui
  (KServe v2 text contract, and ``/v1/intent`` which adds slots), MLServer (KServe v2, adaptive batching, a runtime
  around ONNX Runtime), PyTriton (Triton's KServe v2 server and dynamic batcher) and LitServe (``/predict``, dynamic
  batching); the peers all use ``benchmarks/peers/intent_model.py`` (ONNX Runtime, 2 threads, the artifact's
  tokenizer). Closed-loop load with the dev split's texts: req/s, p50, p99 at ``--concurrency``.
* The 1-minute load average is recorded before each configuration: this machine is shared, so a figure taken under
  load is noisy; quiet re-runs are what to publish.

Writes ``peers_generation_cpu.json/.png`` and ``peers_intent_cpu.json/.png`` (ratios miaohui/peer per metric and
level included) and prints the tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from peers import load, procs, report  # noqa: E402

QUESTIONS = [  # the prompts of bench_generation_cpu.py
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
    "What should I consider before buying a government bond?",
    "Give me three tips for a salary negotiation.",
    "How do I reset my online banking password?",
    "Summarize the benefits of regular exercise.",
    "Describe a calm morning routine for a busy office worker.",
]
GEN_PEERS = ("llamacpp", "transformers")
INTENT_PEERS = ("mlserver", "pytriton", "litserve")
PEERS = GEN_PEERS + INTENT_PEERS
MIAOHUI_LLMS = ("fp32", "int4", "int8", "llamacpp", "llamacpp-q8_0", "llamacpp-f16")
GATE_RECIPE = {
    "miaohui-ort-fp32": "fp32",
    "miaohui-ort-int4": "int4",
    "miaohui-ort-int8": "int8",
    "miaohui-llamacpp-q4_1": "llamacpp-q4_1",
    "miaohui-llamacpp-q8_0": "llamacpp-q8_0",
    "miaohui-llamacpp-f16": "llamacpp-f16",
    "llamacpp-q4_1": "llamacpp-q4_1",
}
"""Each generation server's row in decoder_recipes_cpu.json (bench_decoder_recipes_cpu.py): its decoder gate."""


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 1, e.g. 1,8,32")
    return values


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated subset of {','.join(allowed)}")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--part", type=_choices(("generation", "intent")), default=["generation", "intent"])
    ap.add_argument("--peers", type=_choices(PEERS), default=list(PEERS), help="peers to run (default: all)")
    ap.add_argument(
        "--miaohui-precision",
        type=_choices(MIAOHUI_LLMS),
        default=["fp32", "int8"],
        help="miaohui LLM variants, each served and measured: fp32 / int4 / int8 on ONNX Runtime, llamacpp (the same "
        "Q4_1 GGUF as the llama.cpp peer, built with --backend llamacpp: llama.cpp's kernels under miaohui's server), "
        "llamacpp-q8_0 / llamacpp-f16 (GGUFs miaohui writes from the fp32 model: --precision q8_0|f16)",
    )
    ap.add_argument("--streams", type=_ints, default=[1, 8, 32])
    ap.add_argument(
        "--reference-streams",
        type=_ints,
        default=[1, 8],
        help="stream counts for `transformers serve` (fp32 PyTorch: slow at 32 on 2 cores)",
    )
    ap.add_argument(
        "--llamacpp-prompt-cache",
        action="store_true",
        help="let llama.cpp reuse a slot's cached prompt (its default; off here: the 8 prompts repeat "
        "every round, so a warm cache would skip their prefill)",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1, help="measured rounds per generation level (after a warm-up)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 16, 64])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per intent level")
    ap.add_argument(
        "--intent-model",
        type=Path,
        default=None,
        help="trained intent checkpoint (train-intent's output); default var/models/intent-e5-small, "
        "trained once if missing as `miaohui prepare` does",
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads every server gets")
    ap.add_argument("--max-batch-size", type=int, default=32, help="peers' batchers (intent)")
    ap.add_argument("--max-delay-ms", type=float, default=2.0, help="peers' batch wait (intent)")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--work", type=Path, default=ROOT / "var" / "peers", help="peer venvs, repositories, logs")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/peers.sh first")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="generation: every server up at once, each level's rounds taken server by server in turn (a machine "
        "whose speed drifts between minutes then moves all servers alike); transformers is not run",
    )
    ap.add_argument("--smoke", action="store_true", help="check every server answers: 1 level, tiny loads")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of servers this run does not measure from the existing result JSON",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.reference_streams, args.concurrency = [2], [1], [2]
        args.new_tokens, args.seconds = min(args.new_tokens, 8), 2.0
    return args


def _project_versions() -> dict[str, str]:
    out = {}
    for pkg in ("miaohui", "onnxruntime", "numpy", "openai", "aiohttp"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _install(args: argparse.Namespace) -> dict[str, Any]:
    if not args.no_install:
        env = {**os.environ, "PEERS_DIR": str(args.work)}
        subprocess.run(["bash", str(ROOT / "scripts" / "peers.sh"), *args.peers], check=True, env=env)
    path = args.work / "install.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class Runner:
    """Runs configurations one server at a time, recording the load average before each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.logs = args.work / "logs"
        self.py = {p: str(args.work / p / "bin" / "python") for p in PEERS}

    def serve(
        self, name: str, cmd: list[str], ready_path: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> Any:
        print(f"… starting {name}", file=sys.stderr, flush=True)
        url = f"http://127.0.0.1:{port or self.args.port}{ready_path}"
        return procs.running(cmd, url, self.logs / f"{name}.log", env=env)

    @staticmethod
    def measure(fn: Callable[[], dict[str, Any]], **labels: Any) -> dict[str, Any]:
        load_before = os.getloadavg()[0]
        print(f"… {labels} (load {load_before:.1f})", file=sys.stderr, flush=True)
        try:
            result = fn()
        except Exception as exc:  # one failed level is recorded, the rest still run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        return {**labels, "loadavg_1m_before": round(load_before, 2), **result}


# ---- generation ------------------------------------------------------------------------------------------
def _miaohui_llm(args: argparse.Namespace, precision: str) -> Path:
    from miaohui.generation.build.artifact import build_causal_lm

    repo = args.work / f"repo-{precision}"
    log = functools.partial(print, file=sys.stderr)
    if not precision.startswith("llamacpp"):
        build_causal_lm(repo, "smollm2", precision, log=log)  # reused while its key holds
        return repo
    gguf = precision.partition("-")[2] or "gguf"
    build_causal_lm(repo, "smollm2", gguf, backend="llamacpp", log=log)
    # as the llama.cpp peer: a slot per stream of the largest level, its 8192-token context split among them
    slots = max(args.streams)
    sched = {"max_running_seqs": slots, "max_model_len": max(256, 8192 // slots), "max_batched_tokens": 2048}
    (repo / "smollm2" / "generation.yaml").write_text(json.dumps({"scheduler": sched, "threads": args.threads}))
    return repo


def miaohui_server_name(precision: str) -> str:
    """The result rows' server name of a ``--miaohui-precision`` value."""
    if precision.startswith("llamacpp"):
        return f"miaohui-llamacpp-{precision.partition('-')[2] or 'q4_1'}"
    return f"miaohui-ort-{precision}"


def attach_gates(rows: list[dict[str, Any]], recipes: Path) -> None:
    """Each row gets its server's decoder-gate verdict from ``recipes`` (decoder_recipes_cpu.json), when there."""
    if not recipes.is_file():
        return
    gates = {r["recipe"]: r for r in json.loads(recipes.read_text())["rows"]}
    for row in rows:
        gate = gates.get(GATE_RECIPE.get(row["server"], ""))
        if gate is not None:
            keys = ("gate_passed", "exact_match", "teacher_forced", "factual", "commit")
            row["gate"] = {k: gate.get(k) for k in keys}


def _miaohui_cmd(repo: Path, port: int, models: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miaohui.cli",
        "serve",
        "--repository",
        str(repo),
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--models",
        models,
    ]


@dataclasses.dataclass(frozen=True)
class _ChatServer:
    """A generation server of the run: its process name, its rows' ``server`` label, the command serving it on a
    port, its readiness path and the request's extra body."""

    name: str
    label: str
    cmd: Callable[[int], list[str]]
    ready_path: str
    extra: dict[str, Any]

    def target(self, port: int) -> load.ChatTarget:
        return load.ChatTarget(f"http://127.0.0.1:{port}/v1", "smollm2", self.extra)


def _chat_servers(args: argparse.Namespace, runner: Runner) -> list[_ChatServer]:
    """miaohui's servers (one per ``--miaohui-precision``, its version built here) and llama.cpp's, when asked."""
    from miaohui.zoo.smollm import smollm_gguf_path

    servers = [
        _ChatServer(
            f"miaohui-{precision}",
            miaohui_server_name(precision),
            functools.partial(_miaohui_cmd, _miaohui_llm(args, precision), models="smollm2"),
            "/v2/health/ready",
            {"ignore_eos": True},
        )
        for precision in args.miaohui_precision
    ]
    if "llamacpp" in args.peers:
        servers.append(
            _ChatServer(
                "llamacpp",
                "llamacpp-q4_1",
                lambda port: [
                    runner.py["llamacpp"],
                    str(HERE / "peers" / "serve_llamacpp.py"),
                    str(smollm_gguf_path()),
                    "--port",
                    str(port),
                    "--threads",
                    str(args.threads),
                    "--parallel",
                    str(max(args.streams)),
                ],
                "/health",
                {"ignore_eos": True, "cache_prompt": args.llamacpp_prompt_cache},
            )
        )
    return servers


def _interleaved(args: argparse.Namespace, runner: Runner, servers: list[_ChatServer]) -> list[dict[str, Any]]:
    """``--interleave``: every server up at once (ports ``--port``, ``--port`` + 1, …), each level's rounds taken
    server by server in turn (:func:`load.generation_rounds`); an idle server waits on its socket, so the one
    measured has the cores."""
    with contextlib.ExitStack() as stack:
        targets = {}
        for port, server in enumerate(servers, start=args.port):
            stack.enter_context(runner.serve(server.name, server.cmd(port), server.ready_path, port=port))
            targets[server.label] = server.target(port)
        rows: list[dict[str, Any]] = []
        for s in args.streams:
            level = runner.measure(
                functools.partial(load.generation_rounds, targets, QUESTIONS, s, args.new_tokens, args.runs),
                servers=list(targets),
                streams=s,
            )
            for label in targets:
                result = level.get(label, {"error": level.get("error", "no result")})
                rows.append({"server": label, "streams": s, "loadavg_1m_before": level["loadavg_1m_before"], **result})
        return rows


def run_generation(args: argparse.Namespace, runner: Runner) -> list[dict[str, Any]]:
    from miaohui.zoo.smollm import ensure_smollm_cache

    rows: list[dict[str, Any]] = []
    base = f"http://127.0.0.1:{args.port}/v1"

    def levels(server: str, target: load.ChatTarget, streams: list[int]) -> None:
        for s in streams:
            rows.append(
                runner.measure(
                    functools.partial(load.generation_load, target, QUESTIONS, s, args.new_tokens, args.runs),
                    server=server,
                    streams=s,
                )
            )

    servers = _chat_servers(args, runner)
    if args.interleave:
        rows += _interleaved(args, runner, servers)
    else:
        for server in servers:
            with runner.serve(server.name, server.cmd(args.port), server.ready_path):
                levels(server.label, server.target(args.port), args.streams)
    if "transformers" in args.peers and not args.interleave:
        model = str(ensure_smollm_cache())
        tserve = str(Path(runner.py["transformers"]).with_name("transformers"))
        cmd = [
            tserve,
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(args.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--continuous-batching",
        ]
        env = {"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
        with runner.serve("transformers", cmd, "/health", env=env):
            levels("transformers-fp32", load.ChatTarget(base, model), args.reference_streams)
    return rows


# ---- intent ----------------------------------------------------------------------------------------------
def intent_artifact(args: argparse.Namespace) -> tuple[Path, Path]:
    """Build (or reuse) the int8 intent engine as ``make run`` does; (repository, artifact directory)."""
    from miaohui.engines.store import build_artifact
    from miaohui.prepare import DEFAULT_MODEL, default_config
    from miaohui.zoo.intents import load_split

    checkpoint = args.intent_model or ROOT / "var" / "models" / DEFAULT_MODEL
    if not (checkpoint / "meta.json").is_file() and args.intent_model is None:
        from miaohui.models.train import TrainConfig, train_intent

        print(f"no intent model at {checkpoint}: training one (minutes)", file=sys.stderr)
        train_intent(TrainConfig(), checkpoint)
    repo = args.work / "repo-intent"
    texts = [x.text for x in load_split("train")]
    outcome = build_artifact(
        checkpoint,
        "intent",
        default_config("onnxruntime", "int8"),
        repo,
        calib_texts=texts,
        log=lambda m: print(m, file=sys.stderr),
    )
    return repo, outcome.path


def _libpython_dir(python: str) -> str:
    """The directory of the libpython the venv's interpreter was built with. Triton's Python-backend stub links
    ``libpython3.X.so.1.0`` dynamically and otherwise finds the system's (Debian's 3.11.2 here), which then runs
    the venv's newer standard library: ``'_thread.RLock' object has no attribute '_recursion_count'`` when
    PyTriton starts its tensor store."""
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return ":".join(filter(None, [out.stdout.strip(), os.environ.get("LD_LIBRARY_PATH")]))


def run_intent(args: argparse.Namespace, runner: Runner, texts: list[str]) -> tuple[list[dict[str, Any]], dict]:
    repo, artifact = intent_artifact(args)
    url = f"http://127.0.0.1:{args.port}"
    rows: list[dict[str, Any]] = []
    agreement: dict[str, Any] = {}
    check = texts[:50]
    reference: list[str] = []

    def levels(server: str, target: load.IntentTarget) -> None:
        try:
            answers = load.intent_answers(target, check)
        except Exception as exc:  # a server that cannot answer is recorded, the others still run
            rows.extend({"server": server, "concurrency": c, "error": f"{exc}"[-1500:]} for c in args.concurrency)
            return
        if not reference:
            reference.extend(answers)
        agreement[server] = sum(a == b for a, b in zip(answers, reference, strict=True)) / len(check)
        for c in args.concurrency:
            rows.append(
                runner.measure(
                    functools.partial(load.intent_load, target, texts, c, args.seconds), server=server, concurrency=c
                )
            )

    with runner.serve("miaohui-intent", _miaohui_cmd(repo, args.port, "intent"), "/v2/health/ready"):
        levels("miaohui-kserve-v2", load.IntentTarget(url, "kserve"))
        levels("miaohui-v1-intent", load.IntentTarget(url, "intent"))
    peer_opts = ["--port", str(args.port), "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size)]
    if "mlserver" in args.peers:
        with tempfile.TemporaryDirectory(prefix="mlserver-") as work:
            cmd = [
                runner.py["mlserver"],
                str(HERE / "peers" / "serve_mlserver.py"),
                str(artifact),
                *peer_opts,
                "--max-batch-time-ms",
                str(args.max_delay_ms),
                "--workdir",
                work,
            ]
            with runner.serve("mlserver", cmd, "/v2/models/intent/ready"):
                levels("mlserver", load.IntentTarget(url, "kserve"))
    if "pytriton" in args.peers:
        cmd = [
            runner.py["pytriton"],
            str(HERE / "peers" / "serve_pytriton.py"),
            str(artifact),
            *peer_opts,
            "--max-queue-delay-ms",
            str(args.max_delay_ms),
        ]
        env = {"LD_LIBRARY_PATH": _libpython_dir(runner.py["pytriton"])}
        try:
            with runner.serve("pytriton", cmd, "/v2/models/intent/ready", env=env):
                levels("pytriton", load.IntentTarget(url, "kserve", kserve_shape=(1, 1)))
        except procs.ServerFailed as exc:  # recorded: whether Triton's server runs CPU-only here is a finding
            rows.extend({"server": "pytriton", "concurrency": c, "error": str(exc)[-1500:]} for c in args.concurrency)
    if "litserve" in args.peers:
        cmd = [
            runner.py["litserve"],
            str(HERE / "peers" / "serve_litserve.py"),
            str(artifact),
            *peer_opts,
            "--batch-timeout-ms",
            str(args.max_delay_ms),
        ]
        with runner.serve("litserve", cmd, "/health"):
            levels("litserve", load.IntentTarget(url, "litserve"))
    return rows, {"artifact": str(artifact), "agreement_with_miaohui_on_50_dev_texts": agreement}


# ---- main ------------------------------------------------------------------------------------------------
def build_doc(
    title: str,
    kind: str,
    config: dict[str, Any],
    env: dict[str, Any],
    rows: list[dict[str, Any]],
    earlier: Path | None = None,
) -> dict:
    """The result document; with ``earlier`` (an existing result JSON), its rows of servers that ``rows`` lacks
    are kept (marked with the run they came from) and its environment is kept under ``earlier_runs``."""
    level_key, metrics = (
        ("streams", report.GEN_METRICS) if kind == "generation" else ("concurrency", report.INTENT_METRICS)
    )
    earlier_runs: list[dict[str, Any]] = []
    if earlier is not None and earlier.is_file():
        old = json.loads(earlier.read_text())
        measured = {r["server"] for r in rows}
        old_env = old.get("environment", {})
        kept = [{**r, "run": old_env.get("date")} for r in old.get("results", []) if r["server"] not in measured]
        rows = kept + rows
        earlier_runs = [*old.get("earlier_runs", []), old_env] if kept else old.get("earlier_runs", [])
    return {
        "schema": f"miaohui-bench-peers-{kind}/1",
        "title": title,
        "config": config,
        "environment": env,
        "results": rows,
        "ratios_miaohui_over_peer": report.ratios(rows, level_key, metrics),
        "note": "shared 2-core machine: compare loadavg_1m_before; a quiet re-run is needed for publishable figures",
        "earlier_runs": earlier_runs,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    install = _install(args)
    env = report.environment(
        ROOT, sys.argv if argv is None else ["bench_peers_cpu.py", *argv], install, _project_versions()
    )
    runner = Runner(args)
    suffix = "_smoke" if args.smoke else ""
    tables = []
    common = {"threads_per_server": args.threads, "smoke": args.smoke}
    if "generation" in args.part:
        rows = run_generation(args, runner)
        attach_gates(rows, args.out / "decoder_recipes_cpu.json")
        config = {
            **common,
            "new_tokens": args.new_tokens,
            "runs": args.runs,
            "streams": args.streams,
            "reference_streams": args.reference_streams,
            "prompts": QUESTIONS,
            "system_message": f"one per request, numbered so no prompt cache reuses another's: {load.system_line(0)!r}",
            "decoding": "greedy (temperature 0); ignore_eos for miaohui and llama.cpp",
            "llamacpp_prompt_cache": args.llamacpp_prompt_cache,
            "interleave": args.interleave,
            "miaohui_precisions": args.miaohui_precision,
        }
        path = args.out / f"peers_generation_cpu{suffix}.json"
        doc = build_doc(
            "SmolLM2-135M-Instruct chat, streaming", "generation", config, env, rows, path if args.append else None
        )
        report.write(doc, path)
        panels = [
            (("ttft_ms", "p50"), "TTFT p50 (ms)", True),
            (("tpot_ms", "p50"), "TPOT p50 (ms)", True),
            (("tokens_per_s",), "tokens/s (all streams)", False),
        ]
        report.plot(doc, args.out / f"peers_generation_cpu{suffix}.png", "streams", panels)
        tables += [
            report.generation_table(doc),
            report.ratio_table(doc["ratios_miaohui_over_peer"], "streams", report.GEN_METRICS),
        ]
    if "intent" in args.part:
        from miaohui.zoo.intents import load_split

        texts = [x.text for x in load_split("dev")]
        rows, extra = run_intent(args, runner, texts)
        config = {
            **common,
            "seconds_per_level": args.seconds,
            "concurrency": args.concurrency,
            "texts": f"dev split ({len(texts)} texts)",
            "peer_max_batch_size": args.max_batch_size,
            "peer_max_delay_ms": args.max_delay_ms,
            **extra,
        }
        path = args.out / f"peers_intent_cpu{suffix}.json"
        doc = build_doc(
            f"int8 intent model ({(args.intent_model or Path('intent-e5-small')).name}), one text per request",
            "intent",
            config,
            env,
            rows,
            path if args.append else None,
        )
        report.write(doc, path)
        panels = [
            (("req_per_s",), "requests/s", False),
            (("latency_ms", "p50"), "p50 (ms)", True),
            (("latency_ms", "p99"), "p99 (ms)", True),
        ]
        report.plot(doc, args.out / f"peers_intent_cpu{suffix}.png", "concurrency", panels)
        tables += [
            report.intent_table(doc),
            report.ratio_table(doc["ratios_miaohui_over_peer"], "concurrency", report.INTENT_METRICS),
        ]
    print(f"wrote results into {args.out} (loads are of a shared machine: see loadavg_1m_before)")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
