"""``build-llm DIR --backend llamacpp --precision q8_0|f16``: miaohui writes the GGUF from the fp32 HF model.

Tiny random Mistral (Llama layout: permuted Q/K, untied head) and Qwen2 (NeoX RoPE, Q/K/V biases, tied head)
directories with SmolLM2's real tokenizer: the Mistral one written as F16 and served by llama.cpp itself (its greedy
ids equal transformers'), the Qwen2 one as Q8_0 read back with the ``gguf`` reader (names, types, metadata). The
real SmolLM2 at both precisions goes through the decoder gate in benchmarks/bench_decoder_recipes_cpu.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.tiny_decoders import hf_greedy, save_tiny_decoder, smollm_tokenizer

from miaohui.errors import ConfigError
from miaohui.generation.build.artifact import build_causal_lm, read_info
from miaohui.generation.build.llamacpp_artifact import read_llamacpp_meta

pytestmark = pytest.mark.slow  # real builds, llama.cpp

pytest.importorskip("xllamacpp", reason="the llamacpp extra: pip install 'miaohui[llamacpp]'")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return smollm_tokenizer()


def _llama_cpp_greedy(version: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.engine.scheduler import SchedulerConfig

    async def run() -> list[int]:
        sched = SchedulerConfig(max_running_seqs=1, max_waiting=1, max_batched_tokens=64, max_model_len=64)
        async with LlamaCppLLMEngine(version, sched, threads=2) as engine:
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            return [e.token_id async for e in engine.generate(prompt, params) if e.token_id is not None]

    return asyncio.run(run())


def test_llama_layout_f16_gguf_runs_greedy_like_transformers(tokenizer: Any, tmp_path: Path) -> None:
    """Mistral (Llama layout): Q and K permuted to llama.cpp's interleaved RoPE, an untied head; llama.cpp's greedy
    ids on the F16 file equal transformers' on the fp32 directory."""
    import gguf

    folder = save_tiny_decoder("mistral", tmp_path / "mistral", tokenizer)
    f16 = build_causal_lm(tmp_path / "repo", "mistral-f16", "f16", backend="llamacpp", source=folder)
    assert (read_info(f16).precision, read_llamacpp_meta(f16).architecture) == ("f16", "llama")
    tensors = {t.name: t for t in gguf.GGUFReader(str(f16 / "model.gguf")).tensors}
    assert tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    prompt = tokenizer.encode("The capital of France is")
    assert _llama_cpp_greedy(f16, prompt, 8) == hf_greedy(folder, prompt, 8)


def test_qwen2_q8_0_gguf_reads_back(tokenizer: Any, tmp_path: Path) -> None:
    """Qwen2: Q/K/V biases kept F32, the tied head left out, every matrix Q8_0 within a block's rounding of the
    fp32 weight, the pre-tokenizer recognised from the probe text, metadata as llama.cpp names it."""
    import gguf
    from transformers import AutoModelForCausalLM

    folder = save_tiny_decoder("qwen2", tmp_path / "qwen2", tokenizer)
    q8 = build_causal_lm(tmp_path / "repo", "qwen2-q8", "q8_0", backend="llamacpp", source=folder)
    assert (read_info(q8).precision, read_llamacpp_meta(q8).architecture) == ("q8_0", "qwen2")
    reader = gguf.GGUFReader(str(q8 / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and len(tensors) == 1 + 1 + 2 * 12
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0

    def field(key: str) -> Any:
        f = reader.fields[key]
        return f.contents()

    assert (field("tokenizer.ggml.pre"), field("tokenizer.ggml.model"), field("qwen2.block_count")) == (
        "smollm", "gpt2", 2
    )  # fmt: skip
    assert (field("qwen2.attention.head_count"), field("qwen2.attention.head_count_kv")) == (4, 2)
    assert field("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").state_dict()
    k = tensors["blk.1.attn_k.weight"]
    got = gguf.quants.dequantize(k.data, k.tensor_type).reshape(32, 64)
    want = hf["model.layers.1.self_attn.k_proj.weight"].numpy()
    assert np.abs(got - want).max() <= np.abs(want).max() / 127


def test_writer_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    from tests.integration.conftest import SMOLLM_CACHE

    from miaohui.generation.build.gguf_writer import check_writable

    (tmp_path / "tokenizer.json").write_bytes((SMOLLM_CACHE / "tokenizer.json").read_bytes())
    config = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^m: the GGUF writer takes RoPE default or linear, not 'llama3'"):
        check_writable(tmp_path, "LlamaForCausalLM", "m")
    with pytest.raises(ConfigError, match=r"^--precision q8_0/f16 writes GGUFs of Llama, Mistral and Qwen2 models; m "
                       r"is Gemma3ForCausalLM"):  # fmt: skip
        check_writable(tmp_path, "Gemma3ForCausalLM", "m")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    with pytest.raises(ConfigError, match=r"^m: the GGUF writer takes byte-level BPE tokenizers \(GPT-2 style\); this one "
                       r"is Unigram"):  # fmt: skip
        check_writable(tmp_path, "LlamaForCausalLM", "m")


def test_the_comparator_runs_an_ort_decoder_against_llama_cpp_on_the_same_llama(tokenizer: Any, tmp_path: Path) -> None:
    """A tiny random Llama (plain RoPE, which the GGUF writer takes; untied head) built twice: fp32 for ONNX Runtime
    and F16 GGUF for llama.cpp. Through validate/comparator.py each side encodes the prompts itself (the ONNX version with its
    tokenizer.json, llama.cpp with the GGUF's vocabulary) and answers on its own backend; the ids and the greedy
    replies are the same."""
    from miaohui.dialogue.compare import negotiation_prompts
    from miaohui.validate.comparator import LlamaCppDecoder, OrtDecoder, decoder_outputs, open_decoder
    from miaohui.validate.consistency import compare_outputs

    folder = save_tiny_decoder("llama", tmp_path / "llama", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    ort_dir = build_causal_lm(tmp_path / "repo", "llama-ort", "fp32", source=folder, log=lambda m: None)
    gguf_dir = build_causal_lm(tmp_path / "repo", "llama-gguf", "f16", backend="llamacpp", source=folder)
    prompts = negotiation_prompts()[:2]
    with open_decoder(ort_dir) as ort, open_decoder(gguf_dir) as cpp:
        assert isinstance(ort, OrtDecoder) and isinstance(cpp, LlamaCppDecoder)
        assert [cpp.prompt_ids(p) for p in prompts] == [ort.prompt_ids(p) for p in prompts]
        ours, theirs = decoder_outputs([ort, cpp], prompts, 8)
    report = compare_outputs(ours, theirs, categories={})
    assert (report.n, report.text_exact_match, report.failures) == (2, 1.0, [])
