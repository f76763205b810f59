"""Where an inductor engine's cold start goes, and whether an ahead-of-time format avoids it.

Builds a small intent classifier (random BERT, 4 layers x 256) in half precision on the GPU (fp32 on CPU), then
times, each in a FRESH process (faulthandler on, so a crash prints its stack): ``import torch``, load, first
call, calls at two more shapes, for
  A. the artifact ``miaohui build --backend inductor`` makes (``InductorEngine``): the AOTInductor package when it
     passes the build's probe, else the exported program + Inductor cache (Dynamo re-traces on load),
  B. AOTInductor: ``aoti_compile_and_package`` → ``aoti_load_package`` (segfaulted on load in session 2),
  C. ``torch.compile(...).aot_compile`` → ``save_compiled_function`` / ``torch.compiler.load_compiled_function``.

    python3 lab/diagnostics/diag_coldstart.py [OUT_DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

CHILD_PRELUDE = """
import faulthandler, json, sys, time
faulthandler.enable()
t0 = time.perf_counter()
import torch, numpy as np
times = {"import_s": time.perf_counter() - t0}
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cuda":
    torch.zeros(1, device=dev); torch.cuda.synchronize()
times["cuda_init_s"] = time.perf_counter() - t0 - times["import_s"]
def ids(b, s):
    x = torch.randint(5, 900, (b, s), device=dev)
    return x, torch.ones_like(x)
def timed(name, fn):
    t = time.perf_counter(); out = fn()
    if dev == "cuda": torch.cuda.synchronize()
    times[name] = time.perf_counter() - t
    return out
"""

CHILD = {
    "A_artifact": """
from pathlib import Path
from miaohui.engines.inductor_engine import InductorEngine
from miaohui.engines.store import read_manifest
p = Path(ART)
eng = timed("load_s", lambda: InductorEngine(read_manifest(p), p))
def feeds(b, s):
    ids = np.random.randint(5, 900, (b, s)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((b, s), np.int64)}
timed("first_call_1x16_s", lambda: eng.infer(feeds(1, 16)))
timed("call_8x32_s", lambda: eng.infer(feeds(8, 32)))
timed("call_32x64_s", lambda: eng.infer(feeds(32, 64)))
""",
    "B_aoti_package": """
fn = timed("load_s", lambda: torch._inductor.aoti_load_package(ART))
with torch.no_grad():
    timed("first_call_1x16_s", lambda: fn(*ids(1, 16)))
    timed("call_8x32_s", lambda: fn(*ids(8, 32)))
    timed("call_32x64_s", lambda: fn(*ids(32, 64)))
""",
    "C_aot_compile": """
def load():
    with open(ART, "rb") as f:
        return torch.compiler.load_compiled_function(f)
fn = timed("load_s", load)
with torch.no_grad():
    timed("first_call_1x16_s", lambda: fn(*ids(1, 16)))
    timed("call_8x32_s", lambda: fn(*ids(8, 32)))
    timed("call_32x64_s", lambda: fn(*ids(32, 64)))
""",
}


def log(msg: str) -> None:
    print(f"[cold {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child(kind: str, art: str) -> dict[str, object]:
    code = CHILD_PRELUDE + f"ART = {art!r}\n" + textwrap.dedent(CHILD[kind]) + "\nprint('TIMES', json.dumps(times))\n"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - t
    for line in proc.stdout.splitlines():
        if line.startswith("TIMES "):
            times = json.loads(line[6:])
            return {"ok": True, "process_wall_s": round(wall, 3), **{k: round(v, 3) for k, v in times.items()}}
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"ok": False, "returncode": proc.returncode, "tail": tail}


def main() -> None:
    from miaohui.config import BuildConfig, parse_shapes
    from miaohui.engines.inductor import FloatLogits
    from miaohui.engines.store import build_artifact
    from miaohui.models.checkpoint import ModelMeta, load_checkpoint, save_checkpoint
    from miaohui.models.fast_bert import from_module
    from miaohui.models.intent import IntentClassifier, random_bert
    from miaohui.zoo.tiny import word_tokenizer

    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    cuda = torch.cuda.is_available()
    dev, prec = ("cuda", "fp16") if cuda else ("cpu", "fp32")
    tok = word_tokenizer()
    enc = random_bert(hidden=256, layers=4, heads=4, vocab=tok.get_vocab_size(), max_positions=128)
    meta = ModelMeta(
        kind="intent", base="tiny", bert_config=enc.config.to_diff_dict(), labels=list("abcd"), max_length=64
    )
    ckpt = save_checkpoint(tmp / "m", IntentClassifier(enc, 4).eval(), meta, tok)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}

    log("A: build (export + Inductor cache)")
    t = time.perf_counter()
    cfg = BuildConfig(
        backend="inductor", precision=prec, autotune=False, shapes=parse_shapes("input_ids:1x1,8x32,64x64")
    )
    art_a = build_artifact(ckpt, "t", cfg, tmp / "repo", log=log)
    results["A_build_s"] = round(time.perf_counter() - t, 1)
    results["A_format"] = art_a.manifest.extra["format"]
    results["A_aoti"] = art_a.manifest.extra["aoti"]
    results["A_artifact"] = child("A_artifact", str(art_a.path))
    log(json.dumps(results["A_artifact"]))
    save(out_dir, results)

    module = from_module(load_checkpoint(ckpt, attn_implementation="sdpa").module)
    dtype = torch.float16 if cuda else torch.float32
    model = FloatLogits(module).to(device=dev, dtype=dtype).eval().requires_grad_(False)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=1, max=64)
    x = torch.randint(5, 900, (8, 32), device=dev)
    m = torch.ones_like(x)
    with torch.no_grad():
        ep = torch.export.export(model, (x, m), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))

    log("B: AOTInductor package")
    try:
        t = time.perf_counter()
        with torch.no_grad():
            pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / "model.pt2"))
        results["B_build_s"] = round(time.perf_counter() - t, 1)
        results["B_aoti_package"] = child("B_aoti_package", pkg)
    except Exception as exc:
        results["B_aoti_package"] = {"ok": False, "build_error": repr(exc)[:1500]}
    log(json.dumps(results["B_aoti_package"]))
    save(out_dir, results)

    log("C: torch.compile(...).aot_compile")
    try:
        t = time.perf_counter()
        torch._dynamo.reset()

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return model(input_ids, attention_mask)

        compiled = torch.compile(forward, fullgraph=True, dynamic=True)
        with torch.no_grad():
            aot = compiled.aot_compile(((x, m), {}))  # type: ignore[attr-defined]
        path = tmp / "aot_compiled.bin"
        aot.save_compiled_function(str(path))
        results["C_build_s"] = round(time.perf_counter() - t, 1)
        results["C_aot_compile"] = child("C_aot_compile", str(path))
    except Exception as exc:
        results["C_aot_compile"] = {"ok": False, "build_error": repr(exc)[:1500]}
    log(json.dumps(results["C_aot_compile"]))
    save(out_dir, results)
    print(json.dumps(results, indent=1))


def save(out_dir: Path, results: dict[str, object]) -> None:
    """After every variant, so a run cut by its time limit keeps what it measured."""
    (out_dir / "coldstart_diag.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
