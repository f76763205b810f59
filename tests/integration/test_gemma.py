"""Real Gemma-3-270M (base, Chinese-capable) on the CPU: built into a repository through ``build_causal_lm``, its
ONNX decoder (sliding-window and global layers, Q/K norms, GeGLU) against HF ``generate``.

The converted fp32 model is cached between runs under var/test-cache (keyed by the GGUF's digest); the build
(~40 s: export + the check against torch and HF) is made once per test session.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.conftest import hf_greedy_tokens

from miaohui.errors import ConfigError, InputError
from miaohui.generation.build.artifact import build_causal_lm, read_info
from miaohui.generation.build.export import load_meta
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / "var" / "test-cache" / "gemma3-270m"
NEW_TOKENS = 16


@pytest.fixture(scope="module")  # ~1 GB of fp32 weights: freed after this module
def gemma() -> tuple[Any, Any]:
    from miaohui.zoo.gemma import load_gemma3

    model, tokenizer, _ = load_gemma3(MODEL_CACHE)
    return model, tokenizer


@pytest.fixture(scope="module")
def gemma_version(gemma: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    repo = tmp_path_factory.mktemp("gemma-repo")
    yield build_causal_lm(repo, "gemma3", "fp32", source="gemma3-270m", source_cache=MODEL_CACHE)
    shutil.rmtree(repo, ignore_errors=True)  # 1 GB of ONNX: pytest would keep it for 3 runs


def test_build_writes_a_checked_gemma_version(gemma_version: Path, gemma: tuple[Any, Any]) -> None:
    info, meta = read_info(gemma_version), load_meta(gemma_version)
    assert info.source.startswith("gemma-3-270m-q4_k_m.gguf@sha256:") and info.backend == "onnxruntime"
    assert info.chat_template is not None and "<start_of_turn>" in info.chat_template
    dims = meta.decoder_dims
    assert (dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (18, 4, 1, 256)
    assert max(meta.check.values()) < 2e-3, meta.check
    end_of_turn = gemma[1].convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in meta.eos_token_ids and gemma[1].eos_token_id in meta.eos_token_ids


def test_ort_greedy_equals_hf_generate_in_chinese_and_past_the_sliding_window(
    gemma_version: Path, gemma: tuple[Any, Any]
) -> None:
    """A Chinese chat prompt, and a 600-token prompt (the local layers' window is 512: their mask is exercised)."""
    model, tokenizer = gemma
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "请用一句话介绍一下北京。"}], add_generation_prompt=True, tokenize=False
    )
    chat = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template starts with <bos>
    long = tokenizer("银行理财产品的风险等级从低到高分为五级。" * 60, add_special_tokens=True)["input_ids"][:600]
    assert len(long) == 600 > model.config.sliding_window
    want = hf_greedy_tokens(model, [chat, long], NEW_TOKENS)
    engine = OrtCausalLMEngine(gemma_version)
    llm = LLMEngine(engine, tokenizer.backend_tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [out[0] for out in llm.generate([chat, long], params)]
    assert got == want


def test_served_through_the_openai_client_in_chinese(gemma_version: Path, gemma: tuple[Any, Any]) -> None:
    """The real server on localhost and the ``openai`` client: a streamed Chinese chat completion is the engine's
    greedy text for the prompt HF's tokenizer renders with Gemma's turn format; the completions endpoint too."""
    import openai
    from tests.servers import UvicornThread

    from miaohui.generation.engine.scheduler import SchedulerConfig
    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import chat_observers
    from miaohui.server.openai_api import create_openai_app
    from miaohui.serving.chat import ChatDefaults
    from miaohui.serving.repository import ModelManager

    tokenizer = gemma[1]
    question = [{"role": "user", "content": "我想查一下信用卡账单。"}]
    prompt = tokenizer(tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]  # fmt: skip
    metrics = Metrics()
    sched = SchedulerConfig(max_running_seqs=2, max_batched_tokens=256, max_model_len=256)
    service = ModelManager(
        gemma_version.parent.parent, chat_observer_factory=chat_observers(metrics), chat_defaults=ChatDefaults(sched)
    )
    with UvicornThread(create_openai_app(service, metrics)) as srv:
        llm = service.chat("gemma3")  # the same decoder, run offline in this thread: the reference
        offline = LLMEngine(llm.client.llm.engine, llm.tokenizer.tokenizer)  # type: ignore[attr-defined]
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        want_ids, want_text, _ = offline.generate([prompt], greedy)[0]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=60) as c:
            stream = c.chat.completions.create(
                model="gemma3", messages=question, temperature=0, max_tokens=NEW_TOKENS,  # type: ignore[arg-type]
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            chunks = list(stream)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == want_text and any("\u4e00" <= ch <= "\u9fff" for ch in text)  # Chinese characters
            usage = chunks[-1].usage
            assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), NEW_TOKENS)
            done = c.completions.create(
                model="gemma3", prompt="中国的首都是北京。日本的首都是", temperature=0, max_tokens=4
            )
            assert done.choices[0].text.startswith("东京")
    assert len(want_ids) == NEW_TOKENS


def test_gemma_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="build Gemma 3 with --backend onnxruntime"):
        build_causal_lm(tmp_path, "gemma3", "bf16", source="gemma3-270m", backend="inductor")
    with pytest.raises(InputError, match="llama-70b does not exist"):
        build_causal_lm(tmp_path, "x", "fp32", source="llama-70b")
