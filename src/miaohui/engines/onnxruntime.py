"""``onnxruntime`` backend, the runtime half: an ONNX Runtime CPU session over a built artifact (the embedded default).

It imports nothing but ONNX Runtime and numpy, so a server that serves prebuilt ONNX Runtime artifacts needs neither
the ``onnx`` package nor the training framework. The builder is :mod:`miaohui.engines.onnxruntime_builder`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.target import usable_cores
from miaohui.errors import ArtifactError

ENGINE_FILE = "model.onnx"


def backend_version() -> str:
    import onnxruntime as ort

    return str(ort.__version__)


class OnnxRuntimeEngine(Engine):
    """An ONNX Runtime CPU session. ``threads`` = intra-op threads (default: all cores); ``spin_wait`` = they
    busy-wait between runs."""

    def __init__(self, manifest: Manifest, path: Path, threads: int | None = None, spin_wait: bool = True) -> None:
        super().__init__(manifest, path)
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or usable_cores()
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if not spin_wait:  # idle threads sleep instead of busy-waiting (see ModelConfig.spin_wait)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # graphs rewritten by compile.optimize.unfuse_slow_ops name the ORT fusions that would undo it
        disabled = [str(x) for x in manifest.extra.get("ort_disabled_optimizers", [])]
        try:
            self._session = ort.InferenceSession(
                str(path / manifest.engine_file),
                opts,
                providers=["CPUExecutionProvider"],
                disabled_optimizers=disabled,
            )
        except Exception as exc:
            raise ArtifactError(
                f"ONNX Runtime cannot load {path / manifest.engine_file}: {exc}",
                "the file is corrupt or truncated; rebuild it with `miaohui build`",
            ) from exc
        self._outputs = self.output_names

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self._session.run(self._outputs, feeds)
        return dict(zip(self._outputs, values, strict=True))

    def close(self) -> None:
        self.__dict__.pop("_session", None)
