"""Count the miaohui source files one warm request runs through: ``POST /v1/intent`` and a non-streamed
``POST /v1/chat/completions`` (ONNX Runtime SmolLM2), on the real server app (uvicorn on localhost).

A profile hook on every thread (the event loop's, the engine loop's, the batcher's workers) records the file of each
Python function called while one request runs, after a warm-up request of the same kind; the count is of distinct
files under the imported ``miaohui`` package. Run it once per tree to compare (before / after a restructure)::

    PYTHONPATH=/path/to/tree/src:. python -m lab.diagnostics.request_files --repository /tmp/files-repo

Files are counted once per request kind, with the recorder installed before the server starts its threads.
The repository is made on the first run (the cached intent model built to ONNX, the cached SmolLM2 linked in) and
reused; ``--list`` prints the files.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx


def make_repository(root: Path) -> None:
    """The cached intent model as an ONNX ``intent`` artifact and the cached SmolLM2 (fp32 ONNX) as ``smollm2``."""
    from tests.prebuild import ensure_intent_model, ensure_llm_repository

    from miaohui.config import BuildConfig
    from miaohui.engines.store import build_artifact

    if (root / "intent").is_dir() and (root / "smollm2").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    build_artifact(ensure_intent_model(), "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    (root / "smollm2").symlink_to(ensure_llm_repository() / "smollm2")


class FileRecorder:
    """A profile hook on this thread and every thread started after :meth:`install` (the server's event loop, the
    engine loop, the worker pools): while recording, the files under ``package`` whose functions are called."""

    def __init__(self, package: Path) -> None:
        self.prefix = str(package)
        self.root = package.parent
        self.recording = False
        self.seen: set[str] = set()

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if self.recording and event == "call" and frame.f_code.co_filename.startswith(self.prefix):
            self.seen.add(frame.f_code.co_filename)

    def install(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def files(self, call: Callable[[], Any]) -> list[str]:
        self.seen = set()
        self.recording = True
        try:
            call()
        finally:
            self.recording = False
        return sorted(str(Path(f).relative_to(self.root)) for f in self.seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--list", action="store_true", help="print the files, not only their counts")
    args = ap.parse_args()
    from tests.servers import UvicornThread

    import miaohui
    from miaohui.server.app import build_app

    make_repository(args.repository)
    package = Path(miaohui.__file__).parent
    recorder = FileRecorder(package)
    recorder.install()  # before the server starts its threads
    app = build_app(args.repository, ["intent", "smollm2"])
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    intent = {"text": "我想查一下信用卡账单"}
    out: dict[str, Any] = {"miaohui": str(package)}
    with UvicornThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        for route, body in (("/v1/intent", intent), ("/v1/chat/completions", chat)):
            client.post(route, json=body).raise_for_status()  # warm

            def one(route: str = route, body: dict[str, Any] = body) -> None:
                client.post(route, json=body).raise_for_status()

            files = recorder.files(one)
            out[route] = {"files": len(files), **({"list": files} if args.list else {})}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
