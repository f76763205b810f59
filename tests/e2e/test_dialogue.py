"""Every dialogue pipeline over HTTP on a real server: uvicorn on a free localhost port (background
thread) serving the real e5-small intent model as an ONNX Runtime int8 engine, driven with httpx through
multi-turn dialogues that include the seeds' examples. Checked per turn: intent, slots, the risk disclaimer
exactly once (and nowhere else), every number of the reply grounded in the user's words, the knowledge base
or the booking the turn made, per-stage timings, and the session; then the metrics of all turns.

The app is :func:`miaohui.server.app.build_app`; until the dialogue router is wired into it, the test adds
the router itself (the same object ``build_app`` will include). The ``openai`` client test needs the OpenAI
router to route ``pipeline/<name>`` models and is skipped, with the reason, until it does.

Without a generator the llm routes answer with templates; a second server runs the same routes with a real
generator (SmolLM2-135M-Instruct, exported to ONNX int8, on miaohui's generation engine), so compliance is
checked on text nobody wrote in advance.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from tests.artifacts import install_version
from tests.servers import UvicornThread

from miaohui.dialogue.compliance import DISCLAIMER, count_disclaimers
from miaohui.dialogue.tool_call import NO_MODEL
from miaohui.nlp.numbers import extract_numbers, numbers_grounded
from miaohui.server.app import build_app

pytestmark = pytest.mark.slow

TZ = timezone(timedelta(hours=8))  # the pipelines' local time
KB_TEXT = "\n".join(
    resources.files("miaohui.dialogue").joinpath("data", f).read_text(encoding="utf-8")
    for f in ("bank.yaml", "hotline.yaml", "office.yaml")
)


# ------------------------------------------------------------------------------------------- the server


def has_route(app: FastAPI, path: str) -> bool:
    return any(getattr(r, "path", None) == path for r in app.router.routes)


def dialogue_app(repo: Path) -> FastAPI:
    app = build_app(repo)
    if not has_route(app, "/v1/dialogue/{pipeline}"):  # not wired into build_app yet: add it here
        from miaohui.server.dialogue_api import DialogueService, dialogue_router

        state = app.state.miaohui
        app.state.dialogue = DialogueService.for_manager(state.manager, state.metrics)
        app.include_router(dialogue_router(app.state.dialogue))
    return app


@pytest.fixture(scope="module")
def repo(intent_engines: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("dialogue-repo")
    install_version(intent_engines["int8"], repo, "intent")
    return repo


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[UvicornThread]:
    with UvicornThread(dialogue_app(repo)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: UvicornThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


# ------------------------------------------------------------------------------------------- dialogues


def tomorrow(hour: int) -> str:
    day = datetime.now(TZ).date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day, hour, tzinfo=TZ).isoformat()


@dataclass(frozen=True)
class T:
    """One user turn and what its reply must show."""

    text: str
    intent: str | None
    """The intent answered (None: not checked)."""
    strategy: str
    slots: dict[str, Any] = field(default_factory=dict)
    """Slots the turn must extract (name → value, or a function giving it when the reply is checked: a date
    relative to today must not be fixed when the tests are collected, before a midnight the run may cross); others
    may come too."""
    disclaimer: bool = False
    contains: tuple[str, ...] = ()
    lang: str = "zh"
    variant: str | None = None


DIALOGUES: dict[str, tuple[str, list[T]]] = {
    "bank-zh": (
        "bank_advisor",
        [
            T("我想买一只稳健型基金，年化收益5%左右", "fund_recommendation", "kb",
              {"risk_level": "稳健型", "product": "基金", "percent": 5.0}, True, ("5%", "稳享固收增强混合")),
            T("最近黄金涨得不错，现在入场合适吗？", "market_outlook", "llm", {"product": "黄金"}, True,
              ("黄金ETF联接A",)),
            T("五年定期存款利率是多少？", "deposit_rates", "kb", {"product": "定期"}, False, ("1.6%",)),
            T("转人工", "human_agent", "handoff", {}, False, ("人工客服",)),
        ],
    ),
    "bank-en": (
        "bank_advisor",
        [
            T("I want a conservative fund with about 3% annual return", "fund_recommendation", "kb",
              {"risk_level": "保守型", "percent": 3.0}, True, ("3%",), "en"),
            T("Is now a good time to buy gold?", "market_outlook", "llm", {"product": "黄金"}, True,
              ("Gold ETF Feeder A",), "en"),
        ],
    ),
    "hotline": (
        "gov_hotline",
        [
            T("查社保", "social_insurance", "kb", {}, False, ("12333",)),
            T("我在朝阳区，社保断缴了怎么补缴？", "social_insurance", "kb", {"district": "朝阳区"}, False,
              ("（朝阳区）",)),
            T("公积金怎么提取", "housing_fund", "kb", {}, False, ("12329",)),
            T("转人工", "human_agent", "handoff", {}, False),
        ],
    ),
    "meeting": (
        "meeting_assistant",
        [
            T("帮我订明天上午九点的会议室", "book_meeting_room", "action", {"datetime": lambda: tomorrow(9)}, False,
              ("青松厅",), variant="need_room"),
            T("那就订青松厅", "book_meeting_room", "action", {}, False, ("已为您预订青松厅",), variant="default"),
            T("改到下午三点", "cancel_booking", "action", {}, False, ("15:00–16:00",), variant="changed"),
            T("取消预订", "cancel_booking", "action", {}, False, ("已取消预订",), variant="cancelled"),
        ],
    ),
    "negotiation": (
        "negotiation_coach",
        [
            T("你好", "greeting", "kb", {}, False, ("谈判训练教练",)),
            T("对方要求降价15%，我该如何应对？", None, "llm", {"percent": 15.0}, False, ("15%", "底线")),
            T("谢谢，再见", "goodbye", "kb"),
        ],
    ),
}  # fmt: skip


def booking_facts(resp: dict[str, Any]) -> list[str]:
    """The booking state of a turn (the booking made or changed, the session's pending times) as the replies
    write it: ``B0001``, ``2026-03-04 09:00``."""
    values = [*(resp.get("booking") or {}).values(), *resp["memory"].values()]
    out = [json.dumps(values, ensure_ascii=False)]
    for v in values:
        with contextlib.suppress(TypeError, ValueError):
            out.append(f"{datetime.fromisoformat(v):%Y-%m-%d %H:%M}")
    return out


def check_turn(t: T, i: int, resp: dict[str, Any], said: list[str], wall_ms: float, session: str | None) -> None:
    where = f"turn {i + 1} {t.text!r} -> {resp.get('text')!r}"
    if t.intent is not None:
        assert resp["intent"] == t.intent, where
    assert resp["strategy"] == t.strategy, where
    if t.variant is not None:
        assert resp["variant"] == t.variant, where
    assert resp["lang"] == t.lang, where
    slots = {s["name"]: s["value"] for s in resp["slots"]}
    want = {name: value() if callable(value) else value for name, value in t.slots.items()}
    assert want.items() <= slots.items(), (where, slots)
    for s in resp["slots"]:
        assert t.text[s["start"] : s["end"]] == s["text"], (where, s)
    # the disclaimer: exactly once in the session's language where required, nowhere otherwise
    text = resp["text"]
    assert resp["disclaimer"] is t.disclaimer, where
    assert count_disclaimers(text) == int(t.disclaimer), where
    if t.disclaimer:
        assert text.count(DISCLAIMER[t.lang]) == 1 and text.rstrip("。").endswith(DISCLAIMER[t.lang]), where
    # numbers: from the user's words, the knowledge base, or the booking this turn made or changed
    assert numbers_grounded(text, [*said, KB_TEXT, *booking_facts(resp)]) == [], where
    assert not resp["replaced"] and all(x["rule"] != "number_grounding" for x in resp["interventions"]), where
    for part in t.contains:
        assert part in text, (where, part)
    # timings
    tm = resp["timings"]
    parts = [tm[k] for k in ("normalize_ms", "intent_ms", "reply_ms", "compliance_ms")]
    assert all(p >= 0 for p in parts) and tm["total_ms"] >= sum(parts) - 0.05, (where, tm)
    assert tm["intent_ms"] > 0 and tm["total_ms"] <= wall_ms, (where, tm, wall_ms)
    # session and engine
    assert resp["turn"] == i + 1 and resp["new_session"] is (i == 0), where
    assert session is None or resp["session_id"] == session, where
    assert resp["engine"] == {"model": "intent", "version": 1}, where


def run_dialogue(http: httpx.Client, pipeline: str, turns: list[T]) -> list[dict[str, Any]]:
    session: str | None = None
    said: list[str] = []
    out = []
    for i, t in enumerate(turns):
        said.append(t.text)
        started = time.perf_counter()
        r = http.post(f"/v1/dialogue/{pipeline}", json={"text": t.text, "session_id": session, "timings": True})
        wall_ms = (time.perf_counter() - started) * 1000
        assert r.status_code == 200, r.text
        resp = r.json()
        check_turn(t, i, resp, said, wall_ms, session)
        session = resp["session_id"]
        out.append(resp)
    return out


@pytest.mark.parametrize("name", list(DIALOGUES))
def test_dialogue_over_http(http: httpx.Client, server: UvicornThread, name: str) -> None:
    pipeline, turns = DIALOGUES[name]
    before = {
        s: server.sample("miaohui_pipeline_stage_seconds_count", pipeline=pipeline, stage=s)
        for s in ("intent", "total")
    }
    replies = run_dialogue(http, pipeline, turns)
    for stage, count in before.items():
        after = server.sample("miaohui_pipeline_stage_seconds_count", pipeline=pipeline, stage=stage)
        assert after == count + len(turns)
    if pipeline == "meeting_assistant":
        booked, changed, cancelled = (r["booking"] for r in replies[1:])
        assert booked["room_id"] == changed["room_id"] == cancelled["room_id"] and booked["start"] == tomorrow(9)
        assert changed["start"] == tomorrow(15) and booked["id"] in replies[3]["text"]
        no_model = {"function": "book_meeting", "source": "rules", "arguments": None, "fallback": NO_MODEL}
        assert [r["tool_call"] for r in replies] == [no_model, no_model, None, None]  # cancel takes no call
    if pipeline == "negotiation_coach":
        keywords = replies[1]["keywords"]
        assert set(keywords) == {"拒绝", "接受", "折中", "探询"} and keywords["折中"] >= 1 and keywords["拒绝"] >= 1


def test_timings_only_when_asked_and_metrics_always(http: httpx.Client, server: UvicornThread) -> None:
    labels = {"pipeline": "bank_advisor", "rule": "risk_disclaimer", "action": "inserted"}
    inserted = server.sample("miaohui_compliance_interventions_total", **labels)
    total = server.sample("miaohui_pipeline_stage_seconds_count", pipeline="bank_advisor", stage="total")
    r = http.post("/v1/dialogue/bank_advisor", json={"text": "赎回基金多久到账"})
    assert r.status_code == 200 and "timings" not in r.json()
    assert r.json()["intent"] == "product_redemption" and r.json()["text"].count(DISCLAIMER["zh"]) == 1
    assert server.sample("miaohui_compliance_interventions_total", **labels) == inserted + 1
    assert server.sample("miaohui_pipeline_stage_seconds_count", pipeline="bank_advisor", stage="total") == total + 1
    text = http.get("/metrics").text
    assert 'miaohui_pipeline_stage_seconds_bucket{le="0.1",pipeline="bank_advisor",stage="reply"}' in text
    assert 'miaohui_requests_total{code="200",model="pipeline/bank_advisor",protocol="http",version="1"}' in text


def test_errors_are_4xx_and_the_server_keeps_serving(http: httpx.Client) -> None:
    unknown = http.post("/v1/dialogue/wealth", json={"text": "hi"})
    assert unknown.status_code == 404
    assert unknown.json()["pipelines"] == ["bank_advisor", "gov_hotline", "meeting_assistant", "negotiation_coach"]
    missing = http.post("/v1/dialogue/gov_hotline", json={"session_id": "x"})
    assert missing.status_code == 400 and missing.json()["error"].startswith("invalid dialogue request at text")
    garbage = http.post("/v1/dialogue/gov_hotline", content=b"{", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and garbage.json()["error"].startswith("request body is not valid JSON")
    late = http.post("/v1/dialogue/gov_hotline", json={"text": "查社保"}, headers={"x-request-timeout-ms": "0.001"})
    assert late.status_code == 504, late.text
    ok = http.post("/v1/dialogue/gov_hotline", json={"text": "查社保"})
    assert ok.status_code == 200 and ok.json()["intent"] == "social_insurance"


def test_concurrent_sessions_stay_apart(http: httpx.Client, server: UvicornThread) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(k: int) -> list[dict[str, Any]]:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return run_dialogue(c, "gov_hotline", DIALOGUES["hotline"][1])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    sessions = {r[0]["session_id"] for r in results}
    assert len(sessions) == 8 and all([x["turn"] for x in r] == [1, 2, 3, 4] for r in results)


def test_openai_client_with_pipeline_models(server: UvicornThread, http: httpx.Client) -> None:
    listed = http.get("/v1/models")
    names = [m.get("id") for m in listed.json().get("data", [])] if listed.status_code == 200 else []
    if "pipeline/bank_advisor" not in names:
        pytest.skip(
            "the OpenAI router (/v1/chat/completions, /v1/models) does not serve pipeline models yet: pass "
            "chat_delegate=DialogueService.chat_delegate and the pipelines' model_names() to openai_router"
        )
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    seed = [{"role": "user", "content": "我想买一只稳健型基金，年化收益5%左右"}]
    c = client.chat.completions.create(model="pipeline/bank_advisor", messages=seed, user="oa-fund")  # type: ignore[arg-type]
    content = c.choices[0].message.content or ""
    assert c.model == "pipeline/bank_advisor" and content.count(DISCLAIMER["zh"]) == 1
    assert 5.0 in extract_numbers(content) and (c.model_extra or {})["miaohui"]["intent"] == "fund_recommendation"
    # multi-turn without `user`: the server finds the session from the conversation
    book = [{"role": "user", "content": "帮我订明天下午两点的会议室"}]
    first = client.chat.completions.create(model="pipeline/meeting_assistant", messages=book)  # type: ignore[arg-type]
    book += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "那就订星河厅"},
    ]
    second = client.chat.completions.create(model="pipeline/meeting_assistant", messages=book)  # type: ignore[arg-type]
    assert (second.choices[0].message.content or "").startswith("已为您预订星河厅")
    stream = client.chat.completions.create(
        model="pipeline/gov_hotline", messages=[{"role": "user", "content": "查社保"}], stream=True
    )  # type: ignore[arg-type]
    assert "12333" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="pipeline/nope", messages=seed)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- with a real LLM

SMOLLM_CACHE = Path(__file__).resolve().parents[2] / "var" / "test-cache" / "smollm2-135m"


@pytest.fixture(scope="module")
def llm_server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornThread]:
    """The dialogue routes with a real generator, wired as ``miaohui serve --dialogue-llm smollm2`` wires them
    (:func:`build_app`): SmolLM2-135M-Instruct (fp32 ONNX, :mod:`tests.prebuild`) in the same repository as the
    intent model, served by the server's generation service, the pipelines generating through the server's own
    generator (:class:`~miaohui.server.openai_api.LLMTextGenerator`) instead of their fallback templates."""
    from tests.prebuild import LLM_MODEL, ensure_llm_repository

    from miaohui.server.openai_api import LLMTextGenerator

    both = tmp_path_factory.mktemp("dialogue-llm-repo")
    shutil.copytree(repo / "intent", both / "intent", copy_function=os.link)
    shutil.copytree(ensure_llm_repository() / LLM_MODEL, both / LLM_MODEL, copy_function=os.link)
    app = build_app(both, dialogue_llm=LLM_MODEL)
    with UvicornThread(app) as srv:
        generators = {type(p.generator) for p in app.state.miaohui.dialogue.pipelines.values()}
        assert generators == {LLMTextGenerator}
        yield srv


@pytest.mark.parametrize(
    ("pipeline", "text", "lang", "disclaimer"),
    [
        ("bank_advisor", "最近黄金涨得不错，现在入场合适吗？", "zh", True),
        ("bank_advisor", "Is now a good time to buy gold?", "en", True),
        ("negotiation_coach", "对方要求降价15%，我该如何应对？", "zh", False),
        ("negotiation_coach", "The buyer wants a 10% discount and free shipping. How should I respond?", "en", False),
    ],
)
def test_generated_replies_pass_compliance(
    llm_server: UvicornThread, pipeline: str, text: str, lang: str, disclaimer: bool
) -> None:
    """Whatever the model writes: the disclaimer exactly once where required, no guaranteed-return wording,
    and every number grounded — or the reply replaced by the pipeline's safe answer, and the rule counted."""
    from miaohui.dialogue.compliance import find_forbidden_promises
    from miaohui.dialogue.config import load_pipeline_config

    with httpx.Client(base_url=llm_server.url, timeout=120) as http:
        r = http.post(f"/v1/dialogue/{pipeline}", json={"text": text, "timings": True})
    assert r.status_code == 200, r.text
    resp = r.json()
    reply = resp["text"]
    assert resp["strategy"] == "llm" and resp["variant"] is None and resp["lang"] == lang  # generated, not a template
    assert count_disclaimers(reply) == int(disclaimer) and reply.count(DISCLAIMER[lang]) == int(disclaimer)
    assert find_forbidden_promises(reply) == []
    safe = load_pipeline_config(pipeline).compliance.safe_reply.get(lang)  # type: ignore[arg-type]
    if resp["replaced"]:
        assert reply.startswith(safe) and any(i["action"] == "replaced" for i in resp["interventions"])
    else:
        assert numbers_grounded(reply, [text, KB_TEXT]) == []
    for i in resp["interventions"]:
        labels = {"pipeline": pipeline, "rule": i["rule"], "action": i["action"]}
        assert llm_server.sample("miaohui_compliance_interventions_total", **labels) >= 1
    assert resp["timings"]["reply_ms"] > resp["timings"]["intent_ms"]  # the generator ran in the reply stage
    if pipeline == "negotiation_coach":
        assert set(resp["keywords"]) == {"拒绝", "接受", "折中", "探询"}


BOOKING_TURNS = [
    "帮我订明天上午九点的会议室",
    "8个人，两个小时",
    "那就订青松厅",
    "Book the Galaxy Room tomorrow at 3 pm for 10 people, one hour.",
    "后天下午两点到四点，翠竹厅",
]


def test_the_meeting_assistant_books_from_the_model_tool_call(llm_server: UvicornThread) -> None:
    """With a chat model the booking slots come from SmolLM2's call of ``book_meeting``, decoded under the
    function's JSON schema: every call parses and validates against the schema. The 135M model's values may be
    wrong (a date that is no calendar day, a time the office is closed): only the shape is checked, and a call whose
    values fail the calendar check falls back to the rule slots and says so."""
    import jsonschema

    from miaohui.dialogue.config import load_pipeline_config
    from miaohui.dialogue.knowledge import load_knowledge
    from miaohui.dialogue.tool_call import booking_tool

    route = load_pipeline_config("meeting_assistant").routes["book_meeting_room"]
    assert route.tool_call is not None
    kb = load_knowledge()
    session = None
    with httpx.Client(base_url=llm_server.url, timeout=300) as http:
        for k, text in enumerate(BOOKING_TURNS):
            if k == 3:
                session = None  # a new conversation in English
            body: dict[str, Any] = {"text": text, "session_id": session} if session else {"text": text}
            r = http.post("/v1/dialogue/meeting_assistant", json=body)
            assert r.status_code == 200, r.text
            resp = r.json()
            session = resp["session_id"]
            if resp["intent"] != "book_meeting_room":
                continue  # the intent model routed the turn elsewhere: no call
            call = resp["tool_call"]
            assert call["function"] == "book_meeting" and call["arguments"] is not None, call
            schema = booking_tool(kb, route.tool_call, resp["lang"])["function"]["parameters"]
            jsonschema.validate(call["arguments"], schema)
            if call["source"] == "rules":
                assert call["fallback"].startswith("the model's call failed validation: date "), call
            else:
                assert call["source"] == "model" and call["fallback"] is None
