"""The CPU generation engine: an exported decoder directory (fp32, int4 or int8) on ONNX Runtime.

Session: CPU provider, all graph optimizations, ``intra_op_num_threads`` = the physical cores given
(default: all cores this process may use), sequential execution. Inputs and outputs are numpy; the
``present`` outputs of one step are the next step's ``past`` inputs unchanged (see
:mod:`miaohui.generation.executors.base` for the batched, left-padded KV layout). An int4 decoder's one-stream decode
steps (its fused one-row graph) write the cache in place instead of copying it
(:mod:`miaohui.generation.executors.ort_in_place`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from miaohui.engines.target import usable_cores
from miaohui.errors import ArtifactError, BackendUnavailableError
from miaohui.generation.build.export import MODEL_NAME, DecoderMeta, input_names, load_meta, output_names
from miaohui.generation.executors.base import CausalLMEngine
from miaohui.generation.executors.ort_in_place import InPlaceRow, runs_one_row


class OrtCausalLMEngine(CausalLMEngine):
    """A decoder directory (``model.onnx`` + ``decoder.json``) served by ONNX Runtime on the CPU."""

    name = "onnxruntime"

    def __init__(self, folder: Path, *, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise BackendUnavailableError(
                "onnxruntime is not installed", "pip install onnxruntime (it is a miaohui dependency)"
            ) from exc
        self.folder = Path(folder)
        self.meta: DecoderMeta = load_meta(self.folder)
        dims = self.meta.decoder_dims
        super().__init__(dims, self.meta.eos_token_ids, self.meta.pad_token_id)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or usable_cores()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        path = self.folder / MODEL_NAME
        try:
            self._session: ort.InferenceSession | None = ort.InferenceSession(
                str(path), opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            raise ArtifactError(
                f"cannot load decoder {path}: {exc}", f"export the decoder again into {self.folder}"
            ) from exc
        got_in = [i.name for i in self._session.get_inputs()]
        got_out = [o.name for o in self._session.get_outputs()]
        if got_in != input_names(dims.num_layers) or got_out != output_names(dims.num_layers):
            raise ArtifactError(
                f"decoder {path} has inputs {got_in[:4]}... / outputs {got_out[:2]}... that do not match "
                f"{self.folder / 'decoder.json'}",
                f"export the decoder again into {self.folder}",
            )
        self._in_names = got_in
        self._in_place: InPlaceRow | None = None
        """The one-row steps with the cache written in place, where the one-row graph is the fused one."""
        if self.meta.one_row_graph == "fused":
            self._in_place = InPlaceRow(self._session, dims, got_in, got_out)

    @property
    def precision(self) -> str:
        return self.meta.precision

    def _forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        if self._session is None:
            raise ArtifactError("the engine is closed", "create a new OrtCausalLMEngine")
        if self._in_place is not None and runs_one_row(input_ids, attention_mask):
            return self._in_place.step(input_ids, attention_mask, position_ids, past)
        feeds = dict(zip(self._in_names, [input_ids, attention_mask, position_ids, *past], strict=True))
        outs = self._session.run(None, feeds)
        return outs[0], list(outs[1:])

    def close(self) -> None:
        self._session, self._in_place = None, None
