"""Shadow mode for a chat model, with the real server (``miaohui serve``) and the ``openai`` client, in one process
and through ``--workers 2 --shared-engine``: two tiny random decoders (SmolLM2's tokenizer, different seeds) are
versions 1 and 2 of one model; ``generation.yaml`` serves both and shadows every request on version 2.

Every answer the client gets is version 1's (its fingerprint, and the tokens the offline engine gives for version
1); version 2 answers the same prompts off the response path; ``GET /v1/shadow/<model>`` and ``/metrics`` report
greedy agreement 0 (the two random models never agree) and the keyword frequencies: the negotiation keywords are in
neither version's answers, and a word of version 2's answer that version 1 never says is in 100 % of the
candidate's answers and 0 % of the primary's, so the report fails with the keyword named.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.artifacts import scratch_dir
from tests.e2e.test_workers import Served, serve_workers
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.generation.build.artifact import ChatTokenizer, build_causal_lm, read_info
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

pytestmark = pytest.mark.slow  # two server processes (three with the engine process) load torch and ORT

MODEL = "coach"
NEW = 6
MESSAGES = [{"role": "user", "content": "对方报价太高，我该怎么回应？"}]
REQUESTS = 4
"""Chat requests (streamed) and as many completions (not streamed): every one is shadowed."""


@dataclass(frozen=True)
class Repo:
    root: Path
    prompt: list[int]
    """The chat prompt's token ids (both versions share the tokenizer and template)."""
    answers: dict[int, tuple[list[int], str]]
    """Each version's greedy answer to ``prompt`` (token ids, text), from the offline engine."""
    keyword: str
    """A word of version 2's answer that version 1's answer lacks."""


def _greedy(version_dir: Path, prompt: list[int]) -> tuple[list[int], str]:
    tokenizer = ChatTokenizer.from_dir(version_dir, read_info(version_dir))
    engine = OrtCausalLMEngine(version_dir, threads=1)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    tokens, text, _ = LLMEngine(engine, tokenizer.tokenizer).generate([prompt], params)[0]
    return tokens, text


def _label_safe(word: str) -> bool:
    """Printed as a Prometheus label value unchanged (no quote, backslash or control character)."""
    return word.isprintable() and '"' not in word and "\\" not in word


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Repo]:
    with scratch_dir(tmp_path_factory, "chat-shadow") as scratch:
        tokenizer = smollm_tokenizer()
        root = scratch / "repo"
        for seed in (0, 1):  # versions 1 and 2: the same architecture and tokenizer, other weights
            source = save_tiny_decoder("qwen2", scratch / f"hf{seed}", tokenizer, seed=seed)
            build_causal_lm(root, MODEL, "fp32", source=source, log=lambda m: None)
        v1 = root / MODEL / "1"
        prompt = ChatTokenizer.from_dir(v1, read_info(v1)).encode_chat(MESSAGES)
        answers = {v: _greedy(root / MODEL / str(v), prompt) for v in (1, 2)}
        words = [w for w in answers[2][1].split() if len(w) > 1 and w not in answers[1][1] and _label_safe(w)]
        assert answers[1][0] != answers[2][0] and words, answers  # the seeds give two different models
        shadow = {"version": 2, "sample_rate": 1.0, "keywords": ["拒绝", "接受", "折中", words[0]]}
        config = {"version_policy": {"policy": "all"}, "shadow": shadow, "threads": 1}
        (root / MODEL / "generation.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
        yield Repo(root, prompt, answers, words[0])


@pytest.fixture(scope="module", params=[(), ("--workers", "2", "--shared-engine")], ids=["one-process", "shared"])
def server(request: pytest.FixtureRequest, repo: Repo) -> Iterator[Served]:
    yield from serve_workers(repo.root, *request.param, models=MODEL)


def _shadow_status(url: str, want: int) -> dict[str, Any]:
    """``GET /v1/shadow/<model>`` once the answering worker compared ``want`` pairs (any number with two workers:
    each compares the requests it answered) and none is in flight."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body: dict[str, Any] = httpx.get(f"{url}/v1/shadow/{MODEL}", timeout=10).json()
        if body["pending"] == 0 and (body["observed"] == want if want else body["observed"] > 0):
            return body
        time.sleep(0.1)
    pytest.fail(f"the shadow runs did not finish: {body}")


def test_the_candidate_answers_off_the_response_path_and_drift_is_reported(server: Served, repo: Repo) -> None:
    shared = "--shared-engine" in server.proc.args  # type: ignore[operator]
    v1_tokens, v1_text = repo.answers[1]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        for _ in range(REQUESTS):
            chunks = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            parts = [(c.system_fingerprint, c.choices[0].delta.content or "") for c in chunks if c.choices]
            assert {f for f, _ in parts} == {f"miaohui-{MODEL}-v1-fp32"}
            assert "".join(t for _, t in parts) == v1_text  # the primary's answer, not the candidate's
            done = client.completions.create(
                model=MODEL, prompt=repo.prompt, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
            )
            assert (done.system_fingerprint, done.choices[0].text) == (f"miaohui-{MODEL}-v1-fp32", v1_text)
        assert len(v1_tokens) == NEW

    status = _shadow_status(server.url, 0 if shared else 2 * REQUESTS)
    n = status["observed"]
    report = status["report"]
    zero = {"拒绝": 0.0, "接受": 0.0, "折中": 0.0}
    assert (status["kind"], status["state"], status["primary_version"], status["candidate_version"]) == (
        "chat", "active", 1, 2,
    )  # fmt: skip
    assert (status["errors"], status["dropped"], report["n"], report["greedy_pairs"]) == (0, 0, n, n)
    assert report["greedy_agreement"] == 0.0
    assert report["keyword_frequency_old"] == {**zero, repo.keyword: 0.0}
    assert report["keyword_frequency_new"] == {**zero, repo.keyword: 1.0}
    assert report["keyword_frequency_drift"] == 1.0
    assert report["failures"] == [
        f"keyword {repo.keyword!r} is in 100.0% of the new engine's answers and 0.0% of the old one's "
        "(difference 100.0% exceeds 5.0%)"
    ]
    assert status["passed"] is False

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
        for s in family.samples
        if s.name.startswith("miaohui_shadow")
    }
    drift = {figure: samples.get(("miaohui_shadow_drift", (("figure", figure), ("model", MODEL)))) for figure in (
        "greedy_agreement", "keyword_frequency_drift", "passed",
    )}  # fmt: skip
    assert drift == {"greedy_agreement": 0.0, "keyword_frequency_drift": 1.0, "passed": 0.0}
    frequency = {
        (keyword, role): samples.get(
            ("miaohui_shadow_keyword_frequency", (("keyword", keyword), ("model", MODEL), ("version", role)))
        )
        for keyword in (repo.keyword, "拒绝")
        for role in ("primary", "candidate")
    }
    assert frequency == {
        (repo.keyword, "primary"): 0.0, (repo.keyword, "candidate"): 1.0,
        ("拒绝", "primary"): 0.0, ("拒绝", "candidate"): 0.0,
    }  # fmt: skip
    # the chat versions' cold start, split by phase, as the encoders' (miaohui_model_start_seconds)
    started = {
        (s.labels["version"], s.labels["phase"])
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
        for s in family.samples
        if s.name == "miaohui_model_start_seconds" and s.labels["model"] == MODEL and s.value > 0
    }
    assert {("1", "load"), ("2", "load")} <= started, started
    listing = httpx.get(f"{server.url}/v1/shadow", timeout=10).json()["shadows"]
    assert [(s["model"], s["kind"]) for s in listing] == [(MODEL, "chat")]
