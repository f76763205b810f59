"""Shadow mode's bookkeeping on fakes of the served versions (no engines): which version is primary, the
config checks, sampling, the in-flight bound, failures of the candidate, reloads, and the metrics. The
integration test runs it on the real e5 engines over live requests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from miaohui.errors import ConfigError, InputError, ModelNotFoundError
from miaohui.server.metrics import Metrics
from miaohui.serving.model_config import ModelConfig, ShadowConfig, VersionPolicy
from miaohui.serving.repository import ModelState
from miaohui.serving.shadow import ShadowManager, primary_version

LABELS = ["greeting", "goodbye", "human_agent"]


@dataclass
class FakeManifest:
    labels: list[str]


@dataclass
class FakeServed:
    """The parts of ServedVersion shadow mode uses: ``run_rows`` returns fixed logits per text."""

    name: str
    version: int
    config: ModelConfig
    logits: dict[str, list[float]]
    delay: float = 0.0
    manifest: FakeManifest = field(default_factory=lambda: FakeManifest(LABELS))
    shadow_tap: Any = None

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if any(t == "too long" for t in texts):
            raise InputError("text #0 is too long", "shorten it")
        return [[ord(c) for c in t] for t in texts]

    async def run_rows(self, rows: list[list[int]], deadline: float | None) -> np.ndarray:
        await asyncio.sleep(self.delay)
        return np.array([self.logits["".join(map(chr, r))] for r in rows])

    async def classify(self, texts: list[str]) -> None:
        """What ServedVersion.classify does around the tap."""
        logits = np.array([self.logits[t] for t in texts])
        if self.shadow_tap is not None:
            self.shadow_tap(texts, logits)


def FakeState(name: str, versions: dict[int, Any], chat: bool = False) -> ModelState[Any]:
    """The manager's own state record over fake versions."""
    return ModelState(name, chat, versions)


class FakeManager:
    def __init__(self, *states: ModelState[Any]) -> None:
        self._states = list(states)

    def all_states(self) -> list[ModelState[Any]]:
        return self._states

    def version(self, name: str, version: int | None = None) -> Any:
        for s in self._states:
            if s.name == name:
                return s.primary
        raise ModelNotFoundError(f"model {name!r} is not loaded", "loaded models: intent")


def config(**shadow: Any) -> ModelConfig:
    return ModelConfig(version_policy=VersionPolicy(policy="all"), shadow=ShadowConfig(version=2, **shadow))


def pair(cfg: ModelConfig, texts: list[str], flip: set[str] = frozenset(), delay: float = 0.0) -> FakeState:  # type: ignore[assignment]
    """v1 and v2 with the same logits except on ``flip`` (v2 then says goodbye)."""
    base = {t: [2.0, 0.0, 0.0] for t in texts}
    cand = {t: ([0.0, 3.0, 0.0] if t in flip else [1.9, 0.0, 0.1]) for t in texts}
    return FakeState("intent", {1: FakeServed("intent", 1, cfg, base), 2: FakeServed("intent", 2, cfg, cand, delay)})


def test_primary_is_the_newest_version_that_is_not_the_candidate() -> None:
    cfg = config()
    assert cfg.primary_of([1, 2]) == 1 and cfg.primary_of([1, 2, 3]) == 3 and cfg.primary_of([2]) == 2
    assert ModelConfig().primary_of([1, 2]) == 2 and cfg.primary_of([]) is None
    state = pair(cfg, ["a"])
    assert primary_version(state.versions) == 1


def test_shadow_config_needs_the_candidate_served() -> None:
    with pytest.raises(ConfigError, match=r"shadow.version 2 is not among version_policy.versions \[1\]"):
        ModelConfig(version_policy=VersionPolicy(policy="specific", versions=[1]), shadow=ShadowConfig(version=2))
    with pytest.raises(ConfigError, match="needs two served versions, but version_policy is latest: 1"):
        ModelConfig(shadow=ShadowConfig(version=2))
    ModelConfig(version_policy=VersionPolicy(policy="latest", latest=2), shadow=ShadowConfig(version=2))


async def test_pairs_are_compared_off_the_call_and_exported() -> None:
    texts = [f"t{i}" for i in range(20)]
    state = pair(config(), texts, flip={"t3"}, delay=0.01)
    metrics = Metrics()
    shadow = ShadowManager(FakeManager(state), metrics)  # type: ignore[arg-type]
    shadow.sync()
    primary = state.versions[1]
    assert primary.shadow_tap is not None and state.versions[2].shadow_tap is None
    await primary.classify(texts[:10])
    await primary.classify(texts[10:])
    assert shadow.report("intent").pending == 2  # the primary's calls returned; the shadow runs are still going
    await shadow.drain()
    s = shadow.report("intent")
    assert (s.state, s.primary_version, s.candidate_version, s.observed, s.pending) == ("active", 1, 2, 20, 0)
    assert s.report.intent_agreement == pytest.approx(0.95) and s.passed  # 1 of 20 is exactly 5%: not above
    assert s.report.logit_max_abs_error == pytest.approx(3.0)
    sample = metrics.registry.get_sample_value
    assert sample("miaohui_shadow_drift", {"model": "intent", "figure": "intent_agreement"}) == pytest.approx(0.95)
    assert sample("miaohui_shadow_drift", {"model": "intent", "figure": "passed"}) == 1.0
    await shadow.stop()
    assert primary.shadow_tap is None and sample("miaohui_shadow_drift", {"model": "intent", "figure": "pairs"}) is None


async def test_sampling_bound_and_candidate_errors() -> None:
    texts = [f"t{i}" for i in range(200)] + ["too long"]
    state = pair(config(sample_rate=0.25, max_pending=2), texts, delay=0.05)
    shadow = ShadowManager(FakeManager(state), seed=7)  # type: ignore[arg-type]
    shadow.sync()
    for t in texts[:200]:
        await state.versions[1].classify([t])
    s = shadow.report("intent")
    assert 25 < s.sampled < 75 and s.dropped == s.sampled - 2  # only two runs may be in flight
    await shadow.drain()
    for _ in range(20):  # the candidate rejects this text: counted, the primary is unaffected
        await state.versions[1].classify(["too long"])
    await shadow.drain()
    s = shadow.report("intent")
    assert s.errors >= 1 and s.observed == 2
    await shadow.stop()


async def test_missing_candidate_and_unshadowed_models() -> None:
    cfg = config()
    only_primary = FakeState("intent", {1: FakeServed("intent", 1, cfg, {})})
    manager = FakeManager(only_primary, FakeState("plain", {1: FakeServed("plain", 1, ModelConfig(), {})}))
    shadow = ShadowManager(manager)  # type: ignore[arg-type]
    s = shadow.report("intent")
    assert s.state == "candidate_not_loaded" and s.reason.startswith("candidate version 2 of 'intent' is not loaded")
    assert only_primary.versions[1].shadow_tap is None
    with pytest.raises(ModelNotFoundError, match="model 'plain' is not shadowed"):
        shadow.report("plain")
    with pytest.raises(ModelNotFoundError, match="model 'nope' is not loaded"):
        shadow.report("nope")
    # the candidate arrives (a reload): the next sync taps the primary
    only_primary.versions[2] = FakeServed("intent", 2, cfg, {})
    assert shadow.report("intent").state == "active" and only_primary.versions[1].shadow_tap is not None
    # shadowing switched off in the config: state and tap go
    plain = ModelConfig()
    only_primary.versions = {1: FakeServed("intent", 1, plain, {}), 2: FakeServed("intent", 2, plain, {})}
    assert shadow.reports() == []
