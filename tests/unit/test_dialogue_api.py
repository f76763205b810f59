"""The dialogue HTTP routes and the OpenAI chat helper in-process (httpx ASGI), with a keyword
``FakeClassifier`` standing in for the intent engine. The e2e tests drive the same routes with the real int8
engine on a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from fastapi import FastAPI

from miaohui.dialogue.compliance import DISCLAIMER
from miaohui.errors import InputError, ModelNotFoundError
from miaohui.server.dialogue_api import (
    DialogueService,
    completion_chunks,
    dialogue_router,
    pipeline_of_model,
)
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics

NOW = datetime(2026, 3, 3, 10, 0, tzinfo=timezone(timedelta(hours=8)))  # a Tuesday morning
RULES = [
    ("转人工", "human_agent"),
    ("基金", "fund_recommendation"),
    ("社保", "social_insurance"),
    ("会议室", "book_meeting_room"),
    ("你好", "greeting"),
]


class FakeClassifier:
    """Stands in for the intent engine: the first keyword rule that matches (0.95), else out_of_scope (0.9)."""

    async def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        return [next(((i, 0.95) for k, i in RULES if k in t), ("out_of_scope", 0.9)) for t in texts]


class _NoManager:
    """create_app needs a manager for its own routes; these tests only use the dialogue routes."""

    ready = True

    def states(self) -> list[object]:
        return []


@pytest.fixture
def service() -> DialogueService:
    return DialogueService(FakeClassifier(), Metrics(), clock=lambda: NOW)


@pytest.fixture
async def client(service: DialogueService) -> AsyncIterator[httpx.AsyncClient]:
    from miaohui.server.state import ServerState

    app: FastAPI = create_app(ServerState(_NoManager(), service.metrics))  # type: ignore[arg-type]
    app.include_router(dialogue_router(service))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def _sample(service: DialogueService, name: str, **labels: str) -> float:
    assert service.metrics is not None
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_turn_with_and_without_timings(client: httpx.AsyncClient, service: DialogueService) -> None:
    r = await client.post(
        "/v1/dialogue/bank_advisor", json={"text": "我想买一只稳健型基金，年化收益5%左右", "timings": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["intent"] == "fund_recommendation" and body["text"].count(DISCLAIMER["zh"]) == 1
    assert set(body["timings"]) == {"normalize_ms", "intent_ms", "reply_ms", "compliance_ms", "total_ms"}
    assert body["engine"] == {"model": None, "version": None}  # a fake classifier reports no served version
    again = await client.post("/v1/dialogue/bank_advisor", json={"text": "转人工", "session_id": body["session_id"]})
    assert "timings" not in again.json() and again.json()["turn"] == 2 and again.json()["handoff"] is True
    # timings are always in the metrics, asked for or not
    count = "miaohui_pipeline_stage_seconds_count"
    for stage in ("normalize", "intent", "reply", "compliance", "total"):
        assert _sample(service, count, pipeline="bank_advisor", stage=stage) == 2
    interventions = "miaohui_compliance_interventions_total"
    labels = {"pipeline": "bank_advisor", "rule": "risk_disclaimer", "action": "inserted"}
    assert _sample(service, interventions, **labels) == 1
    ok = {"model": "pipeline/bank_advisor", "version": "", "protocol": "http", "code": "200"}
    assert _sample(service, "miaohui_requests_total", **ok) == 2


async def test_unknown_pipeline_is_404_with_the_list(client: httpx.AsyncClient, service: DialogueService) -> None:
    r = await client.post("/v1/dialogue/bank", json={"text": "hi"})
    assert r.status_code == 404
    assert r.json() == {
        "error": "unknown pipeline 'bank'. Fix: use one of bank_advisor, gov_hotline, meeting_assistant, "
        "negotiation_coach",
        "pipelines": ["bank_advisor", "gov_hotline", "meeting_assistant", "negotiation_coach"],
    }
    bad = {"model": "_unknown", "version": "", "protocol": "http", "code": "404"}
    assert _sample(service, "miaohui_requests_total", **bad) == 1
    listing = (await client.get("/v1/dialogue")).json()["pipelines"]
    assert [p["model"] for p in listing][:2] == ["pipeline/bank_advisor", "pipeline/gov_hotline"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "request body is not valid JSON"),
        (b"[1]", "request body is a JSON list, not an object"),
        (b"{}", "invalid dialogue request at text: Field required"),
        (b'{"text": 5}', "invalid dialogue request at text: Input should be a valid string"),
        (b'{"text": ""}', "invalid dialogue request at text: String should have at least 1 character"),
        (b'{"text": "hi", "timings": "yes"}', "invalid dialogue request at timings: Input should be a valid boolean"),
        (b'{"text": "hi", "lang": "fr"}', "invalid dialogue request at lang: Input should be 'zh' or 'en'"),
        (b'{"text": "hi", "sesion_id": "x"}', "invalid dialogue request at sesion_id: Extra inputs are not permitted"),
        (b'{"text": "hi", "session_id": "a b"}', "bad session id 'a b'"),
        (b'{"text": "   "}', "empty dialogue text '   '"),
    ],
)
async def test_bad_bodies_are_400(client: httpx.AsyncClient, body: bytes, message: str) -> None:
    r = await client.post("/v1/dialogue/gov_hotline", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(message)
    assert (await client.post("/v1/dialogue/gov_hotline", json={"text": "查社保"})).status_code == 200


async def test_session_id_from_the_routing_header(client: httpx.AsyncClient) -> None:
    """The ingress hashes X-Session-Id; a body without session_id continues the header's session."""
    head = {"X-Session-Id": "routed-1"}
    r1 = await client.post("/v1/dialogue/gov_hotline", json={"text": "查社保"}, headers=head)
    r2 = await client.post("/v1/dialogue/gov_hotline", json={"text": "查社保"}, headers=head)
    assert (r1.json()["session_id"], r1.json()["turn"], r2.json()["turn"]) == ("routed-1", 1, 2)


def test_pipeline_model_names() -> None:
    assert pipeline_of_model("pipeline/bank_advisor") == "bank_advisor"
    assert pipeline_of_model("pipeline:gov_hotline") == "gov_hotline"
    assert pipeline_of_model("intent") is None and pipeline_of_model("pipeline/") is None


async def test_chat_completion_keeps_the_session_by_user_or_by_conversation(service: DialogueService) -> None:
    first = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "帮我订明天上午九点的会议室"}]
    c1 = await service.chat_completion("pipeline/meeting_assistant", first)
    assert c1["object"] == "chat.completion" and c1["model"] == "pipeline/meeting_assistant"
    reply = c1["choices"][0]["message"]
    assert reply["role"] == "assistant" and reply["content"].startswith("2026-03-04 09:00–10:00可预订的会议室有")
    # no `user` field: the conversation so far finds the session
    second = [*first, reply, {"role": "user", "content": "青松厅吧"}]
    c2 = await service.chat_completion("pipeline/meeting_assistant", second)
    assert c2["choices"][0]["message"]["content"].startswith("已为您预订青松厅")
    assert c2["miaohui"]["session_id"] == c1["miaohui"]["session_id"] and c2["miaohui"]["turn"] == 2
    # with `user`: that is the session (hashed when it is not a plain id)
    u1 = await service.chat_completion("gov_hotline", [{"role": "user", "content": "你好"}], user="Alice Smith")
    u2 = await service.chat_completion("gov_hotline", [{"role": "user", "content": "查社保"}], user="Alice Smith")
    assert u1["miaohui"]["session_id"] == u2["miaohui"]["session_id"] and u2["miaohui"]["turn"] == 2
    assert u1["miaohui"]["session_id"].startswith("u-")
    chunks = completion_chunks(u2)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 2
    assert chunks[0]["choices"][0]["delta"]["content"] == u2["choices"][0]["message"]["content"]
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_completion_errors(service: DialogueService) -> None:
    with pytest.raises(ModelNotFoundError, match="unknown pipeline 'nope'"):
        await service.chat_completion("pipeline/nope", [{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="the last message has role 'assistant'"):
        await service.chat_completion("pipeline/gov_hotline", [{"role": "assistant", "content": "hi"}])
    with pytest.raises(InputError, match="messages is empty"):
        await service.chat_completion("pipeline/gov_hotline", [])
    parts = [{"role": "user", "content": [{"type": "text", "text": "查社保"}]}]
    assert (await service.chat_completion("pipeline/gov_hotline", parts))["miaohui"]["intent"] == "social_insurance"


async def test_chat_delegate_for_the_openai_router(service: DialogueService) -> None:
    assert service.chat_delegate("smollm2-135m") is None
    assert service.model_names() == [
        "pipeline/bank_advisor",
        "pipeline/gov_hotline",
        "pipeline/meeting_assistant",
        "pipeline/negotiation_coach",
    ]
    handler = service.chat_delegate("pipeline/gov_hotline")
    assert handler is not None
    done = await handler({"model": "pipeline/gov_hotline", "messages": [{"role": "user", "content": "查社保"}]})
    assert done["miaohui"]["intent"] == "social_insurance" and "12333" in done["choices"][0]["message"]["content"]
    unknown = service.chat_delegate("pipeline/wealth")
    assert unknown is not None
    with pytest.raises(ModelNotFoundError, match="unknown pipeline 'wealth'"):
        await unknown({"messages": [{"role": "user", "content": "hi"}]})


async def test_chat_function_generator_takes_dicts_and_client_objects() -> None:
    from types import SimpleNamespace

    from miaohui.dialogue.engine_adapters import ChatFunctionGenerator
    from miaohui.errors import ArtifactError

    calls: list[dict[str, object]] = []

    async def as_dict(**kwargs: object) -> dict[str, object]:
        calls.append(kwargs)
        return {"choices": [{"message": {"role": "assistant", "content": "先了解原因"}}]}

    async def as_object(**kwargs: object) -> object:
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="ask why first"))])

    async def broken(**kwargs: object) -> dict[str, object]:
        return {"choices": []}

    messages = [{"role": "user", "content": "对方要求降价15%"}]
    assert await ChatFunctionGenerator(as_dict, "m").generate(messages, 64, 0.2) == "先了解原因"  # type: ignore[arg-type]
    assert calls == [{"model": "m", "messages": messages, "max_tokens": 64, "temperature": 0.2}]
    assert await ChatFunctionGenerator(as_object, "m").generate(messages, 64) == "ask why first"  # type: ignore[arg-type]
    with pytest.raises(ArtifactError, match=r"the chat function returned no choices\[0\].message.content"):
        await ChatFunctionGenerator(broken, "m").generate(messages, 64)  # type: ignore[arg-type]
