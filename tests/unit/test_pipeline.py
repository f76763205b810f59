"""Dialogue pipelines end to end in-process, with sessions and the booking table.

``FakeClassifier`` (keyword rules) and ``FakeGenerator`` (scripted replies) are fakes standing in for the
intent engine and the causal-LM engine; the e2e tests drive the same pipelines with the real engines over
HTTP. Everything else here is the real code: configs, knowledge base, slots, compliance, sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from miaohui.dialogue import PIPELINE_NAMES, ChatMessage, Pipeline, load_pipeline_config
from miaohui.dialogue.session import SessionConfig, SessionStore, Turn
from miaohui.errors import ConfigError, InputError

TZ = timezone(timedelta(hours=8))
NOW = datetime(2026, 3, 3, 10, 0, tzinfo=TZ)  # a Tuesday
ZH = "投资有风险，入市需谨慎"
EN = "Investing involves risk; enter the market with caution."

RULES: list[tuple[str, str, float]] = [
    ("转人工", "human_agent", 0.97),
    ("human", "human_agent", 0.95),
    ("基金", "fund_recommendation", 0.95),
    ("fund", "fund_recommendation", 0.93),
    ("黄金", "market_outlook", 0.91),
    ("gold", "market_outlook", 0.9),
    ("利率", "deposit_rates", 0.9),
    ("稳健型", "risk_assessment", 0.8),
    ("社保", "social_insurance", 0.97),
    ("取消", "cancel_booking", 0.92),
    ("改到", "cancel_booking", 0.9),
    ("会议室", "book_meeting_room", 0.96),
    ("订", "book_meeting_room", 0.9),
    ("book", "book_meeting_room", 0.9),
    ("你好", "greeting", 0.99),
    ("嗯嗯", "out_of_scope", 0.2),
]


class FakeClassifier:
    """Stands in for the intent engine: the first keyword rule that matches, else out_of_scope (0.9)."""

    def __init__(self, rules: Sequence[tuple[str, str, float]] = RULES) -> None:
        self.rules = rules
        self.calls: list[list[str]] = []

    async def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        self.calls.append(list(texts))
        out = []
        for text in texts:
            hit = next(((i, c) for k, i, c in self.rules if k in text.lower()), ("out_of_scope", 0.9))
            out.append(hit)
        return out


class FakeGenerator:
    """Stands in for the causal-LM engine: returns scripted replies in turn and records the prompts."""

    def __init__(self, *replies: str, delay: float = 0.0) -> None:
        self.replies = list(replies)
        self.delay = delay
        self.calls: list[tuple[list[ChatMessage], int, float]] = []

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        self.calls.append((messages, max_tokens, temperature))
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.replies[(len(self.calls) - 1) % len(self.replies)]


def make(name: str, generator: FakeGenerator | None = None) -> Pipeline:
    return Pipeline.from_name(name, FakeClassifier(), generator, clock=lambda: NOW)


# ------------------------------------------------------------------------------------------- the seeds


async def test_seed_fund_recommendation() -> None:
    pipe = make("bank_advisor")
    r = await pipe.run_turn("我想买一只稳健型基金，年化收益5%左右", "s1")
    assert (r.intent, r.strategy, r.variant, r.lang) == ("fund_recommendation", "kb", "default", "zh")
    assert {(s.name, s.value) for s in r.slots} == {
        ("risk_level", "稳健型"),
        ("product", "基金"),
        ("percent", 5.0),
    }
    assert r.text.startswith("根据您的稳健型风险偏好，目标年化收益约5%，以下产品的风险等级与您匹配：稳享固收增强混合")
    assert r.text.count(ZH) == 1 and r.text.endswith(f"{ZH}。")
    assert r.disclaimer and not r.replaced
    assert [(i.rule, i.action) for i in r.interventions] == [("risk_disclaimer", "inserted")]
    t = r.timings
    parts = (t.normalize_ms, t.intent_ms, t.reply_ms, t.compliance_ms)
    assert all(p >= 0 for p in parts)
    assert t.total_ms >= sum(parts) - 0.01
    assert (r.session_id, r.new_session, r.turn) == ("s1", True, 1)


async def test_seed_market_outlook_through_the_llm() -> None:
    gen = FakeGenerator(f"黄金ETF联接A历史年化在-5%到12%之间，短期难以预测。这只产品稳赚不赔。{ZH}。{ZH}")
    pipe = make("bank_advisor", gen)
    r = await pipe.run_turn("最近黄金涨得不错，现在入场合适吗？")
    assert (r.intent, r.strategy, r.variant) == ("market_outlook", "llm", None)
    assert r.text == f"黄金ETF联接A历史年化在-5%到12%之间，短期难以预测。{ZH}。"
    assert [(i.rule, i.action) for i in r.interventions] == [
        ("forbidden_promise", "removed"),
        ("risk_disclaimer", "deduplicated"),
    ]
    messages, max_tokens, temperature = gen.calls[0]
    assert (max_tokens, temperature) == (256, 0.3)
    assert messages[0]["role"] == "system"
    assert "理财顾问" in messages[0]["content"] and "MH5001" not in messages[0]["content"]
    assert messages[-1]["role"] == "user" and "黄金ETF联接A（MH5001" in messages[-1]["content"]
    assert messages[-1]["content"].startswith(
        "最近黄金涨得不错，现在入场合适吗？\n\n参考资料（只可引用其中的数字）：\n"
    )


async def test_llm_number_not_in_sources_is_replaced() -> None:
    pipe = make("bank_advisor", FakeGenerator("黄金今年已经涨了28%，还能再涨。"))
    r = await pipe.run_turn("最近黄金涨得不错，现在入场合适吗？")
    assert r.replaced
    assert r.text == f"{pipe.config.compliance.safe_reply.zh}{ZH}。"
    assert r.interventions[0].detail == "numbers not in the user's words or the knowledge base: 28"


async def test_market_outlook_without_generator_uses_its_template() -> None:
    r = await make("bank_advisor").run_turn("最近黄金涨得不错，现在入场合适吗？")
    assert (r.strategy, r.variant) == ("llm", "default")
    assert r.text.startswith("黄金的短期走势受多种因素影响，无法准确预测")
    assert r.text.count(ZH) == 1


async def test_seed_social_insurance() -> None:
    r = await make("gov_hotline").run_turn("查社保")
    assert (r.intent, r.strategy, r.disclaimer) == ("social_insurance", "kb", False)
    assert r.text.startswith("关于社保查询与缴费：第一步，")
    assert "人社服务热线12333、政务服务便民热线12345" in r.text
    assert r.interventions == []


async def test_seed_booking_date_then_room() -> None:
    pipe = make("meeting_assistant")
    first = await pipe.run_turn("帮我订明天上午九点的会议室", "a")
    assert (first.intent, first.variant) == ("book_meeting_room", "need_room")
    assert first.slots[0].value == "2026-03-04T09:00:00+08:00"
    assert first.text.startswith("2026-03-04 09:00–10:00可预订的会议室有：明月轩（5楼，4人）")
    second = await pipe.run_turn("青松厅吧", "a")  # the fake says out_of_scope: the pending booking continues
    assert (second.classified_intent, second.intent, second.variant) == (
        "out_of_scope",
        "book_meeting_room",
        "default",
    )
    assert second.text == "已为您预订青松厅（3楼，可容纳12人），时间2026-03-04 09:00–10:00，预订号B0001。"
    assert second.booking is not None and second.booking.room_id == "R301"
    assert second.memory["last_booking"] == "B0001"
    assert "booking_start" not in second.memory


async def test_booking_conflict_between_sessions_then_change_and_cancel() -> None:
    pipe = make("meeting_assistant")
    await pipe.run_turn("订明天上午九点的青松厅", "a")
    clash = await pipe.run_turn("订明天上午九点半的青松厅，8个人", "b")
    assert clash.variant == "conflict"
    assert clash.text == (
        "青松厅在2026-03-04 09:00–10:00已被预订，与2026-03-04 09:30–10:30冲突。"
        "该时段空闲的会议室有：星河厅（5楼，20人）、海棠厅（8楼，30人）。"
    )
    ok = await pipe.run_turn("那就星河厅", "b")
    assert ok.variant == "default" and ok.booking is not None and ok.booking.room_id == "R501"
    assert (await pipe.run_turn("取消B0001", "b")).variant == "no_booking"  # not b's booking
    moved = await pipe.run_turn("改到下午三点", "a")
    assert moved.text == "已将预订B0001从青松厅（2026-03-04 09:00–10:00）改为青松厅（2026-03-04 15:00–16:00）。"
    gone = await pipe.run_turn("取消预订", "a")
    assert gone.text == "已取消预订B0001：青松厅，2026-03-04 15:00–16:00。"
    assert len(pipe.bookings) == 1


async def test_booking_checks_time_and_size() -> None:
    pipe = make("meeting_assistant")
    assert (await pipe.run_turn("订今天早上八点的青松厅", "p")).variant == "past"
    closed = await pipe.run_turn("订明天晚上十点的青松厅", "c")
    assert closed.text == ("会议室开放时间为08:00到21:00，2026-03-04 22:00–23:00不在开放时间内，请换一个时间。")
    small = await pipe.run_turn("订明天下午三点的翠竹厅，10个人", "s")
    assert small.text.startswith("翠竹厅只能容纳6人，不够10人使用。")
    assert (await pipe.run_turn("订明天下午两点到四点的海棠厅", "r")).booking.end.hour == 16  # type: ignore[union-attr]


async def test_booking_asks_for_a_time_and_remembers_the_day() -> None:
    pipe = make("meeting_assistant")
    ask = await pipe.run_turn("我想订后天的会议室", "d")
    assert ask.variant == "need_time"
    done = await pipe.run_turn("下午两点，明月轩", "d")
    assert done.text == "已为您预订明月轩（5楼，可容纳4人），时间2026-03-05 14:00–15:00，预订号B0001。"


async def test_seed_negotiation_reports_keyword_categories() -> None:
    gen = FakeGenerator("先了解原因，再决定是否接受；可以用条件交换争取折中，超出底线就拒绝。")
    pipe = make("negotiation_coach", gen)
    r = await pipe.run_turn("对方要求降价15%，我该如何应对？", "n")
    assert (r.intent, r.strategy, r.disclaimer) == ("out_of_scope", "llm", False)
    assert r.keywords == {"拒绝": 1, "接受": 1, "折中": 2, "探询": 1}
    assert "谈判训练教练" in gen.calls[0][0][0]["content"]
    await pipe.run_turn("那对方不同意怎么办？", "n")
    history = gen.calls[1][0]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2]["content"] == r.text


async def test_llm_prompt_is_a_growing_prefix() -> None:
    """Turn k+1's prompt starts with turn k's prompt (its facts included) and the model's own reply (the disclaimer
    compliance appends is not repeated), so a prefix cache reuses all of it."""
    gen = FakeGenerator("黄金ETF联接A波动较大，请谨慎。", "黄金ETF联接A适合长期持有。")
    pipe = make("bank_advisor", gen)
    r = await pipe.run_turn("最近黄金涨得不错，现在入场合适吗？", "g")
    await pipe.run_turn("黄金还能买吗？", "g")
    first, second = gen.calls[0][0], gen.calls[1][0]
    assert "参考资料" in first[1]["content"] and ZH in r.text
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "黄金ETF联接A波动较大，请谨慎。"}
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]


def test_history_window_moves_in_half_window_steps() -> None:
    from miaohui.dialogue.pipeline import history_window

    turns = [Turn(user=str(i), reply="r", intent="greeting") for i in range(12)]
    starts = [int(history_window(turns[:n], 6)[0].user) if n else None for n in range(13)]
    assert starts == [None, 0, 0, 0, 0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert history_window(turns, 0) == []


async def test_negotiation_without_generator_echoes_the_figures() -> None:
    r = await make("negotiation_coach").run_turn("对方要求降价15%，我该如何应对？")
    assert r.text.startswith("对方提出的条件「对方要求降价15%」先别急着答应")
    assert not r.replaced


# ------------------------------------------------------------------------------------------- routing


async def test_english_session_gets_english_disclaimer() -> None:
    pipe = make("bank_advisor")
    r = await pipe.run_turn("Recommend a fund for a low risk investor, around 2% a year", "e")
    assert r.lang == "en"
    assert r.text.startswith("For your Conservative risk profile, aiming at about 2% a year")
    assert r.text.count(EN) == 1
    follow = await pipe.run_turn("123", "e")  # no language in the text: the session's is kept
    assert follow.lang == "en"


async def test_low_confidence_clarifies() -> None:
    r = await make("bank_advisor").run_turn("嗯嗯")
    assert (r.strategy, r.confidence) == ("clarify", 0.2)
    assert r.text.startswith("抱歉，我没太明白您的意思")


async def test_handoff_and_other_business_lines() -> None:
    pipe = make("bank_advisor")
    handoff = await pipe.run_turn("帮我转人工")
    assert handoff.handoff and handoff.strategy == "handoff"
    other = await pipe.run_turn("查社保")
    assert (other.intent, other.strategy) == ("social_insurance", "kb")
    assert other.text.startswith("这个问题超出了我的服务范围")


async def test_slot_memory_carries_the_risk_level() -> None:
    pipe = make("bank_advisor")
    await pipe.run_turn("我是稳健型的", "m")
    r = await pipe.run_turn("推荐个基金吧，年化4%左右", "m")
    assert r.text.startswith("根据您的稳健型风险偏好，目标年化收益约4%")
    assert r.memory["risk_level"] == "稳健型"


async def test_same_session_turns_run_one_after_the_other() -> None:
    gen = FakeGenerator("先问清原因。", "再谈条件交换。", delay=0.01)
    pipe = make("negotiation_coach", gen)
    first, second = await asyncio.gather(pipe.run_turn("第一轮", "x"), pipe.run_turn("第二轮", "x"))
    assert sorted([first.turn, second.turn]) == [1, 2]
    assert len(gen.calls[1][0]) == 4  # the second call saw the first turn in its history


# ------------------------------------------------------------------------------------------- sessions


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_sessions_expire_by_ttl() -> None:
    clock = Clock()
    store = SessionStore(SessionConfig(ttl_s=60, max_sessions=10, max_turns=5), clock=clock)
    s, created = store.get("a")
    s.memory["x"] = 1.0
    clock.t += 59
    assert store.get("a") == (s, False)
    clock.t += 60
    assert "a" not in store
    fresh, created = store.get("a")
    assert created and fresh.memory == {}
    assert store.stats().expired == 1


def test_sessions_evict_least_recently_used() -> None:
    clock = Clock()
    store = SessionStore(SessionConfig(ttl_s=600, max_sessions=2, max_turns=5), clock=clock)
    store.get("a")
    store.get("b")
    store.get("a")  # a is now the most recent
    store.get("c")
    assert "b" not in store and "a" in store and "c" in store
    assert store.stats().model_dump() == {"active": 2, "created": 3, "expired": 0, "evicted": 1}


def test_sessions_keep_the_last_turns() -> None:
    store = SessionStore(SessionConfig(max_turns=2))
    s, _ = store.get("a")
    for i in range(3):
        s.add_turn(Turn(user=str(i), reply="r", intent="greeting"))
    assert [t.user for t in s.turns] == ["1", "2"] and s.turns_total == 3


def test_bad_session_id() -> None:
    with pytest.raises(InputError) as exc:
        SessionStore().get("has space")
    assert str(exc.value) == (
        "bad session id 'has space' — use 1-128 characters from letters, digits and _ . : @ -, "
        "or omit it to start a new session"
    )


async def test_pipeline_session_expires() -> None:
    clock = Clock()
    cfg = load_pipeline_config("bank_advisor")
    store = SessionStore(cfg.session, clock=clock)
    pipe = Pipeline(cfg, FakeClassifier(), clock=lambda: NOW, sessions=store)
    await pipe.run_turn("我是稳健型的", "m")
    clock.t += cfg.session.ttl_s + 1
    r = await pipe.run_turn("推荐个基金", "m")
    assert r.new_session and r.variant == "need_risk"


# ------------------------------------------------------------------------------------------- errors


async def test_input_errors() -> None:
    pipe = make("bank_advisor")
    with pytest.raises(InputError, match="empty dialogue text"):
        await pipe.run_turn("  \u200b ")
    with pytest.raises(InputError) as exc:
        await pipe.run_turn("好" * 2001)
    assert str(exc.value) == (
        "dialogue text has 2001 characters, more than 2000 — "
        "send one user turn at a time, or raise max_text_chars in the pipeline config"
    )


async def test_classifier_errors() -> None:
    pipe = Pipeline.from_name("bank_advisor", FakeClassifier([("", "fund_recommend", 0.9)]), clock=lambda: NOW)
    with pytest.raises(ConfigError) as exc:
        await pipe.run_turn("你好")
    assert str(exc.value) == (
        "the intent classifier returned the unknown label 'fund_recommend' — "
        "use a classifier trained on the 24 labels of shared/INTENTS.md"
    )


def test_llm_route_needs_a_generator() -> None:
    cfg = load_pipeline_config("negotiation_coach")
    fallback = cfg.fallback.model_copy(update={"templates": {}})
    with pytest.raises(ConfigError) as exc:
        Pipeline(cfg.model_copy(update={"fallback": fallback}), FakeClassifier())
    assert str(exc.value) == (
        "pipeline 'negotiation_coach' answers fallback with the llm strategy but no generator was given — "
        "pass generator=..., or give the route templates to answer without one"
    )


def test_every_packaged_pipeline_loads() -> None:
    for name in PIPELINE_NAMES:
        cfg = load_pipeline_config(name)
        assert cfg.name == name
        assert make(name, FakeGenerator("好的。")).config.name == name
    with pytest.raises(ConfigError, match="unknown pipeline 'bank'"):
        load_pipeline_config("bank")


def _write(tmp_path: Path, old: str, new: str) -> Path:
    src = Path(__file__).parents[2] / "src/miaohui/dialogue/pipelines/bank_advisor.yaml"
    text = src.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "bank.yaml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


def test_template_with_a_number_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, "感谢您的咨询，祝您生活愉快！", "感谢您的咨询，客服电话95555。")
    with pytest.raises(ConfigError) as exc:
        load_pipeline_config(path)
    assert str(exc.value) == (
        "pipeline 'bank_advisor' routes.goodbye: template default.zh has numbers in its text: "
        "'感谢您的咨询，客服电话95555。' — move figures into the knowledge base and use a field; "
        "template numbers are not grounded"
    )


def test_template_variants_and_fields_are_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "      no_match:\n", "      nomatch:\n")
    with pytest.raises(ConfigError) as exc:
        load_pipeline_config(path)
    assert str(exc.value) == (
        "pipeline 'bank_advisor' routes.fund_recommendation: templates ['above_range', 'default', "
        "'need_risk', 'nomatch'] do not match the variants of 'funds'; missing ['no_match']; unknown "
        "['nomatch'] — give exactly the variants ['above_range', 'default', 'need_risk', 'no_match']"
    )
    path = _write(tmp_path, '"{answer}{fund}赎回后{days}到账。"', '"{answer}{fund}赎回后{day}到账。"')
    with pytest.raises(ConfigError, match=r"template fund.zh uses unknown field\(s\) \['day'\]"):
        load_pipeline_config(path)


async def test_rejected_time_and_room_are_not_remembered() -> None:
    pipe = make("meeting_assistant")
    past = await pipe.run_turn("订今天早上八点的青松厅", "f")
    assert past.variant == "past" and "booking_start" not in past.memory and past.memory["room"] == "R301"
    small = await pipe.run_turn("订明天上午十点的翠竹厅，10个人", "g")
    assert small.variant == "too_small" and "room" not in small.memory
    assert small.memory["attendees"] == 10.0
    done = await pipe.run_turn("那就青松厅", "g")
    assert done.text == "已为您预订青松厅（3楼，可容纳12人），时间2026-03-04 10:00–11:00，预订号B0001。"


class RejectingClassifier:
    """A model below its out-of-scope threshold: ``out_of_scope`` with the candidate it rejected."""

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        return [("out_of_scope", 0.41, "card_loss") for _ in texts]


async def test_an_out_of_scope_answer_takes_the_fallback_and_names_the_candidate() -> None:
    pipe = Pipeline.from_name("gov_hotline", RejectingClassifier(), None, clock=lambda: NOW)
    r = await pipe.run_turn("what's the weather like", "oos")
    assert (r.intent, r.classified_intent, r.candidate, r.confidence) == (
        "out_of_scope",
        "out_of_scope",
        "card_loss",
        0.41,
    )
    assert r.strategy == pipe.config.fallback.strategy
    plain = await make("gov_hotline").run_turn("你好", "plain")
    assert plain.candidate is None
