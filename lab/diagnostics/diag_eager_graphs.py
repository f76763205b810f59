"""Could the intent engine start in < 1 s by serving its exported program EAGERLY under CUDA graphs (no Dynamo trace,
no Inductor at load), and what does that cost per batch against the compiled engine?

Builds the e5-shaped intent model's inductor artifact (exported-program format, fp16) once, then in FRESH processes:
  engine: ``InductorEngine`` as the server loads it (Dynamo re-traces the program; Inductor cache hits),
  eager:  ``torch.export.load(program.pt2).module()`` run as is, one CUDA graph per bucket,
  fast:   ``InductorEngine(fast_start=True)``: the fast model from ``eager.safetensors`` under CUDA graphs at once,
          then ``upgrade()`` (timed: loads and compiles the program) to compiled ones.
Each child times imports, load, the first answers at 1×16 and 8×32 (the server's default warm-up shapes, captures
included: load + these = the cold start), then every bucket's replay
(CUDA events, median of 200) at 1×16, 1×128, 32×128, and returns its 1×16 logits (compared here). If eager graphs
start in < 1 s at a small replay cost, a server can answer with them at once and swap in the compiled graphs
as a background compile finishes them (built since: ``ModelConfig.fast_start``).

    python3 lab/diagnostics/diag_eager_graphs.py OUT_DIR [MODEL_DIR] [MODES, default engine,eager,fast]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import faulthandler, json, sys, time
faulthandler.enable()
t0 = time.perf_counter()
import numpy as np, torch
from pathlib import Path
times = {"import_s": time.perf_counter() - t0}
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
times["cuda_init_s"] = time.perf_counter() - t0 - times["import_s"]
art, mode = Path(sys.argv[1]), sys.argv[2]
SHAPES = [(1, 16), (1, 128), (32, 128)]

def io_for(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    io = torch.ones((2, b, s), dtype=torch.int64)
    io[0] = torch.randint(5, 900, (b, s), generator=g)
    return io.cuda()

def replay_ms(graph, n=200):
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(n):
        start.record(); graph.replay(); end.record(); end.synchronize()
        ms.append(start.elapsed_time(end))
    return float(np.median(ms))

if mode != "eager":
    from miaohui.engines.inductor_engine import InductorEngine
    from miaohui.engines.store import read_manifest
    times["import_miaohui_s"] = time.perf_counter() - t0 - times["import_s"] - times["cuda_init_s"]
t = time.perf_counter()
if mode == "eager":
    prog = torch.export.load(str(art / "program.pt2")).module()
    stream = torch.cuda.Stream()
    def capture(b, s):
        io = io_for(b, s, b * 1000 + s)
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(2):
                prog(io[0], io[1])
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = prog(io[0], io[1])
        return graph, out
else:  # "engine": as the server loads it by default; "fast": with fast_start (eager graphs, then upgrade())
    eng = InductorEngine(read_manifest(art), art, fast_start=mode == "fast")
    def capture(b, s):
        eng.capture(b, s)
        k = eng._graphs[(b, s)]
        # with graph_copies (the default) a replay copies the pinned host buffer in first: write the inputs there
        (k.host_io if k.copies else k.io).copy_(io_for(b, s, b * 1000 + s))
        return k.graph, k.out
times["load_s"] = time.perf_counter() - t
graph, out = capture(1, 16)
graph.replay(); torch.cuda.synchronize()
times["first_answer_1x16_s"] = time.perf_counter() - t - times["load_s"]
t8 = time.perf_counter()
graph8, _ = capture(8, 32)
graph8.replay(); torch.cuda.synchronize()
times["first_answer_8x32_s"] = time.perf_counter() - t8
times["cold_start_s"] = time.perf_counter() - t  # load + the server's default warm-up shapes (1x16, 8x32)
logits = out.float().cpu().tolist()
if mode == "fast":  # the background compile's work, timed here in the foreground; replays below are compiled
    t = time.perf_counter()
    eng.upgrade()
    times["upgrade_s"] = time.perf_counter() - t
    graph, out = eng._graphs[(1, 16)].graph, eng._graphs[(1, 16)].out
for b, s in SHAPES:
    t = time.perf_counter()
    graph, out = capture(b, s) if (b, s) != (1, 16) else (graph, out)
    times[f"capture_{b}x{s}_s"] = time.perf_counter() - t
    times[f"replay_{b}x{s}_ms"] = replay_ms(graph)
print("RESULT", json.dumps({"times": times, "logits_1x16": logits}))
"""


def log(msg: str) -> None:
    print(f"[eager-graphs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child(art: Path, mode: str) -> dict[str, object]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(art), mode], capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["process_wall_s"] = round(time.perf_counter() - t, 2)
            return res
    return {"ok": False, "returncode": proc.returncode, "tail": (proc.stderr or proc.stdout)[-2000:]}


def main() -> None:
    import numpy as np
    import torch

    from miaohui.config import BuildConfig, parse_shapes
    from miaohui.engines.store import build_artifact

    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    model = Path(sys.argv[2] if len(sys.argv) > 2 else "var/models/intent-e5-shape")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cfg = BuildConfig(
        backend="inductor",
        precision="fp16",
        autotune=False,
        shapes=parse_shapes("input_ids:1x1,32x32,256x128"),
        inductor_format="exported-program",
    )
    t = time.perf_counter()
    art = build_artifact(model, "intent", cfg, Path(tempfile.mkdtemp()) / "repo", log=log).path
    report: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": str(model),
        "build_s": round(time.perf_counter() - t, 1),
        "command": "python3 lab/diagnostics/diag_eager_graphs.py " + " ".join(sys.argv[1:]),
    }
    modes = (sys.argv[3] if len(sys.argv) > 3 else "engine,eager,fast").split(",")
    for run in (1, 2):  # the second run of each finds warm OS and Triton caches
        for mode in modes:
            res = child(art, mode)
            report[f"{mode}_{run}"] = res
            log(f"{mode} run {run}: {json.dumps(res.get('times', res))}")
            (out_dir / "diag_eager_graphs.json").write_text(json.dumps(report, indent=1))
    runs = [report.get(f"{m}_1") for m in ("engine", "fast")]
    if all(isinstance(r, dict) and "logits_1x16" in r for r in runs):
        a, b = (np.asarray(r["logits_1x16"]) for r in runs)  # type: ignore[index]
        report["rel_diff_1x16"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))
    for r in report.values():
        if isinstance(r, dict):
            r.pop("logits_1x16", None)
    (out_dir / "diag_eager_graphs.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
