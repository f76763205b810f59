"""One comparator (as Polygraphy's ``Comparator``): runners take the same inputs, each through its own preprocessing
(its own tokenizer) and its own backend, and one comparison (:func:`~miaohui.validate.consistency.compare_outputs`)
measures how far their outputs drift apart. ``miaohui compare`` (encoders, pipelines, decoders), the pipeline gate
and the decoder gate (``miaohui validate`` on a causal LM) all run through these runners.

Encoder runners (texts → logits, labels), also the dialogue pipelines' offline intent classifiers:

* :class:`ArtifactClassifier` — an engine artifact on its backend (ONNX Runtime, TensorRT, inductor...), with the
  artifact's tokenizer;
* :class:`TorchClassifier` — the source checkpoint in PyTorch fp32 (the gates' reference).

Decoder runners (:class:`DecoderRunner`: one greedy step at a time, chat prompts rendered and encoded with the
runner's own tokenizer and chat template, so a Qwen or Gemma decoder gets its own ids):

* :class:`OrtDecoder` — an ``onnxruntime`` causal-LM version; :class:`SlotDecoder` — an ``inductor`` version on its
  static-KV engine (GPU); :class:`LlamaCppDecoder` — a ``llamacpp`` GGUF version on llama.cpp's server (one slot);
  :func:`open_decoder` picks one from the version's ``causal_lm.json``;
* :class:`TorchDecoder` — the fp32 HF source the version was exported from (:func:`source_decoder`).

The pipelines (a layer above this one) run over encoder runners in :mod:`miaohui.dialogue.compare`.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from miaohui.errors import ArtifactError, ConfigError
from miaohui.generation.build.artifact import MARKER_NAME, CausalLMInfo, ChatTokenizer, is_causal_lm_dir, read_info
from miaohui.models.decision import IntentDecision, decide
from miaohui.validate.consistency import EngineOutputs

if TYPE_CHECKING:
    from miaohui.engines.base import Engine
    from miaohui.nlp.tokenizer import TextTokenizer

__all__ = [
    "ArtifactClassifier",
    "DecoderRunner",
    "EncoderRunner",
    "LlamaCppDecoder",
    "OrtDecoder",
    "SlotDecoder",
    "TorchClassifier",
    "TorchDecoder",
    "decoder_outputs",
    "intent_outputs",
    "open_decoder",
    "source_decoder",
]

Messages = Sequence[Mapping[str, Any]]
"""Chat messages (``role``, ``content``)."""


# ---- encoders ------------------------------------------------------------------------------------------------


def softmax_top(logits: np.ndarray, labels: Sequence[str]) -> list[tuple[str, float]]:
    """The top label and its probability of each row of ``logits``."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    best = probs.argmax(-1)
    return [(labels[int(b)], float(probs[i, b])) for i, b in enumerate(best)]


PIPELINE_OOS = "out_of_scope"
"""What a pipeline is told when the model answers out of scope (whatever the model calls it)."""


def decided(logits: np.ndarray, labels: Sequence[str], decision: IntentDecision | None) -> list[tuple[str, float, str]]:
    """(label, confidence, candidate) a pipeline routes on: the model's calibrated answer (temperature and
    out-of-scope threshold applied), ``out_of_scope`` below its threshold, and the best label."""
    return [
        (PIPELINE_OOS if d.out_of_scope else d.intent, d.confidence, d.candidate)
        for d in decide(logits, labels, decision)
    ]


class ArtifactClassifier:
    """An intent engine artifact loaded in this process (no server, no batcher), with its own tokenizer.

    Use as a context manager (``with ArtifactClassifier.open(path) as clf:``); :meth:`logits` gives the raw outputs,
    :meth:`classify` is the pipelines' ``IntentClassifier``.
    """

    def __init__(self, engine: Engine, tokenizer: TextTokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.labels: list[str] = list(engine.manifest.labels)
        if engine.manifest.task != "intent" or not self.labels:
            raise ArtifactError(
                f"{engine.manifest.name} v{engine.manifest.version} is a {engine.manifest.task} engine without labels",
                "give an intent classifier artifact (built from `miaohui train-intent`)",
            )
        self.output = engine.output_names[0]
        found = engine.manifest.extra.get("decision")
        self.decision = IntentDecision.model_validate(found) if found else None
        self.name = f"{engine.manifest.name} v{engine.manifest.version} ({engine.manifest.backend} "
        self.name += f"{engine.manifest.precision})"

    @classmethod
    @contextlib.contextmanager
    def open(cls, path: Path) -> Iterator[ArtifactClassifier]:
        from miaohui.engines.loader import load_engine
        from miaohui.nlp.tokenizer import TextTokenizer

        with load_engine(path) as engine:
            m = engine.manifest
            tok = TextTokenizer.from_file(path / (m.tokenizer_file or "tokenizer.json"), m.max_length or 512)
            yield cls(engine, tok)

    def logits(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Logits of every text (normalized like the server does, over-long texts truncated)."""
        from miaohui.validate.accuracy import engine_batch, run_logits

        def fn(feeds: dict[str, np.ndarray]) -> np.ndarray:
            return self.engine.infer(feeds)[self.output]

        return run_logits(fn, self.tokenizer, texts, engine_batch(self.engine, batch_size))

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        return decided(await asyncio.to_thread(self.logits, texts), self.labels, self.decision)


class TorchClassifier:
    """A source checkpoint in PyTorch fp32, with its own tokenizer (the default gate reference)."""

    def __init__(self, model_dir: Path) -> None:
        from miaohui.models.checkpoint import load_checkpoint
        from miaohui.nlp.tokenizer import TextTokenizer

        loaded = load_checkpoint(Path(model_dir))
        self.module = loaded.module
        self.labels = list(loaded.meta.labels)
        self.decision = loaded.meta.decision
        self.tokenizer = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
        self.name = f"torch fp32 ({model_dir})"

    def logits(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        import torch

        from miaohui.validate.accuracy import run_logits

        def fn(feeds: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                ids, mask = (torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask"))
                out: np.ndarray = self.module(ids, mask).numpy()
                return out

        return run_logits(fn, self.tokenizer, texts, batch_size)

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        return decided(await asyncio.to_thread(self.logits, texts), self.labels, self.decision)


class EncoderRunner(Protocol):
    """What :func:`intent_outputs` needs of a runner: its labels and the logits of texts."""

    name: str
    labels: list[str]

    def logits(self, texts: list[str], batch_size: int = 32) -> np.ndarray: ...


def intent_outputs(runners: Sequence[EncoderRunner], texts: list[str]) -> list[EngineOutputs]:
    """Every runner over the same texts: intents by label name, and the logits when every runner has the same
    labels (logit error is meaningless across label sets)."""
    logits = [r.logits(texts) for r in runners]
    same = all(list(r.labels) == list(runners[0].labels) for r in runners)
    return [
        EngineOutputs(intents=[r.labels[int(i)] for i in lg.argmax(-1)], logits=lg.tolist() if same else None)
        for r, lg in zip(runners, logits, strict=True)
    ]


# ---- decoders ------------------------------------------------------------------------------------------------


class DecoderRunner(ABC):
    """A causal LM one greedy step at a time, with its own tokenizer and chat template (``tokenizer``)."""

    name: str
    tokenizer: ChatTokenizer
    eos: set[int]

    @abstractmethod
    def first(self, prompt: Sequence[int]) -> int:
        """Start a new sequence on ``prompt``; its greedy next token."""

    @abstractmethod
    def next(self, token: int) -> int:
        """Append ``token`` to the sequence; its greedy next token."""

    def close(self) -> None:  # noqa: B027 — optional hook
        """Free the backend (sessions, the device, a server)."""

    def __enter__(self) -> DecoderRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompt_ids(self, messages: Messages) -> list[int]:
        """``messages`` rendered with this model's chat template and encoded with its tokenizer (a raw text prompt
        for a model without a template: the last message's content)."""
        if self.tokenizer.chat_template:
            return self.tokenizer.encode_chat(
                [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
            )
        return self.tokenizer.encode(str(messages[-1]["content"]))

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """Up to ``n`` greedy tokens after ``prompt``, the end-of-sequence token included when it comes."""
        out = [self.first(prompt)]
        while len(out) < n and out[-1] not in self.eos:
            out.append(self.next(out[-1]))
        return out

    def teacher_forced(self, prompt: Sequence[int], reference: Sequence[int]) -> int:
        """Positions where this model's argmax, fed ``reference`` so far, is the reference's next token."""
        agree = int(self.first(prompt) == reference[0])
        for i in range(1, len(reference)):
            agree += int(self.next(reference[i - 1]) == reference[i])
        return agree

    def reply(self, messages: Messages, max_tokens: int) -> str:
        """The greedy reply to ``messages`` as text (special tokens dropped, surrounding space stripped)."""
        return self.tokenizer.decode(self.greedy(self.prompt_ids(messages), max_tokens)).strip()


def _label(info: CausalLMInfo, folder: Path) -> str:
    return f"{info.name} v{info.version} ({info.backend} {info.precision}, {folder})"


class OrtDecoder(DecoderRunner):
    """An ``onnxruntime`` causal-LM version (explicit KV cache, CPU)."""

    def __init__(self, folder: Path, info: CausalLMInfo) -> None:
        from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

        self.engine = OrtCausalLMEngine(folder)
        self.name, self.tokenizer = _label(info, folder), ChatTokenizer.from_dir(folder, info)
        self.eos = set(self.engine.meta.eos_token_ids)
        self._kv: Any = None

    def first(self, prompt: Sequence[int]) -> int:
        logits, self._kv = self.engine.prefill([list(prompt)])
        return int(logits[0].argmax())

    def next(self, token: int) -> int:
        logits, self._kv = self.engine.decode([token], self._kv)
        return int(logits[0].argmax())

    def close(self) -> None:
        self.engine.close()


class SlotDecoder(DecoderRunner):
    """An ``inductor`` version on its static-KV engine (GPU), one slot. ``int8_batch1``: with the engine's int8 copy
    of the weights read by steps of one row (``SlotEngineOptions.int8_batch1``, its default ``int8_kernel``, as
    serve runs it); every step here decodes one row, so every decoded token reads the int8 copy.

    On the CPU (no CUDA) the engine is eager and has one slot (the default 64 slots' fp32 KV cache would take
    gigabytes for nothing: the runner uses slot 0 only); the int8 kernels run their torch form there (the same
    dequantize-and-multiply arithmetic as the Triton kernels)."""

    def __init__(self, folder: Path, info: CausalLMInfo, int8_batch1: bool = False) -> None:
        from miaohui.generation.build.static_artifact import load_slot_engine, read_static_meta
        from miaohui.generation.executors.slot_options import SlotEngineOptions
        from miaohui.generation.executors.slot_steps import resolve_device

        meta = read_static_meta(folder)
        options = SlotEngineOptions(dtype=meta.precision, int8_batch1=int8_batch1)
        if resolve_device(options).type == "cpu":
            options = options.model_copy(update={"num_slots": 1})
        self.engine = load_slot_engine(folder, options)
        self.engine.warmup()
        self.name, self.tokenizer = _label(info, folder), ChatTokenizer.from_dir(folder, info)
        kind = f"int8 batch-1 weights, {options.int8_kernel} kernels" if int8_batch1 else f"{meta.precision} weights"
        self.engine_label = f"{kind}, {self.engine.device.type}, {options.num_slots} slot(s)"
        """What ran: the weights read by one-row steps, the device, the slots."""
        if int8_batch1:
            self.name += f" with {kind}"
        self.eos = set(meta.eos_token_ids)

    def first(self, prompt: Sequence[int]) -> int:
        self.engine.release(0)
        return int(self.engine.prefill([0], [list(prompt)]).argmax()[0])

    def next(self, token: int) -> int:
        return int(self.engine.decode([0], [token]).argmax()[0])

    def close(self) -> None:
        self.engine.close()


class LlamaCppDecoder(DecoderRunner):
    """A ``llamacpp`` version on llama.cpp's server, one slot: each step is a one-token greedy request on the context
    so far with llama.cpp's prompt cache on, so it evaluates only the new token (teacher forcing feeds the
    reference's tokens the same way; llama.cpp returns no logits, its greedy pick is the argmax)."""

    def __init__(self, folder: Path, info: CausalLMInfo) -> None:
        from miaohui.generation.build.llamacpp_artifact import read_llamacpp_meta
        from miaohui.generation.engine.llamacpp_engine import open_server

        meta = read_llamacpp_meta(folder)
        self.server = open_server(folder, 1, min(meta.max_positions, 2048), None)
        self.name, self.tokenizer = _label(info, folder), ChatTokenizer.from_dir(folder, info)
        self.eos = set(meta.eos_token_ids)
        self._ids: list[int] = []

    def _argmax(self) -> int:
        """The greedy next token, from llama.cpp's native ``/completion`` on the server's own 127.0.0.1 port: its
        ``return_tokens`` has every generated id (the in-process OpenAI-style call reports none for a token whose text
        is an incomplete character, the first byte tokens of a Chinese character for SmolLM2)."""
        import httpx

        body = {
            "prompt": self._ids, "n_predict": 1, "temperature": 0.0, "top_k": 0, "min_p": 0.0,
            "repeat_penalty": 1.0, "cache_prompt": True, "return_tokens": True, "stream": False,
        }  # fmt: skip
        try:
            reply = httpx.post(f"{self.server.listening_address}/completion", json=body, timeout=600).json()
            return int(reply["tokens"][0])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ArtifactError(f"llama.cpp failed a greedy step: {exc!r}", "see the llama.cpp log above") from exc

    def first(self, prompt: Sequence[int]) -> int:
        self._ids = [int(t) for t in prompt]
        return self._argmax()

    def next(self, token: int) -> int:
        self._ids.append(int(token))
        return self._argmax()


class TorchDecoder(DecoderRunner):
    """A Hugging Face causal LM in PyTorch fp32 (a version's source), with the version's tokenizer. :meth:`greedy` is
    ``generate`` (as users run the source); :meth:`first` / :meth:`next` step its KV cache for teacher forcing."""

    def __init__(self, model: Any, tokenizer: ChatTokenizer, eos: set[int], name: str) -> None:
        self.model, self.tokenizer, self.eos, self.name = model, tokenizer, eos, name
        self._past: Any = None

    def _step(self, ids: list[int]) -> int:
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), past_key_values=self._past, use_cache=True)
        self._past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def first(self, prompt: Sequence[int]) -> int:
        self._past = None
        return self._step([int(t) for t in prompt])

    def next(self, token: int) -> int:
        return self._step([int(token)])

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        import torch

        eos = sorted(self.eos)
        with torch.inference_mode():
            ids = torch.tensor([list(prompt)])
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                pad_token_id=eos[0],
            )  # fmt: skip
        return [int(t) for t in out[0, len(prompt) :]]


def open_decoder(folder: Path, int8_batch1: bool = False) -> DecoderRunner:
    """The runner of the causal-LM version ``folder`` on its own backend (``causal_lm.json``'s ``backend``);
    ``int8_batch1``: an ``inductor`` version's engine with its int8 batch-1 weights (:class:`SlotDecoder`), a
    ConfigError for other backends."""
    if not is_causal_lm_dir(folder):
        raise ConfigError(
            f"{folder} is not a causal-LM version (no {MARKER_NAME})",
            "build it with `miaohui build-llm` and give the version folder or NAME[:VERSION] of the repository",
        )
    info = read_info(folder)
    if int8_batch1 and info.backend != "inductor":
        raise ConfigError(
            f"int8 batch-1 weights are an option of the inductor engine, not of {info.backend}",
            "build the model with `miaohui build-llm --backend inductor`",
        )
    if info.backend == "onnxruntime":
        return OrtDecoder(folder, info)
    if info.backend == "llamacpp":
        return LlamaCppDecoder(folder, info)
    return SlotDecoder(folder, info, int8_batch1)


def _source_folder(info: CausalLMInfo) -> Path | None:
    """The fp32 HF directory a version was exported from; versions built before ``source_path`` was recorded: the
    built-in SmolLM2's cache when that is their source."""
    if info.source_path:
        return Path(info.source_path)
    from miaohui.zoo.smollm import GGUF_NAME, smollm_cache_dir

    return smollm_cache_dir() if info.source.startswith(f"{GGUF_NAME}@") else None


def source_decoder(folder: Path, eos: set[int]) -> TorchDecoder:
    """The fp32 HF source of the causal-LM version ``folder`` in PyTorch, stopping at ``eos``; ArtifactError when the
    version does not record its source or the source is gone."""
    info = read_info(folder)
    fix = f"rebuild it with `miaohui build-llm ... --name {info.name} --force` (the source is recorded then)"
    source = _source_folder(info)
    if source is None:
        raise ArtifactError(f"{folder / MARKER_NAME} does not say where its fp32 source is", fix)
    if not (source / "config.json").is_file():
        raise ArtifactError(f"the fp32 source of {info.name} v{info.version}, {source}, is gone", fix)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), local_files_only=True, dtype="float32").eval()
    name = f"fp32 {info.architecture or 'HF'} in PyTorch ({info.source_path})"
    return TorchDecoder(model, ChatTokenizer.from_dir(folder, info), eos, name)


def decoder_outputs(
    runners: Sequence[DecoderRunner], prompts: Sequence[Messages], max_tokens: int
) -> list[EngineOutputs]:
    """Every runner's greedy replies (``max_tokens`` at most) to the same chat prompts, each prompt encoded with that
    runner's own tokenizer and chat template."""
    return [EngineOutputs(texts=[r.reply(p, max_tokens) for p in prompts]) for r in runners]
