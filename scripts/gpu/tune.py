"""On the GPU: measure which of miaohui's kernels beat the library kernels at an encoder's shapes, and write the
GPU's tuning file (:mod:`miaohui.models.tuning`) that ``miaohui build --gpu-kernels tuned`` reads.

For each model width it runs the lab's probes (``lab/probes``, timed by ``lab/harness.py``) in turn and keeps what
:mod:`miaohui.models.tuning.rules` accepts:

1. ``encoder_gemm_sweep``: each of the layer's four GEMMs over the skinny kernel's configurations at 16 and 128 rows;
2. ``pdl_probe``: the 12-layer chain of the sweep's best configurations launched as programmatic dependents against
   cuBLAS's chain → the ``skinny`` rows where it is faster;
3. ``ln_fusion_probe``: forced splits of the products those rows do not split, fused with the LayerNorm after them,
   against the unfused pair → ``ln_split``;
4. ``attn_probe``: the attention kernel's configurations per (batch, sequence) against the SDPA form → ``attention``;
5. ``cublaslt_probe``: cuBLASLt's candidate algorithms per product at 512, 4,096 and 16,384 rows against torch's
   call → ``cublaslt`` (valid for this cuBLASLt only).

The file is named for this GPU (``<gpu-slug>-sm<cc>.json``), records the torch, Triton and cuBLASLt versions and
this run's date, commit and command, and goes to ``--write`` (default: ``--out``); commit it into
``src/miaohui/models/tuning/`` to make it the GPU's table (its digest enters the build key: tuned engines rebuild).

    python3 scripts/gpu/tune.py --models bert-base,e5-small --out /tmp/tune
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the lab's harness and probes

from lab.harness import provenance  # noqa: E402

from miaohui.models import tuning  # noqa: E402
from miaohui.models.tuning import rules  # noqa: E402

MODELS = {"bert-base": (768, 3072, 12), "e5-small": (384, 1536, 12)}
"""Named widths (hidden, intermediate, heads); ``--models`` also takes ``HxIxHEADS``."""
ATTN_SHAPES = (
    "1x8,1x16,1x32,1x64,1x128,2x16,2x32,2x64,4x16,4x32,4x64,8x16,8x32,8x64,16x16,16x64,32x16,32x64,32x128,"
    "64x16,64x64,128x16,128x64,128x128,256x64"
)
"""(batch, sequence) shapes the attention kernel is tried at: the intent server's bucket grid and larger offline
batches."""


def probe(name: str, out: Path, *args: str) -> dict[str, Any]:
    """Run ``lab.probes.<name>`` with ``args`` into ``out`` and return its report."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", f"lab.probes.{name}", *args, "--out", str(out)]
    print("·", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    report: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return report


def tune_model(hidden: int, inter: int, heads: int, out: Path, args: argparse.Namespace) -> tuning.ModelTuning:
    widths = ["--hidden", str(hidden), "--inter", str(inter)]
    sweep = probe("encoder_gemm_sweep", out / "sweep", *widths, "--rows", args.rows)
    chain = probe("pdl_probe", out / "pdl", *widths, "--rows", args.rows,
                  "--sweep", str(out / "sweep" / "encoder_gemm_sweep.json"))  # fmt: skip
    configs = {int(m): cfgs for m, cfgs in chain["configs"].items()}
    timed = {(r["rows"], r["variant"]): r.get("us_per_chain") for r in chain["rows"]}
    chains = {m: {"configs": configs[m], "us": timed[(m, "skinny_pdl")], "cublas_us": timed[(m, "cublas")]}
              for m in configs if timed.get((m, "skinny_pdl")) and timed.get((m, "cublas"))}  # fmt: skip
    skinny = rules.skinny_entries(chains)
    ln_split: dict[int, dict[str, Any]] = {}
    if skinny:
        (out / "skinny.json").write_text(json.dumps(skinny))
        pairs = probe("ln_fusion_probe", out / "ln", *widths, "--rows", ",".join(map(str, skinny)),
                      "--skinny", str(out / "skinny.json"))  # fmt: skip
        ln_split = rules.ln_split_entries([r | {"gemm": r["pair"].split("->")[0]} for r in pairs["rows"] if r["pdl"]])
    attn = probe("attn_probe", out / "attn", "--heads", str(heads), "--head-size", str(hidden // heads),
                 "--shapes", args.attn_shapes)  # fmt: skip
    lt = probe("cublaslt_probe", out / "lt", *widths, "--rows", args.lt_rows)
    del sweep
    return tuning.ModelTuning(
        hidden=hidden,
        intermediate=inter,
        heads=heads,
        skinny=skinny,  # type: ignore[arg-type]
        ln_split=ln_split,  # type: ignore[arg-type]
        attention=[
            tuning.AttnEntry(batch=b, seq=s, config=c) for (b, s), c in rules.attention_entries(attn["best"]).items()
        ],
        cublaslt=rules.lt_entries([e | {"hex": e["best"]["hex"]} for e in lt["best"]]),  # type: ignore[arg-type]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert-base,e5-small", help=f"{', '.join(MODELS)} or HIDDENxINTERxHEADS")
    ap.add_argument("--rows", default="16,128", help="rows (batch × sequence) the skinny GEMMs are tried at")
    ap.add_argument("--attn-shapes", default=ATTN_SHAPES)
    ap.add_argument("--lt-rows", default="512,4096,16384", help="rows the cuBLASLt algorithms are timed at")
    ap.add_argument("--pdl-max-rows", type=int, default=128,
                    help="static programs of more rows compile Inductor's kernels without PDL (measured slower there "
                         "by the encoder benchmark's static variants)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("/tmp/tune"))
    ap.add_argument("--write", type=Path, help="folder of the tuning file (default: --out)")
    args = ap.parse_args()
    runtime = tuning.Runtime.detect()
    if runtime is None or runtime.triton is None:
        raise SystemExit("tune.py measures on a CUDA GPU with Triton; this process has none")
    models = []
    for name in args.models.split(","):
        hidden, inter, heads = MODELS.get(name) or tuple(int(v) for v in name.split("x"))
        models.append(tune_model(hidden, inter, heads, args.out / f"{hidden}x{inter}", args))
    made = provenance()
    result = tuning.TuningFile(
        gpu=runtime.gpu,
        compute_capability=f"{runtime.capability[0]}.{runtime.capability[1]}",
        versions=tuning.Versions(torch=runtime.torch, triton=runtime.triton, cublaslt=runtime.cublaslt),
        pdl_max_rows=args.pdl_max_rows,
        written=tuning.Written(date=made["date"], commit=str(made["commit"]), command=made["command"]),
        models=models,
    )
    folder = args.write or args.out
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / tuning.file_name(runtime.gpu, runtime.capability)
    tuning.dump(result, path)
    for m in models:
        print(f"{m.hidden}x{m.intermediate}: skinny rows {sorted(m.skinny)}, ln splits {sorted(m.ln_split)}, "
              f"{len(m.attention)} attention shapes, cuBLASLt rows {sorted(m.cublaslt)}")  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()
