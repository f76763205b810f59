"""Cold start of the intent engine through ``torch.compile(...).aot_compile`` (torch's Python-side ahead-of-time
compile: traced, compiled and saved at build; loaded without Dynamo re-tracing and without AOTInductor's C++
loader, which segfaults on the H200 image). The question for issue 4's cold-start goal (< 1 s): on this CPU
(torch 2.13, real e5 intent model, fp32, session 9, helper study) it cut load + first calls from 6.3 s (the
exported-program format) to 2.3 s, 0.71 s for the AOTInductor package; never run on a GPU.

Build here (the module the engine builds: checkpoint → FastBert → ``FloatLogits``; example 8×32, so batch ≥ 2 and
sequence ≥ 2 are dynamic: a batch of 1 gets a padding row), save ``fn.pt`` + the weights, then time ``--runs``
fresh processes that load them and run 1×16, 8×32, 8×32, 3×20 (same Inductor/Triton caches), and one more with
empty caches (a new machine: are the Triton kernels inside the artifact?). Outputs are compared with eager.

    python3 lab/diagnostics/diag_aot_compile.py var/models/intent-e5-shape --out DIR [--device cuda --precision fp16]
    python3 lab/diagnostics/diag_aot_compile.py var/models/intent-e5-shape --device cpu --precision fp32 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = (("first_1x16_s", 1, 16), ("then_8x32_s", 8, 32), ("again_8x32_s", 8, 32), ("new_3x20_s", 3, 20))


def _model(model_dir: Path, device: str, precision: str) -> Any:
    from miaohui.engines.inductor import DTYPES, FloatLogits
    from miaohui.models.checkpoint import load_checkpoint
    from miaohui.models.fast_bert import from_module

    ckpt = load_checkpoint(model_dir, attn_implementation="sdpa")
    model = FloatLogits(from_module(ckpt.module)).to(device=device, dtype=DTYPES[precision]).eval()
    model.requires_grad_(False)
    return model, ckpt


def build(args: argparse.Namespace, art: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    torch._dynamo.config.specialize_float = True  # else TensorifyScalarRestartAnalysis escapes aot_compile
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True  # off by default in torch 2.11
    model, ckpt = _model(args.model, args.device, args.precision)
    c = ckpt.meta.bert_config
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "type_vocab_size", "layer_norm_eps")  # fmt: skip
    cfg = {k: c[k] for k in keys} | {"num_labels": len(ckpt.meta.labels)}
    (art / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(art / "weights.safetensors"))
    ids = torch.randint(5, 1000, (8, 32), device=args.device)
    mask = torch.ones_like(ids)
    started = time.perf_counter()
    with torch.no_grad():
        fn = torch.compile(model, fullgraph=True, dynamic=True).forward.aot_compile(((ids, mask), {}))
    compile_s = time.perf_counter() - started
    fn.save_compiled_function(str(art / "fn.pt"))
    with torch.no_grad():
        diff = float((fn(model, ids, mask) - model(ids, mask)).abs().max())
    return {"aot_compile_s": round(compile_s, 2), "bytes": (art / "fn.pt").stat().st_size, "self_check": diff}


def child(args: argparse.Namespace, art: Path) -> dict[str, Any]:
    """In a fresh process: rebuild the module on the meta device, load the weights and ``fn.pt``, time calls."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    from miaohui.engines.inductor import DTYPES, FloatLogits
    from miaohui.models.fast_bert import FastBert, FastIntentClassifier

    t1 = time.perf_counter()
    cfg = json.loads((art / "config.json").read_text())
    with torch.device("meta"):
        enc = FastBert(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                       cfg["intermediate_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"],
                       cfg["layer_norm_eps"])  # fmt: skip
        model = FloatLogits(FastIntentClassifier(enc, cfg["num_labels"]))
    model.load_state_dict(load_file(str(art / "weights.safetensors"), device=args.device), assign=True)
    model.eval().requires_grad_(False)
    model.to(dtype=DTYPES[args.precision])
    t2 = time.perf_counter()
    with open(art / "fn.pt", "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    t3 = time.perf_counter()
    traced = counters["stats"]["unique_graphs"]

    def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] == 1:  # the artifact's guards say 2 <= batch: a padding row
            return fn(model, ids.repeat(2, 1), mask.repeat(2, 1))[:1]
        return fn(model, ids, mask)

    res: dict[str, Any] = {"import_torch_s": t_torch - t0, "import_code_s": t1 - t_torch, "weights_s": t2 - t1}
    res["load_fn_s"] = t3 - t2
    diffs = []
    with torch.no_grad():
        for i, (key, b, s) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(5, 1000, (b, s), generator=g).to(args.device)
            mask = torch.ones_like(ids)
            mask[0, s // 2 :] = 0
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = run(ids, mask)
            if args.device == "cuda":
                torch.cuda.synchronize()
            res[key] = time.perf_counter() - t
            diffs.append(float((out.float() - model(ids, mask).float()).abs().max()))
    res["cold_start_s"] = res["weights_s"] + res["load_fn_s"] + res["first_1x16_s"] + res["then_8x32_s"]
    res["dynamo_graphs_traced"] = counters["stats"]["unique_graphs"] - traced
    res["max_abs_diff_vs_eager"] = max(diffs)
    return res


def _spawn(args: argparse.Namespace, art: Path, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, str(args.model), "--child", str(art), "--device", args.device,
           "--precision", args.precision]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    return {"error": (proc.stderr or proc.stdout)[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args, args.child)))
        return
    import torch

    art = Path(tempfile.mkdtemp(prefix="aotc-"))
    report: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "precision": args.precision}
    try:
        report["build"] = build(args, art)
    except Exception as exc:  # the answer may be "not on this torch": say so
        report["build"] = {"error": repr(exc)[:1500]}
    if "error" not in report["build"]:
        env = dict(os.environ)
        report["warm"] = [_spawn(args, art, env) for _ in range(args.runs)]
        empty = Path(tempfile.mkdtemp(prefix="aotc-cache-"))
        cold = env | {"TORCHINDUCTOR_CACHE_DIR": str(empty / "inductor"), "TRITON_CACHE_DIR": str(empty / "triton")}
        report["empty_caches"] = _spawn(args, art, cold)
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"diag_aot_compile_{args.device}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
