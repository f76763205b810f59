"""A dialogue pipeline: normalize → intent (+ slots) → reply → compliance → response, one turn at a time.

Build one from its YAML with an intent classifier and, for the ``llm`` strategy, a text generator::

    pipeline = Pipeline.from_name("bank_advisor", classifier=my_classifier, generator=my_generator)
    response = await pipeline.run_turn("我想买一只稳健型基金，年化收益5%左右", session_id="abc")
    response.text, response.intent, response.slots, response.timings.total_ms

The model calls sit behind two small protocols so that the pipeline stays pure Python and testable with
fakes: :class:`IntentClassifier` (the server wraps its intent engine and batcher) and
:class:`TextGenerator` (the server wraps its causal-LM engine). Stages and their timings
(:class:`StageTimings`, milliseconds):

* ``normalize`` — :func:`~miaohui.nlp.normalize.normalize_text`, language detection (the text's, else the
  session's, else the pipeline's default), slot extraction against the pipeline's local clock.
* ``intent`` — the classifier on the normalized text.
* ``reply`` — route selection, then the route's strategy. A pending action (a booking waiting for its
  room) is continued when the turn carries what it needs and the classifier did not name another business
  line's intent with confidence; else confidence below ``clarify_threshold`` takes the clarify route;
  else the intent's route (or ``fallback``).
* ``compliance`` — :func:`~miaohui.dialogue.compliance.apply_compliance` with the session's user turns
  and the knowledge-base facts of this reply as number sources.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Protocol, TypedDict

from pydantic import BaseModel, Field

from miaohui.dialogue.answers import LOOKUPS, AnswerContext, KbAnswer, MemoryValue
from miaohui.dialogue.booking import (
    ActionResult,
    Booking,
    BookingTable,
    book_action,
    cancel_action,
    continues_booking,
    rule_slots,
)
from miaohui.dialogue.compliance import Intervention, apply_compliance
from miaohui.dialogue.config import PipelineConfig, Route, Strategy, load_pipeline_config
from miaohui.dialogue.knowledge import KnowledgeBase, Lang, load_knowledge
from miaohui.dialogue.language import detect_language
from miaohui.dialogue.session import Session, SessionBackend, SessionStore, Turn
from miaohui.dialogue.tool_call import ToolCallTrace, slots_from_model
from miaohui.errors import ConfigError, InputError
from miaohui.nlp.keywords import count_categories
from miaohui.nlp.normalize import normalize_text
from miaohui.nlp.slots import Slot, extract_slots
from miaohui.zoo.intents import BUSINESS_LINE, LABELS

logger = logging.getLogger(__name__)

__all__ = ["ChatMessage", "DialogueResponse", "IntentClassifier", "Pipeline", "StageTimings", "TextGenerator"]


class ChatMessage(TypedDict):
    """One OpenAI-style chat message: role ``system`` / ``user`` / ``assistant`` and its content."""

    role: str
    content: str


Classification = tuple[str, float] | tuple[str, float, str]
"""``(intent label, confidence)``, or with a third item, the best label: when the label is ``out_of_scope`` because the
model was not confident enough, the candidate it rejected."""


class IntentClassifier(Protocol):
    """Classifies texts into the 24 intent labels of shared/INTENTS.md."""

    async def classify(self, texts: list[str]) -> Sequence[Classification]:
        """One ``(intent label, confidence in [0, 1])`` (or ``(label, confidence, candidate)``) per text, in order."""
        ...


class TextGenerator(Protocol):
    """Generates an assistant reply for a chat."""

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        """The reply text (without the prompt) for ``messages``."""
        ...


class StageTimings(BaseModel):
    """Milliseconds spent per stage of one turn."""

    normalize_ms: float
    intent_ms: float
    reply_ms: float
    compliance_ms: float
    total_ms: float


class DialogueResponse(BaseModel):
    """The answer to one turn."""

    pipeline: str
    """Pipeline name."""
    session_id: str
    """Session id to send with the next turn."""
    new_session: bool
    """True when this turn started the session (new id, unknown or expired one)."""
    turn: int
    """1-based number of this turn in the session."""
    lang: Lang
    """Language of the reply."""
    text: str
    """The reply, after compliance."""
    intent: str
    """Intent the reply answers (the pending one when this turn continued an action)."""
    classified_intent: str
    """What the classifier said."""
    confidence: float
    """The classifier's confidence."""
    candidate: str | None = None
    """The best label the classifier rejected when it answered ``out_of_scope`` below its threshold (the turn went
    to the fallback route); None otherwise."""
    strategy: Strategy
    """Strategy that produced the reply."""
    variant: str | None = None
    """Template variant of a templated reply (kb, action, handoff, clarify, llm without a generator)."""
    slots: list[Slot] = Field(default_factory=list)
    """Slots of this turn (spans index the request's text)."""
    memory: dict[str, MemoryValue] = Field(default_factory=dict)
    """The session's slot memory after this turn."""
    handoff: bool = False
    """True when the user should be transferred to a human agent."""
    disclaimer: bool = False
    """True when the reply carries the risk disclaimer."""
    replaced: bool = False
    """True when compliance replaced the reply with the safe answer."""
    interventions: list[Intervention] = Field(default_factory=list)
    """What compliance changed."""
    booking: Booking | None = None
    """Booking made, changed or cancelled by this turn."""
    tool_call: ToolCallTrace | None = None
    """Routes with a ``tool_call``: whether the action's slots came from the chat model's function call or the
    rules, and why the rules answered."""
    keywords: dict[str, int] | None = None
    """Keyword hits per category of the reply (pipelines with keyword_categories)."""
    timings: StageTimings
    """Per-stage milliseconds."""


class _Reply(BaseModel):
    text: str
    strategy: Strategy
    answer: KbAnswer
    templated: bool = True
    tool_call: ToolCallTrace | None = None
    prompt_user: str | None = None
    prompt_reply: str | None = None


def _ms(t0: float, t1: float) -> float:
    return round((t1 - t0) * 1000.0, 3)


class Pipeline:
    """One business line's dialogue pipeline with its sessions and booking table."""

    def __init__(
        self,
        config: PipelineConfig,
        classifier: IntentClassifier,
        generator: TextGenerator | None = None,
        *,
        knowledge: KnowledgeBase | None = None,
        clock: Callable[[], datetime] | None = None,
        sessions: SessionBackend | None = None,
    ) -> None:
        """``clock`` gives the local time for slots and bookings (default: now at the config's UTC offset);
        ``sessions`` replaces the in-memory store built from ``config.session`` (a shared store of the server, or
        a fake clock in tests)."""
        self.config = config
        self.classifier = classifier
        self.generator = generator
        self.knowledge = knowledge if knowledge is not None else load_knowledge()
        tz = timezone(timedelta(hours=config.utc_offset_hours))
        self.clock = clock or (lambda: datetime.now(tz))
        self.sessions = sessions if sessions is not None else SessionStore(config.session)
        self.bookings = BookingTable(self.knowledge, config.max_bookings)
        self._check_routes()
        self.check_model_labels()

    @classmethod
    def from_name(
        cls,
        name_or_path: str | Path,
        classifier: IntentClassifier,
        generator: TextGenerator | None = None,
        *,
        knowledge: KnowledgeBase | None = None,
        clock: Callable[[], datetime] | None = None,
        sessions: SessionBackend | None = None,
    ) -> Pipeline:
        """The packaged pipeline ``name_or_path`` (or a pipeline YAML file) with these engines."""
        config = load_pipeline_config(name_or_path)
        return cls(config, classifier, generator, knowledge=knowledge, clock=clock, sessions=sessions)

    def _routes(self) -> list[tuple[str, Route]]:
        named = [(intent, route) for intent, route in self.config.routes.items()]
        return [*named, ("fallback", self.config.fallback), ("clarify", self.config.clarify)]

    def _check_routes(self) -> None:
        for where, route in self._routes():
            if route.strategy == "llm" and self.generator is None and not route.templates:
                raise ConfigError(
                    f"pipeline {self.config.name!r} answers {where} with the llm strategy but no generator was given",
                    "pass generator=..., or give the route templates to answer without one",
                )
            if route.lookup == "faq" and where != "fallback" and self.knowledge.faq_answer(where) is None:
                raise ConfigError(
                    f"pipeline {self.config.name!r} answers {where} from the FAQ, which has no entry for it",
                    f"add faq.{where} to the knowledge base or route {where} elsewhere",
                )

    def check_model_labels(self) -> None:
        """Raise when the classifier's model lacks labels the routes name (a model trained on other data).
        Classifiers that expose no ``labels`` (or not yet: a served model still loading) are not checked."""
        labels = getattr(self.classifier, "labels", None)
        if not labels:
            return
        missing = sorted(set(self.config.routes) - set(labels))
        if missing:
            model = getattr(self.classifier, "name", None) or getattr(self.classifier, "model_name", None)
            shown = ", ".join(labels[:8]) + (f" ... ({len(labels)} in all)" if len(labels) > 8 else "")
            raise ConfigError(
                f"pipeline {self.config.name!r} routes intent label(s) {missing} that the intent model "
                f"{model or type(self.classifier).__name__!r} does not have (its labels: {shown})",
                "give the pipeline an intent model trained on those labels, or route only labels the model has",
            )

    # -------------------------------------------------------------------------------------------- turn

    async def run_turn(self, text: str, session_id: str | None = None, *, lang: Lang | None = None) -> DialogueResponse:
        """Answer one user turn of session ``session_id`` (a new session when None)."""
        t0 = time.perf_counter()
        norm = normalize_text(text) if isinstance(text, str) else ""
        if not norm:
            raise InputError(f"empty dialogue text {text!r}", "send the user's words as a non-empty string")
        if len(text) > self.config.max_text_chars:
            raise InputError(
                f"dialogue text has {len(text)} characters, more than {self.config.max_text_chars}",
                "send one user turn at a time, or raise max_text_chars in the pipeline config",
            )
        async with self.sessions.turn(session_id) as (session, created):
            return await self._turn(session, created, text, norm, lang, t0)

    async def _turn(
        self, session: Session, created: bool, text: str, norm: str, lang: Lang | None, t0: float
    ) -> DialogueResponse:
        lang = lang or detect_language(norm) or session.lang or self.config.default_lang
        now = self.clock()
        slots = extract_slots(text, now)
        t1 = time.perf_counter()
        label, confidence, candidate = await self._classify(norm)
        t2 = time.perf_counter()
        for slot in slots:
            session.memory[slot.name] = slot.value
        ctx = AnswerContext(label, text, lang, tuple(slots), session.memory, now)
        intent, route = self._route(session, ctx, confidence, rejected=candidate not in (None, label))
        ctx = AnswerContext(intent, text, lang, tuple(slots), session.memory, now)
        reply = await self._reply(route, ctx, session)
        t3 = time.perf_counter()
        sources = [t.user for t in session.turns] + [text, *reply.answer.all_facts()]
        checked = apply_compliance(reply.text, intent=intent, lang=lang, sources=sources, config=self.config.compliance)
        t4 = time.perf_counter()
        for record in checked.interventions:
            logger.info(
                "compliance rule %s %s (pipeline %s, session %s, intent %s): %s",
                record.rule, record.action, self.config.name, session.id, intent, record.detail,
            )  # fmt: skip
        prompt_reply = None if checked.replaced else reply.prompt_reply  # a replaced reply is not repeated
        self._update_session(
            session, lang, intent, reply.answer, Turn(text, checked.text, intent, reply.prompt_user, prompt_reply)
        )
        categories = self.config.keyword_categories
        return DialogueResponse(
            pipeline=self.config.name,
            session_id=session.id,
            new_session=created,
            turn=session.turns_total,
            lang=lang,
            text=checked.text,
            intent=intent,
            classified_intent=label,
            confidence=confidence,
            candidate=candidate if candidate != label else None,
            strategy=reply.strategy,
            variant=reply.answer.variant if reply.templated else None,
            slots=slots,
            memory=dict(session.memory),
            handoff=reply.strategy == "handoff",
            disclaimer=checked.disclaimer,
            replaced=checked.replaced,
            interventions=checked.interventions,
            booking=reply.answer.booking if isinstance(reply.answer, ActionResult) else None,
            tool_call=reply.tool_call,
            keywords=count_categories(checked.text, categories) if categories else None,
            timings=StageTimings(
                normalize_ms=_ms(t0, t1),
                intent_ms=_ms(t1, t2),
                reply_ms=_ms(t2, t3),
                compliance_ms=_ms(t3, t4),
                total_ms=_ms(t0, time.perf_counter()),
            ),
        )

    async def _classify(self, text: str) -> tuple[str, float, str | None]:
        results = await self.classifier.classify([text])
        if len(results) != 1:
            raise ConfigError(
                f"the intent classifier returned {len(results)} results for 1 text",
                "make classify(texts) return one (intent, confidence) pair per text",
            )
        label, confidence = results[0][0], results[0][1]
        candidate = results[0][2] if len(results[0]) > 2 else None
        if label not in LABELS:
            raise ConfigError(
                f"the intent classifier returned the unknown label {label!r}",
                "use a classifier trained on the 24 labels of shared/INTENTS.md",
            )
        return label, min(max(float(confidence), 0.0), 1.0), candidate

    def _route(
        self, session: Session, ctx: AnswerContext, confidence: float, rejected: bool = False
    ) -> tuple[str, Route]:
        """``rejected``: the model answered out of scope below its threshold; the turn goes to the label's route (the
        fallback unless the pipeline routes ``out_of_scope``), not to clarify: the model already said it is unsure."""
        pending = session.pending
        label = ctx.intent
        if pending is not None and label != pending:
            same_line = BUSINESS_LINE[label] == BUSINESS_LINE[pending]
            weak = confidence < self.config.clarify_threshold or label == "out_of_scope"
            route = self.config.routes.get(pending)
            if (same_line or weak) and route is not None and continues_booking(self.knowledge, ctx):
                return pending, route
        if confidence < self.config.clarify_threshold and not rejected:
            return label, self.config.clarify
        return label, self.config.routes.get(label, self.config.fallback)

    async def _reply(self, route: Route, ctx: AnswerContext, session: Session) -> _Reply:
        if route.strategy == "action" and route.lookup == "book":
            slots, trace = rule_slots(self.knowledge, ctx), None
            if route.tool_call is not None:
                turns = session.turns
                slots, trace = await slots_from_model(
                    self.generator, route.tool_call, self.knowledge, ctx, turns, slots
                )
            answer: KbAnswer = book_action(self.bookings, self.knowledge, ctx, session.id, slots)
            text = _render(route, answer, ctx.lang)
            return _Reply(text=text, strategy=route.strategy, answer=answer, tool_call=trace)
        if route.strategy == "action":
            answer = cancel_action(self.bookings, self.knowledge, ctx, session.id)
            return _Reply(text=_render(route, answer, ctx.lang), strategy=route.strategy, answer=answer)
        answer = LOOKUPS[route.lookup](self.knowledge, ctx)
        if route.strategy != "llm" or self.generator is None:
            return _Reply(text=_render(route, answer, ctx.lang), strategy=route.strategy, answer=answer)
        llm = self.config.llm
        if llm is None:  # checked by PipelineConfig
            raise ConfigError(f"pipeline {self.config.name!r} has no llm block", "add llm: to its YAML")
        # The conversation is a growing prefix: the fixed system prompt, the history, and only then this turn's
        # facts with the user's words, so a prefix cache reuses every earlier turn of the session.
        prompt = (route.system_prompt or llm.system_prompt).get(ctx.lang)
        messages: list[ChatMessage] = [{"role": "system", "content": prompt}]
        for turn in history_window(list(session.turns), llm.history_turns):
            messages.append({"role": "user", "content": turn.prompt_user or turn.user})
            messages.append({"role": "assistant", "content": turn.prompt_reply or turn.reply})
        user = ctx.text
        facts = [f for f in answer.all_facts() if f]
        if facts:
            head = (
                "参考资料（只可引用其中的数字）："
                if ctx.lang == "zh"
                else "Reference facts (quote only these figures):"
            )
            user = f"{ctx.text}\n\n{head}\n" + "\n".join(facts)
        messages.append({"role": "user", "content": user})
        text = await self.generator.generate(messages, max_tokens=llm.max_tokens, temperature=llm.temperature)
        return _Reply(text=text, strategy="llm", answer=answer, templated=False, prompt_user=user, prompt_reply=text)

    def _update_session(self, session: Session, lang: Lang, intent: str, answer: KbAnswer, turn: Turn) -> None:
        session.lang = lang
        session.pending = None
        if isinstance(answer, ActionResult):
            session.memory.update(answer.remember)
            for key in answer.forget:  # forget wins: a rejected time or room is not kept
                session.memory.pop(key, None)
            session.pending = intent if answer.pending else None
        session.add_turn(turn)


def history_window(turns: list[Turn], size: int) -> list[Turn]:
    """The earlier turns an llm prompt repeats: at most ``size``, dropped in steps of half a window, so that the
    prompt stays a growing prefix of the last one (a prefix cache hits) between the steps."""
    if size <= 0:
        return []
    step = max(1, size // 2)
    start = 0 if len(turns) <= size else -(-(len(turns) - size) // step) * step
    return turns[start:]


def _render(route: Route, answer: KbAnswer, lang: Lang) -> str:
    template = route.templates[answer.variant].get(lang)
    return template.format_map(answer.fields).strip()
