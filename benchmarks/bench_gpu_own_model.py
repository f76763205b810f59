"""A team's own encoder on the GPU, through the CLI and the defaults: build from a Hugging Face directory, serve on a
"fresh machine" (new empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``), time to ready, then the engine's
speed against transformers eager and ``torch.compile(mode="reduce-overhead")`` on the same weights, in one run.

The model: a BERT-base-shaped ``BertForSequenceClassification`` (12 × 768, RANDOM weights: the shape is what matters
for speed), the project's 24 intents as its labels, a WordPiece vocabulary of the intent data's words and characters,
saved with ``save_pretrained`` as a team would hand it over. Steps, each timed:

1. ``miaohui build DIR --backend inductor --precision fp16`` (nothing else: the defaults), fresh compile caches;
2. ``miaohui serve`` in a new process with new empty compile caches: seconds from the process start to
   ``/v2/health/ready``, and the server's own split (``miaohui_model_start_seconds{phase}``);
3. ``miaohui validate`` (the accuracy gate against the HF model in fp32 on the project's 606 dev texts), plus top-1
   agreement and the largest softmax difference computed here;
4. CUDA-event medians of a graph replay (inputs on the GPU, as ``trtexec``'s GPU compute time) at 1×16, 1×128 and
   32×128, against HF eager fp16 and HF ``torch.compile(mode="reduce-overhead")`` fp16 (its own CUDA graphs).

    python benchmarks/bench_gpu_own_model.py --out benchmarks/results   (scripts/gpu/run_h200.sh own-model)

Writes ``gpu_own_encoder_<gpu>.json`` and ``.png`` (``h200``, ``h100``: the GPU's model number) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miaohui.bench.report import git_commit

SHAPES = ((1, 16), (1, 128), (32, 128))


def make_source(out: Path) -> tuple[Path, Path]:
    """The HF directory and a dev JSONL (the project's dev split)."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from miaohui.zoo.intents import load_split

    train, dev = load_split("train"), load_split("dev")
    labels = sorted({e.intent for e in train + dev})
    norm, pre = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = sorted({w for e in train + dev for w, _ in pre.pre_tokenize_str(norm.normalize_str(e.text))})
    torch.manual_seed(0)
    config = BertConfig(num_labels=len(labels), id2label=dict(enumerate(labels)),
                        label2id={v: k for k, v in enumerate(labels)})  # fmt: skip
    src = out / "bert-base-intent"
    BertForSequenceClassification(config).eval().save_pretrained(src)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(tokens)})
    if len(tok) != len(tokens):  # a transformers that reads only a vocabulary file
        (src / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
        tok = BertTokenizerFast(vocab_file=str(src / "vocab.txt"))
    tok.save_pretrained(src)
    dev_file = out / "dev.jsonl"
    dev_file.write_text("".join(json.dumps({"text": e.text, "intent": e.intent}, ensure_ascii=False) + "\n"
                                for e in dev), encoding="utf-8")  # fmt: skip
    return src, dev_file


def fresh_env(root: Path, tag: str) -> dict[str, str]:
    """This process's environment with new empty compile caches (a machine that never compiled anything)."""
    caches = {k: root / f"{tag}-{k.lower()}" for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    for p in caches.values():
        p.mkdir(parents=True)
    return {**os.environ, **{k: str(v) for k, v in caches.items()}}


def cli(args: list[str], env: dict[str, str], log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "miaohui.cli", *args], env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"miaohui {args[0]} failed: {log.read_text()[-3000:]}")
    return time.perf_counter() - started


def serve_ready(repo: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    """Start ``miaohui serve``; seconds until ready, the server's phases from /metrics, one /v1/intent answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port),
                                 "--grpc-port", "0"], env=env, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + log.read_text()[-3000:])
            if time.perf_counter() - started > 300:
                raise RuntimeError("server not ready in 300 s: " + log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready_s = time.perf_counter() - started
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            text = r.read().decode()
        phases = {
            m[1]: float(m[2])
            for m in re.finditer(
                r'miaohui_model_start_seconds\{model="support",phase="([^"]+)",version="\d+"\}\s+(\S+)|'
                r'miaohui_model_start_seconds\{model="support",version="\d+",phase="([^"]+)"\}\s+(\S+)',
                text,
            )
            if m[1]
        }
        if not phases:
            phases = {m[1]: float(m[2]) for m in re.finditer(r'miaohui_model_start_seconds\{[^}]*phase="([^"]+)"[^}]*\}'
                                                             r"\s+(\S+)", text)}  # fmt: skip
        body = json.dumps({"model": "support", "texts": ["我想买基金"], "slots": False}).encode()
        req = urllib.request.Request(f"{base}/v1/intent", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        rest = None  # a fast-graphs version captures its remaining buckets after ready
        while rest is None and time.perf_counter() - started < ready_s + 60:
            rest = next((ln for ln in log.read_text().splitlines() if "CUDA graph captured" in ln), None)
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = log.read_text().splitlines()
    ready_line = [ln for ln in lines if " ready: load " in ln][-1:]
    return {"ready_s": round(ready_s, 3), "phases": phases, "log": ready_line, "answer": answer,
            "capture_after_ready": rest, "log_head": lines[:25]}  # fmt: skip


def process_start() -> dict[str, float]:
    """Seconds a new Python process takes to import miaohui's CLI, and torch with CUDA initialised: the part of a
    start that comes before the model."""
    took = {}
    for name, code in (
        ("import_cli_s", "import miaohui.cli"),
        ("import_torch_cuda_init_s", "import torch; torch.cuda.init(); torch.zeros(1, device='cuda')"),
    ):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        took[name] = round(time.perf_counter() - started, 3)
    return took


def time_calls(call: Any, iters: int) -> tuple[float, float]:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times)), float(np.percentile(times, 99))


def speed(version: Path, src: Path, iters: int) -> dict[str, dict[str, list[float]]]:
    """ms (median, p99) per shape: the engine's graph replay, HF eager fp16, HF torch.compile reduce-overhead."""
    from transformers import AutoModelForSequenceClassification

    from miaohui.engines.inductor_engine import InductorEngine
    from miaohui.engines.loader import load_engine

    engine = load_engine(version, graph_copies=False)
    assert isinstance(engine, InductorEngine)
    hf16 = AutoModelForSequenceClassification.from_pretrained(str(src), attn_implementation="sdpa")
    hf16 = hf16.to("cuda", torch.float16).eval()
    compiled = torch.compile(lambda i, a: hf16(input_ids=i, attention_mask=a).logits, mode="reduce-overhead")
    rows: dict[str, dict[str, list[float]]] = {"engine": {}, "hf_eager_fp16": {}, "hf_compile_reduce_overhead": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, s in SHAPES:
        key = f"{b}x{s}"
        ids = torch.randint(1000, 20000 if hf16.config.vocab_size > 20000 else hf16.config.vocab_size, (b, s),
                            device="cuda", generator=gen)  # fmt: skip
        ids.clamp_(max=hf16.config.vocab_size - 1)
        mask = torch.ones_like(ids)
        engine.capture(*engine.bucket(b, s))
        k = engine._graphs[engine.bucket(b, s)]
        k.io[0].copy_(ids)
        k.io[1].copy_(mask)
        rows["engine"][key] = list(time_calls(k.graph.replay, iters))
        with torch.no_grad():
            rows["hf_eager_fp16"][key] = list(time_calls(lambda i=ids, a=mask: hf16(input_ids=i, attention_mask=a),
                                                         max(30, iters // 10)))  # fmt: skip
            for _ in range(5):
                compiled(ids, mask)
            rows["hf_compile_reduce_overhead"][key] = list(time_calls(lambda i=ids, a=mask: compiled(i, a), iters))
        print(" ".join(f"{n} {key}: {v[key][0]:.4f} ms" for n, v in rows.items()), flush=True)
    return rows


def agreement(version: Path, src: Path, dev: Path) -> dict[str, float]:
    """Top-1 agreement and the largest softmax difference, engine (fp16) vs the HF model in fp32, on the dev texts."""
    from transformers import AutoModelForSequenceClassification

    from miaohui.engines.loader import load_engine
    from miaohui.nlp.tokenizer import TextTokenizer

    texts = [json.loads(line)["text"] for line in dev.read_text(encoding="utf-8").splitlines()]
    tok = TextTokenizer.from_file(version / "tokenizer.json", 128)
    engine = load_engine(version)
    hf = AutoModelForSequenceClassification.from_pretrained(str(src), attn_implementation="sdpa").to("cuda").eval()
    top1, worst = [], 0.0
    for i in range(0, len(texts), 32):
        ids, mask = tok.encode(texts[i : i + 32])
        got = torch.from_numpy(engine.infer({"input_ids": ids, "attention_mask": mask})["logits"]).softmax(-1)
        with torch.no_grad():
            want = hf(input_ids=torch.from_numpy(ids).cuda(), attention_mask=torch.from_numpy(mask).cuda()).logits
        want = want.float().cpu().softmax(-1)
        top1.append((got.argmax(-1) == want.argmax(-1)).float())
        worst = max(worst, float((got - want).abs().max()))
    return {"texts": len(texts), "top1_agreement": float(torch.cat(top1).mean()), "max_softmax_diff": worst}


def gpu_tag(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the model number of a GPU's name (the whole name, lowercased, otherwise)."""
    found = re.search(r"\b([A-Z]+\d{2,4})\b", name)
    return (found[1] if found else re.sub(r"\W+", "-", name)).lower()


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["ms"])
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [result["ms"][name][f"{b}x{s}"][0] for b, s in SHAPES]
        ax.bar([i + j * width for i in range(len(SHAPES))], vals, width, label=name)
    ax.set_xticks([i + width for i in range(len(SHAPES))], [f"{b}×{s}" for b, s in SHAPES])
    ax.set_ylabel("ms (median, CUDA events)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("HF BERT-base classifier, fp16, H200")
    phases = result["serve"]["phases"]
    bx.barh(list(phases), list(phases.values()))
    bx.set_xlabel("seconds")
    bx.set_title(f"serve on a fresh machine: ready after {result['serve']['ready_s']:.2f} s")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--work", default=None, help="working folder (default: a new temporary one)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="own-model-"))
    work.mkdir(parents=True, exist_ok=True)
    src, dev = make_source(work)
    repo = work / "repo"
    build_s = cli(["build", str(src), "--name", "support", "-r", str(repo), "--backend", "inductor",
                   "--precision", "fp16"], fresh_env(work, "build"), work / "build.log")  # fmt: skip
    print(f"build: {build_s:.1f}s", flush=True)
    version = repo / "support" / "1"
    manifest = json.loads((version / "manifest.json").read_text())
    serve = [serve_ready(repo, fresh_env(work, f"serve{i}"), work / f"serve{i}.log") for i in range(2)]
    started_process = process_start()
    print(f"process start: {started_process}", flush=True)
    print(f"serve ready (fresh caches): {[s['ready_s'] for s in serve]} s; {serve[-1]['phases']}", flush=True)
    validate_log = work / "validate.log"
    cli(["validate", "support", "-r", str(repo), "--data", str(dev), "--json", str(work / "validate.json"),
         "--max-drop", "100", "--min-agreement", "0.99"], os.environ.copy(), validate_log)  # fmt: skip
    gate = json.loads((work / "validate.json").read_text())["report"]
    agree = agreement(version, src, dev)
    print(f"gate: passed={gate.get('passed')} agreement={agree}", flush=True)
    ms = speed(version, src, args.iters)
    ratios = {key: {"vs_compile": ms["hf_compile_reduce_overhead"][key][0] / ms["engine"][key][0],
                    "vs_eager": ms["hf_eager_fp16"][key][0] / ms["engine"][key][0]}
              for key in ms["engine"]}  # fmt: skip
    commit = git_commit() or "unknown"
    import transformers
    import triton

    result = {
        "what": "a team's HF BertForSequenceClassification (BERT-base shape, random weights, 24 labels) through "
        "`miaohui build --backend inductor --precision fp16` defaults and `miaohui serve` with empty compile caches",
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "command": "python benchmarks/bench_gpu_own_model.py " + " ".join(sys.argv[1:]),
        "build_s": round(build_s, 1),
        "format": manifest["extra"].get("format"),
        "gpu_kernels": manifest["extra"].get("gpu_kernels", {}).get("mode"),
        "serve": serve[-1],
        "process_start": started_process,
        "serve_runs_ready_s": [s["ready_s"] for s in serve],
        "gate": {k: gate.get(k) for k in ("passed", "agreement", "max_logit_error", "accuracy", "failures")},
        "agreement_vs_hf_fp32": agree,
        "ms": ms,
        "ratios": ratios,
    }
    name = f"gpu_own_encoder_{gpu_tag(result['gpu'])}"  # the GPU in the name: H100 and H200 runs sit side by side
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    plot(result, out / f"{name}.png")
    print(f"\nbuild {build_s:.1f}s ({result['format']}, kernels {result['gpu_kernels']}); serve ready "
          f"{result['serve_runs_ready_s']} s, phases {serve[-1]['phases']}")  # fmt: skip
    print(
        f"top-1 agreement {agree['top1_agreement']:.4f} on {agree['texts']} dev texts, "
        f"max softmax diff {agree['max_softmax_diff']:.2e}; gate passed {gate.get('passed')}"
    )
    print(f"{'shape':8s} {'engine':>9s} {'hf compile':>11s} {'hf eager':>9s} {'×compile':>9s} {'×eager':>8s}")
    for key in ms["engine"]:
        print(
            f"{key:8s} {ms['engine'][key][0]:9.4f} {ms['hf_compile_reduce_overhead'][key][0]:11.4f} "
            f"{ms['hf_eager_fp16'][key][0]:9.4f} {ratios[key]['vs_compile']:9.2f} {ratios[key]['vs_eager']:8.1f}"
        )


if __name__ == "__main__":
    main()
