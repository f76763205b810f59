"""Causal-LM versions for the GPU engine (backend ``inductor``): weights + config, compiled at load time.

A version folder holds ``causal_lm.json`` (backend ``inductor``), ``static_decoder.json``
(:class:`StaticDecoderMeta`), ``config.json`` (the HF config), ``weights.safetensors`` (HF tensor names,
in the build precision) and ``tokenizer.json``; built on a GPU, also ``precompiled/`` (every graph the build's warm-up
compiled, :mod:`miaohui.engines.precompiled`), ``compile-cache.bin`` and ``triton-cache.tar``. Serving needs neither
``transformers`` nor ONNX: the weights go straight into a
:class:`~miaohui.generation.models.static_kv.StaticKVDecoder`, whose pieces are the precompiled graphs (or, where
they are missing or were built elsewhere, compiled by Inductor during the warm-up) and whose steps are captured as
CUDA graphs.

Every save is checked: the static-KV module, built in fp32 from the same HF model, must match HF's own
logits on a prompt's prefill and a decode step (``max_abs_error`` is stored).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from miaohui.errors import ArtifactError, ExportError
from miaohui.generation.build.compile_cache import (
    CompileCacheInfo,
    PrecompiledInfo,
    load_compile_cache,
    load_precompiled,
    restore_triton,
    save_compile_cache,
    save_precompiled,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from miaohui.engines.precompiled import CompileFn
    from miaohui.generation.executors.slot_defaults import ServeDefaults
    from miaohui.generation.executors.slot_engine import TorchSlotEngine
    from miaohui.generation.executors.slot_options import SlotEngineOptions

META_NAME = "static_decoder.json"
WEIGHTS_NAME = "weights.safetensors"
HF_CONFIG_NAME = "config.json"
StaticPrecision = Literal["bf16", "fp16", "fp32"]


class StaticDecoderMeta(BaseModel):
    """``static_decoder.json``."""

    dims: dict[str, Any]
    precision: StaticPrecision
    eos_token_ids: list[int]
    pad_token_id: int
    check_max_abs_error: float
    """fp32 static-KV module vs HF logits (prefill + one decode step) at save time."""
    save_seconds: float
    compile_cache: CompileCacheInfo | None = None
    """``compile-cache.bin`` (built on a GPU: what every bucket compiled), loaded before the engine compiles."""
    precompiled: PrecompiledInfo | None = None
    """``precompiled/`` (built on a GPU): every compiled graph, called at serve without Dynamo."""


def _check(hf_model: PreTrainedModel, prompt: list[int], tolerance: float) -> float:
    """Max |logit error| of the fp32 static-KV module against HF on ``prompt`` (prefill) and one decode."""
    import torch

    from miaohui.generation.models.static_kv import StaticKVDecoder

    ref_model = hf_model
    if next(hf_model.parameters()).dtype != torch.float32:  # compare against an fp32 copy, never in place
        import copy

        ref_model = copy.deepcopy(hf_model).float()
    with torch.inference_mode():
        dec = StaticKVDecoder.from_hf(ref_model, num_slots=1, max_len=len(prompt) + 2, dtype=torch.float32)
        ids = torch.tensor([prompt], device=dec.embed.device)
        ref = ref_model(ids).logits[0].float()
        got = dec.prefill(ids, torch.tensor([len(prompt)], device=ids.device), torch.tensor([0], device=ids.device))
        nxt = int(got.argmax(-1))
        step = dec.decode(
            torch.tensor([nxt], device=ids.device), torch.tensor([len(prompt)], device=ids.device), len(prompt) + 1
        )
        ref2 = ref_model(torch.tensor([[*prompt, nxt]], device=ids.device)).logits[0, -1].float()
    err = max(float((got[0] - ref[-1]).abs().max()), float((step[0] - ref2).abs().max()))
    if not err <= tolerance:
        raise ExportError(
            f"the static-KV decoder differs from HF by {err:.2e} (tolerance {tolerance:.0e})", "report this"
        )
    return err


def save_static_decoder(
    folder: Path,
    hf_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    precision: StaticPrecision,
    eos_token_ids: list[int],
    pad_token_id: int,
    *,
    check_prompt: list[int] | None = None,
    tolerance: float = 2e-3,
) -> StaticDecoderMeta:
    """Write the version files (see the module docstring) into ``folder`` (which must exist)."""
    from safetensors.torch import save_file

    from miaohui.generation.executors.slot_steps import DTYPES
    from miaohui.generation.models.dims import DecoderDims

    started = time.perf_counter()
    err = _check(hf_model, check_prompt or [1, 2, 3, 4, 5, 6, 7, 8], tolerance)
    state = dict(hf_model.state_dict())
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the loader takes the embeddings as the head
    dtype = DTYPES[precision]
    tensors = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in state.items() if v.is_floating_point()}
    save_file(tensors, str(folder / WEIGHTS_NAME))
    (folder / HF_CONFIG_NAME).write_text(json.dumps(hf_model.config.to_dict(), indent=1, default=str))
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ExportError("the tokenizer has no backend_tokenizer", "pass a HF *fast* tokenizer")
        backend.save(str(folder / "tokenizer.json"))
    dims = DecoderDims.from_hf(hf_model.config)
    meta = StaticDecoderMeta(
        dims=dims.__dict__, precision=precision, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
        check_max_abs_error=err, save_seconds=round(time.perf_counter() - started, 2),
    )  # fmt: skip
    (folder / META_NAME).write_text(meta.model_dump_json(indent=2))
    return meta


def read_static_meta(folder: Path) -> StaticDecoderMeta:
    path = folder / META_NAME
    try:
        return StaticDecoderMeta.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read {path}: {exc}", "rebuild it with `miaohui build-llm --backend inductor`"
        ) from exc


def load_slot_engine(
    folder: Path, options: SlotEngineOptions | None = None, compile_fn: CompileFn | None = None
) -> TorchSlotEngine:
    """The GPU engine of a version folder (not warmed up: call ``warmup()``). ``options.dtype`` defaults to
    the saved precision; ArtifactError for missing or corrupt files. Without ``compile_fn`` the engine calls the
    build's precompiled graphs where they are usable (``torch.compile`` otherwise, helped by the compile cache)."""
    import logging

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from miaohui.generation.executors.slot_engine import TorchSlotEngine
    from miaohui.generation.executors.slot_options import SlotEngineOptions
    from miaohui.generation.executors.slot_steps import resolve_device, torch_compile_fn

    started = time.perf_counter()
    meta = read_static_meta(folder)
    opts = options or SlotEngineOptions(dtype=meta.precision)
    precompiled, said = None, ""
    if compile_fn is None:
        precompiled, said = load_precompiled(folder, meta.precompiled, torch_compile_fn(opts))
        compile_fn = precompiled
    if precompiled is None:
        cache = load_compile_cache(folder, meta.compile_cache)
    elif meta.compile_cache is not None:  # only the build's Triton kernels: the graphs need no Inductor cache
        cache = f"not loaded (precompiled graphs in use); {restore_triton(folder, meta.compile_cache)}"
    else:
        cache = "none built"
    logging.getLogger(__name__).info("compile cache of %s: %s", folder, cache)
    fix = f"rebuild {folder.parent.name} with `miaohui build-llm --backend inductor`"
    try:
        config = json.loads((folder / HF_CONFIG_NAME).read_text(encoding="utf-8"))
        state: dict[str, torch.Tensor] = load_file(str(folder / WEIGHTS_NAME), device=str(resolve_device(opts)))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ArtifactError(f"cannot load the decoder weights in {folder}: {exc}", fix) from exc
    max_len = min(opts.max_len, int(meta.dims["max_positions"]))
    if max_len != opts.max_len:
        opts = opts.model_copy(update={"max_len": max_len, "length_buckets": (), "mixed_length_buckets": ()})
    engine = TorchSlotEngine.create(config, state, meta.eos_token_ids, meta.pad_token_id, opts, compile_fn)
    engine.start_phases["load"] = time.perf_counter() - started
    if compile_fn is precompiled:
        if precompiled is not None:
            engine.precompiled = precompiled
            said += " (each loaded at its first call)"
        logging.getLogger(__name__).info("precompiled graphs of %s: %s", folder, said)
    return engine


def build_compile_cache(folder: Path, options: SlotEngineOptions | None = None) -> CompileCacheInfo | None:
    """Compile (warm up) the version's engine on this machine's GPU and save what it compiled into the version
    (:mod:`miaohui.generation.build.compile_cache`); its facts are written into ``static_decoder.json``. Without
    ``options``: what ``serve`` chooses for the version on this GPU when it has no ``generation.yaml``
    (:func:`~miaohui.generation.executors.slot_defaults.choose_defaults`), so the build compiles what serve runs."""
    from miaohui.engines.precompiled import Recorder
    from miaohui.generation.executors.slot_options import SlotEngineOptions
    from miaohui.generation.executors.slot_steps import compile_mode

    if options is None:
        options = _serve_defaults(folder)
    recorder = Recorder(compile_mode(options or SlotEngineOptions()))
    engine = load_slot_engine(folder, options, compile_fn=recorder)
    try:
        info = save_compile_cache(folder, engine.warmup)
        precompiled = save_precompiled(folder, recorder) if engine.compiled else None
    finally:
        engine.close()
    meta = read_static_meta(folder).model_copy(update={"compile_cache": info, "precompiled": precompiled})
    (folder / META_NAME).write_text(meta.model_dump_json(indent=2))
    return info


def serve_defaults(folder: Path, validation: dict[str, Any] | None, gpu_memory_bytes: int) -> ServeDefaults:
    """What :func:`~miaohui.generation.executors.slot_defaults.choose_defaults` picks for the version ``folder`` on a
    GPU of ``gpu_memory_bytes``: from its dims and precision, with int8 at batch 1 only where its stored decoder gate
    result (``validation``) passed on it."""
    from miaohui.generation.executors.slot_defaults import choose_defaults, int8_gate_passed

    meta = read_static_meta(folder)
    passed = int8_gate_passed(validation)
    return choose_defaults(meta.dims, gpu_memory_bytes, meta.precision, int8_gate_passed=passed)


def _serve_defaults(folder: Path) -> SlotEngineOptions | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from miaohui.generation.build.artifact import MARKER_NAME, read_info

    # a build compiles before its causal_lm.json is written, so before any gate: int8 at batch 1 off, as serve has it
    validation = read_info(folder).validation if (folder / MARKER_NAME).is_file() else None
    return serve_defaults(folder, validation, torch.cuda.mem_get_info()[1]).engine
