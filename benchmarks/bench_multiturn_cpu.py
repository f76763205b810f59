"""One growing conversation, turn after turn: does time to first token stay flat as the history grows?

    .venv/bin/python benchmarks/bench_multiturn_cpu.py                       # miaohui on llama.cpp Q4_1 vs llama.cpp
    .venv/bin/python benchmarks/bench_multiturn_cpu.py --repository R --model M   # any served chat model

* The conversation: a short system prompt, :data:`TURNS` (twelve user turns); each answer is greedy,
  ``--max-tokens`` (32) tokens, streamed through the ``openai`` client, and kept in the history the next turn sends.
  TTFT = request start → first streamed content. ``--runs`` conversations per server (each with its own system
  prompt, so a run cannot reuse the previous run's cache); the figure per turn is the median over runs.
* miaohui: ``miaohui serve`` on ``--repository``/``--model``; without them, SmolLM2 built with ``--backend`` /
  ``--precision`` (default: what ``make run`` serves, ``miaohui.prepare.DEFAULT_LLM``) into ``--work``. Its
  ``miaohui_prefix_cache_hit_tokens_total`` before and after is kept.
* llama.cpp: its own server (``xllamacpp``, ``scripts/peers.sh llamacpp``) on the shipped Q4_1 GGUF, prompt cache
  on as shipped, 4 slots sharing 8192 tokens, ``--threads`` threads, in the same run, one server at a time.

Writes ``multiturn_cpu.json`` and ``multiturn_cpu.png``: TTFT per turn for both, prompt tokens per turn, the
ratios turn 12 / turn 2 per server and miaohui / llama.cpp at turn 12, the 1-minute load average before each
server (a shared machine: absolute times are noisy, the ratios within the run are what to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from miaohui.prepare import DEFAULT_LLM  # noqa: E402
from peers import procs, report  # noqa: E402

SYSTEM = "You are a concise assistant at a bank's help desk."
TURNS = [
    "Hello! I would like to open a savings account.",
    "What documents do I need to bring?",
    "Can I open it online instead?",
    "How long does the online process take?",
    "Is there a minimum deposit?",
    "What interest rate do savings accounts get?",
    "Are there any monthly fees?",
    "Can I link it to my checking account?",
    "How do I transfer money between them?",
    "What happens if I forget my password?",
    "Can I set up automatic monthly savings?",
    "Thank you. Can you summarize the steps for me?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--repository", type=Path, default=None, help="miaohui repository holding --model")
    ap.add_argument("--model", default="smollm2", help="the served chat model miaohui answers with")
    ap.add_argument("--backend", default=DEFAULT_LLM[0], help="without --repository: the build's backend")
    ap.add_argument("--precision", default=DEFAULT_LLM[1], help="without --repository: the build's precision")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=1, help="conversations per server (median per turn)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8140)
    ap.add_argument("--peers", default="llamacpp", help="'llamacpp' or 'none'")
    ap.add_argument("--work", type=Path, default=ROOT / "var" / "peers")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/peers.sh llamacpp first")
    return ap.parse_args(argv)


async def conversation(base_url: str, model: str, system: str, max_tokens: int) -> list[dict[str, Any]]:
    """Twelve turns; per turn: TTFT (ms), prompt tokens (the server's usage), the answer."""
    import httpx
    from openai import AsyncOpenAI

    # a connection per request, as peers/load.py opens them (llama.cpp's server closes idle keep-alive connections)
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)
    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0, http_client=http)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: Any = None
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        answer = "".join(text)
        messages.append({"role": "assistant", "content": answer})
        turns.append(
            {
                "ttft_ms": round(((first or time.perf_counter()) - start) * 1e3, 1),
                "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "answer": answer[:120],
            }
        )
    await client.close()
    return turns


def measure(name: str, base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    import os

    load_before = os.getloadavg()[0]
    runs = []
    for run in range(args.runs):
        system = SYSTEM if run == 0 else f"{SYSTEM} (conversation {run + 1})"
        runs.append(asyncio.run(conversation(base_url, model, system, args.max_tokens)))
        print(f"… {name} run {run + 1}: TTFT {[t['ttft_ms'] for t in runs[-1]]}", file=sys.stderr, flush=True)
    ttft = [statistics.median(r[i]["ttft_ms"] for r in runs) for i in range(len(TURNS))]
    return {
        "server": name,
        "loadavg_1m_before": round(load_before, 2),
        "ttft_ms": ttft,
        "prompt_tokens": [t["prompt_tokens"] for t in runs[0]],
        "answers": [t["answer"] for t in runs[0]],
        "turn12_over_turn2": round(ttft[-1] / ttft[1], 3),
    }


def _metric(url: str, name: str) -> float:
    import httpx

    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def _miaohui_repo(args: argparse.Namespace) -> Path:
    if args.repository is not None:
        return Path(args.repository)
    from miaohui.generation.build.artifact import build_causal_lm

    repo = args.work / f"multiturn-{args.backend}-{args.precision}"
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    build_causal_lm(repo, args.model, args.precision, backend=args.backend, source="smollm2", log=log)
    config = {"scheduler": {"max_running_seqs": 4, "max_model_len": 2048}, "threads": args.threads}
    (repo / args.model / "generation.yaml").write_text(json.dumps(config))
    return repo


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.peers == "llamacpp" and not args.no_install:
        env = {**__import__("os").environ, "PEERS_DIR": str(args.work)}
        subprocess.run(["bash", str(ROOT / "scripts" / "peers.sh"), "llamacpp"], check=True, env=env)
    logs = args.work / "logs"
    base = f"http://127.0.0.1:{args.port}"
    repo = _miaohui_repo(args)
    rows = []
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "--repository", str(repo), "--port", str(args.port)]
    cmd += ["--grpc-port", "0", "--models", args.model]
    hit_name = f'miaohui_prefix_cache_hit_tokens_total{{model="{args.model}"}}'
    with procs.running(cmd, f"{base}/v2/health/ready", logs / "multiturn-miaohui.log"):
        before = _metric(base, hit_name)
        row = measure(f"miaohui-{args.model}", f"{base}/v1", args.model, args)
        row["prefix_cache_hit_tokens"] = _metric(base, hit_name) - before
        rows.append(row)
    if args.peers == "llamacpp":
        from miaohui.zoo.smollm import smollm_gguf_path

        py = str(args.work / "llamacpp" / "bin" / "python")
        cmd = [py, str(HERE / "peers" / "serve_llamacpp.py"), str(smollm_gguf_path()), "--port", str(args.port)]
        cmd += ["--threads", str(args.threads), "--parallel", "4"]
        with procs.running(cmd, f"{base}/health", logs / "multiturn-llamacpp.log"):
            rows.append(measure("llamacpp-q4_1", f"{base}/v1", "smollm2", args))
    env = report.environment(ROOT, sys.argv if argv is None else ["bench_multiturn_cpu.py", *argv], {}, {})
    doc: dict[str, Any] = {
        "schema": "miaohui-bench-multiturn/1",
        "title": "one growing conversation: TTFT per turn",
        "config": {
            "system": SYSTEM,
            "turns": TURNS,
            "max_tokens": args.max_tokens,
            "runs": args.runs,
            "decoding": "greedy (temperature 0), streamed, answers kept in the history",
            "miaohui": {"repository": str(repo), "model": args.model},
            "threads_per_server": args.threads,
        },
        "environment": env,
        "results": rows,
        "note": "shared 2-core machine: compare loadavg_1m_before; the ratios within the run are what to compare",
    }
    if len(rows) == 2:
        doc["miaohui_over_llamacpp_turn12"] = round(rows[0]["ttft_ms"][-1] / rows[1]["ttft_ms"][-1], 3)
    args.out.mkdir(parents=True, exist_ok=True)
    report.write(doc, args.out / "multiturn_cpu.json")
    plot(doc, args.out / "multiturn_cpu.png")
    for r in rows:
        print(f"{r['server']:<24} TTFT ms per turn {r['ttft_ms']}  turn12/turn2 {r['turn12_over_turn2']}")
    if "miaohui_over_llamacpp_turn12" in doc:
        print(f"miaohui / llama.cpp at turn 12: {doc['miaohui_over_llamacpp_turn12']}")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in doc["results"]:
        ax.plot(range(1, len(r["ttft_ms"]) + 1), r["ttft_ms"], marker="o", label=r["server"])
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{doc['title']} ({doc['environment']['date'][:10]}, {doc['environment']['commit'][:9]})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
