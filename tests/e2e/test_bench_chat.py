"""``miaohui bench --target chat`` from the CLI (a subprocess, 2 client processes) against a real uvicorn server on
localhost serving a tiny random decoder (2 layers × 64, SmolLM2's tokenizer) on ONNX Runtime.

The JSON must agree with the server: every answer ``max_tokens`` long (``ignore_eos``), the output tokens the
client reports equal to the server's ``usage`` and to the growth of its ``miaohui_generated_tokens`` counter, its
200s to the requests the client counted, percentiles ordered, no error. A wrong ``--model`` ends as counted 404s
with the server's message and a clear error, not a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.artifacts import scratch_dir
from tests.servers import UvicornThread
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.bench.report import validate_document
from miaohui.bench.scrape import fetch_metrics
from miaohui.generation.build.artifact import build_causal_lm
from miaohui.server.app import build_app

pytestmark = pytest.mark.slow  # builds a decoder (a tiny one: ~15 s) and starts client processes

MODEL = "tiny"
MAX_TOKENS = 12
REQUESTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornThread]:
    with scratch_dir(tmp_path_factory, "bench-chat") as root:
        source = save_tiny_decoder("qwen2", root / "hf", smollm_tokenizer())
        build_causal_lm(root / "repo", MODEL, "fp32", source=source, log=lambda m: None)
        with UvicornThread(build_app(root / "repo", [MODEL])) as srv:
            yield srv


def bench(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "miaohui.cli", "bench", "--target", "chat", "--url", url, "--warmup", "0s"]
    cmd += ["--max-tokens", str(MAX_TOKENS), "--requests", str(REQUESTS), "--processes", "2", "--out", str(out)]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=300, env=os.environ | {"COLUMNS": "200"}
    )


def counters(srv: UvicornThread) -> tuple[float, float]:
    """The server's generated tokens and 200 answers for the model, from its /metrics."""
    snap = fetch_metrics(srv.url)
    assert snap is not None
    return snap.total("miaohui_generated_tokens_total", model=MODEL), snap.total(
        "miaohui_requests_total", model=MODEL, code="200"
    )


def ordered(stats: dict[str, Any]) -> bool:
    return bool(stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"])


@pytest.mark.parametrize(("endpoint", "streams"), [("chat", 2), ("completions", 1)])
def test_chat_bench_agrees_with_the_server(server: UvicornThread, tmp_path: Path, endpoint: str, streams: int) -> None:
    before = counters(server)
    done = bench(server.url, tmp_path / "chat.json", "--model", MODEL, "--concurrency", str(streams),
                 "--endpoint", endpoint, "--plot", str(tmp_path / "chat.png"))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert validate_document(doc) == []
    assert " bench --target chat --url " in doc["command"]
    assert doc["commit"] and doc["created_at"] and doc["environment"]["versions"]["httpx"]
    want = {"endpoint": endpoint, "max_tokens": MAX_TOKENS, "ignore_eos": True, "model": MODEL, "processes": 2}
    assert doc["config"].items() >= want.items(), doc["config"]
    (point,) = doc["points"]
    assert point["concurrency"] == streams
    chat = point["chat"]
    assert (point["sent"], point["answered"], point["errors"], point["lost"]) == (REQUESTS, REQUESTS, {}, 0)
    assert point["client"]["processes"] == streams  # one process per stream, up to --processes 2
    assert chat["tokens_source"] == "usage"  # stream_options.include_usage honoured
    assert chat["output_tokens"] == REQUESTS * MAX_TOKENS
    assert chat["tokens_per_request"] == {"min": MAX_TOKENS, "mean": MAX_TOKENS, "max": MAX_TOKENS}
    assert chat["finish_reasons"] == {"length": REQUESTS}
    assert REQUESTS <= chat["content_chunks"] <= chat["output_tokens"]  # a chunk holds one token or more
    assert chat["output_tokens_per_s"] == pytest.approx(chat["output_tokens"] / point["window_s"])
    for key in ("ttft_ms", "inter_token_ms", "chunk_gap_ms", "request_tokens_per_s"):
        assert ordered(chat[key]), (key, chat[key])
    assert chat["ttft_ms"]["n"] == chat["inter_token_ms"]["n"] == REQUESTS
    assert chat["ttft_ms"]["max"] <= point["latency_ms"]["max"]
    assert chat["error_messages"] == {}
    # every token the client counted the server generated, and nothing else ran on it meanwhile
    after = counters(server)
    assert (after[0] - before[0], after[1] - before[1]) == (REQUESTS * MAX_TOKENS, REQUESTS)
    assert (tmp_path / "chat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_model_is_counted_404s_with_the_servers_message(server: UvicornThread, tmp_path: Path) -> None:
    done = bench(
        server.url, tmp_path / "nope.json", "--model", "nope", "--concurrency", "2", "--plot", str(tmp_path / "n.png")
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"c=2: {REQUESTS} × 404: The model 'nope' does not exist. Fix: chat models served here: tiny" in done.stderr
    assert "error: no request was answered (model 'nope' at http://127.0.0.1:" in done.stderr
    assert "fix: check --model against the server's GET /v1/models, and --url" in done.stderr
    assert (tmp_path / "n.png").is_file()  # the plot of a run without answers too
    doc = json.loads((tmp_path / "nope.json").read_text())
    (point,) = doc["points"]
    assert (point["sent"], point["answered"], point["errors"], point["lost"]) == (REQUESTS, 0, {"404": REQUESTS}, 0)
    assert point["error_groups"]["4xx"] == REQUESTS
    assert point["chat"]["output_tokens"] == 0
    assert point["chat"]["error_messages"] == {
        "404": "The model 'nope' does not exist. Fix: chat models served here: tiny"
    }
