"""The ``chat`` target's report: per level, the generic point (sent, answered, errors by label, request latency,
client health; :func:`miaohui.bench.report.summarize`) plus a ``chat`` section made from the streams' records —
time to first token, inter-token latency, each request's tokens/s, the aggregate output tokens/s and the servers'
error messages — its table and its PNG.

Definitions (answered requests only; percentiles nearest-rank, as the other targets'):

* ``ttft_ms`` — request sent → first chunk with content.
* ``inter_token_ms`` — per request, (last content chunk − first) / (output tokens − 1): the mean time per token
  after the first (vLLM's TPOT), one value per request of ≥ 2 tokens.
* ``chunk_gap_ms`` — every gap between consecutive content chunks (vLLM's ITL; a server that puts several tokens
  into one chunk under load shows longer, fewer gaps here).
* ``request_tokens_per_s`` — per request, output tokens / its whole latency (what one user sees, TTFT included).
* ``output_tokens_per_s`` — all answered requests' output tokens / the measured window.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from miaohui.bench.chat import StreamRecord
from miaohui.bench.load import LoadPlan, RawRun
from miaohui.bench.report import latency_stats, summarize


def summarize_chat(raw: RawRun, plan: LoadPlan) -> dict[str, Any]:
    """One level's point: :func:`~miaohui.bench.report.summarize` plus the ``chat`` section."""
    point = summarize(raw, plan)
    records = [r for r in raw.details if isinstance(r, StreamRecord)]
    ok = [r for r in records if r.status == "ok"]
    tokens = [r.output_tokens for r in ok]
    sources = {"usage" if r.usage_tokens is not None else "chunks" for r in ok}
    messages: dict[str, str] = {}
    for r in records:
        if r.status != "ok" and r.error:
            messages.setdefault(r.status, r.error)
    window = point["window_s"]
    point["chat"] = {
        "output_tokens": sum(tokens),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "tokens_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None),
        "tokens_per_request": {
            "min": min(tokens, default=0),
            "mean": sum(tokens) / len(tokens) if tokens else 0.0,
            "max": max(tokens, default=0),
        },
        "content_chunks": sum(r.content_chunks for r in ok),
        "output_tokens_per_s": sum(tokens) / window if window else 0.0,
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "inter_token_ms": latency_stats([r.decode_s / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "chunk_gap_ms": latency_stats([g for r in ok for g in r.gaps_s]),
        "request_tokens_per_s": _plain(
            latency_stats([r.output_tokens / r.latency_s for r in ok if r.latency_s > 0]), 1e-3
        ),
        "finish_reasons": dict(sorted(Counter(str(r.finish_reason) for r in ok).items())),
        "error_messages": messages,
    }
    return point


def _plain(stats: dict[str, float], scale: float) -> dict[str, float]:
    """``latency_stats`` of values that are not seconds: undo its ×1000 (``n`` stays a count)."""
    return {k: (v if k == "n" else v * scale) for k, v in stats.items()}


CHAT_COLUMNS = ("level", "sent", "ok", "errors", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "tok/s/req p50", "tokens")  # fmt: skip


def chat_row(point: dict[str, Any], label: str) -> list[str]:
    chat = point["chat"]
    errs = " ".join(f"{k}:{v}" for k, v in point["errors"].items()) or "0"
    ttft, itl = chat["ttft_ms"], chat["inter_token_ms"]
    return [
        label,
        str(point["sent"]),
        str(point["answered"]),
        errs,
        f"{chat['output_tokens_per_s']:.1f}",
        *(_num(x) for x in (ttft["p50"], ttft["p99"], itl["p50"], itl["p99"], chat["request_tokens_per_s"]["p50"])),
        str(chat["output_tokens"]),
    ]


def _num(x: float) -> str:
    if x != x:  # NaN: no successes
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def plot_chat(doc: dict[str, Any], path: Path) -> Path:
    """Aggregate output tokens/s and TTFT / inter-token latency (p50, p99) against the concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = doc["points"]
    levels = [p["concurrency"] if p["mode"] == "closed" else p["rate"] for p in points]
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    ax_tp.plot(levels, [p["chat"]["output_tokens_per_s"] for p in points], "o-", label="output tokens/s (all)")
    ax_tp.plot(
        levels, [p["chat"]["request_tokens_per_s"]["p50"] for p in points], "s--", label="tokens/s per request (p50)"
    )
    closed = all(p["mode"] == "closed" for p in points)
    ax_tp.set(xlabel="concurrent streams" if closed else "offered rate (requests/s)", ylabel="tokens/s")
    ax_tp.set_title("throughput")
    for q, style in (("p50", "o-"), ("p99", "^--")):
        ax_lat.plot(levels, [p["chat"]["ttft_ms"][q] for p in points], style, color="tab:blue", label=f"TTFT {q}")
        ax_lat.plot(
            levels,
            [p["chat"]["inter_token_ms"][q] for p in points],
            style,
            color="tab:orange",
            label=f"inter-token {q}",
        )
    answered = any(p["answered"] for p in points)  # no answer at all: NaN latencies, no log scale
    ax_lat.set(xlabel=ax_tp.get_xlabel(), ylabel="ms", yscale="log" if answered else "linear", title="latency")
    for ax in (ax_tp, ax_lat):
        if len(levels) > 1 and min(levels) > 0 and max(levels) / min(levels) >= 8:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    cfg = doc.get("config", {})
    fig.suptitle(
        f"miaohui bench · {cfg.get('endpoint')} · model {cfg.get('model')} · {cfg.get('url')} · "
        f"max_tokens {cfg.get('max_tokens')} · {doc['environment'].get('cpu', '')}",
        fontsize=9,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
