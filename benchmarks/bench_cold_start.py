"""Cold start of an ``inductor`` intent engine: the AOTInductor package, the exported-program format, and the
exported-program format loaded with ``fast_start`` (the fast model from ``eager.safetensors``, compiled later).

Builds the model twice with ``miaohui``'s builder (once as it chooses, the AOTInductor package; once with the
package refused, so the fallback format, exported program + Inductor cache, is written), then starts a FRESH
Python process per run that imports, loads the artifact with ``load_engine`` and answers a 1×16 and an 8×32 request
(on a GPU each is a new CUDA-graph bucket). Reports the median over ``--runs`` of each phase; the first run of
the fallback also fills Inductor's on-disk caches, so it is reported separately. ``fast-start`` runs the fallback
artifact with ``fast_start=True``: its answers come from the eager fast model (its background compile is not
started: no server warm-up ends here), so its cold start excludes any compile. Writes a PNG next to the JSON.

    python benchmarks/bench_cold_start.py --model var/models/intent-e5-small --runs 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines import inductor
from miaohui.engines.store import build_artifact

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from pathlib import Path
from miaohui.engines.loader import load_engine
t1 = time.perf_counter()
engine = load_engine(Path(sys.argv[1]), fast_start=sys.argv[2] == "fast")
t2 = time.perf_counter()
def feeds(b, s):
    return {"input_ids": np.full((b, s), 7, np.int64), "attention_mask": np.ones((b, s), np.int64)}
engine.infer(feeds(1, 16))
t3 = time.perf_counter()
engine.infer(feeds(8, 32))
t4 = time.perf_counter()
print("RESULT", json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_1x16_s": t3 - t2, "then_8x32_s": t4 - t3,
                            "cold_start_s": t4 - t1}))
"""
PHASES = ("import_s", "load_s", "first_1x16_s", "then_8x32_s", "cold_start_s")


def fresh_process(path: Path, mode: str) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, str(path), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {k: round(v, 3) for k, v in json.loads(line[7:]).items()}
    raise RuntimeError(f"the child process failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="var/models/intent-e5-small")
    ap.add_argument("--precision", default=None, help="default: fp16 on a GPU, fp32 on a CPU")
    ap.add_argument("--shapes", default="input_ids:1x1,8x32,32x64")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cold_start_cpu.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    precision = args.precision or ("fp16" if cuda else "fp32")
    cfg = BuildConfig(backend="inductor", precision=precision, autotune=False, shapes=parse_shapes(args.shapes))
    repo = Path(tempfile.mkdtemp(prefix="cold-start-"))
    console = Console()
    formats: dict[str, Any] = {}
    t = time.perf_counter()
    packaged = build_artifact(Path(args.model), "packaged", cfg, repo, log=console.log)
    formats["aoti-package"] = {"build_s": round(time.perf_counter() - t, 1), "path": packaged.path}
    refuse = inductor.probe_aoti_package
    inductor.probe_aoti_package = lambda *a: "refused by bench_cold_start.py to measure the fallback format"
    try:
        t = time.perf_counter()
        fallback = build_artifact(Path(args.model), "fallback", cfg, repo, log=console.log)
    finally:
        inductor.probe_aoti_package = refuse
    formats["exported-program"] = {"build_s": round(time.perf_counter() - t, 1), "path": fallback.path}
    formats["fast-start"] = {"build_s": formats["exported-program"]["build_s"], "path": fallback.path}
    assert packaged.manifest.extra["format"] == "aoti-package", packaged.manifest.extra["aoti"]
    assert fallback.manifest.extra["format"] == "exported-program"
    for name, entry in formats.items():
        mode = "fast" if name == "fast-start" else "default"
        runs = [fresh_process(entry["path"], mode) for _ in range(args.runs + (name == "exported-program"))]
        if name == "exported-program":
            entry["first_run_fills_caches"], runs = runs[0], runs[1:]
        entry["runs"] = runs
        entry["median"] = {k: round(statistics.median(r[k] for r in runs), 3) for k in PHASES}
        entry["path"] = str(entry["path"])
        console.log(name, entry["median"])
    ratio = formats["exported-program"]["median"]["cold_start_s"] / formats["aoti-package"]["median"]["cold_start_s"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model,
        "precision": precision,
        "note": "cold_start_s = load + a 1x16 and an 8x32 request in a fresh process (import excluded); median of runs",
        "formats": formats,
        "exported_program_over_package": round(ratio, 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    table = Table(title=f"cold start, {result['device']}, {precision} (median of {args.runs} fresh processes)")
    for col in ("format", "build s", *PHASES):
        table.add_column(col)
    for name, entry in formats.items():
        table.add_row(name, str(entry["build_s"]), *(f"{entry['median'][k]:.3f}" for k in PHASES))
    console.print(table)
    plot(result, Path(args.out).with_suffix(".png"))
    console.print(f"exported program / package: {ratio:.1f}x; wrote {args.out} and its PNG")


def plot(result: dict[str, Any], path: Path) -> None:
    """One stacked bar per format: load, first 1×16 answer, then 8×32 (medians, seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["formats"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(names)
    for phase, label in (("load_s", "load"), ("first_1x16_s", "first 1×16"), ("then_8x32_s", "then 8×32")):
        vals = [result["formats"][n]["median"][phase] for n in names]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f} s", ha="center", va="bottom")
    ax.set_ylim(0, max(bottom) * 1.15)
    ax.set_ylabel("seconds (median, fresh process, import excluded)")
    ax.set_title(f"cold start: {Path(result['model']).name}, {result['precision']}, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
