"""Dialogue pipelines per business line: normalize → intent (+ slots) → reply → compliance → response.

* :mod:`.pipeline` — :class:`Pipeline` (one turn: :meth:`Pipeline.run_turn`), the engine protocols
  :class:`IntentClassifier` / :class:`TextGenerator`, the response model :class:`DialogueResponse`.
* :mod:`.config` — the pipeline YAMLs (``pipelines/*.yaml``) and their checks.
* :mod:`.knowledge`, :mod:`.answers` — the knowledge base (example data in ``data/``) and template fields.
* :mod:`.booking`, :mod:`.session` — the booking table and the session store.
* :mod:`.compliance` — risk disclaimer, forbidden promises, number grounding.
* :mod:`.consistency` — drift between two engines (offline and in shadow mode).
* :mod:`.gate` — ``miaohui validate --pipeline``: a candidate engine must keep disclaimers and numbers.
* :mod:`.engine_adapters` — the engine protocols over served models, artifacts and chat callables.
* :mod:`.cli` — ``miaohui compare`` and ``miaohui validate --pipeline`` (registered by the main CLI).
"""

from miaohui.dialogue.config import PIPELINE_NAMES, PipelineConfig, load_pipeline_config
from miaohui.dialogue.pipeline import (
    ChatMessage,
    DialogueResponse,
    IntentClassifier,
    Pipeline,
    StageTimings,
    TextGenerator,
)

__all__ = [
    "PIPELINE_NAMES",
    "ChatMessage",
    "DialogueResponse",
    "IntentClassifier",
    "Pipeline",
    "PipelineConfig",
    "StageTimings",
    "TextGenerator",
    "load_pipeline_config",
]
