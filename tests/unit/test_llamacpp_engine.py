"""The llamacpp engine's pure parts: the request body from SamplingParams, llama.cpp's chunks parsed (the shapes its
server sends, taken from real runs), and the install hint when xllamacpp is missing."""

from __future__ import annotations

import sys

import pytest

from miaohui.errors import ConfigError
from miaohui.generation.engine.llamacpp_engine import import_xllamacpp, parse_chunk, request_body
from miaohui.generation.engine.params import SamplingParams


def test_request_body_maps_sampling_params() -> None:
    greedy = request_body([1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0), 7, cache_prompt=False)
    assert greedy["prompt"] == [1, 2, 3] and greedy["max_tokens"] == 7 and greedy["stream"] is True
    assert (greedy["temperature"], greedy["top_k"], greedy["min_p"], greedy["seed"]) == (0.0, 0, 0.0, -1)
    assert greedy["cache_prompt"] is False and "ignore_eos" not in greedy
    sampled = request_body([5], SamplingParams(temperature=0.7, top_p=0.9, seed=2**40 + 3, ignore_eos=True), 4, True)
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 3)
    assert sampled["ignore_eos"] is True and sampled["cache_prompt"] is True


def test_parse_chunk_text_ids_finish_usage_and_errors() -> None:
    token = {
        "choices": [
            {"text": " AI", "index": 0, "finish_reason": None,
             "logprobs": {"content": [{"id": 5646, "token": " AI", "bytes": [32, 65, 73], "prob": 1.0}]}}
        ],
        "object": "text_completion",
    }  # fmt: skip
    assert parse_chunk(token) == parse_chunk(token) and parse_chunk(token).ids == (5646,)
    assert parse_chunk(token).text == " AI" and parse_chunk(token).finish is None
    last = {
        "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": {"completion_tokens": 3, "prompt_tokens": 6, "total_tokens": 9},
    }
    parsed = parse_chunk(last)
    assert (parsed.text, parsed.ids, parsed.finish, parsed.completion_tokens) == ("", (), "length", 3)
    error = {"error": {"code": 400, "message": "request (1350 tokens) exceeds the available context size"}}
    assert parse_chunk(error).error == "request (1350 tokens) exceeds the available context size"
    assert parse_chunk("nonsense").error is not None


def test_missing_xllamacpp_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # what an environment without the wheel sees
    with pytest.raises(ConfigError) as info:
        import_xllamacpp()
    assert "pip install 'miaohui[llamacpp]'" in str(info.value.fix)
