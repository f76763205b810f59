"""Pipeline configuration: one YAML per business line in ``miaohui/dialogue/pipelines/``.

A pipeline maps each intent to a *route*: a reply strategy plus what it needs.

* ``kb`` — a knowledge-base lookup (:data:`miaohui.dialogue.answers.LOOKUPS`) fills a template chosen by
  the lookup's variant; ``templates`` holds every variant in both languages.
* ``llm`` — the pipeline's ``llm.system_prompt`` (or the route's own), the session's recent history and
  the user's turn go to the text generator; an optional ``lookup`` adds knowledge-base facts to the
  prompt (and so to the numbers the reply may quote). ``templates`` are optional: the answer used when
  the pipeline runs without a generator.
* ``action`` — a stateful action on the booking table (``book`` / ``cancel``), answered by templates.
* ``handoff`` — a fixed message; the response says ``handoff: true`` so the caller transfers the user.
* ``clarify`` — the route taken when the classifier's confidence is below ``clarify_threshold``.

Intents without a route take ``fallback``. Top-level keys starting with ``x-`` are ignored (holders of
YAML anchors shared by several routes). Templates are checked at load time: every variant present in
both languages, placeholders only from the variant's fields, and no numbers in the template text (figures
must come from the knowledge base so that the number-grounding rule can vouch for them).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miaohui.dialogue.answers import VARIANT_FIELDS
from miaohui.dialogue.booking import ACTION_VARIANTS
from miaohui.dialogue.compliance import ComplianceConfig
from miaohui.dialogue.knowledge import Bilingual, Lang
from miaohui.dialogue.session import SessionConfig
from miaohui.dialogue.tool_call import ToolCallConfig
from miaohui.errors import ConfigError
from miaohui.nlp.numbers import extract_numbers
from miaohui.zoo.intents import LABELS

__all__ = ["PIPELINE_NAMES", "LlmConfig", "PipelineConfig", "Route", "Strategy", "load_pipeline_config"]

Strategy = Literal["kb", "llm", "action", "handoff", "clarify"]
PIPELINE_NAMES: tuple[str, ...] = ("bank_advisor", "gov_hotline", "meeting_assistant", "negotiation_coach")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Route(_Frozen):
    """How one intent is answered."""

    strategy: Strategy
    """Reply strategy (see the module docstring)."""
    lookup: str = "none"
    """Knowledge-base lookup (kb, llm) or action name (action: ``book`` / ``cancel``)."""
    templates: dict[str, Bilingual] = Field(default_factory=dict)
    """One template per variant of the lookup or action, ``{field}`` placeholders."""
    system_prompt: Bilingual | None = None
    """llm only: replaces the pipeline's system prompt for this intent."""
    tool_call: ToolCallConfig | None = None
    """action ``book`` only: take the booking slots from the chat model's call of this function when the pipeline
    has a chat model (constrained to the function's JSON schema), the rule slots otherwise
    (:mod:`miaohui.dialogue.tool_call`); None: always the rule slots."""

    def variants(self) -> Mapping[str, frozenset[str]]:
        """The variants this route's lookup or action can produce, with their fields."""
        table = ACTION_VARIANTS if self.strategy == "action" else VARIANT_FIELDS
        return table[self.lookup]


class LlmConfig(_Frozen):
    """How the ``llm`` strategy calls the text generator."""

    system_prompt: Bilingual
    """System prompt per language."""
    max_tokens: int = Field(default=256, ge=1, le=4096)
    """Most tokens generated per reply."""
    temperature: float = Field(default=0.3, ge=0.0, le=2.0)
    """Sampling temperature (0 = greedy)."""
    history_turns: int = Field(default=6, ge=0, le=100)
    """Earlier turns of the session sent with the prompt."""


class PipelineConfig(_Frozen):
    """One business line's dialogue pipeline."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{1,63}$")
    """Pipeline name (also the model name clients use)."""
    description: str = ""
    """What the pipeline is for."""
    default_lang: Lang = "zh"
    """Language when neither the text nor the session tells."""
    clarify_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    """Below this intent confidence the ``clarify`` route answers (0 disables clarifying)."""
    utc_offset_hours: float = Field(default=8.0, ge=-12.0, le=14.0)
    """Local time of the service (dates such as 明天 resolve in it); China is UTC+8 all year."""
    max_text_chars: int = Field(default=2000, ge=1, le=100_000)
    """Longest user turn accepted."""
    routes: dict[str, Route]
    """Intent label → route."""
    fallback: Route
    """Route of intents without one (other business lines, out_of_scope)."""
    clarify: Route
    """Route taken below ``clarify_threshold``."""
    llm: LlmConfig | None = None
    """Generator settings; required when a route uses the llm strategy."""
    compliance: ComplianceConfig = ComplianceConfig()
    """Compliance rules."""
    session: SessionConfig = SessionConfig()
    """Session bounds."""
    keyword_categories: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    """Categories reported for each reply (e.g. 拒绝/接受/折中); empty = not reported."""
    max_bookings: int = Field(default=10_000, ge=1)
    """Upcoming bookings held by the booking table (action routes)."""

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        unknown = sorted(set(self.routes) - set(LABELS))
        if unknown:
            raise ConfigError(
                f"pipeline {self.name!r} routes unknown intent label(s) {unknown}",
                "key routes by the 24 labels of shared/INTENTS.md",
            )
        if self.clarify.strategy != "clarify":
            raise ConfigError(
                f"pipeline {self.name!r}: the clarify route has strategy {self.clarify.strategy!r}",
                "set clarify.strategy to clarify",
            )
        named = [(f"routes.{k}", v) for k, v in self.routes.items()]
        for where, route in [*named, ("fallback", self.fallback), ("clarify", self.clarify)]:
            self._check_route(where, route)
        return self

    def _check_route(self, where: str, route: Route) -> None:
        at = f"pipeline {self.name!r} {where}"
        table = ACTION_VARIANTS if route.strategy == "action" else VARIANT_FIELDS
        if route.lookup not in table:
            raise ConfigError(
                f"{at}: unknown {'action' if route.strategy == 'action' else 'lookup'} {route.lookup!r}",
                f"use one of {sorted(table)}",
            )
        if route.tool_call is not None and (route.strategy, route.lookup) != ("action", "book"):
            raise ConfigError(
                f"{at}: tool_call is set on a route with strategy {route.strategy!r} and lookup {route.lookup!r}",
                "set tool_call only on the action route with lookup book (the booking function)",
            )
        if route.strategy in ("handoff", "clarify") and route.lookup != "none":
            raise ConfigError(f"{at}: strategy {route.strategy} takes no lookup", "remove lookup")
        if route.strategy == "llm" and self.llm is None:
            raise ConfigError(
                f"{at} uses the llm strategy but the pipeline has no llm block",
                "add llm: {system_prompt: {zh: ..., en: ...}, max_tokens: 256}",
            )
        if route.strategy != "llm" or route.templates:
            _check_templates(at, route)


def _check_templates(at: str, route: Route) -> None:
    variants = route.variants()
    missing = sorted(set(variants) - set(route.templates))
    extra = sorted(set(route.templates) - set(variants))
    if missing or extra:
        raise ConfigError(
            f"{at}: templates {sorted(route.templates)} do not match the variants of {route.lookup!r}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else ""),
            f"give exactly the variants {sorted(variants)}",
        )
    for variant, text in route.templates.items():
        for lang in ("zh", "en"):
            template = getattr(text, lang)
            try:
                parsed = list(string.Formatter().parse(template))
            except ValueError as exc:
                raise ConfigError(
                    f"{at}: template {variant}.{lang} is malformed ({exc}): {template!r}",
                    "write placeholders as {name}; double literal braces as {{ }}",
                ) from exc
            names = {name for _, name, _, _ in parsed if name is not None}
            bad = sorted(names - variants[variant])
            if bad:
                raise ConfigError(
                    f"{at}: template {variant}.{lang} uses unknown field(s) {bad}",
                    f"use only {sorted(variants[variant]) or 'no fields'} in variant {variant!r}",
                )
            literal = "".join(lit for lit, _, _, _ in parsed)
            if extract_numbers(literal):
                raise ConfigError(
                    f"{at}: template {variant}.{lang} has numbers in its text: {template!r}",
                    "move figures into the knowledge base and use a field; template numbers are not grounded",
                )


def _parse(text: str, where: str) -> PipelineConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"pipeline config {where} is not valid YAML: {exc}", "fix the YAML syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"pipeline config {where} must hold a mapping", "start with name: and routes:")
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}  # YAML anchors' holders
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"invalid pipeline config {where}: {loc}: {err['msg']}",
            "fix that field (see miaohui/dialogue/config.py for the schema)",
        ) from exc


def load_pipeline_config(name_or_path: str | Path) -> PipelineConfig:
    """A packaged pipeline by name (``bank_advisor`` ...) or a pipeline YAML file by path."""
    if str(name_or_path) in PIPELINE_NAMES:
        res = resources.files("miaohui.dialogue").joinpath("pipelines", f"{name_or_path}.yaml")
        return _parse(res.read_text(encoding="utf-8"), f"miaohui/dialogue/pipelines/{name_or_path}.yaml")
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return _parse(path.read_text(encoding="utf-8"), str(path))
    raise ConfigError(
        f"unknown pipeline {str(name_or_path)!r}",
        f"use one of {', '.join(PIPELINE_NAMES)} or the path of a pipeline YAML file",
    )
