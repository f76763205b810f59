"""Resident memory of one process building the intent model's fp32 and default int8 ONNX Runtime versions, logged at
each build message (what a test worker or ``miaohui prepare`` holds after in-process builds):

    MIAOHUI_HOME=/tmp/mh PYTHONPATH=. .venv/bin/python lab/probes/build_memory.py
"""

from __future__ import annotations

import resource
import tempfile
from pathlib import Path

import psutil
from tests.prebuild import ensure_intent_model

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.prepare import default_config
from miaohui.zoo.intents import load_split


def log(message: object) -> None:
    rss = psutil.Process().memory_info().rss / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"rss {rss:.2f} GB, peak {peak:.2f} GB | {str(message)[:100]}", flush=True)


def main() -> None:
    model = ensure_intent_model()
    repo = Path(tempfile.mkdtemp())
    build_artifact(model, "fp32", BuildConfig(), repo, log=log)
    log("fp32 done")
    texts = [x.text for x in load_split("train")]
    build_artifact(model, "int8", default_config("onnxruntime", "int8"), repo, calib_texts=texts, log=log)
    log("int8 done")


if __name__ == "__main__":
    main()
