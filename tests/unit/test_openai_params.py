"""OpenAI request parsing and validation (no model, no server): every bad parameter is a 400 in OpenAI's
error shape naming the parameter; exact messages are matched."""

from __future__ import annotations

import json

import pytest

from miaohui.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_messages,
    completion_prompt,
    parse_request,
    sampling_params,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatRequest:
    req = parse_request(ChatRequest, json.dumps({"model": "m", "messages": USER, **fields}).encode())
    assert isinstance(req, ChatRequest)
    return req


def bad(cls: type[ChatRequest] | type[CompletionRequest], body: object) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request(cls, json.dumps(body).encode())
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        (
            {"temperature": -1},
            "temperature",
            "Invalid value for 'temperature': -1. Input should be greater than or equal to 0.",
        ),
        (
            {"temperature": 2.5},
            "temperature",
            "Invalid value for 'temperature': 2.5. Input should be less than or equal to 2.",
        ),
        ({"top_p": 0}, "top_p", "Invalid value for 'top_p': 0. Input should be greater than 0."),
        ({"top_p": 1.5}, "top_p", "Invalid value for 'top_p': 1.5. Input should be less than or equal to 1."),
        (
            {"max_tokens": 0},
            "max_tokens",
            "Invalid value for 'max_tokens': 0. Input should be greater than or equal to 1.",
        ),
        (
            {"max_completion_tokens": -3},
            "max_completion_tokens",
            "Invalid value for 'max_completion_tokens': -3. Input should be greater than or equal to 1.",
        ),
        ({"seed": -1}, "seed", "Invalid value for 'seed': -1. Input should be greater than or equal to 0."),
        ({"stop": ["ok", 3]}, "stop.1", "Invalid value for 'stop.1': 3. Input should be a valid string."),
        (
            {"stream": "maybe"},
            "stream",
            "Invalid value for 'stream': \"maybe\". Input should be a valid boolean, unable to interpret input.",
        ),
        ({"n": 2}, "n", "n=2 is not supported: only one choice per request (n=1)"),
        ({"best": 1}, "best", "Unrecognized request argument supplied: best"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ),
        (
            {"stream": True, "stream_options": {"usage": True}},
            "stream_options.usage",
            "Unrecognized request argument supplied: stream_options.usage",
        ),
        ({"logprobs": 3}, "logprobs", "logprobs is 3: send true or false (and top_logprobs 0-20)"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        (
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "Invalid value for 'top_logprobs': 21. Input should be less than or equal to 20.",
        ),
        (
            {"frequency_penalty": 0.5},
            "frequency_penalty",
            "'frequency_penalty' is not supported by this server: penalties are not implemented; send 0 or leave it out",
        ),
        (
            {"functions": [{"name": "f"}]},
            "functions",
            "'functions' is not supported by this server: the legacy function calling is not implemented; "
            "send tools and tool_choice",
        ),
        (
            {"max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
            "max_tokens=5 and max_completion_tokens=6 disagree; send one",
        ),
    ],
)
def test_bad_chat_parameters_name_the_parameter(fields: dict[str, object], param: str, text: str) -> None:
    err = bad(ChatRequest, {"model": "m", "messages": USER, **fields})
    assert err.message == text
    assert err.param == param
    assert err.body()["error"] == {"message": text, "type": "invalid_request_error", "param": param, "code": err.code}


def test_neutral_values_of_unsupported_features_are_accepted() -> None:
    req = chat(logprobs=False, frequency_penalty=0, presence_penalty=0.0, tools=[], tool_choice="none", user="u1",
               response_format={"type": "text"}, n=1, stream=True, stream_options={"include_usage": True}, store=False)  # fmt: skip
    assert req.stream and req.stream_options is not None and req.stream_options.include_usage


def test_missing_and_malformed_bodies() -> None:
    assert bad(ChatRequest, {"messages": USER}).message == "Missing required parameter: 'model'."
    assert bad(ChatRequest, {"model": "m"}).message == "Missing required parameter: 'messages'."
    assert bad(CompletionRequest, {"model": "m"}).message == "Missing required parameter: 'prompt'."
    assert bad(ChatRequest, [1, 2]).message == "the request body must be a JSON object, got list"
    with pytest.raises(OpenAIError, match="^the request body is not valid JSON: Expecting property name"):
        parse_request(ChatRequest, b"{not json")
    err = bad(CompletionRequest, {"model": "m", "prompt": "x", "echo": True})
    assert err.message == "'echo' is not supported by this server: send false or leave it out"


def test_chat_messages() -> None:
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "refusal": None},
    ]
    assert chat_messages(msgs) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": ""},
    ]
    with pytest.raises(OpenAIError, match=r"^messages is empty: send at least one") as info:
        chat_messages([])
    assert info.value.param == "messages"
    with pytest.raises(OpenAIError, match=r"^messages\[1\]\.role is 'tool': use system, developer, user or assistant$"):
        chat_messages([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(OpenAIError, match=r"^messages\[0\]\.content\[0\] is not a text part"):
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(OpenAIError, match=r"^messages\[0\]\.content is int: send a string$"):
        chat_messages([{"role": "user", "content": 5}])


def test_completion_prompts() -> None:
    assert completion_prompt("Once").text == "Once"
    assert completion_prompt(["Once"]).text == "Once"
    assert completion_prompt([5, 6]).token_ids == [5, 6]
    assert completion_prompt([[5, 6]]).token_ids == [5, 6]
    with pytest.raises(OpenAIError, match="^2 prompts in one request: send one prompt per request$"):
        completion_prompt(["a", "b"])
    with pytest.raises(OpenAIError, match="^prompt is empty$"):
        completion_prompt([])


def test_sampling_params_fit_the_context() -> None:
    p = sampling_params(chat(temperature=0, seed=3, stop="\n"), prompt_tokens=10, max_model_len=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (90, 0.0, 1.0, 3, ("\n",))
    assert sampling_params(chat(), 10, 100).temperature == 1.0  # OpenAI's default
    assert sampling_params(chat(max_completion_tokens=7), 10, 100).max_tokens == 7
    assert sampling_params(chat(max_tokens=90), 10, 100).max_tokens == 90
    with pytest.raises(OpenAIError) as info:
        sampling_params(chat(max_tokens=91), 10, 100)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens (10 in the messages, "
        "91 in the completion). Please reduce the length of the messages or completion."
    )
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(OpenAIError) as info:
        sampling_params(chat(), 100, 100)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, your messages resulted in 100 tokens. "
        "Please reduce the length of the messages."
    )
    with pytest.raises(OpenAIError, match="at most 16 stop sequences, got 17") as info:
        sampling_params(chat(stop=[str(i) for i in range(17)]), 10, 100)
    assert info.value.param == "stop"


def test_completion_logprobs_is_a_count() -> None:
    assert bad(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": True}).message == (
        "logprobs is True: send the number of alternatives per token, 0-20"
    )
    assert bad(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 21}).param == "logprobs"
