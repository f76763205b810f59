"""The GPU generation benchmark's own CPU smoke mode, end to end (tiny model, real server, streaming clients), so a
script error shows here and not in an H200 session's limited device time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_generation_benchmark_smoke_with_staggered_streams(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/bench_generation_gpu.py", "--smoke", "--server", "--stagger-ms", "5"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("generation_gpu_*.json")
    server = json.loads(path.read_text())["models"][0]["server"]
    assert server["stagger_ms"] == 5.0 and server["errors"] == 0 and server["output_tokens"] > 0
    assert server["ttft_ms_p99"] >= server["ttft_ms_median"] > 0
    # the server's own TTFT, inter-token and whole-request sums and counts come with it
    names = {line.split("{")[0] for line in server["metrics_excerpt"]}
    assert {"miaohui_time_to_first_token_seconds_count", "miaohui_inter_token_latency_seconds_sum"} <= names
    # the server froze its warm heap (miaohui.gcpolicy) and its collections are reported by generation
    assert server["gc_freeze"] == "on" and server["gc_frozen_objects"] > 10_000
    assert set(server["gc_pauses"]) <= {"0", "1", "2"}
    # the engine loop's steps and the server's own TTFT over the window: where a TTFT tail comes from
    steps = server["steps"]
    # (the p99 is interpolated inside its bucket: with every prefill of one prompt it reads 0.99, below the mean)
    assert steps["prefill_steps"] > 0 and steps["prompts_per_prefill"] >= 1.0 and steps["prompts_per_prefill_p99"] > 0
    assert 0.0 <= steps["prefills_over_8_prompts"] <= 1.0
    assert steps["decode_ms_p99"] > 0 and steps["server_ttft_ms_p99"] >= steps["server_ttft_ms_p50"] > 0
    assert 0.0 <= steps["server_ttft_share_over_50ms"] <= 1.0
    assert steps["queue_ms_p99"] >= steps["queue_ms_p50"] >= 0
    # the server's steady state (first scrape → end of the clients' window) and the clients' own CPU use
    steady = server["steady"]
    assert steady["window_s"] > 0 and steady["generated_tokens_per_s"] > 0 and steady["steps_per_s"] > 0
    assert steady["window_s"] < steps["window_s"]
    assert len(server["client_cpu_cores"]) == server["client_processes"]
    assert all(0 < c < 2 for c in server["client_cpu_cores"])
    # the clients start together after all have imported (none late), and count what arrived in their window
    assert 0 <= server["client_late_s"] < 0.5
    window = server["window_tokens_per_s"]
    assert window > 0 and window * server["wall_s"] < 2 * server["output_tokens"]


def test_prefix_cache_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """The H200 prefix-cache TTFT script with a tiny random decoder on the CPU: it runs and writes its JSON and PNG."""
    cmd = [sys.executable, "benchmarks/bench_prefix_cache_gpu.py", "--model", "tiny", "--history", "40,24"]
    cmd += ["--turn", "8", "--iters", "2", "--warmup", "0", "--max-len", "128", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    doc = json.loads((tmp_path / "prefix_cache_gpu_tiny.json").read_text())
    # per iteration: the short prompt (8 tokens, no full block); each history misses, then its turn reuses the
    # history's full blocks (the 48-token turn 2 blocks, 32 tokens; the 32-token turn 1 block, 16 tokens) from the
    # slot the history left; an unrelated 8-token prompt takes that slot, and a second turn copies them from the pool
    queried, hits = 8 + (40 + 48 + 8 + 48) + (24 + 32 + 8 + 32), 2 * (32 + 16)
    assert doc["prefix_cache"] == {"queried_tokens": 2 * queried, "hit_tokens": 2 * hits, "kept_tokens": 2 * 48}
    assert sorted(doc["ttft"]) == ["short", "turn_cached", "turn_pool", "turn_uncached"]
    assert sorted(doc["by_history"]) == ["24", "40"] and doc["history_tokens"] == 40
    assert doc["ttft"]["turn_cached"] == doc["by_history"]["40"]["turn_cached"]
    assert (tmp_path / "prefix_cache_gpu_tiny.png").read_bytes().startswith(b"\x89PNG")
