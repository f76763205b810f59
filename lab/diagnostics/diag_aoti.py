"""On the GPU: where does a CUDA AOTInductor package crash on load (session 2 and 6: signal 11 in the build's probe)?

Builds small AOTInductor packages (a Linear/LayerNorm model with a float input; the tiny intent model with static
shapes; the tiny intent model with the dynamic batch/sequence dims ``miaohui build`` uses), then loads and runs each
in a fresh child process with three loaders (torch's C++ loader single- and multi-threaded, torch's Python
``aoti_load_package``). Each child prints a marker before and after load and run, with ``faulthandler`` on, under
gdb when the machine has it (a native backtrace). Results → ``$OUT/diag_aoti.json`` after every child.

    python3 lab/diagnostics/diag_aoti.py "$OUT"
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHILD = r"""
import faulthandler, sys, time
faulthandler.enable()
import torch
path, loader, kind, dev = sys.argv[1:5]
print("import ok", flush=True)
t = time.perf_counter()
if loader == "py":
    from torch._inductor import aoti_load_package
    run = aoti_load_package(path)
    call = lambda xs: run(*xs)
else:
    cls = torch._C._aoti.AOTIModelPackageLoader
    ld = cls(path, "model", loader == "cpp_st", 1, -1)
    call = lambda xs: ld.boxed_run(list(xs))
print(f"loaded {time.perf_counter() - t:.3f}s", flush=True)
if kind == "float":
    xs = (torch.randn(4, 64, device=dev),)
else:
    ids = torch.randint(5, 1000, (2, 16), device=dev); xs = (ids, torch.ones_like(ids))
out = call(xs)
torch.cuda.synchronize() if dev == "cuda" else None
print("ran", out[0].shape if isinstance(out, (list, tuple)) else out.shape, flush=True)
"""


class _Float(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.norm(self.lin(x)))


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
    out_dir.mkdir(parents=True, exist_ok=True)
    from miaohui.engines.inductor import FloatLogits
    from miaohui.models.checkpoint import load_checkpoint
    from miaohui.models.fast_bert import from_module
    from miaohui.models.tiny import save_tiny_intent

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a check of this script on a machine without a GPU
    gdb = shutil.which("gdb")
    results: dict[str, object] = {"gdb": gdb, "torch": torch.__version__}
    tmp = Path(tempfile.mkdtemp(prefix="diag-aoti-"))
    tiny = save_tiny_intent(tmp / "tiny")
    dtype = torch.float16 if dev == "cuda" else torch.float32
    intent = FloatLogits(from_module(load_checkpoint(tiny, attn_implementation="sdpa").module)).to(dev, dtype).eval()
    ids = torch.randint(5, 1000, (2, 16), device=dev)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=1, max=64)
    models = {
        "float_static": (_Float().to(dev).eval(), (torch.randn(4, 64, device=dev),), None, "float"),
        "intent_static": (intent, (ids, torch.ones_like(ids)), None, "ids"),
        "intent_dynamic": (intent, (ids, torch.ones_like(ids)), ({0: batch, 1: seq}, {0: batch, 1: seq}), "ids"),
    }
    for name, (module, args, dyn, kind) in models.items():
        t = time.perf_counter()
        try:
            with torch.no_grad():
                ep = torch.export.export(module, args, dynamic_shapes=dyn)
                pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / f"{name}.pt2"))
        except Exception as exc:
            results[name] = {"build_error": repr(exc)[:1500]}
            continue
        results[f"{name}_compile_s"] = round(time.perf_counter() - t, 1)
        print(f"[aoti] {name} compiled in {results[f'{name}_compile_s']}s", flush=True)
        for loader in ("cpp_st", "cpp_mt", "py"):
            cmd = [sys.executable, "-c", CHILD, pkg, loader, kind, dev]
            if gdb:
                cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                text = (proc.stdout + proc.stderr)[-4000:]
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                text, rc = "timeout", None
            ok = "ran " in text and "SIGSEGV" not in text and "Segmentation" not in text
            results[f"{name}/{loader}"] = {"rc": rc, "ok": ok, "tail": text}
            print(f"[aoti] {name}/{loader}: rc={rc} ok={ok}", flush=True)
            if not ok:
                print("\n".join(text.splitlines()[-30:]), flush=True)
            (out_dir / "diag_aoti.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
