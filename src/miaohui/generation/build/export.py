"""Export a Llama-style decoder to ONNX with an explicit KV cache, check it, and quantize it to int8.

The graph (see :mod:`miaohui.generation.models.llama` for the math)::

    inputs   input_ids [batch, seq] int64, attention_mask [batch, past+seq] int64,
             position_ids [batch, seq] int64,
             past_key_values.{i}.key|value [batch, kv_heads, past, head_dim] float32
    outputs  logits [batch, vocab] float32 (last position only),
             present.{i}.key|value [batch, kv_heads, past+seq, head_dim] float32

``batch``, ``seq`` and ``past`` are dynamic; one graph serves prefill (past = 0) and decode (seq = 1).

A decoder directory holds ``model.onnx``, ``decoder.json`` (:class:`DecoderMeta`: dims, names, how it
was made, the check's errors) and ``tokenizer.json``. Every export is checked on ONNX Runtime against
the explicit-KV torch module *and* against HF's own logits: a real prompt's prefill, a decode step on its
cache, and a left-padded batch of two; over ``tolerance`` raises :class:`ExportError`. Directories are
written to a temp dir and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from miaohui.config import Frozen
from miaohui.errors import ArtifactError, ExportError
from miaohui.generation.build.graph_cse import merge_common
from miaohui.generation.models.dims import DecoderDims
from miaohui.paths import atomic_dir

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

    from miaohui.generation.models.llama import KVLlama

META_NAME = "decoder.json"
MODEL_NAME = "model.onnx"
TOKENIZER_NAME = "tokenizer.json"
EXPORT_FORM = 3
"""The exported graph's form, part of a build's key: raised when the same source would now export a different graph
(2: each layer's repeated shape arithmetic merged, :mod:`~miaohui.generation.build.graph_cse`; 3: int4's fused
one-row graph), so a cached build of the older form is redone rather than reused."""
Int8Method = Literal["dynamic", "weight-only", "weight-only-edges", "weight-only-a32"]
"""How an fp32 decoder is quantized (:func:`quantize_decoder`)."""


class DecoderExportSpec(Frozen):
    """How a decoder is exported and how strictly the export is checked."""

    opset: int = Field(default=17, ge=17)
    """ONNX opset of the exported graph."""
    tolerance: float = Field(default=2e-3, gt=0.0)
    """Largest allowed |logit difference| between ONNX Runtime and PyTorch (fp32)."""
    check_text: str = "Write a short poem about the sea and the moon."
    """User message whose chat prompt is used to check the export."""


class DecoderMeta(BaseModel):
    """``decoder.json``: what a decoder directory holds and how it was made."""

    name: str
    dims: dict[str, Any]
    """:class:`~miaohui.generation.models.llama.DecoderDims` as a dict."""
    precision: Literal["fp32", "int8", "int4"]
    """``int4``: :func:`quantize_decoder_int4`'s 4-bit weight blocks with fp32 arithmetic."""
    int8_method: Int8Method | None = None
    """int8 only: ``dynamic`` (MatMulInteger, activations quantized per call), ``weight-only`` (MatMulNBits,
    8-bit blockwise weights, int8 dot products), ``weight-only-edges`` (the same with the first and last blocks and
    the LM head kept fp32) or ``weight-only-a32`` (8-bit weights, fp32 compute)."""
    opset: int
    input_names: list[str]
    output_names: list[str]
    eos_token_ids: list[int]
    pad_token_id: int
    export_seconds: float
    check: dict[str, float] = Field(default_factory=dict)
    """Max |error| of each check (fp32: against torch; int8: logits against the fp32 graph)."""
    versions: dict[str, str] = Field(default_factory=dict)
    rope_inv_freq: list[float] | None = None
    """The RoPE frequencies of a Llama-family export (scaled ones included), from which the fused one-row graph's
    cos/sin tables are made (:mod:`~miaohui.generation.build.one_row_graph`); None for other architectures."""
    one_row_graph: Literal["fused", "exported"] | None = None
    """int4: which graph runs a stream's decode step — ``fused`` (one ``GroupQueryAttention`` a layer, for a row
    without padding) or ``exported`` (the export's own operators, where no fused graph could be made)."""

    @property
    def decoder_dims(self) -> DecoderDims:
        return DecoderDims(**self.dims)


def input_names(num_layers: int) -> list[str]:
    past = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past]


def output_names(num_layers: int) -> list[str]:
    return ["logits", *[f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]]


def _dynamic_axes(num_layers: int) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch"},
    }
    for i in range(num_layers):
        for kind in ("key", "value"):
            axes[f"past_key_values.{i}.{kind}"] = {0: "batch", 2: "past"}
            axes[f"present.{i}.{kind}"] = {0: "batch", 2: "total"}
    return axes


def load_meta(folder: Path) -> DecoderMeta:
    """Read ``decoder.json`` of a decoder directory; ArtifactError if missing or unreadable."""
    path = folder / META_NAME
    try:
        return DecoderMeta.model_validate_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read decoder metadata {path}: {exc}", "export the decoder again (export_decoder)"
        ) from exc


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def _feeds(ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: Sequence[np.ndarray]) -> dict[str, Any]:
    names = input_names(len(past) // 2)
    return dict(zip(names, [ids, mask, pos, *past], strict=True))


def _padded_batch(prompts: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, ...]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    pos = np.zeros((len(prompts), width), dtype=np.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = p
        mask[r, width - len(p) :] = 1
        pos[r, width - len(p) :] = np.arange(len(p))
    return ids, mask, pos


def check_decoder(
    onnx_path: Path,
    kv_model: KVLlama,
    hf_model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    pad_token_id: int,
) -> dict[str, float]:
    """Max |error| of ONNX Runtime against torch: prefill, one decode step, a left-padded batch."""
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    d = kv_model.dims
    empty = [np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
    ids = np.asarray([prompts[0]], dtype=np.int64)
    mask, pos = np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None]
    errors: dict[str, float] = {}
    with torch.inference_mode():
        ort_out = sess.run(None, _feeds(ids, mask, pos, empty))
        pt_out = kv_model(*(torch.from_numpy(a) for a in (ids, mask, pos, *empty)))
        hf_logits = hf_model(torch.from_numpy(ids)).logits[:, -1].numpy()
        errors["prefill_logits_vs_torch"] = float(np.abs(ort_out[0] - pt_out[0].numpy()).max())
        errors["prefill_logits_vs_hf"] = float(np.abs(ort_out[0] - hf_logits).max())
        errors["prefill_present_vs_torch"] = max(
            float(np.abs(a - b.numpy()).max()) for a, b in zip(ort_out[1:], pt_out[1:], strict=True)
        )
        nxt = np.asarray([[int(hf_logits[0].argmax())]], dtype=np.int64)
        ids2 = np.concatenate([ids, nxt], axis=1)
        step = sess.run(None, _feeds(nxt, np.ones_like(ids2), np.asarray([[ids.shape[1]]]), ort_out[1:]))
        hf_step = hf_model(torch.from_numpy(ids2)).logits[:, -1].numpy()
        errors["decode_logits_vs_hf"] = float(np.abs(step[0] - hf_step).max())
        b_ids, b_mask, b_pos = _padded_batch(prompts[:2], pad_token_id)
        empty2 = [np.zeros((2, d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
        batch = sess.run(None, _feeds(b_ids, b_mask, b_pos, empty2))
        alone = [hf_model(torch.tensor([list(p)], dtype=torch.long)).logits[0, -1].numpy() for p in prompts[:2]]
        errors["batch_logits_vs_hf"] = float(np.abs(batch[0] - np.stack(alone)).max())
    return errors


def check_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``text`` as a user message in the tokenizer's chat template, or as a raw prompt when it has none."""
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        from miaohui.zoo.smollm import encode_chat

        return encode_chat([{"role": "user", "content": text}], tokenizer=tokenizer)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def _check_prompts(tokenizer: PreTrainedTokenizerBase, spec: DecoderExportSpec) -> list[list[int]]:
    return [check_prompt_ids(tokenizer, spec.check_text), check_prompt_ids(tokenizer, "Hi!")]


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("the tokenizer has no backend_tokenizer", "pass a HF *fast* tokenizer")
    backend.save(str(folder / TOKENIZER_NAME))


def eos_ids(hf_model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = hf_model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


def kv_decoder(hf_model: Any) -> KVLlama:
    """The explicit-KV module for ``hf_model``: :class:`~miaohui.generation.models.gemma.KVGemma3` for Gemma 3 text
    models, :class:`~miaohui.generation.models.llama.KVLlama` for Llama-style ones (Llama, SmolLM2, Qwen2)."""
    from miaohui.generation.models.gemma import KVGemma3
    from miaohui.generation.models.llama import KVLlama

    if str(getattr(hf_model.config, "model_type", "")).startswith("gemma3"):
        return KVGemma3(hf_model)  # type: ignore[return-value]  # same forward contract
    return KVLlama(hf_model)


def export_decoder(
    hf_model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    spec: DecoderExportSpec | None = None,
    *,
    name: str = "smollm2-135m",
) -> DecoderMeta:
    """Export ``hf_model`` to ``out_dir`` (fp32), check it against torch and HF, write ``decoder.json``."""
    import torch
    from rich.console import Console

    spec = spec or DecoderExportSpec()
    kv_model = kv_decoder(hf_model).eval()
    d = kv_model.dims
    names_in, names_out = input_names(d.num_layers), output_names(d.num_layers)
    # trace with batch 2, seq 3, past 4 so that no dynamic dimension is specialised to 0 or 1
    dummy_ids = torch.ones((2, 3), dtype=torch.long)
    dummy = (
        dummy_ids,
        torch.ones((2, 7), dtype=torch.long),
        torch.arange(4, 7).repeat(2, 1),
        *(torch.zeros((2, d.num_kv_heads, 4, d.head_dim)) for _ in range(2 * d.num_layers)),
    )
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(hf_model, tokenizer)[0])
    console = Console(stderr=True)
    with atomic_dir(out_dir) as tmp:
        start = time.perf_counter()
        with console.status(f"exporting {name} ({d.num_layers} layers) to ONNX"), torch.inference_mode():
            try:
                with warnings.catch_warnings():  # "legacy TorchScript-based ONNX export" deprecation
                    warnings.filterwarnings("ignore", category=DeprecationWarning)
                    # head counts and sizes read with int(): constants on purpose (only batch and length vary)
                    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
                    torch.onnx.export(
                        kv_model, dummy, str(tmp / MODEL_NAME), input_names=names_in, output_names=names_out,
                        dynamic_axes=_dynamic_axes(d.num_layers), opset_version=spec.opset, dynamo=False,
                        do_constant_folding=True,
                    )  # fmt: skip
            except Exception as exc:  # the exporter raises many unrelated types
                raise ExportError(f"torch.onnx.export of {name} failed: {exc}", "report this model") from exc
            merged = _tidy_graph(tmp / MODEL_NAME, kv_model)
        seconds = time.perf_counter() - start
        with console.status("checking the ONNX graph against PyTorch and HF"):
            errors = check_decoder(tmp / MODEL_NAME, kv_model, hf_model, _check_prompts(tokenizer, spec), pad)
        worst = max(errors.values())
        console.print(
            f"[dim]export {seconds:.1f}s ({merged['nodes']} repeated nodes merged); max |error| "
            + ", ".join(f"{k}={v:.2e}" for k, v in errors.items())
        )
        if worst > spec.tolerance:
            raise ExportError(
                f"exported {name} disagrees with PyTorch: max |logit error| {worst:.3g} > tolerance "
                f"{spec.tolerance:g} ({errors})",
                "check the export (opset, dynamic axes) or raise DecoderExportSpec.tolerance if justified",
            )
        meta = DecoderMeta(
            name=name, dims=asdict(d), precision="fp32", opset=spec.opset, input_names=names_in,
            output_names=names_out, eos_token_ids=eos_ids(hf_model, tokenizer), pad_token_id=pad,
            export_seconds=round(seconds, 2), check=errors, versions=_versions(),
            rope_inv_freq=_llama_inv_freq(kv_model),
        )  # fmt: skip
        (tmp / META_NAME).write_text(meta.model_dump_json(indent=2))
        _save_tokenizer(tokenizer, tmp)
    return meta


def quantize_decoder(src_dir: Path, out_dir: Path, method: Int8Method = "weight-only") -> DecoderMeta:
    """int8 copy of an fp32 decoder directory; the constant-weight MatMuls are quantized.

    ``dynamic``: ``quantize_dynamic`` — int8 per-channel weights, activations quantized on the fly
    (uint8, per tensor) into ``MatMulInteger``/``DynamicQuantizeMatMul`` (VNNI kernels on x86).
    ``weight-only`` (default): ``MatMulNBits``, 8-bit symmetric weights in blocks of 32 along K;
    ``accuracy_level=4`` lets ORT quantize activations per block at run time (int8 dot products), which
    tolerates the outlier features of LLM activations. ``weight-only-edges``: the same, but the first and last
    blocks and the LM head (:func:`edge_weights`, where quantization error hurts most) stay fp32.
    ``weight-only-a32``: 8-bit weights, dequantized and multiplied in fp32 (``accuracy_level=1``). Attention's
    activation x activation MatMuls, norms and softmax stay fp32 in all. On SmolLM2 ``dynamic`` is unusable
    (max logit error ~33, top-1 wrong: per-tensor activation scales are ruined by outlier channels)
    — the check below refuses it.
    """
    import onnx
    from rich.console import Console

    meta = load_meta(src_dir)
    if meta.precision != "fp32":
        raise ExportError(f"{src_dir} is already {meta.precision}", "quantize the fp32 decoder directory")
    with (
        atomic_dir(out_dir) as tmp,
        Console(stderr=True).status(f"quantizing {meta.name} to int8 ({method})"),
    ):
        start = time.perf_counter()
        if method == "dynamic":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(
                src_dir / MODEL_NAME, tmp / MODEL_NAME, weight_type=QuantType.QInt8, per_channel=True,
                op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True},
            )  # fmt: skip
        else:
            from onnxruntime.quantization.matmul_nbits_quantizer import (
                DefaultWeightOnlyQuantConfig,
                MatMulNBitsQuantizer,
            )

            level = 1 if method == "weight-only-a32" else 4
            config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=8, accuracy_level=level)
            model = onnx.load(str(src_dir / MODEL_NAME))
            keep = edge_weights(meta.decoder_dims.num_layers) if method == "weight-only-edges" else ()
            quant = MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=_matmuls_of(model, keep))
            with _quiet("onnxruntime.quantization.matmul_nbits_quantizer"):  # it logs every node at INFO
                quant.process()
            quant.model.save_model_to_file(str(tmp / MODEL_NAME), use_external_data_format=False)
        seconds = time.perf_counter() - start
        out = meta.model_copy(
            update={
                "precision": "int8",
                "int8_method": method,
                "export_seconds": round(seconds, 2),
                "check": {},
            }
        )
        out.check = _compare_logits(src_dir / MODEL_NAME, tmp / MODEL_NAME, meta)
        if out.check["top1_agrees"] < 1.0:
            raise ExportError(
                f"int8 ({method}) {meta.name} picks a different next token than fp32 on the check sequence "
                f"(max |logit error| {out.check['logits_vs_fp32']:.3g})",
                "use method='weight-only' (blockwise weights), or keep this model in fp32",
            )
        (tmp / META_NAME).write_text(out.model_dump_json(indent=2))
        shutil.copy(src_dir / TOKENIZER_NAME, tmp / TOKENIZER_NAME)
    return out


def _tidy_graph(path: Path, kv_model: Any) -> dict[str, int]:
    """Rewrite the exported graph at ``path`` once (weights stored beside it stay where they are): each layer's
    repeated shape arithmetic merged (:func:`~miaohui.generation.build.graph_cse.merge_common`; what was merged), and
    every parameter of ``kv_model`` given a name in it. The exporter stores equal parameters once (a random model's
    norms, all ones, become one tensor, the others ``Identity`` nodes of it, which the merge folds), and the fused
    one-row graph (:mod:`~miaohui.generation.build.one_row_graph`) finds each layer's weights by name: a parameter
    whose name is gone gets an initializer of its own (unused by the exported graph itself, which ONNX Runtime drops
    at load)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    merged = merge_common(model.graph)
    have = {t.name for t in model.graph.initializer} | {o for node in model.graph.node for o in node.output}
    missing = [(n, p) for n, p in kv_model.named_parameters() if n not in have]
    model.graph.initializer.extend(numpy_helper.from_array(p.detach().cpu().numpy(), n) for n, p in missing)
    onnx.save(model, str(path))
    return merged


def _llama_inv_freq(kv_model: Any) -> list[float] | None:
    from miaohui.generation.models.llama import KVLlama

    return [float(f) for f in kv_model.inv_freq.tolist()] if isinstance(kv_model, KVLlama) else None


def _fused_one_row(src_dir: Path, meta: DecoderMeta, exported: Any) -> tuple[Any | None, str]:
    """The fused one-row graph of an fp32 decoder directory, checked against its exported graph on a 48-token prefill
    and three decode steps (logits and every layer's present key/value within ``FUSED_TOLERANCE``); None and why
    where it cannot be made or does not agree (the exported graph then runs the one-row steps)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from miaohui.generation.build.one_row_graph import fused_one_row

    if meta.rope_inv_freq is None:
        return None, "not a Llama-family export"
    fused = fused_one_row(exported, meta.decoder_dims, meta.rope_inv_freq)
    if fused is None:
        return None, "the export's weights are not named as a Llama-family decoder's"
    d = meta.decoder_dims
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(fused, str(Path(tmp) / MODEL_NAME))  # a session of a >2 GiB proto needs its file
        sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in
                    (src_dir / MODEL_NAME, Path(tmp) / MODEL_NAME)]  # fmt: skip
        ids = (np.arange(48, dtype=np.int64) * 997 % d.vocab)[None]
        past = [np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
        worst, position = 0.0, 0
        for _ in range(4):  # the prefill, then three one-token steps on the exported graph's cache
            n = ids.shape[1]
            feeds = _feeds(ids, np.ones((1, position + n), np.int64), np.arange(position, position + n)[None], past)
            want, got = (s.run(None, feeds) for s in sessions)
            worst = max(worst, *(float(np.abs(a - b).max()) for a, b in zip(want, got, strict=True)))
            ids, past, position = np.array([[int(want[0].argmax())]]), want[1:], position + n
    if worst > FUSED_TOLERANCE:
        return None, f"the fused graph differs from the export by {worst:.3g} (> {FUSED_TOLERANCE:g})"
    return fused, f"fused (max |difference| from the export {worst:.2g})"


FUSED_TOLERANCE = 1e-3
"""Largest |difference| of the fused one-row graph's logits and key/values from the exported graph's (fp32 both;
measured on SmolLM2: 5e-5, summation order)."""


def quantize_decoder_int4(src_dir: Path, out_dir: Path) -> DecoderMeta:
    """``int4`` copy of an fp32 decoder directory: the layers' weights in 4-bit blocks with a scale and a minimum
    per 32 values (llama.cpp's ``Q4_1`` layout), the LM head in 8-bit blocks (``Q8_0``'s), every layer product and the
    head's largest logits in fp32 (:mod:`miaohui.generation.build.weight_blocks`). A third of the fp32 graph's bytes
    read per decoded token, and no rounding of the activations where the answer is decided (llama.cpp's Q4 and ORT's
    ``accuracy_level=4`` round them to 8 bits everywhere).

    The fp32 graph stays for the steps of more than one token (:func:`~miaohui.generation.build.weight_blocks.
    one_row_switch`, one graph holding both): ``MatMulNBits`` in fp32 dequantizes its whole weight per call once a
    step has several rows, so a prefill or a batched decode is faster on the fp32 weights (on SmolLM2, 8 rows: 44
    against 53 ms a step). The 4-bit graph runs one stream's decode and is what the check below compares."""
    import onnx
    from rich.console import Console

    from miaohui.generation.build.weight_blocks import one_row_switch, quantize_blocks_model, save_graph

    meta = load_meta(src_dir)
    if meta.precision != "fp32":
        raise ExportError(f"{src_dir} is already {meta.precision}", "quantize the fp32 decoder directory")
    console = Console(stderr=True)
    with atomic_dir(out_dir) as tmp, console.status(f"quantizing {meta.name} to int4 blocks"):
        start = time.perf_counter()
        exported = onnx.load(str(src_dir / MODEL_NAME))
        fused, said = _fused_one_row(src_dir, meta, exported)
        console.print(f"[dim]one-row decode graph: {said}")
        model = fused if fused is not None else exported
        quantize_blocks_model(model)
        save_graph(model, tmp / MODEL_NAME)
        check = _compare_logits(src_dir / MODEL_NAME, tmp / MODEL_NAME, meta)  # the 4-bit graph alone
        if check["top1_agrees"] < 1.0:
            raise ExportError(
                f"int4 {meta.name} picks a different next token than fp32 on the check sequence "
                f"(max |logit error| {check['logits_vs_fp32']:.3g})",
                "keep this model in fp32, or use precision int8",
            )
        batched = exported if fused is not None else onnx.load(str(src_dir / MODEL_NAME))  # else rewritten above
        both = one_row_switch(model, batched, unpadded_only=fused is not None)
        for stale in tmp.glob(f"{MODEL_NAME}*"):  # the 4-bit graph alone (and its .data file, if any)
            stale.unlink()
        save_graph(both, tmp / MODEL_NAME)  # both graphs: over 2 GiB from ~0.45B parameters, then with a .data file
        seconds = round(time.perf_counter() - start, 2)
        one_row = "fused" if fused is not None else "exported"
        out = meta.model_copy(
            update={"precision": "int4", "export_seconds": seconds, "check": check, "one_row_graph": one_row}
        )
        (tmp / META_NAME).write_text(out.model_dump_json(indent=2))
        shutil.copy(src_dir / TOKENIZER_NAME, tmp / TOKENIZER_NAME)
    return out


def edge_weights(num_layers: int) -> tuple[str, ...]:
    """Weight names of the first and last blocks and the LM head in an exported decoder graph."""
    blocks = (f"layers.{i}.{w}" for i in sorted({0, num_layers - 1}) for w in ("qkv", "o", "gate_up", "down"))
    return (*blocks, "head")


def _matmuls_of(model: Any, weights: Sequence[str]) -> list[str]:
    """Names of the MatMul nodes whose constant input is one of ``weights``."""
    wanted = set(weights)
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and wanted.intersection(n.input)]


def _compare_logits(ref: Path, new: Path, meta: DecoderMeta) -> dict[str, float]:
    """Logit error of a quantized graph against its fp32 source on a fixed token sequence: over every logit, and
    over the source's 20 largest (what a greedy pick and ``top_logprobs`` read)."""
    import onnxruntime as ort

    d = meta.decoder_dims
    ids = (np.arange(48, dtype=np.int64) * 997 % d.vocab)[None]
    past = [np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
    feeds = _feeds(ids, np.ones_like(ids), np.arange(48, dtype=np.int64)[None], past)
    outs = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0] for p in (ref, new)
    ]
    top = np.argsort(-outs[0][0])[:20]
    return {
        "logits_vs_fp32": float(np.abs(outs[0] - outs[1]).max()),
        "top_logits_vs_fp32": float(np.abs(outs[0][0, top] - outs[1][0, top]).max()),
        "top1_agrees": float(outs[0].argmax() == outs[1].argmax()),
    }
