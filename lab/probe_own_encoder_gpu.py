"""Probe (H200): a team's HF BERT-base-shaped classifier through miaohui's fast encoder, eager in CUDA graphs or
compiled, against transformers eager and torch.compile(reduce-overhead); Triton's compile at a fresh process with an
empty and a carried cache; the AOTInductor package load crash, loaded both ways.

    python lab/probe_own_encoder_gpu.py [--skip-aoti] [--out DIR]

Prints one line per measurement (median ms over CUDA-event-timed graph replays) and writes probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = ((1, 16), (1, 128), (32, 128))


def hf_bert(layers: int = 12, hidden: int = 768, heads: int = 12, labels: int = 24) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, num_labels=labels)  # fmt: skip
    return BertForSequenceClassification(cfg).eval()


def time_graph(fn: Any, ids: torch.Tensor, mask: torch.Tensor, iters: int = 200) -> float:
    """Median ms of a CUDA-graph replay of fn(ids, mask)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            fn(ids, mask)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        fn(ids, mask)
    return time_calls(g.replay, iters)


def time_calls(call: Any, iters: int = 200) -> float:
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
    times.sort()
    return times[len(times) // 2]


def inputs(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1000, 29000, (b, s), device="cuda")
    mask = torch.ones_like(ids)
    if b > 1:
        mask[1, s // 2 :] = 0
    return ids, mask


def fast_model(hf: Any, kernels: str) -> Any:
    from miaohui.engines.inductor import FloatLogits, use_gpu_kernels
    from miaohui.models.fast_bert import use_fused_gelu
    from miaohui.models.fast_hf import fast_from_hf
    from miaohui.sources.hf_encoder import HFClassifier

    fast = fast_from_hf(HFClassifier(hf))
    use_fused_gelu(fast, True)
    info = use_gpu_kernels(fast, kernels, "fp16")
    return FloatLogits(fast).to("cuda", torch.float16).eval(), info


CHILD = r"""
import sys, time, torch
t0 = time.perf_counter()
from miaohui.models.fast_bert import load_fast
from miaohui.engines.inductor import FloatLogits, use_gpu_kernels
m = FloatLogits(load_fast(sys.argv[1], "cuda")).eval()
info = use_gpu_kernels(m, "tuned", "fp16")
t1 = time.perf_counter()
with torch.no_grad():
    for b, s in ((1, 16), (1, 128), (32, 128), (8, 64)):
        ids = torch.randint(1000, 2000, (b, s), device="cuda"); m(ids, torch.ones_like(ids))
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"CHILD load {t1-t0:.2f}s first-calls {t2-t1:.2f}s {info.get('mode')}")
"""


def fresh_triton(out: Path, hf: Any) -> dict[str, Any]:
    """Run the tuned fast model's first calls in fresh processes: empty caches, then a copy of the first's cache."""
    from miaohui.models.fast_bert import save_fast
    from miaohui.models.fast_hf import fast_from_hf
    from miaohui.sources.hf_encoder import HFClassifier

    d = Path(tempfile.mkdtemp())
    fast = fast_from_hf(HFClassifier(hf)).half()
    from miaohui.models.fast_bert import use_fused_gelu

    use_fused_gelu(fast, True)
    save_fast(fast, d)
    res = {}
    first = Path(tempfile.mkdtemp())
    for name in ("empty", "carried"):
        tri, ind = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
        if name == "carried":
            shutil.copytree(first, tri, dirs_exist_ok=True)
        env = {**os.environ, "TRITON_CACHE_DIR": str(tri), "TORCHINDUCTOR_CACHE_DIR": str(ind)}
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", CHILD, str(d)], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        line = [x for x in p.stdout.splitlines() if x.startswith("CHILD")]
        print(f"fresh process, {name} triton cache: wall {wall:.2f}s {line} rc={p.returncode} {p.stderr[-300:]}")
        res[name] = {"wall_s": wall, "child": line, "files": sum(1 for _ in tri.rglob("*") if _.is_file())}
        if name == "empty":
            shutil.copytree(tri, first, dirs_exist_ok=True)
    return res


AOTI_CHILD = r"""
import sys, torch, faulthandler
faulthandler.enable()
pkg, how = sys.argv[1], sys.argv[2]
ids = torch.randint(5, 900, (2, 16), device="cuda"); mask = torch.ones_like(ids)
if how == "direct":
    from miaohui.engines.inductor import load_package
    run = load_package(__import__("pathlib").Path(pkg), single_threaded=True)
    out = run(ids, mask)
elif how == "direct-mt":
    from miaohui.engines.inductor import load_package
    run = load_package(__import__("pathlib").Path(pkg), single_threaded=False)
    out = run(ids, mask)
else:
    from torch._inductor import aoti_load_package
    m = aoti_load_package(pkg, run_single_threaded=(how == "torch-st"))
    out = m(ids, mask)
torch.cuda.synchronize()
print("AOTI OK", how, tuple(out.shape), float(out.float().abs().sum()))
"""


def aoti_probe(hf_small: Any) -> dict[str, Any]:
    from torch._inductor import aoti_compile_and_package

    from miaohui.engines.inductor import FloatLogits
    from miaohui.sources.hf_encoder import HFClassifier

    model = FloatLogits(HFClassifier(hf_small)).to("cuda", torch.float16).eval()
    ids = torch.randint(5, 900, (2, 16), device="cuda")
    dim_b, dim_s = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("sequence", min=1, max=128)
    res: dict[str, Any] = {}
    with torch.no_grad():
        ep = torch.export.export(model, (ids, torch.ones_like(ids)), dynamic_shapes=({0: dim_b, 1: dim_s},) * 2)
        pkg = Path(tempfile.mkdtemp()) / "model.pt2"
        t = time.perf_counter()
        aoti_compile_and_package(ep, package_path=str(pkg))
        res["compile_s"] = time.perf_counter() - t
    for how in ("direct", "direct-mt", "torch-st", "torch"):
        p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", AOTI_CHILD, str(pkg), how],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        tail = (p.stdout + p.stderr).strip().splitlines()[-12:]
        print(f"AOTI load {how}: rc={p.returncode}\n  " + "\n  ".join(tail))
        res[how] = {"rc": p.returncode, "tail": tail}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-aoti", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    hf = hf_bert()
    hf32 = hf.to("cuda")
    # correctness: fast tuned fp16 vs HF fp32, softmax
    tuned, info = fast_model(hf32, "tuned")
    print("tuned kernels:", info)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1000, 29000, (64, 48), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[::3, 20:] = 0
    with torch.no_grad():
        ref = hf32(input_ids=ids, attention_mask=mask).logits.float().softmax(-1)
        got = tuned(ids, mask).float().softmax(-1)
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"tuned fp16 vs HF fp32: top1 agreement {agree:.4f} max softmax diff {(ref - got).abs().max():.2e}")
    result["agreement"] = {"top1": agree, "max_softmax_diff": float((ref - got).abs().max())}
    library, _ = fast_model(hf32, "library")
    hf16 = hf_bert().to("cuda", torch.float16)

    def hf_call(m: Any) -> Any:
        return lambda i, a: m(input_ids=i, attention_mask=a).logits

    rows: dict[str, dict[str, float]] = {}
    variants: dict[str, Any] = {"hf_eager_fp16": hf_call(hf16), "fast_tuned_eager_graph": tuned,
                                "fast_library_eager_graph": library}  # fmt: skip
    for name, fn in variants.items():
        rows[name] = {}
        for b, s in SHAPES:
            i, a = inputs(b, s)
            if name == "hf_eager_fp16":
                with torch.no_grad():
                    rows[name][f"{b}x{s}"] = time_calls(lambda i=i, a=a, fn=fn: fn(i, a), 50)
            else:
                rows[name][f"{b}x{s}"] = time_graph(fn, i, a)
            print(f"{name:28s} {b}x{s}: {rows[name][f'{b}x{s}']:.4f} ms", flush=True)
    if not args.skip_compile:
        t = time.perf_counter()
        ro = torch.compile(hf_call(hf16), mode="reduce-overhead")
        rows["hf_compile_reduce_overhead"] = {}
        for b, s in SHAPES:
            i, a = inputs(b, s)
            with torch.no_grad():
                for _ in range(5):
                    ro(i, a)
                rows["hf_compile_reduce_overhead"][f"{b}x{s}"] = time_calls(lambda i=i, a=a: ro(i, a), 100)
            print(f"hf_compile_reduce_overhead   {b}x{s}: {rows['hf_compile_reduce_overhead'][f'{b}x{s}']:.4f} ms "
                  f"(+{time.perf_counter() - t:.0f}s)", flush=True)  # fmt: skip
        from miaohui.engines.inductor import compile_program

        t = time.perf_counter()
        comp = compile_program(tuned, False, pdl=True)
        rows["fast_tuned_compiled_graph"] = {}
        for b, s in SHAPES:
            i, a = inputs(b, s)
            rows["fast_tuned_compiled_graph"][f"{b}x{s}"] = time_graph(comp, i, a)
            print(f"fast_tuned_compiled_graph    {b}x{s}: {rows['fast_tuned_compiled_graph'][f'{b}x{s}']:.4f} ms "
                  f"(+{time.perf_counter() - t:.0f}s)", flush=True)  # fmt: skip
    result["ms"] = rows
    result["fresh_triton"] = fresh_triton(out, hf_bert())
    if not args.skip_aoti:
        result["aoti"] = aoti_probe(hf_bert(layers=2, hidden=128, heads=2).to("cuda"))
    (out / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
