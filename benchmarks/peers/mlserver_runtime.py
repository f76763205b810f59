"""An MLServer runtime around ONNX Runtime for the intent model (MLServer's own HF runtime needs TensorFlow).

KServe v2: TEXT (BYTES, one string per row) → INTENT (BYTES), CONFIDENCE (FP32). MLServer's adaptive batcher
stacks the rows of queued requests along the first axis, so ``predict`` sees a batch. Configured by
``serve_mlserver.py``; runs in var/peers/mlserver (``scripts/peers.sh``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intent_model import IntentModel


class OnnxIntentRuntime(MLModel):
    async def load(self) -> bool:
        params = self.settings.parameters
        extra = (params.extra if params else None) or {}
        self.model = IntentModel(str(params.uri if params else ""), int(extra.get("threads", 2)))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        texts = [str(t) for t in StringCodec.decode_input(payload.inputs[0])]
        results = self.model.predict(texts)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                StringCodec.encode_output("INTENT", [r[0] for r in results]),
                NumpyCodec.encode_output("CONFIDENCE", np.array([r[1] for r in results], dtype=np.float32)),
            ],
        )
