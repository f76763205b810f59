"""Start CUDA while the server starts: where a repository holds a model that runs on a GPU, ``serve`` imports torch and
creates the CUDA context on a thread of its own at once, beside the import of the HTTP/gRPC stack and the server's
own start, instead of after them when the first model loads.

Creating a CUDA context is driver work that does not hold the GIL (torch lets go of it inside ``torch.zeros``), so it
overlaps the main thread's imports; importing torch itself mostly holds the GIL, so that part overlaps only where the
main thread waits (files, sockets). The model load that follows finds torch imported and the context made. A repository
with no GPU model starts nothing (an ONNX Runtime or llama.cpp server never imports torch). Reading which models are
GPU models costs a few small JSON reads, no torch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from miaohui.engines.base import MANIFEST_NAME
from miaohui.engines.store import versions

log = logging.getLogger(__name__)

GPU_DECODER_BACKENDS = frozenset({"inductor"})
"""``causal_lm.json`` backends whose engine runs on a GPU where one exists."""


def _version_dirs(repository: Path, models: Sequence[str] | None) -> list[Path]:
    if not repository.is_dir():
        return []
    names = set(models) if models else None
    return [m / str(v) for m in sorted(repository.iterdir()) if names is None or m.name in names for v in versions(m)]


def runs_on_gpu(version: Path) -> bool:
    """Whether the artifact in ``version`` runs on a GPU: a manifest built for ``cuda``, or a causal LM whose backend
    is a GPU engine. Unreadable files say no (the load reports them)."""
    try:
        manifest = version / MANIFEST_NAME
        if manifest.is_file():
            target = json.loads(manifest.read_text(encoding="utf-8")).get("target") or {}
            return target.get("device") == "cuda"
        marker = version / "causal_lm.json"
        if marker.is_file():
            return json.loads(marker.read_text(encoding="utf-8")).get("backend") in GPU_DECODER_BACKENDS
    except (OSError, ValueError, AttributeError):
        return False
    return False


def start_cuda_early(repository: Path, models: Sequence[str] | None = None) -> threading.Thread | None:
    """Import torch and create the CUDA context on a daemon thread now, where ``repository`` (only ``models`` of it,
    when given) holds a GPU model; returns the thread, or None where there is none. Failures are left to the model
    load, which reports them with the model's name."""
    if not any(runs_on_gpu(v) for v in _version_dirs(repository, models)):
        return None

    def init() -> None:
        started = time.perf_counter()
        try:
            import torch

            imported = time.perf_counter()
            if torch.cuda.is_available():
                torch.zeros(1, device="cuda")  # the primary context: the driver's work, GIL released
            log.info(
                "CUDA started beside the server's start: torch imported in %.2fs, context in %.2fs",
                imported - started, time.perf_counter() - imported,
            )  # fmt: skip
        except Exception as exc:  # the model load meets the same error and reports it
            log.debug("early CUDA start failed: %s", exc)

    thread = threading.Thread(target=init, name="miaohui-cuda-start", daemon=True)
    thread.start()
    return thread
