"""Start CUDA while the server starts: where a repository holds a model that runs on a GPU, ``serve`` imports torch and
creates the CUDA context on a thread of its own at once, beside the import of the HTTP/gRPC stack and the server's
own start, instead of after them when the first model loads.

Two pieces of work, on two threads. The driver's initialisation and the device's primary context (``cuInit``,
``cuDevicePrimaryCtxRetain`` through ``ctypes``, which lets go of the GIL in every foreign call) run beside everything,
torch's import included: it is the context torch's runtime then finds made. Importing torch mostly holds the GIL, so
that part overlaps the main thread's imports only where either waits (files, sockets); once imported, a first CUDA
tensor finishes the runtime's own start. The model load that follows finds torch imported and the context made.
A repository with no GPU model starts nothing (an ONNX Runtime or llama.cpp server never imports torch). Reading
which models are GPU models costs a few small JSON reads, no torch.
"""

from __future__ import annotations

import ctypes
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


def driver_context(ordinal: int = 0) -> float | None:
    """Initialise the CUDA driver and retain device ``ordinal``'s primary context (the one torch's runtime uses) through
    ``libcuda`` directly, with the GIL released in each call; the seconds it took, or None where there is no driver or
    a call fails (the model load then meets and reports the error). The context stays retained for the process."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    started = time.perf_counter()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != 0:
        return None
    return time.perf_counter() - started


def start_cuda_early(repository: Path, models: Sequence[str] | None = None) -> threading.Thread | None:
    """Import torch and create the CUDA context on a daemon thread now, where ``repository`` (only ``models`` of it,
    when given) holds a GPU model; returns the thread, or None where there is none. Failures are left to the model
    load, which reports them with the model's name."""
    if not any(runs_on_gpu(v) for v in _version_dirs(repository, models)):
        return None

    driver: list[float | None] = []
    context = threading.Thread(target=lambda: driver.append(driver_context()), name="miaohui-cuda-context", daemon=True)
    context.start()

    def init() -> None:
        started = time.perf_counter()
        try:
            import torch

            imported = time.perf_counter()
            context.join()
            joined = time.perf_counter()
            if torch.cuda.is_available():
                torch.zeros(1, device="cuda")  # the runtime's start on the context made above
            made = driver[0] if driver else None
            log.info(
                "CUDA started beside the server's start: torch imported in %.2fs, driver context in %s "
                "(waited %.2fs for it), runtime in %.2fs",
                imported - started, "-" if made is None else f"{made:.2f}s", joined - imported,
                time.perf_counter() - joined,
            )  # fmt: skip
        except Exception as exc:  # the model load meets the same error and reports it
            log.debug("early CUDA start failed: %s", exc)

    thread = threading.Thread(target=init, name="miaohui-cuda-start", daemon=True)
    thread.start()
    return thread
