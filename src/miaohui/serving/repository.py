"""The model repository at serving time: which versions are live, load / unload / reload.

A (re)load builds the new versions completely — engines loaded, warm-up run — before swapping them in.
If anything fails, the versions that were serving keep serving and the error is kept for the API; a model whose
first load failed is not loaded (its error shows in the repository index).

Model names are plain folder names (:func:`miaohui.paths.check_model_name`): they come from clients and become paths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from miaohui.engines.store import read_manifest, versions
from miaohui.errors import MiaohuiError, ModelNotFoundError
from miaohui.gcpolicy import refreeze
from miaohui.paths import check_model_name, is_model_name
from miaohui.serving.batcher import BatcherObserver
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.model_config import load_model_config
from miaohui.serving.served import ServedVersion

log = logging.getLogger("miaohui.repository")
ObserverFactory = Callable[[str, int], BatcherObserver | None]


@dataclass
class ModelState:
    name: str
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    state: str = "UNAVAILABLE"
    """READY, LOADING, UNAVAILABLE (Triton's repository-index states)."""
    reason: str = ""
    """Why the last load failed (kept while the old versions serve)."""

    @property
    def latest(self) -> ServedVersion | None:
        return self.versions[max(self.versions)] if self.versions else None


class ModelManager:
    """Owns every served version. All methods run on the server's event loop."""

    def __init__(
        self,
        repository: Path,
        observer_factory: ObserverFactory | None = None,
        engine_process: EngineClient | None = None,
    ) -> None:
        """``engine_process``: versions are served by that engine process (``--shared-engine``), not here."""
        self.repository = Path(repository)
        self.engine_process = engine_process
        self._observer_factory = observer_factory or (lambda name, version: None)
        self._models: dict[str, ModelState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, str] = {}
        """Why the first load of a model on disk failed (for the index; the model is not in ``_models``)."""

    def names_on_disk(self) -> list[str]:
        if not self.repository.is_dir():
            return []
        from miaohui.generation.build.artifact import is_causal_lm_model

        return sorted(
            p.name
            for p in self.repository.iterdir()
            if is_model_name(p.name) and p.is_dir() and versions(p) and not is_causal_lm_model(p)
        )

    def is_known(self, name: str) -> bool:
        """Loaded, loading, or a folder in the repository (cheap: one ``stat`` for names not loaded)."""
        return name in self._models or (is_model_name(name) and (self.repository / name).is_dir())

    async def load_all(self, only: list[str] | None = None) -> None:
        for name in only or self.names_on_disk():
            try:
                await self.load(name)
            except MiaohuiError as exc:
                log.error("model %s failed to load: %s", name, exc)
            except Exception:  # a broken engine file must not keep the other models from serving
                log.exception("model %s failed to load", name)

    async def load(self, name: str) -> ModelState:
        """Load (or reload) ``name`` per its version policy. New versions go live only once warm."""
        check_model_name(name)
        model_dir = self.repository / name
        missing = f"no versions of {name!r} in {self.repository}"
        fix = f"build it with `miaohui build ... --name {name}`"
        if name not in self._models and not versions(model_dir):
            raise ModelNotFoundError(missing, fix)  # before a lock exists: random names leave nothing behind
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            state = self._models.setdefault(name, ModelState(name))
            available = versions(model_dir)
            if not available:
                state.reason = missing
                if not state.versions:
                    self._models.pop(name, None)
                raise ModelNotFoundError(missing, fix)
            previous = state.state
            state.state = "LOADING"
            try:
                backend = read_manifest(model_dir / str(available[-1])).backend
                config = load_model_config(model_dir / "config.yaml", backend)
                wanted = config.version_policy.select(available)
                fresh: dict[int, ServedVersion] = {}
                started = time.perf_counter()
                try:
                    for v in wanted:
                        if v in state.versions and state.versions[v].config == config:
                            continue
                        served = await asyncio.to_thread(
                            ServedVersion,
                            model_dir / str(v),
                            config,
                            self._observer_factory(name, v),
                            self.engine_process,
                        )
                        fresh[v] = served
                        served.load_seconds = time.perf_counter() - started
                        await served.start()
                except BaseException:
                    for served in fresh.values():
                        await served.stop()
                    raise
            except BaseException as exc:
                if state.versions:
                    state.state = previous
                    state.reason = f"load failed, previous versions keep serving: {exc}"
                else:  # a failed first load: not loaded, not listed as loaded
                    self._models.pop(name, None)
                    self._failed[name] = f"load failed: {exc}"
                raise
            old = state.versions
            state.versions = {v: fresh.get(v) or old[v] for v in wanted}
            state.state, state.reason = "READY", ""
            self._failed.pop(name, None)
            for v, served in old.items():
                if state.versions.get(v) is not served:
                    await served.stop()
            refreeze(f"after loading {name}")
            return state

    async def unload(self, name: str) -> None:
        await self._unload(name)
        refreeze(f"after unloading {name}")

    async def _unload(self, name: str) -> None:
        check_model_name(name)
        not_loaded = ModelNotFoundError(f"model {name!r} is not loaded", "see GET /v2/repository/index")
        if name not in self._models:
            raise not_loaded
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            state = self._models.pop(name, None)
            if state is None:
                raise not_loaded
            for served in state.versions.values():
                await served.stop()

    async def stop(self) -> None:
        for name in list(self._models):
            await self._unload(name)  # the process is ending: no refreeze

    def get(self, name: str, version: int | str | None = None) -> ServedVersion:
        state = self._models.get(name)
        if (state is None or not state.versions) and name in self._failed:
            raise ModelNotFoundError(
                f"model {name!r} is not loaded ({self._failed[name]})",
                f"fix it, then POST /v2/repository/models/{name}/load",
            )
        if state is None or not state.versions:
            known = ", ".join(s.name for s in self.states() if s.versions) or "none"
            raise ModelNotFoundError(f"model {name!r} is not loaded", f"loaded models: {known}")
        if version is None or version == "":  # the primary: never a shadow candidate (ModelConfig.shadow)
            newest = state.versions[max(state.versions)]
            return state.versions[newest.config.primary_of(state.versions) or newest.version]
        try:
            v = int(version)
        except ValueError:
            raise ModelNotFoundError(
                f"version {version!r} of {name!r} is not a number", "use an integer version"
            ) from None
        if v not in state.versions:
            raise ModelNotFoundError(
                f"model {name!r} has no loaded version {v}",
                f"loaded versions: {', '.join(map(str, sorted(state.versions)))}",
            )
        return state.versions[v]

    def states(self) -> list[ModelState]:
        return [self._models[n] for n in sorted(self._models)]

    def index(self) -> list[dict[str, str]]:
        """Triton-style repository index: every model on disk, with its state."""
        rows = []
        for name in sorted(set(self.names_on_disk()) | set(self._models)):
            state = self._models.get(name)
            if state and state.versions:
                for v in sorted(state.versions):
                    rows.append({"name": name, "version": str(v), "state": state.state, "reason": state.reason})
            else:
                rows.append(
                    {
                        "name": name,
                        "version": "",
                        "state": state.state if state else "UNAVAILABLE",
                        "reason": state.reason if state else self._failed.get(name, ""),
                    }
                )
        return rows

    @property
    def ready(self) -> bool:
        """Some model is loaded and every loaded version is ready. A model still in its first load does not
        count, so loading a new model over the API does not take a serving replica out of rotation."""
        loaded = [s for s in self._models.values() if s.versions]
        return bool(loaded) and all(v.ready for s in loaded for v in s.versions.values())
