"""The model repository at serving time: which versions are live, load / unload / reload — for every kind of model:
encoders (:class:`~miaohui.serving.served.ServedVersion`) and chat models
(:class:`~miaohui.serving.chat.ServedChatVersion`) alike.

A (re)load builds the new versions completely — engines loaded, warm-up run — before swapping them in.
If anything fails, the versions that were serving keep serving and the error is kept for the API; a model whose
first load failed is not loaded (its error shows in the repository index). A swap drops nothing: an encoder version
that leaves drains its batcher; a chat version that leaves *retires* in the background — new requests go to the
new version at once, the streams running on the old one finish there, then it shuts down. Unloading a chat model
answers new requests with 503 while its running streams finish.

Model names are plain folder names (:func:`miaohui.paths.check_model_name`): they come from clients and become paths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, NoReturn, TypeVar, cast

from miaohui.config import VersionPolicy
from miaohui.engines.store import read_manifest, versions
from miaohui.errors import InputError, MiaohuiError, ModelNotFoundError, UnavailableError
from miaohui.gcpolicy import refreeze
from miaohui.generation.build.artifact import CausalLMInfo, ChatTokenizer, is_causal_lm_model, load_generation_config
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.paths import check_model_name, is_model_name
from miaohui.serving.batcher import BatcherObserver
from miaohui.serving.chat import ChatDefaults, ChatObserverFactory, ServedChatVersion, load_chat_version, local_client
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.model_config import ModelConfig, load_model_config
from miaohui.serving.served import RemoteServedVersion, ServedVersion

if TYPE_CHECKING:
    from miaohui.generation.executors.base import AnyCausalLMEngine

log = logging.getLogger("miaohui.repository")
ObserverFactory = Callable[[str, int], BatcherObserver | None]
V = TypeVar("V", ServedVersion, ServedChatVersion)


@dataclass
class ModelState(Generic[V]):
    name: str
    chat: bool
    """Its versions are chat models (:class:`ServedChatVersion`), else encoders (:class:`ServedVersion`)."""
    versions: dict[int, V] = field(default_factory=dict)
    state: str = "UNAVAILABLE"
    """READY, LOADING, UNLOADING, UNAVAILABLE (Triton's repository-index states)."""
    reason: str = ""
    """Why the last load failed (kept while the old versions serve)."""

    @property
    def latest(self) -> V | None:
        return self.versions[max(self.versions)] if self.versions else None

    @property
    def primary(self) -> V | None:
        """The version that answers requests naming none: the newest that is not the shadow candidate
        (``shadow`` in the newest version's config)."""
        newest = self.latest
        if newest is None:
            return None
        config = newest.config
        version = config.primary_of(list(self.versions)) if config is not None else None
        return self.versions[version or newest.version]


AnyState = ModelState[ServedVersion] | ModelState[ServedChatVersion]


class ModelManager:
    """Owns every served version. All methods run on the server's event loop."""

    def __init__(
        self,
        repository: Path,
        observer_factory: ObserverFactory | None = None,
        engine_process: EngineClient | None = None,
        *,
        chat_observer_factory: ChatObserverFactory | None = None,
        chat_defaults: ChatDefaults | None = None,
    ) -> None:
        """``engine_process``: versions are served by that engine process (``--shared-engine``), not here.
        ``chat_defaults``: scheduler and threads of chat models without a ``generation.yaml``."""
        self.repository = Path(repository)
        self.engine_process = engine_process
        self._observer_factory = observer_factory or (lambda name, version: None)
        self._chat_observer_factory = chat_observer_factory or (lambda name, version: None)
        self.chat_defaults = chat_defaults or ChatDefaults()
        self._models: dict[str, AnyState] = {}
        self._retiring: dict[asyncio.Task[None], ServedChatVersion] = {}
        """Chat versions swapped out, finishing their running streams."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, str] = {}
        """Why the first load of a model on disk failed (for the index; the model is not in ``_models``)."""

    def names_on_disk(self) -> list[str]:
        if not self.repository.is_dir():
            return []
        return sorted(p.name for p in self.repository.iterdir() if is_model_name(p.name) and p.is_dir() and versions(p))

    def is_known(self, name: str) -> bool:
        """Loaded, loading, or a folder in the repository (cheap: one ``stat`` for names not loaded)."""
        return name in self._models or (is_model_name(name) and (self.repository / name).is_dir())

    async def load_all(self, only: list[str] | None = None) -> None:
        for name in only or self.names_on_disk():
            try:
                await self.load(name, forward=False)  # a worker of --shared-engine: the engine process loaded it
            except MiaohuiError as exc:
                log.error("model %s failed to load: %s", name, exc)
            except Exception:  # a broken engine file must not keep the other models from serving
                log.exception("model %s failed to load", name)

    async def load(self, name: str, *, forward: bool = True) -> AnyState:
        """Load (or reload) ``name`` per its version policy. New versions go live only once warm.
        ``forward``: in an HTTP worker of ``--shared-engine``, have the engine process load it first (where the
        models run); False when the worker only mirrors what the engine process serves (at start)."""
        check_model_name(name)
        model_dir = self.repository / name
        missing = f"no versions of {name!r} in {self.repository}"
        fix = f"build it with `miaohui build ... --name {name}`"
        if name not in self._models and not versions(model_dir):
            raise ModelNotFoundError(missing, fix)  # before a lock exists: random names leave nothing behind
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            mirrored: list[int] | None = None
            if self.engine_process is not None and forward:
                await self.engine_process.load(name)
            elif self.engine_process is not None:
                # a worker's start mirrors what the engine process serves, not the newest version on disk: a version
                # added since (not loaded there yet) would not be served, and the model would fail here
                mirrored = (await self.engine_process.status()).get(name) or None
            chat = is_causal_lm_model(model_dir)
            state = self._models.get(name)
            if state is not None and state.chat != chat:
                raise InputError(  # the newest version changed kind: serve it under another name
                    f"model {name!r} serves {'encoder' if chat else 'chat'} versions; its newest is a "
                    f"{'chat' if chat else 'encoder'} model",
                    f"unload {name} first (POST /v2/repository/models/{name}/unload), then load it",
                )
            if chat:
                return await self._load_chat(name, model_dir, missing, fix, mirrored)
            return await self._load_encoder(name, model_dir, missing, fix, mirrored)

    @staticmethod
    def _wanted(policy: VersionPolicy, available: list[int], mirrored: list[int] | None) -> list[int]:
        """The versions to serve: those the engine process serves (``mirrored``, a worker's start) where still on
        disk, else the version policy's choice."""
        kept = [v for v in mirrored or [] if v in available]
        return kept or list(policy.select(available))

    async def _load_encoder(
        self, name: str, model_dir: Path, missing: str, fix: str, mirrored: list[int] | None = None
    ) -> ModelState[ServedVersion]:
        encoders = cast("ModelState[ServedVersion]", self._models.get(name) or ModelState[ServedVersion](name, False))
        self._models[name] = encoders
        available = versions(model_dir)
        if not available:
            return self._vanished(encoders, missing, fix)
        previous, encoders.state = encoders.state, "LOADING"
        try:
            backend = read_manifest(model_dir / str(available[-1])).backend
            config = load_model_config(model_dir / "config.yaml", backend)
            wanted = self._wanted(config.version_policy, available, mirrored)
            fresh: dict[int, ServedVersion] = {}
            started = time.perf_counter()
            try:
                for v in wanted:
                    if v in encoders.versions and encoders.versions[v].config == config:
                        continue
                    served = await asyncio.to_thread(self._open_version, model_dir / str(v), config, name, v)
                    fresh[v] = served
                    served.load_seconds = time.perf_counter() - started
                    await served.start()
            except BaseException:
                for served in fresh.values():
                    await served.stop()
                raise
        except BaseException as exc:
            self._failed_load(encoders, previous, exc)
            raise
        old = encoders.versions
        encoders.versions = {v: fresh.get(v) or old[v] for v in wanted}
        self._loaded(encoders)
        for v, served in old.items():
            if encoders.versions.get(v) is not served:
                await served.stop()
        refreeze(f"after loading {name}")
        return encoders

    def _open_version(self, path: Path, config: ModelConfig, name: str, version: int) -> ServedVersion:
        """An encoder version: its engines here, or (an HTTP worker of ``--shared-engine``) the engine process's."""
        observer = self._observer_factory(name, version)
        if self.engine_process is not None:
            return RemoteServedVersion(path, config, observer, self.engine_process)
        return ServedVersion(path, config, observer)

    async def _load_chat(
        self, name: str, model_dir: Path, missing: str, fix: str, mirrored: list[int] | None = None
    ) -> ModelState[ServedChatVersion]:
        chats = cast(
            "ModelState[ServedChatVersion]", self._models.get(name) or ModelState[ServedChatVersion](name, True)
        )
        self._models[name] = chats
        available = versions(model_dir)
        if not available:
            return self._vanished(chats, missing, fix)
        previous, chats.state = chats.state, "LOADING"
        fresh: dict[int, ServedChatVersion] = {}
        try:
            config = load_generation_config(model_dir)
            wanted = self._wanted(config.version_policy, available, mirrored)
            try:
                for v in wanted:
                    if v in chats.versions and chats.versions[v].config == config:
                        continue
                    observer = self._chat_observer_factory(name, v)
                    path = model_dir / str(v)
                    fresh[v] = await load_chat_version(path, config, self.chat_defaults, observer, self.engine_process)
            except BaseException:
                for served in fresh.values():
                    await served.stop()
                raise
        except BaseException as exc:
            self._failed_load(chats, previous, exc)
            raise
        old = chats.versions
        chats.versions = {v: fresh.get(v) or old[v] for v in wanted}
        self._loaded(chats)
        for v, served in old.items():
            if chats.versions.get(v) is not served:
                self._retire(served)
        refreeze(f"after loading {name}")
        return chats

    async def add_chat_engine(
        self,
        info: CausalLMInfo,
        engine: AnyCausalLMEngine,
        tokenizer: ChatTokenizer,
        scheduler: SchedulerConfig | None = None,
    ) -> ServedChatVersion:
        """Serve an executor made elsewhere (a torch / GPU engine built in this process, a test double) as
        ``info.name`` version ``info.version``: it replaces the model's versions once it started (they retire).
        The manager owns it from here: unload and stop close it."""
        sched = scheduler or self.chat_defaults.scheduler
        client = local_client(engine, tokenizer, sched, self._chat_observer_factory(info.name, info.version))
        served = ServedChatVersion(info, None, tokenizer, client)
        await served.start()
        lock = self._locks.setdefault(info.name, asyncio.Lock())
        async with lock:
            state = self._models.get(info.name)
            if state is not None and not state.chat:
                await served.stop()
                raise InputError(f"model {info.name!r} is an encoder model", "serve the engine under another name")
            chats = cast("ModelState[ServedChatVersion]", state or ModelState[ServedChatVersion](info.name, True))
            self._models[info.name] = chats
            old, chats.versions = chats.versions, {info.version: served}
            self._loaded(chats)
            for previous in old.values():
                self._retire(previous)
        return served

    def _retire(self, served: ServedChatVersion) -> None:
        """Let ``served`` finish its running streams in the background (new requests go elsewhere already)."""
        served.ready = False
        task = asyncio.get_running_loop().create_task(served.retire(self.chat_defaults.drain_timeout_s))
        self._retiring[task] = served
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    def _vanished(self, state: AnyState, missing: str, fix: str) -> NoReturn:
        state.reason = missing
        if not state.versions:
            self._models.pop(state.name, None)
        raise ModelNotFoundError(missing, fix)

    def _failed_load(self, state: AnyState, previous: str, exc: BaseException) -> None:
        if state.versions:
            state.state = previous
            state.reason = f"load failed, previous versions keep serving: {exc}"
        else:  # a failed first load: not loaded, not listed as loaded
            self._models.pop(state.name, None)
            self._failed[state.name] = f"load failed: {exc}"

    def _loaded(self, state: AnyState) -> None:
        state.state, state.reason = "READY", ""
        self._failed.pop(state.name, None)

    async def unload(self, name: str) -> None:
        await self._unload(name, drain=True)
        refreeze(f"after unloading {name}")

    async def _unload(self, name: str, *, drain: bool) -> None:
        """Stop serving ``name``. ``drain``: a chat model answers new requests with 503 while its running streams
        finish (and, in an HTTP worker of ``--shared-engine``, the engine process unloads it first)."""
        check_model_name(name)
        not_loaded = ModelNotFoundError(f"model {name!r} is not loaded", "see GET /v2/repository/index")
        if name not in self._models:
            raise not_loaded
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            state = self._models.get(name)
            if state is None:
                raise not_loaded
            state.state = "UNLOADING"
            try:
                if drain and self.engine_process is not None:
                    await self.engine_process.unload(name)
                for served in state.versions.values():
                    if drain and isinstance(served, ServedChatVersion):
                        await served.retire(self.chat_defaults.drain_timeout_s)
                    else:
                        await served.stop()
            finally:
                self._models.pop(name, None)

    async def stop(self) -> None:
        """The process is ending: every version stops now (unfinished streams end with 503)."""
        for name in list(self._models):
            await self._unload(name, drain=False)  # no refreeze
        for task, served in list(self._retiring.items()):
            task.cancel()
            await served.stop()

    def get(self, name: str, version: int | str | None = None) -> ServedVersion:
        """An encoder version (the primary by default); ModelNotFoundError (404) naming the loaded ones."""
        served = self.version(name, version)
        if isinstance(served, ServedChatVersion):
            raise InputError(
                f"model {name!r} is a chat model; this endpoint needs an encoder model",
                "send it to POST /v1/chat/completions or /v1/completions",
            )
        return served

    def version(self, name: str, version: int | str | None = None) -> ServedVersion | ServedChatVersion:
        """A loaded version of any kind (the primary by default)."""
        state = self._models.get(name)
        if (state is None or not state.versions) and name in self._failed:
            raise ModelNotFoundError(
                f"model {name!r} is not loaded ({self._failed[name]})",
                f"fix it, then POST /v2/repository/models/{name}/load",
            )
        if state is None or not state.versions:
            known = ", ".join(s.name for s in self.all_states() if s.versions) or "none"
            raise ModelNotFoundError(f"model {name!r} is not loaded", f"loaded models: {known}")
        if version is None or version == "":  # the primary: never a shadow candidate (config's shadow)
            return cast("ServedVersion | ServedChatVersion", state.primary)
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

    def chat(self, name: str, version: int | None = None) -> ServedChatVersion:
        """The chat model's serving version (its newest loaded one other than a shadow candidate), or ``version``:
        ModelNotFoundError (404) naming the chat models served, UnavailableError (503) while it unloads."""
        state = self._models.get(name)
        if state is not None and state.chat and state.state == "UNLOADING":
            raise UnavailableError(
                f"model {name!r} is unloading", f"load it again (POST /v2/repository/models/{name}/load)"
            )
        if version is not None and state is not None and state.chat:
            served = self.version(name, version)
            if isinstance(served, ServedChatVersion):
                return served
        primary = state.primary if state is not None else None
        if isinstance(primary, ServedChatVersion):
            return primary
        if name in self._failed:
            raise ModelNotFoundError(
                f"model {name!r} is not loaded ({self._failed[name]})",
                f"fix it, then POST /v2/repository/models/{name}/load",
            )
        known = ", ".join(s.name for s in self.chat_states() if s.versions) or "none"
        raise ModelNotFoundError(f"The model '{name}' does not exist", f"chat models served here: {known}")

    def chat_states(self) -> list[ModelState[ServedChatVersion]]:
        return [cast("ModelState[ServedChatVersion]", s) for s in self.all_states() if s.chat]

    def all_states(self) -> list[AnyState]:
        return [self._models[n] for n in sorted(self._models)]

    def states(self) -> list[ModelState[ServedVersion]]:
        """The encoder models' states (:meth:`chat_states`: the chat models')."""
        return [cast("ModelState[ServedVersion]", s) for s in self.all_states() if not s.chat]

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
        loaded = [s for s in self._models.values() if s.versions and s.state != "UNLOADING"]
        return bool(loaded) and all(v.ready for s in loaded for v in s.versions.values())
