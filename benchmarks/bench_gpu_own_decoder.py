"""A team's decoder on the GPU through the CLI and the defaults: build, time to ready on empty compile caches, speed.

    python benchmarks/bench_gpu_own_decoder.py --tokenizer DIR --out DIR      (scripts/gpu/run_h200.sh own-decoder)

A Qwen2.5-1.5B-*shaped* ``Qwen2ForCausalLM`` (hidden 1536, 28 layers, 12 heads, 2 KV heads, RANDOM bf16 weights; the
vocabulary of the tokenizer given, e.g. SmolLM2's) is saved with ``save_pretrained`` as a team would, then:

1. ``miaohui build-llm DIR --backend inductor --precision bf16`` (its own empty compile caches) — the build compiles
   every bucket and writes the portable compile cache into the version;
2. ``miaohui serve`` with NEW empty ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` and no ``generation.yaml``:
   seconds until ``/v2/health/ready``, and the server's log lines about the compile cache and the chosen defaults;
3. ``miaohui bench --target chat`` against it at 1 and 64 streams from 8 client processes (greedy, ignore-eos).

Writes ``gpu_own_decoder.json`` (+ the bench's JSON/PNG) under ``--out``. The weights are random: the figures are the
shape's speed, not a model's quality.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from miaohui.bench.report import git_commit

QWEN_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)


def save_model(folder: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN_15B, vocab_size=len(tok), eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    for name in ("chat_template.jinja",):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)


def build(src: Path, repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = cli("build-llm", str(src), "--name", "own", "--backend", "inductor", "--precision", "bf16")
    command += ["-r", str(repo)]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "miaohui.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json + tokenizer_config.json")
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/own-decoder"))
    ap.add_argument("--duration", default="15s")
    ap.add_argument("--variants", default="default,tuned", help="serves to measure: default, shared, tuned, tuned_int8")
    ap.add_argument("--ready-timeout", type=float, default=200.0)
    ap.add_argument("--no-bench", action="store_true", help="time to ready only")
    ap.add_argument("--processes", type=int, default=8, help="client processes of `miaohui bench --target chat`")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    src, repo = args.work / "hf", args.work / "repo"
    doc: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": QWEN_15B}
    doc["commit"] = git_commit() or "unknown"
    from miaohui.generation.build.compile_cache import machine_facts

    doc["machine"] = machine_facts()  # the GPU and the torch / CUDA / Triton versions
    t0 = time.perf_counter()
    save_model(src, args.tokenizer)
    doc["save_s"] = round(time.perf_counter() - t0, 1)

    env = dict(os.environ)
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(args.work / "c-build"), "TRITON_CACHE_DIR": str(args.work / "t-build")}
    t0 = time.perf_counter()
    built = build(src, repo, env)
    doc["build_s"] = round(time.perf_counter() - t0, 1)
    doc["build_rc"] = built.returncode
    doc["build_tail"] = (built.stdout + built.stderr)[-2500:]
    (args.out / "build.log").write_text(built.stdout + built.stderr)
    print(f"build-llm: rc {built.returncode} in {doc['build_s']} s", flush=True)
    cache = list(repo.glob("own/*/compile-cache.bin"))
    doc["compile_cache_bytes"] = cache[0].stat().st_size if cache else None
    meta = list(repo.glob("own/*/static_decoder.json"))
    doc["precompiled"] = json.loads(meta[0].read_text()).get("precompiled") if meta else None
    doc["compile_cache"] = json.loads(meta[0].read_text()).get("compile_cache") if meta else None
    (args.out / "gpu_own_decoder.json").write_text(json.dumps(doc, indent=1))  # what a cut-off run keeps

    doc["serves"] = {}
    for variant in args.variants.split(","):
        doc["serves"][variant] = serve_and_measure(variant, repo, args)
        (args.out / "gpu_own_decoder.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    serves = doc["serves"]
    if "default" in serves and "tuned" in serves:
        doc["default_vs_tuned"] = ratios(serves["default"], serves["tuned"])
    if "default" in serves and "tuned_int8" in serves:
        doc["default_vs_tuned_int8"] = ratios(serves["default"], serves["tuned_int8"])
    (args.out / "gpu_own_decoder.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    print(json.dumps({k: doc.get(k) for k in ("save_s", "build_s", "build_rc", "compile_cache_bytes")}))
    print(
        "precompiled:", json.dumps({k: (doc.get("precompiled") or {}).get(k) for k in ("graphs", "bytes", "skipped")})
    )
    print(json.dumps({v: {k: r.get(k) for k in ("ready_s", "start_phases")} for v, r in serves.items()}))
    print(json.dumps({k: doc.get(k) for k in ("default_vs_tuned", "default_vs_tuned_int8")}))


TUNED_YAML = """# the best configuration docs/gpu.md's H200 benchmark uses, int8 at batch 1 as the variant says
engine:
  num_slots: 64
  static_prefill: true
  int8_batch1: {int8}
scheduler:
  max_running_seqs: 64
  max_batched_tokens: 4096
  async_scheduling: true
"""


def serve_and_measure(variant: str, repo: Path, args: argparse.Namespace) -> dict:
    """``default``: no generation.yaml, one process; ``tuned``: docs/gpu.md's best configuration (generation.yaml
    above, ``--workers 2 --shared-engine``) without int8 at batch 1, which changes the numbers the model computes and
    which serve turns on only where the decoder gate passed on it (a random-weight model cannot pass it);
    ``tuned_int8``: the same with it. Each on new empty compile caches."""
    work = args.work / f"serve-{variant}"
    env = dict(os.environ)
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(work / "c"), "TRITON_CACHE_DIR": str(work / "t")}
    yaml_path = repo / "own" / "generation.yaml"
    yaml_path.unlink(missing_ok=True)
    extra: list[str] = []
    if variant in ("tuned", "tuned_int8"):
        yaml_path.write_text(TUNED_YAML.format(int8=str(variant == "tuned_int8").lower()))
    if variant in ("tuned", "tuned_int8", "shared"):  # shared: the defaults, served by the engine process of 2 workers
        extra = ["--workers", "2", "--shared-engine"]
    out: dict = {"variant": variant}
    log_path = args.out / f"serve_{variant}.log"
    log = log_path.open("w")
    t0 = time.perf_counter()
    server = subprocess.Popen(
        cli("serve", "-r", str(repo), "--port", "8077", "--grpc-port", "0", *extra), env=env, stdout=log, stderr=log
    )
    ready = None
    try:
        while time.perf_counter() - t0 < args.ready_timeout and server.poll() is None:
            try:
                if httpx.get("http://127.0.0.1:8077/v2/health/ready", timeout=2).status_code == 200:
                    ready = round(time.perf_counter() - t0, 1)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        out["ready_s"] = ready
        print(f"serve {variant}: ready after {ready} s", flush=True)
        if ready is not None:
            # one request at once (the graphs left for after ready are being captured), then the split once that is
            # done (engine_capture_after_ready), then the same request again
            out["request_at_ready"] = one_request()
            out["start_phases"] = capture_done(time.perf_counter() + 60)
            out["request_after_capture"] = one_request()
            print(f"serve {variant}: {json.dumps({k: out[k] for k in ('request_at_ready', 'start_phases')})}")
            if not args.no_bench:
                out |= chat_bench(variant, args)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        yaml_path.unlink(missing_ok=True)
    # a kernel that benchmarked its launch configs in the serve writes a .best_config (0 on an H200: none does)
    out["best_configs_in_serve_cache"] = len(list((work / "c").rglob("*.best_config")))
    lines = log_path.read_text(errors="replace").splitlines()
    keys = ("cache", "default", "ready", "graph", "rror", "compile", "capture")
    out["serve_log"] = [ln[-400:] for ln in lines if any(k in ln for k in keys)][-40:]
    return out


def one_request(tokens: int = 64) -> dict:
    """One greedy chat request of ``tokens`` new tokens: its seconds and tokens."""
    body = {"model": "own", "messages": [{"role": "user", "content": "Hello, who are you?"}], "max_tokens": tokens,
            "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    r = httpx.post("http://127.0.0.1:8077/v1/chat/completions", json=body, timeout=60)
    seconds = time.perf_counter() - t0
    got = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
    return {"status": r.status_code, "seconds": round(seconds, 3), "tokens": got}


def capture_done(deadline: float) -> dict[str, float]:
    """The server's start split once the graphs left for after ready are captured (or at ``deadline``)."""
    while True:
        phases = start_phases(httpx.get("http://127.0.0.1:8077/metrics", timeout=10).text)
        done = "engine_capture_after_ready" in phases or "engine_capture" not in phases  # not in this process
        if done or time.perf_counter() > deadline:
            return phases
        time.sleep(0.25)


def start_phases(metrics: str) -> dict[str, float]:
    """``miaohui_model_start_seconds{model="own",phase=...}`` from a /metrics text."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith("miaohui_model_start_seconds{") and 'model="own"' in line:
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            found[phase] = round(float(line.rsplit(" ", 1)[1]), 2)
    return found


def chat_bench(variant: str, args: argparse.Namespace) -> dict:
    name = f"gpu_own_decoder_chat_{variant}"
    bench = subprocess.run(
        cli(
            "bench", "--target", "chat", "--url", "http://127.0.0.1:8077", "--model", "own",
            "--concurrency", "1,64", "--max-tokens", "128", "--warmup", "3s", "--duration", args.duration,
            "--processes", str(args.processes),
            "--out", str(args.out / f"{name}.json"), "--plot", str(args.out / f"{name}.png"),
        ),
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    print(bench.stdout[-1500:], bench.stderr[-800:], flush=True)
    got: dict = {"bench_rc": bench.returncode}
    path = args.out / f"{name}.json"
    if path.is_file():
        got["chat"] = json.loads(path.read_text())
    return got


def _level(result: dict, streams: int) -> dict | None:
    for point in (result.get("chat") or {}).get("points", []):
        if point.get("concurrency") == streams:
            return point["chat"]
    return None


def ratios(default: dict, tuned: dict) -> dict:
    """Default / tuned: aggregate output tokens/s at 64 streams (goal >= 0.9) and the single stream's inter-token time
    p50 (goal <= 1.1)."""
    d64, t64, d1, t1 = _level(default, 64), _level(tuned, 64), _level(default, 1), _level(tuned, 1)
    out: dict = {}
    if d64 and t64:
        out["tokens_per_s_64"] = [d64["output_tokens_per_s"], t64["output_tokens_per_s"]]
    if d1 and t1:
        out["itl_p50_ms_1"] = [d1["inter_token_ms"]["p50"], t1["inter_token_ms"]["p50"]]
    for key, (a, b) in list(out.items()):
        if a and b:
            out[f"{key}_ratio"] = round(a / b, 3)
    return out


if __name__ == "__main__":
    main()
