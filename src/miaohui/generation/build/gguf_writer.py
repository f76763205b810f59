"""fp32 Hugging Face decoder → a Q8_0 or F16 GGUF that llama.cpp loads, with the ``gguf`` package's writer and
quantizers (``build-llm DIR --backend llamacpp --precision q8_0|f16``).

What llama.cpp's ``convert_hf_to_gguf.py`` does for these architectures, and only that:

* **Tensors** get llama.cpp's names from ``gguf.get_tensor_name_map`` (``model.layers.0.self_attn.q_proj.weight`` →
  ``blk.0.attn_q.weight``). Llama's Q and K projections are permuted from HF's rotate-half layout to llama.cpp's
  interleaved RoPE (Qwen2 runs NeoX RoPE: no permutation). A tied ``lm_head`` is left out (llama.cpp reuses
  ``token_embd``). Norms and biases stay F32; every matrix becomes Q8_0 (blocks of 32: an fp16 scale and 32 int8)
  or F16 — a matrix whose rows do not split into blocks of 32 stays F16, as the converter does.
* **Hyperparameters**: ``<arch>.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count(_kv)``, ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``,
  ``rope.dimension_count``, ``attention.key_length/value_length`` (head_dim), ``vocab_size`` and
  ``general.file_type``; ``linear`` RoPE scaling as ``rope.scaling.type/factor``.
* **Tokenizer**: byte-level BPE tokenizers (``tokenizer.ggml.model = gpt2``: Llama 3, SmolLM, Qwen2) — the token
  list with NORMAL / CONTROL / USER_DEFINED types, the merges, special ids and the chat template
  (``gguf.SpecialVocab``); ``tokenizer.ggml.pre`` from the converter's hash of a probe text for the pre-tokenizers
  known here, else ``default`` (miaohui sends token ids, so llama.cpp's own pre-tokenizer is never used to encode).

Not written (refused with the fix): Gemma 3 (SentencePiece vocabulary with scores, norm offsets, sliding-window
keys), ``llama3`` RoPE scaling (a ``rope_freqs`` tensor) and SentencePiece tokenizers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.errors import ConfigError

WRITER_VERSION = 1
"""Bumped when the written GGUF changes (part of the build key)."""
GGUF_PRECISIONS = ("q8_0", "f16")
"""What the writer quantizes to."""
_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll "
    "make it, 'D you like some tea? We'Ve a'lL"
)
"""convert_hf_to_gguf.py's probe text: the sha256 of its token ids names the pre-tokenizer."""
_PRE = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
_WRITER_FIX = (
    "build it with --backend onnxruntime, or convert it with llama.cpp's convert_hf_to_gguf.py and build the .gguf"
)


def check_writable(folder: Path, architecture: str, label: str) -> None:
    """ConfigError when :func:`write_gguf` cannot write this model (see the module docstring), before loading it."""
    if architecture not in _ARCH:
        raise ConfigError(
            f"--precision q8_0/f16 writes GGUFs of Llama, Mistral and Qwen2 models; {label} is {architecture}",
            _WRITER_FIX,
        )
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope = str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"
    if rope not in ("default", "linear"):
        raise ConfigError(f"{label}: the GGUF writer takes RoPE default or linear, not {rope!r}", _WRITER_FIX)
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    kind = (tokenizer.get("model") or {}).get("type")
    if kind != "BPE" or (tokenizer.get("model") or {}).get("byte_fallback"):
        raise ConfigError(
            f"{label}: the GGUF writer takes byte-level BPE tokenizers (GPT-2 style); this one is "
            f"{kind}{' with byte fallback (SentencePiece)' if kind == 'BPE' else ''}",
            _WRITER_FIX,
        )


def write_gguf(path: Path, folder: Path, architecture: str, model: Any, tokenizer: Any, precision: str) -> None:
    """Write ``model`` (fp32 HF, loaded from ``folder``) and ``tokenizer`` as a ``precision`` GGUF at ``path``."""
    import gguf

    if precision not in GGUF_PRECISIONS:
        raise ConfigError(f"the GGUF writer quantizes to {list(GGUF_PRECISIONS)}, not {precision!r}", "use q8_0 or f16")
    arch = _ARCH[architecture]
    cfg = model.config
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if precision == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(folder.name)
    _add_hparams(writer, cfg)
    writer.add_file_type(int(file_type))
    _add_vocab(writer, folder, tokenizer, int(cfg.vocab_size))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.QWEN2 if arch == "qwen2" else gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers
    )
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    heads, kv_heads = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    for hf_name, tensor in model.state_dict().items():
        if (tied and hf_name == "lm_head.weight") or hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"{folder}: no llama.cpp tensor name for {hf_name}", _WRITER_FIX)
        data = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        data, qtype = _quantize(data, precision)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_hparams(writer: Any, cfg: Any) -> None:
    import gguf

    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(cfg, "num_key_value_heads", heads)))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    rope: Any = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    writer.add_rope_freq_base(float(theta or getattr(cfg, "rope_theta", None) or 10000.0))
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(cfg.vocab_size))


def _add_vocab(writer: Any, folder: Path, tokenizer: Any, vocab_size: int) -> None:
    """convert_hf_to_gguf.py's ``_set_vocab_gpt2``: tokens and types, the pre-tokenizer, merges, special ids."""
    import gguf
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(_PROBE).ids  # the file's own pre-tokenizer
    pre = _PRE.get(hashlib.sha256(str(ids).encode()).hexdigest(), "default")
    reverse = {i: tok for tok, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token in added:
            special = decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows → llama.cpp's interleaved pairs (convert_hf_to_gguf.py's ``LlamaModel.permute``)."""
    shape = weights.shape
    return weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _quantize(data: np.ndarray, precision: str) -> tuple[np.ndarray, Any]:
    import gguf

    if data.ndim < 2:
        return data.astype(np.float32), gguf.GGMLQuantizationType.F32
    if precision == "q8_0" and data.shape[-1] % 32 == 0:
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return data.astype(np.float16), gguf.GGMLQuantizationType.F16
