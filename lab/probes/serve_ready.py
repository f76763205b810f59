"""Time to ready of ``miaohui serve`` on a built repository, with CUDA started beside the server's start (the CLI, as
shipped) and without it (the server entered below the CLI, as before), alternating, each on new empty compile caches:

    python -m lab.probes.serve_ready REPO --runs 3 --out DIR        (on a GPU)

Ready = process start to ``/v2/health/ready`` answering 200 (gRPC off). Writes DIR/serve_ready.json with every run's
seconds, the servers' start phases (``miaohui_model_start_seconds``) and the ready log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

WITHOUT = (
    "import sys; from pathlib import Path; from miaohui.server.app import run_server; "
    "from miaohui.server.state import ServeSpec; "
    "run_server(ServeSpec(Path(sys.argv[1]), port=int(sys.argv[2]), grpc_port=0))"
)


def serve_once(repo: Path, early: bool, log: Path) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fresh = Path(tempfile.mkdtemp(prefix="serve-ready-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"), "TRITON_CACHE_DIR": str(fresh / "triton")}
    if early:
        cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port), "--grpc-port", "0"]
    else:
        cmd = [sys.executable, "-c", WITHOUT, str(repo), str(port)]
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready = time.perf_counter() - started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(60)
    pattern = r'miaohui_model_start_seconds\{[^}]*phase="([^"]+)"[^}]*\}\s+(\S+)'
    phases = {m[1]: float(m[2]) for m in re.finditer(pattern, text)}
    lines = [ln for ln in log.read_text().splitlines() if "ready" in ln or "CUDA started" in ln]
    return {"ready_s": round(ready, 3), "phases": phases, "log": lines[-4:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, object]]] = {"early_cuda": [], "without": []}
    for i in range(args.runs):
        for name in runs:
            got = serve_once(args.repo, name == "early_cuda", args.out / f"serve_ready{args.tag}_{name}_{i}.log")
            runs[name].append(got)
            print(f"{name} run {i}: ready {got['ready_s']} s {got['phases']}", flush=True)
    medians = {name: statistics.median(float(r["ready_s"]) for r in rs) for name, rs in runs.items()}  # type: ignore[arg-type]
    result = {"repo": str(args.repo), "median_ready_s": medians, "runs": runs}
    (args.out / f"serve_ready{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
