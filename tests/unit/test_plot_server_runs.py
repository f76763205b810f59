"""benchmarks/plot_server_runs.py on committed server runs: reads every level of each run and draws the PNG; a label
count that does not match the runs is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "benchmarks" / "results").glob("gpu_server_intent_gpu_wait_*_h200.json"))
SCRIPT = ROOT / "benchmarks" / "plot_server_runs.py"


def test_levels_of_every_run_are_read() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import plot_server_runs
    finally:
        sys.path.remove(str(SCRIPT.parent))
    runs = plot_server_runs.load_runs(RUNS)
    assert len(runs) == 4 and all(sorted(run) == [32, 40] for run in runs)
    assert all(run[c]["rps"] > 1000 and 0 < run[c]["p99"] < 50 for run in runs for c in run)


def test_png_is_written_and_wrong_labels_refused(tmp_path: Path) -> None:
    out = tmp_path / "runs.png"
    ok = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, RUNS), "--labels", "a,b,c,d", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, RUNS), "--labels", "a,b", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "2 labels for 4 runs" in bad.stderr
