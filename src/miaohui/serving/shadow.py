"""Shadow mode: a candidate version answers the same live requests as the primary, off the response path.

Configured per model in its ``config.yaml`` (:class:`~miaohui.serving.model_config.ShadowConfig`)::

    version_policy: {policy: specific, versions: [1, 2]}   # both versions must be served
    shadow: {version: 2, sample_rate: 0.1}                  # v1 answers; 10% of its requests also run on v2

Every :meth:`ServedVersion.classify` of the primary calls its ``shadow_tap`` with the texts and logits it
computed. The tap decides (seeded sampling at ``sample_rate``, at most ``max_pending`` runs in flight) and
schedules the candidate's run as a task: the primary's response never waits for it. When the candidate
answers, each (primary, candidate) pair goes to a
:class:`~miaohui.validate.consistency.ShadowComparator` (intent agreement; logit error when both versions
have the same labels) and the figures are exported as ``miaohui_shadow_drift{model, figure}``.

:class:`ShadowManager` follows the repository: :meth:`ShadowManager.sync` installs the tap on the current
primary and drops state of models no longer shadowed (a reload makes new ``ServedVersion`` objects). It runs
at start and every ``sync_interval_s`` while started, and before each report.

Chat models (``shadow:`` in ``generation.yaml``) work the same way: every request the OpenAI API answered in full
on the primary calls the primary :class:`~miaohui.serving.chat.ServedChatVersion`'s ``shadow_tap`` with the prompt
ids, the sampling parameters and the answer (token ids and text), after the answer went out; the candidate runs the
same prompt with the same parameters through its own front end (an engine-process version of ``--shared-engine``
is pinned, so the engine process runs the candidate and not the serving version). The comparator gets greedy
agreement (token-for-token equal answers, greedy requests only) and the frequency of each ``shadow.keywords`` entry
in each version's answers; a keyword whose frequencies differ by more than ``max_drift`` fails the report. The
figures are in ``miaohui_shadow_drift`` and, per keyword, ``miaohui_shadow_keyword_frequency{model, keyword,
version}`` (``primary`` / ``candidate``). Under ``--workers N`` each HTTP worker shadows the requests it answered;
``GET /v1/shadow`` reports the answering worker's, ``/metrics`` the largest figure over the workers.

The primary is :func:`primary_version`: the newest served version other than the candidate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
from pydantic import BaseModel

from miaohui.errors import ModelNotFoundError
from miaohui.generation.engine.params import SamplingParams
from miaohui.serving.chat import ServedChatVersion
from miaohui.serving.model_config import ShadowConfig
from miaohui.serving.served import ServedVersion
from miaohui.validate.consistency import DriftReport, DriftThresholds, EngineOutput, ShadowComparator

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from miaohui.serving.repository import ModelManager

log = logging.getLogger("miaohui.shadow")

__all__ = ["ShadowManager", "ShadowMetrics", "ShadowStatus", "primary_version"]


class ShadowMetrics(Protocol):
    """Where the drift figures go: the server's :class:`~miaohui.server.metrics.Metrics` has this gauge."""

    @property
    def shadow(self) -> Gauge:
        """``miaohui_shadow_drift{model, figure}``."""
        ...

    @property
    def shadow_keywords(self) -> Gauge:
        """``miaohui_shadow_keyword_frequency{model, keyword, version}``."""
        ...


SHADOW_FIGURES = (
    "pairs",
    "observed",
    "sampled",
    "dropped",
    "errors",
    "intent_agreement",
    "logit_max_abs_error",
    "logit_mean_abs_error",
    "greedy_pairs",
    "greedy_agreement",
    "keyword_frequency_drift",
    "passed",
)
"""The ``figure`` label values of ``miaohui_shadow_drift``."""


def primary_version(versions: Mapping[int, ServedVersion]) -> int | None:
    """The version that answers requests without a version: the newest that is not the shadow candidate
    (:meth:`~miaohui.serving.model_config.ModelConfig.primary_of`)."""
    if not versions:
        return None
    return versions[max(versions)].config.primary_of(versions)


class ShadowStatus(BaseModel):
    """``GET /v1/shadow/{model}``: where shadowing of one model stands, and the drift figures."""

    model: str
    kind: Literal["encoder", "chat"]
    state: Literal["active", "candidate_not_loaded"]
    reason: str = ""
    primary_version: int | None
    candidate_version: int
    sample_rate: float
    observed: int
    """Request texts compared since shadowing (re)started."""
    sampled: int
    """Primary calls chosen for shadowing."""
    dropped: int
    """Sampled calls skipped because ``max_pending`` shadow runs were in flight."""
    errors: int
    """Shadow runs that failed (the candidate rejected the input or crashed)."""
    pending: int
    """Shadow runs in flight now."""
    passed: bool
    """No threshold of the report is crossed (intent disagreement, or a keyword's frequency difference, above
    ``max_drift``)."""
    report: DriftReport
    """Figures over the last ``window`` pairs."""


@dataclass
class _Shadow:
    """One shadowed model: config, the versions in play, counters, in-flight runs."""

    model: str
    config: ShadowConfig
    primary: ServedVersion | ServedChatVersion | None
    candidate: ServedVersion | ServedChatVersion | None
    comparator: ShadowComparator
    rng: random.Random
    sampled: int = 0
    dropped: int = 0
    errors: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def chat(self) -> bool:
        return isinstance(self.primary or self.candidate, ServedChatVersion)

    @property
    def key(self) -> tuple[ShadowConfig, int | None, int | None]:
        return (
            self.config,
            self.primary.version if self.primary else None,
            self.candidate.version if self.candidate else None,
        )


class ShadowManager:
    """Shadows candidate versions of the repository's models (see the module docstring)."""

    def __init__(
        self,
        manager: ModelManager,
        metrics: ShadowMetrics | None = None,
        *,
        seed: int = 0,
        sync_interval_s: float = 1.0,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.seed = seed
        self.sync_interval_s = sync_interval_s
        self._shadows: dict[str, _Shadow] = {}
        self._watcher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Sync now, then keep following the repository (reloads) until :meth:`stop`."""
        self.sync()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="miaohui-shadow-sync")

    async def stop(self) -> None:
        """Stop following the repository, cancel shadow runs in flight and remove the taps."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        for name in list(self._shadows):
            await self._drop(name)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                self.sync()
            except Exception:  # never let a bad state end the watcher
                log.exception("shadow sync failed")

    async def drain(self, model: str | None = None) -> None:
        """Wait for the shadow runs in flight (of ``model``, or of every model)."""
        shadows = [self._shadows[model]] if model in self._shadows else [] if model else list(self._shadows.values())
        for sh in shadows:
            while sh.tasks:
                await asyncio.gather(*list(sh.tasks), return_exceptions=True)

    # ------------------------------------------------------------------ following the repository

    def sync(self) -> None:
        """Install the tap on each shadowed model's primary; forget models that are no longer shadowed."""
        seen: set[str] = set()
        for state in self.manager.all_states():
            newest, primary = state.latest, state.primary
            config = newest.config.shadow if newest is not None and newest.config is not None else None
            if config is None or primary is None:
                continue
            seen.add(state.name)
            if primary.version == config.version:
                primary = None
            self._update(state.name, config, primary, state.versions.get(config.version))
        for name in set(self._shadows) - seen:
            self._forget(name)

    def _update(
        self,
        name: str,
        config: ShadowConfig,
        primary: ServedVersion | ServedChatVersion | None,
        candidate: ServedVersion | ServedChatVersion | None,
    ) -> None:
        sh = self._shadows.get(name)
        key = (config, primary.version if primary else None, candidate.version if candidate else None)
        if sh is None or sh.key != key:
            if sh is not None:
                self._untap(sh)
                for task in sh.tasks:
                    task.cancel()
            chat = isinstance(primary or candidate, ServedChatVersion)
            sh = _Shadow(name, config, primary, candidate, self._comparator(config, chat), random.Random(self.seed))
            self._shadows[name] = sh
            log.info(
                "shadowing %s: primary v%s, candidate v%d (%s), sample rate %.3g",
                name, key[1], config.version, "loaded" if candidate else "NOT loaded", config.sample_rate,
            )  # fmt: skip
        else:  # same versions; a reload may have made new objects
            if sh.primary is not primary:
                self._untap(sh)
            sh.primary, sh.candidate = primary, candidate
        if sh.primary is not None and sh.candidate is not None:
            if isinstance(sh.primary, ServedChatVersion):
                sh.primary.shadow_tap = functools.partial(self._tap_chat, sh)
            else:
                sh.primary.shadow_tap = functools.partial(self._tap, sh)
        self._export(sh)

    @staticmethod
    def _comparator(config: ShadowConfig, chat: bool) -> ShadowComparator:
        thresholds = DriftThresholds(max_drift=config.max_drift)
        keywords = config.keywords if chat else ()
        return ShadowComparator(thresholds, categories={}, window=config.window, keywords=keywords)

    @staticmethod
    def _untap(sh: _Shadow) -> None:
        if sh.primary is not None:
            sh.primary.shadow_tap = None

    def _forget(self, name: str) -> None:
        sh = self._shadows.pop(name, None)
        if sh is None:
            return
        self._untap(sh)
        for task in sh.tasks:
            task.cancel()
        if self.metrics is not None:
            for figure in SHADOW_FIGURES:
                with contextlib.suppress(KeyError):
                    self.metrics.shadow.remove(name, figure)
            for keyword in sh.comparator.keywords:
                for role in ("primary", "candidate"):
                    with contextlib.suppress(KeyError):
                        self.metrics.shadow_keywords.remove(name, keyword, role)

    async def _drop(self, name: str) -> None:
        sh = self._shadows.get(name)
        tasks = list(sh.tasks) if sh else []
        self._forget(name)
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ the live path

    def _sample(self, sh: _Shadow) -> bool:
        """Whether this primary call is shadowed: sampled at ``sample_rate`` and a run slot free."""
        if sh.candidate is None or sh.rng.random() >= sh.config.sample_rate:
            return False
        sh.sampled += 1
        if len(sh.tasks) >= sh.config.max_pending:
            sh.dropped += 1
            self._export(sh)
            return False
        return True

    def _schedule(self, sh: _Shadow, run: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(run)
        sh.tasks.add(task)
        task.add_done_callback(sh.tasks.discard)

    def _tap(self, sh: _Shadow, texts: list[str], logits: np.ndarray) -> None:
        """Called by the primary's classify: decide, then schedule the candidate's run. Returns at once."""
        candidate = sh.candidate
        if candidate is not None and not isinstance(candidate, ServedChatVersion) and self._sample(sh):
            self._schedule(sh, self._run(sh, candidate, list(texts), np.array(logits)))

    def _tap_chat(self, sh: _Shadow, prompt: list[int], params: SamplingParams, tokens: list[int], text: str) -> None:
        """Called by the OpenAI API once the primary's answer went out: decide, then schedule the candidate's run
        of the same prompt and parameters. Returns at once."""
        if isinstance(sh.candidate, ServedChatVersion) and self._sample(sh):
            primary = EngineOutput(text=text, tokens=list(tokens) if params.temperature == 0 else None)
            self._schedule(sh, self._run_chat(sh, sh.candidate, list(prompt), params, primary))

    async def _run_chat(
        self,
        sh: _Shadow,
        candidate: ServedChatVersion,
        prompt: list[int],
        params: SamplingParams,
        primary: EngineOutput,
    ) -> None:
        stream = candidate.client.add(prompt, params)
        try:
            await stream.admitted()
            events = [event async for event in stream]
            finish = events[-1].finish_reason if events else None
            if finish not in ("stop", "length"):
                raise RuntimeError(f"the candidate's answer ended with {finish!r}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            sh.errors += 1
            log.warning("shadow run of %s v%d failed: %s", sh.model, candidate.version, exc)
            self._export(sh)
            return
        finally:
            stream.abort()
        tokens = [e.token_id for e in events if e.token_id is not None]
        text = "".join(e.text for e in events)
        sh.comparator.observe(primary, EngineOutput(text=text, tokens=tokens if primary.tokens is not None else None))
        self._export(sh)

    async def _run(self, sh: _Shadow, candidate: ServedVersion, texts: list[str], primary: np.ndarray) -> None:
        try:
            shadow = await candidate.run_rows(candidate.tokenize(texts), None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            sh.errors += 1
            log.warning("shadow run of %s v%d failed: %s", sh.model, candidate.version, exc)
            self._export(sh)
            return
        if sh.primary is None or isinstance(sh.primary, ServedChatVersion):
            return
        p_labels, c_labels = sh.primary.manifest.labels, candidate.manifest.labels
        same = list(p_labels) == list(c_labels)
        for row_p, row_c in zip(primary, shadow, strict=True):
            sh.comparator.observe(
                EngineOutput(intent=p_labels[int(row_p.argmax())], logits=row_p.tolist() if same else None),
                EngineOutput(intent=c_labels[int(row_c.argmax())], logits=row_c.tolist() if same else None),
            )
        self._export(sh)

    # ------------------------------------------------------------------ reports and metrics

    def status(self, sh: _Shadow) -> ShadowStatus:
        missing = sh.candidate is None or sh.primary is None
        reason = ""
        if sh.candidate is None:
            reason = (
                f"candidate version {sh.config.version} of {sh.model!r} is not loaded; its version_policy must "
                f"serve it (e.g. policy: specific, versions: [PRIMARY, {sh.config.version}])"
            )
        elif sh.primary is None:
            reason = f"{sh.model!r} serves only the candidate version {sh.config.version}; there is no primary"
        report = sh.comparator.report()
        return ShadowStatus(
            model=sh.model,
            kind="chat" if sh.chat else "encoder",
            state="candidate_not_loaded" if missing else "active",
            reason=reason,
            primary_version=sh.primary.version if sh.primary else None,
            candidate_version=sh.config.version,
            sample_rate=sh.config.sample_rate,
            observed=sh.comparator.total,
            sampled=sh.sampled,
            dropped=sh.dropped,
            errors=sh.errors,
            pending=len(sh.tasks),
            passed=report.passed,
            report=report,
        )

    def report(self, model: str) -> ShadowStatus:
        """The status of ``model``; ModelNotFoundError (404) when it is not loaded or not shadowed."""
        self.sync()
        sh = self._shadows.get(model)
        if sh is None:
            self.manager.version(model)  # not loaded: its own 404 message
            raise ModelNotFoundError(
                f"model {model!r} is not shadowed",
                "add shadow: {version: CANDIDATE, sample_rate: 0.1} to its config.yaml (a chat model: its "
                "generation.yaml), serve both versions "
                f"(version_policy), then POST /v2/repository/models/{model}/load",
            )
        return self.status(sh)

    def reports(self) -> list[ShadowStatus]:
        self.sync()
        return [self.status(self._shadows[name]) for name in sorted(self._shadows)]

    def _export(self, sh: _Shadow) -> None:
        if self.metrics is None:
            return
        r = sh.comparator.report()
        values: dict[str, float | None] = {
            "pairs": r.n,
            "observed": sh.comparator.total,
            "sampled": sh.sampled,
            "dropped": sh.dropped,
            "errors": sh.errors,
            "intent_agreement": r.intent_agreement,
            "logit_max_abs_error": r.logit_max_abs_error,
            "logit_mean_abs_error": r.logit_mean_abs_error,
            "greedy_pairs": r.greedy_pairs if sh.chat else None,
            "greedy_agreement": r.greedy_agreement,
            "keyword_frequency_drift": r.keyword_frequency_drift,
            "passed": float(r.passed) if r.n else None,
        }
        for figure, value in values.items():
            if value is not None:
                self.metrics.shadow.labels(sh.model, figure).set(value)
        for role, freqs in (("primary", r.keyword_frequency_old), ("candidate", r.keyword_frequency_new)):
            for keyword, share in (freqs or {}).items():
                self.metrics.shadow_keywords.labels(sh.model, keyword, role).set(share)
