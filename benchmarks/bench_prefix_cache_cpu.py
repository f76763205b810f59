"""Prefix caching on the ONNX Runtime backend, this CPU: time to first token per turn of one growing conversation,
with and without the cache, served over HTTP and read with the ``openai`` client streaming.

    .venv/bin/python benchmarks/bench_prefix_cache_cpu.py [--repository DIR] [--rounds 3] [--out benchmarks/results]

* One server (``create_openai_app`` over a ``ModelManager``, uvicorn on localhost) serves SmolLM2-135M-Instruct fp32
  twice from one repository folder: ``smollm2`` with the default ``prefix_cache_mb`` and ``smollm2-nocache`` with
  ``prefix_cache_mb: 0`` (the same version files, hard-linked). The two alternate, conversation by conversation, so
  both see the same machine load.
* A conversation: a short system prompt, twelve user turns, each answered greedily with ``max_tokens=32``; every
  answer is kept in the history, so turn k's prompt holds the k-1 previous exchanges. Each round's system prompt
  starts with its own number, so no round reuses another round's conversation (only the chat template's first tokens).
* TTFT: ``chat.completions.create(stream=True)`` called → first chunk with text. One warm-up conversation per model
  first (not recorded). Median over the rounds per turn; the ratio turn 12 / turn 2 is the goal's figure (≤ 1.3).
* The greedy answers of the two models are compared turn by turn (the cache must not change them).

Writes ``prefix_cache_cpu.json`` and ``prefix_cache_cpu.png``; prints the table last. The machine is shared: the
load average is recorded per round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from miaohui.bench.report import git_commit

SYSTEM = "You are a concise assistant of a bank's customer hotline."
TURNS = [
    "Hello, I would like to open a savings account.",
    "What documents do I need to bring?",
    "Can I open it online instead?",
    "How long does the online process take?",
    "What is the interest rate on a regular savings account?",
    "Is there a minimum balance?",
    "Are there monthly fees?",
    "Can I link it to my current account?",
    "How do I set up a monthly transfer?",
    "Can I withdraw money at any time?",
    "What happens if I go below the minimum balance?",
    "Thank you. Can you summarize the steps for me?",
]
MODELS = {"smollm2": None, "smollm2-nocache": 0.0}
"""Served name → ``prefix_cache_mb`` in its generation.yaml (None: the default)."""


def make_repository(source: Path, root: Path) -> Path:
    """Both models in one repository: hard links to the built version's files, one generation.yaml each."""
    version = max((p for p in source.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for name, mb in MODELS.items():
        dst = root / name / version.name
        dst.mkdir(parents=True)
        for f in version.iterdir():
            os.link(f, dst / f.name)
        sched: dict[str, Any] = {"max_model_len": 2048}
        if mb is not None:
            sched["prefix_cache_mb"] = mb
        (root / name / "generation.yaml").write_text(json.dumps({"scheduler": sched}))
    return root


def serve(repository: Path) -> tuple[str, Any]:
    import uvicorn

    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import chat_observers
    from miaohui.server.openai_api import create_openai_app
    from miaohui.serving.repository import ModelManager

    metrics = Metrics()
    app = create_openai_app(ModelManager(repository, chat_observer_factory=chat_observers(metrics)), metrics)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def conversation(client: Any, model: str, system: str) -> tuple[list[float], list[str]]:
    """TTFT (s) and answer of each turn."""
    messages = [{"role": "system", "content": system}]
    ttfts, answers = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        first: float | None = None
        parts = []
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0.0, stream=True
        )
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                if first is None:
                    first = time.perf_counter() - start
                parts.append(delta)
        answer = "".join(parts)
        ttfts.append(first if first is not None else time.perf_counter() - start)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return ttfts, answers


def metric(url: str, sample: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def environment() -> dict[str, Any]:
    from miaohui.engines.target import cpu_name

    versions = {}
    for pkg in ("miaohui", "onnxruntime", "numpy", "openai"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    commit = git_commit() or "unknown"
    return {
        "cpu": cpu_name(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "commit": commit,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    turns = range(1, len(TURNS) + 1)
    for name, label, color in (("smollm2", "prefix cache", "#0e7490"), ("smollm2-nocache", "no cache", "#c2410c")):
        ax.plot(turns, doc["models"][name]["ttft_ms_median"], marker="o", label=label, color=color)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, ms (median over rounds)")
    ax.set_title("SmolLM2-135M fp32, ONNX Runtime, 12-turn conversation, 32-token replies, streaming")
    ax.set_xticks(list(turns))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, default=None, help="a repository holding smollm2 (default: build one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    import httpx  # noqa: F401  # imported now: a missing package fails the run before it starts, not after
    import matplotlib  # noqa: F401
    import openai

    from miaohui.generation.build.artifact import build_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        if args.repository is None:
            source = build_causal_lm(Path(tmp) / "built", "smollm2", "fp32").parent
        else:
            source = args.repository / "smollm2"
        url, server = serve(make_repository(source, Path(tmp) / "repo"))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        for model in MODELS:  # warm-up, not recorded
            conversation(client, model, f"[warm-up] {SYSTEM}")
        ttft: dict[str, list[list[float]]] = {m: [] for m in MODELS}
        answers: dict[str, list[list[str]]] = {m: [] for m in MODELS}
        loads = []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for model in MODELS:
                t, a = conversation(client, model, f"[session {r + 1}] {SYSTEM}")
                ttft[model].append(t)
                answers[model].append(a)
                print(f"round {r + 1} {model}: " + " ".join(f"{x * 1000:.0f}" for x in t), flush=True)
        hit = metric(url, 'miaohui_prefix_cache_hit_tokens_total{model="smollm2"}')
        queried = metric(url, 'miaohui_prefix_cache_queried_tokens_total{model="smollm2"}')
        server.should_exit = True

    doc: dict[str, Any] = {"benchmark": "prefix_cache_cpu", "environment": environment(), "load_avg_1m": loads}
    doc["config"] = {"rounds": args.rounds, "turns": len(TURNS), "max_tokens": 32, "system": SYSTEM, "user": TURNS}
    doc["models"] = {}
    for model in MODELS:
        med = [statistics.median(x[i] for x in ttft[model]) * 1000 for i in range(len(TURNS))]
        doc["models"][model] = {
            "prefix_cache_mb": MODELS[model] if MODELS[model] is not None else "default",
            "ttft_ms_median": [round(x, 1) for x in med],
            "ttft_ms_rounds": [[round(x * 1000, 1) for x in t] for t in ttft[model]],
            "turn12_over_turn2": round(med[11] / med[1], 3),
        }
    doc["answers_identical"] = answers["smollm2"] == answers["smollm2-nocache"]
    doc["prefix_cache_tokens"] = {
        "hit": hit,
        "queried": queried,
        "hit_rate": round(hit / queried, 4) if queried else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, args.out / "prefix_cache_cpu.png")
    print(f"\n{'turn':>4} {'cache ms':>9} {'no cache ms':>12}")
    for i in range(len(TURNS)):
        a, b = (doc["models"][m]["ttft_ms_median"][i] for m in MODELS)
        print(f"{i + 1:>4} {a:>9.1f} {b:>12.1f}")
    for m in MODELS:
        print(f"{m}: TTFT turn 12 / turn 2 = {doc['models'][m]['turn12_over_turn2']}")
    print(f"answers identical: {doc['answers_identical']}; prefix cache hit rate {doc['prefix_cache_tokens']}")


if __name__ == "__main__":
    main()
