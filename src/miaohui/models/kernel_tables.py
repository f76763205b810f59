"""Load a tuning file's entries (:mod:`miaohui.models.tuning`) into miaohui's GPU ops.

The ``inductor`` backend's ``gpu_kernels: tuned`` builds FastBert with ``miaohui::skinny_linear``,
``miaohui::proj_ln_proj`` and ``miaohui::encoder_attention`` in its graph and calls :func:`apply` at build and at
load. Each op then runs miaohui's kernel (or cuBLASLt's timed algorithm) only for the shapes the tuning file has for
this GPU, and the library kernel (cuBLAS, SDPA) everywhere else: other shapes, other models, other GPUs.
"""

from __future__ import annotations

from typing import Any

import torch

from miaohui.models import encoder_attention, skinny_gemm, skinny_ln
from miaohui.models.tuning import Selection


def model_dims(module: torch.nn.Module) -> tuple[int, int, int] | None:
    """(hidden, intermediate, heads) of the model's FastBert layers; None without any."""
    from miaohui.models.fast_bert import FastBertLayer

    for layer in module.modules():
        if isinstance(layer, FastBertLayer):
            return int(layer.attn_out.in_features), int(layer.ffn_in.out_features), int(layer.heads)
    return None


def apply(selection: Selection) -> dict[str, Any]:
    """Load ``selection``'s entries into the ops (the attention kernel for its shapes only); returns what the
    manifest records: how many shapes each op runs, and whether Inductor's kernels launch as programmatic dependents
    (``pdl``: where there are skinny GEMMs) and in static programs of up to how many rows.

    The skinny GEMMs always launch as programmatic dependents, as their entries were measured. That flag is
    process-wide and only ever turned on: an engine loaded later (another model, one with no entries) must not change
    how an earlier engine's kernels launch when its buckets are captured."""
    skinny_gemm.SKINNY_BEST.update(selection.skinny)
    skinny_ln.LN_SPLIT_BEST.update(selection.ln_split)
    skinny_gemm.LT_BEST.update(selection.cublaslt)
    if selection.skinny:
        skinny_gemm.SKINNY_PDL = True
    encoder_attention.ATTN_BEST.update(selection.attention)
    encoder_attention.ATTN_SHAPES_ONLY = True
    info: dict[str, Any] = {
        "skinny_gemm_shapes": len(selection.skinny),
        "ln_split_shapes": len(selection.ln_split),
        "attention_shapes": len(selection.attention),
        "cublaslt_shapes": len(selection.cublaslt),
        "pdl": bool(selection.skinny),
    }
    if selection.skinny and selection.pdl_max_rows is not None:
        info["pdl_max_rows"] = selection.pdl_max_rows
    return info
