"""A team's decoder on the GPU through the CLI and the defaults: build, time to ready on empty compile caches, speed.

    python benchmarks/bench_gpu_own_decoder.py --tokenizer DIR --out DIR      (scripts/gpu/run_h200.sh own-decoder)

A Qwen2.5-1.5B-*shaped* ``Qwen2ForCausalLM`` (hidden 1536, 28 layers, 12 heads, 2 KV heads, RANDOM bf16 weights; the
vocabulary of the tokenizer given, e.g. SmolLM2's) is saved with ``save_pretrained`` as a team would, then:

1. ``miaohui build-llm DIR --backend inductor --precision bf16`` (its own empty compile caches) — the build compiles
   every bucket and writes the portable compile cache into the version;
2. ``miaohui serve`` with NEW empty ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` and no ``generation.yaml``:
   seconds until ``/v2/health/ready``, and the server's log lines about the compile cache and the chosen defaults;
3. ``miaohui bench --target chat`` against it at 1 and 64 streams from 4 client processes (greedy, ignore-eos).

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


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "miaohui.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json + tokenizer_config.json")
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/own-decoder"))
    ap.add_argument("--duration", default="15s")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    src, repo = args.work / "hf", args.work / "repo"
    doc: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": QWEN_15B}
    t0 = time.perf_counter()
    save_model(src, args.tokenizer)
    doc["save_s"] = round(time.perf_counter() - t0, 1)

    env = dict(os.environ)
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(args.work / "c-build"), "TRITON_CACHE_DIR": str(args.work / "t-build")}
    t0 = time.perf_counter()
    built = subprocess.run(
        cli("build-llm", str(src), "--name", "own", "--backend", "inductor", "--precision", "bf16", "-r", str(repo)),
        env=env,
        capture_output=True,
        text=True,
    )
    doc["build_s"] = round(time.perf_counter() - t0, 1)
    doc["build_rc"] = built.returncode
    doc["build_tail"] = (built.stdout + built.stderr)[-2500:]
    print(f"build-llm: rc {built.returncode} in {doc['build_s']} s", flush=True)
    cache = list(repo.glob("own/*/compile-cache.bin"))
    doc["compile_cache_bytes"] = cache[0].stat().st_size if cache else None
    (args.out / "gpu_own_decoder.json").write_text(json.dumps(doc, indent=1))  # what a cut-off run keeps

    env = dict(os.environ)
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(args.work / "c-serve"), "TRITON_CACHE_DIR": str(args.work / "t-serve")}
    log = (args.out / "serve.log").open("w")
    t0 = time.perf_counter()
    server = subprocess.Popen(
        cli("serve", "-r", str(repo), "--port", "8077", "--grpc-port", "0"), env=env, stdout=log, stderr=log
    )
    ready = None
    try:
        while time.perf_counter() - t0 < 200 and server.poll() is None:
            try:
                if httpx.get("http://127.0.0.1:8077/v2/health/ready", timeout=2).status_code == 200:
                    ready = round(time.perf_counter() - t0, 1)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        doc["ready_s"] = ready
        print(f"serve: ready after {ready} s", flush=True)
        if ready is not None:
            bench = subprocess.run(
                cli(
                    "bench",
                    "--target",
                    "chat",
                    "--url",
                    "http://127.0.0.1:8077",
                    "--model",
                    "own",
                    "--concurrency",
                    "1,64",
                    "--max-tokens",
                    "128",
                    "--warmup",
                    "3s",
                    "--duration",
                    args.duration,
                    "--processes",
                    "4",
                    "--out",
                    str(args.out / "gpu_own_decoder_chat.json"),
                    "--plot",
                    str(args.out / "gpu_own_decoder_chat.png"),
                ),
                capture_output=True,
                text=True,
                timeout=150,
            )
            doc["bench_rc"] = bench.returncode
            doc["bench_tail"] = (bench.stdout + bench.stderr)[-3000:]
            print(doc["bench_tail"], flush=True)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    lines = (args.out / "serve.log").read_text(errors="replace").splitlines()
    doc["serve_log"] = [ln for ln in lines if any(k in ln for k in ("cache", "default", "ready", "graph", "rror"))][
        -40:
    ]
    (args.out / "gpu_own_decoder.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    print(json.dumps({k: doc.get(k) for k in ("save_s", "build_s", "build_rc", "compile_cache_bytes", "ready_s")}))


if __name__ == "__main__":
    main()
