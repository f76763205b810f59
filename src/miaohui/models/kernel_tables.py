"""Which of miaohui's Triton kernels the GPU engine runs, and with which launch configuration, per GPU and shape:
the measured tables, like TensorRT's tactic choices, but chosen offline by the probes and committed here.

The ``inductor`` backend's ``gpu_kernels: triton`` (the default) builds FastBert with ``miaohui::skinny_linear``
and ``miaohui::encoder_attention`` in its graph, compiles Inductor's own Triton kernels with programmatic
dependent launch, and applies :func:`apply` at build and at load. Each op then runs the Triton kernel only for the
shapes below, where the H200 measured it faster, and the library kernel (cuBLAS, SDPA) everywhere else — other
shapes, other models, other GPUs (an empty table). Only fp16 builds use them (the precision they were measured in).

Where the figures come from (``benchmarks/results``):

* skinny GEMMs: BERT-base's and e5-small's four products at 16 and 128 rows (1×16, 1×128, 8×16 …), the
  configurations ``scripts/gpu/pdl_probe.py`` times (BERT-base, ``pdl_probe_h200_s26b.json``: a 48-GEMM chain with
  PDL 254.8 µs vs cuBLAS 255.1 at 16 rows, 317.2 vs 337.9 at 128; e5-small, ``pdl_probe_e5_h200_s29a.json``: 167.6 vs
  196.1, 205.6 vs 229.2), launched as programmatic dependents;
* attention: ``scripts/gpu/attn_probe.py``'s fastest configuration per shape (``attn_probe_h200_s27a.json``, 12
  heads of 64): e.g. 3.0 µs a call at 1×128 vs 6.9 for the SDPA form, 9.9 vs 14.2 at 32×128.

Together (``encoder_variants_skinny_pdl_attn_h200_s27a.json``): BERT-base fp16 at 1×128 0.346 ms, 1×16 0.270 ms,
against 0.458 and 0.424 ms with the library kernels (``static_gelu_epi``, ``encoder_variants_h200_s26b.json``).
"""

from __future__ import annotations

from typing import Any

import torch

from miaohui.models import cublaslt, encoder_attention, skinny_gemm, skinny_ln
from miaohui.models.encoder_attention import AttnConfig
from miaohui.models.skinny_gemm import SkinnyConfig

BERT_BASE = {"hidden": 768, "intermediate": 3072}


def bert_products(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """An encoder layer's four GEMMs → (N, K) of the weight."""
    return {
        "qkv": (3 * hidden, hidden),
        "attn_out": (hidden, hidden),
        "ffn_in": (intermediate, hidden),
        "ffn_out": (hidden, intermediate),
    }


SKINNY_H200: dict[tuple[int, int], dict[int, dict[str, SkinnyConfig]]] = {
    (768, 3072): {  # BERT-base, pdl_probe_h200_s26b.json
        16: {"qkv": (16, 32, 128, 1, 4), "attn_out": (16, 32, 128, 4, 4), "ffn_in": (16, 32, 128, 1, 4),
             "ffn_out": (16, 32, 128, 4, 4)},
        128: {"qkv": (64, 64, 128, 1, 4), "attn_out": (64, 32, 128, 1, 4), "ffn_in": (64, 64, 128, 1, 4),
              "ffn_out": (64, 32, 128, 4, 4)},
    },
    (384, 1536): {  # multilingual-e5-small, encoder_gemm_sweep_e5_h200_s29a.json → pdl_probe_e5_h200_s29a.json
        16: {"qkv": (16, 32, 128, 1, 4), "attn_out": (16, 32, 128, 1, 4), "ffn_in": (16, 32, 128, 1, 4),
             "ffn_out": (16, 32, 128, 4, 4)},
        128: {"qkv": (64, 32, 128, 1, 4), "attn_out": (64, 32, 128, 1, 4), "ffn_in": (64, 32, 128, 1, 4),
              "ffn_out": (64, 32, 128, 4, 4)},
    },
}  # fmt: skip
"""(hidden, intermediate) → rows → GEMM → (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps), as ``pdl_probe.py`` times
them: a 48-GEMM chain (12 layers) launched as programmatic dependents against cuBLAS. BERT-base: 254.8 vs 255.1 µs at
16 rows, 317.2 vs 337.9 at 128. e5-small (its sweep's fastest configuration per product): 167.6 vs 196.1 µs at 16
rows, 205.6 vs 229.2 at 128."""

LN_SPLIT_H200: dict[tuple[int, int], dict[int, dict[str, SkinnyConfig]]] = {
    (768, 3072): {128: {"attn_out": (64, 32, 128, 2, 4)}},  # BERT-base, ln_fusion_probe_bert_h200_s31a.json
    (384, 1536): {16: {"attn_out": (16, 32, 64, 3, 4)}, 128: {"attn_out": (64, 32, 64, 2, 4)}},  # e5-small, _e5_
}
"""(hidden, intermediate) → rows → GEMM → the configuration of a product that :data:`SKINNY_H200` does not split,
split when the LayerNorm after it is fused (``miaohui::proj_ln_proj``; :data:`miaohui.models.skinny_ln.LN_SPLIT_BEST`):
the split's extra reduce costs less than the add + LayerNorm kernel it replaces. ``ln_fusion_probe.py``'s pairs
(attention output → LayerNorm → FFN in) with PDL, the fastest forced split against the unfused pair
(:func:`ln_split_entries`, ``ln_fusion_probe_{bert,e5}_h200_s31a.json``): BERT-base at 128 rows 10.70 µs against
11.89; e5-small at 16 rows 4.94 against 5.94, at 128 rows 6.41 against 8.16. In the engine (``s31a``, same call):
BERT-base 1×128 0.341 ms static / 0.344 dynamic, against 0.350 / 0.352 without (``gpu_encoder_bert_{split,nosplit}_
s31a.json``)."""

MIN_LN_SPLIT_GAIN = 0.05
"""A forced split becomes an :data:`LN_SPLIT_H200` entry only if its pair is at least this much faster than the
unfused pair (GEMM, add + LayerNorm, GEMM) in ``ln_fusion_probe.py``."""

SKINNY_ROWS = SKINNY_H200[(BERT_BASE["hidden"], BERT_BASE["intermediate"])]
"""BERT-base's rows (``pdl_probe.py``'s default configurations)."""

E5_SERVER_GRID_H200: dict[AttnConfig, list[tuple[int, int]]] = {
    (16, 64, 4, 2): [(1, 8), (1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (2, 48), (2, 64), (8, 16), (16, 8), (16, 16),
                     (32, 8), (32, 16), (64, 8), (64, 16), (128, 8), (128, 16), (256, 8), (256, 16)],
    (64, 64, 4, 1): [(1, 48), (2, 8), (4, 8), (4, 16), (4, 32), (4, 48), (4, 64), (8, 8), (8, 32), (8, 48), (8, 64),
                     (16, 32), (16, 48), (16, 64), (32, 32), (32, 48), (32, 64), (64, 32), (64, 48), (64, 64),
                     (128, 32), (128, 48), (128, 64), (256, 32), (256, 48), (256, 64)],
}  # fmt: skip
"""e5-small (12 heads of 32) over the intent server's bucket grid (batch 1…256 × sequence 8…64), configuration →
(batch, sequence): ``attn_probe.py --configs serving`` (the full sweeps' five winners), ``attn_probe_e5_grid_h200_
s28f.json``. Every shape passed the rule, by 2.7× (1×8: 2.5 vs 6.8 µs) to 6.4× (64×16: 4.0 vs 25.2 µs)."""

ATTN_H200: dict[tuple[int, int, int, int], AttnConfig] = {
    **{(b, 12, s, 32): cfg for cfg, shapes in E5_SERVER_GRID_H200.items() for b, s in shapes},
    (1, 12, 16, 64): (16, 64, 4, 2),
    (1, 12, 64, 64): (16, 64, 4, 2),
    (1, 12, 128, 64): (16, 128, 4, 2),
    (8, 12, 64, 64): (64, 64, 4, 2),
    (32, 12, 128, 64): (64, 64, 4, 1),
    # multilingual-e5-small (12 heads of 32), the full sweep ``attn_probe_e5_h200_s28e.json`` (over the grid's entry
    # where both have one; they agree): 2.4–2.9 µs vs 6.7–7.2 for the SDPA form at one sequence, 6.7 vs 13.8 at 32×128
    (1, 12, 16, 32): (16, 64, 4, 2),
    (1, 12, 64, 32): (16, 64, 4, 2),
    (1, 12, 128, 32): (32, 128, 2, 2),
    (8, 12, 64, 32): (64, 64, 4, 1),
    (32, 12, 128, 32): (128, 64, 4, 1),
    (128, 12, 128, 32): (128, 64, 4, 1),
}
"""(batch, heads, seq, head size) → configuration: ``attn_probe_h200_s27a.json``'s ``best`` where it was at least 10 %
faster than the SDPA form (:func:`attention_entries`; 30–63 % here). BERT-base's 128×128 is left out (44.7 vs
45.5 µs; the engine with it was 1 % slower there than with library kernels, ``gpu_encoder_bert_s27b.json``).
e5-small's entries took its engine (random weights of its shape, ``gpu_encoder_e5shape_s28e.json``) from 0.325 /
0.350 / 0.405 / 0.800 / 2.43 ms to 0.266 / 0.310 / 0.338 / 0.705 / 2.24 ms at 1×16 / 1×128 / 8×64 / 32×128 /
128×128."""


LT_H200: dict[tuple[int, int], dict[int, dict[str, str]]] = {
    (768, 3072): {  # BERT-base, cublaslt_probe_bert_h200_s34c.json
        4096: {
            "attn_out": "4200000021000000230000000100000000000000000000000300000000000500"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
            "ffn_in": "4200000014000000230000000100000000000000000000000100000000000300"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
        },
        16384: {
            "attn_out": "4200000014000000230000000100000000000000000000000100000000000300"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
        },
    },
    (384, 1536): {  # e5-small, cublaslt_probe_e5_h200_s34c.json
        4096: {
            "qkv": "420000001d000000230000000100000000000000000000000700000000000500"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
            "attn_out": "4200000021000000230000000100000000000000000000000300000000000500"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
        },
        16384: {
            "qkv": "4200000014000000230000000100000000000000000000000300000000000500"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
            "attn_out": "4200000076000000230000000100000000000000000000000500000000000300"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
            "ffn_in": "4200000014000000230000000100000000000000000000000100000000000300"
            "0100000034fc0100020000000200000002000200440000000000000000000000",
        },
    },
}  # fmt: skip
"""(hidden, intermediate) → rows → GEMM → the cuBLASLt algorithm (its 64 bytes in hex) that
``scripts/gpu/cublaslt_probe.py`` timed fastest for the product at those rows, where it beat torch's call (the
heuristic's pick) by :data:`MIN_LT_GAIN` (:func:`lt_entries`). Valid for cuBLASLt :data:`LT_H200_CUBLASLT` only.

The probe (``cublaslt_probe_{bert,e5}_h200_s34c.json``) timed 41–57 candidates a product: the heuristic's ~8 for
the shape and those it offers for the same product at other row counts. Winners, in µs against torch's call:
BERT-base at 4,096 rows (32×128) FFN in 33.9 vs 36.6, attention output 9.8 vs 10.2; at 16,384 attention output 31.8
vs 33.8. e5-small at 4,096 QKV 9.3 vs 9.8, attention output 5.0 vs 5.7; at 16,384 QKV 28.9 vs 32.2, attention output
11.7 vs 12.2, FFN in 44.0 vs 45.6. No product at 512 rows passed. The e5-small intent engine with them
(``gpu_encoder_e5_lt_s34d.json``, two rounds): 32×128 0.684–0.685 ms against 0.703–0.704 with ``--cublaslt off``,
128×128 2.117 / 2.192 against 2.154 / 2.204."""

LT_H200_CUBLASLT = 130100
"""The cuBLASLt version :data:`LT_H200` was probed with (``cublaslt.version()``; torch 2.11 + CUDA 13.0 on the
H200): with any other, :func:`apply` loads none of it (an algorithm's bytes belong to one version)."""

MIN_LT_GAIN = 0.03
"""A probed cuBLASLt algorithm becomes an :data:`LT_H200` entry only if it is at least this much faster than torch's
call, taken as the faster of the probe's two timings of it (before and after the candidates)."""

PDL_MAX_ROWS_H200: int | None = 128
"""Static programs (``BuildConfig.static_shapes``) of buckets with more rows (batch × sequence) than this are
compiled without PDL for Inductor's kernels (None: every program uses it where the table has skinny GEMMs). PDL pays
where the skinny GEMMs run (16 and 128 rows: BERT-base 1×16 0.283 ms with it vs 0.341 without, e5-small 0.202 vs
0.248); from 512 rows on it cost 0–6 % (``gpu_encoder_*_pdl_s29e.json``: e5-small 32×128 0.748 vs 0.705 ms, 128×128
2.38–2.42 vs 2.25–2.31; BERT-base 8×64 0.468 vs 0.461, static 128×128 6.05–6.18 vs 5.99–6.11)."""

MIN_ATTN_GAIN = 0.10
"""A probed attention shape becomes an entry only if its best configuration is at least this much faster than the
SDPA form (smaller gains did not survive the whole engine: 128×128 in ``gpu_encoder_bert_s27b.json``)."""


def attention_entries(report: dict[str, Any]) -> dict[tuple[int, int, int, int], AttnConfig]:
    """``attn_probe.py``'s report → the entries that pass :data:`MIN_ATTN_GAIN` (how :data:`ATTN_H200` was chosen)."""
    table = encoder_attention.table_from_probe(report)
    fast = {
        (int(e["batch"]), int(e["heads"]), int(e["seq"]), int(report["head_size"]))
        for e in report["best"]
        if float(e["us"]) <= (1 - MIN_ATTN_GAIN) * float(e["sdpa_us"])
    }
    return {k: v for k, v in table.items() if k in fast}


def ln_split_entries(report: dict[str, Any]) -> dict[int, dict[str, SkinnyConfig]]:
    """``ln_fusion_probe.py``'s report → rows → first product → its fastest forced split, where that pair (with PDL)
    beats the unfused one by :data:`MIN_LN_SPLIT_GAIN` (how :data:`LN_SPLIT_H200`'s entries are chosen)."""
    best: dict[tuple[int, str], tuple[float, SkinnyConfig]] = {}
    unfused: dict[tuple[int, str], float] = {}
    for row in report["rows"]:
        if not row["pdl"]:
            continue
        key = (int(row["rows"]), str(row["pair"]).split("->")[0])
        if row["piece"] == "unfused":
            unfused[key] = float(row["us"])
        elif "config" in row and float(row["us"]) < best.get(key, (float("inf"),))[0]:
            best[key] = (float(row["us"]), tuple(int(v) for v in row["config"]))  # type: ignore[assignment]
    out: dict[int, dict[str, SkinnyConfig]] = {}
    for (rows, product), (us, cfg) in sorted(best.items()):
        if us <= (1 - MIN_LN_SPLIT_GAIN) * unfused.get((rows, product), 0.0):
            out.setdefault(rows, {})[product] = cfg
    return out


def lt_entries(report: dict[str, Any]) -> dict[int, dict[str, str]]:
    """``cublaslt_probe.py``'s report → rows → GEMM → algorithm hex, where the fastest candidate beat torch's call
    (the faster of its two timings) by :data:`MIN_LT_GAIN` (how :data:`LT_H200` is chosen)."""
    out: dict[int, dict[str, str]] = {}
    for e in report["best"]:
        torch_us = min(float(e["torch_us"]), float(e.get("torch_again_us", e["torch_us"])))
        if float(e["best_us"]) <= (1 - MIN_LT_GAIN) * torch_us:
            out.setdefault(int(e["m"]), {})[str(e["gemm"])] = str(e["best"]["hex"])
    return out


def lt_table(
    capability: tuple[int, int] | None, hidden: int, intermediate: int
) -> dict[tuple[int, int, int, bool], str]:
    """(M, N, K, GELU) → algorithm hex: :data:`LT_H200`'s rows for a model of these widths, on an H200 whose cuBLASLt
    is :data:`LT_H200_CUBLASLT` (else none)."""
    if capability != (9, 0) or cublaslt.version_or_none() != LT_H200_CUBLASLT:
        return {}
    products = bert_products(hidden, intermediate)
    rows = LT_H200.get((hidden, intermediate), {})
    return {(m, *products[name], name == "ffn_in"): algo for m, algos in rows.items() for name, algo in algos.items()}


def ln_split_table(hidden: int, intermediate: int) -> dict[tuple[int, int, int], SkinnyConfig]:
    """(M, N, K) → configuration: :data:`LN_SPLIT_H200`'s rows for a model of these widths (other widths: none)."""
    return _by_shape(LN_SPLIT_H200.get((hidden, intermediate), {}), hidden, intermediate)


def _by_shape(
    rows: dict[int, dict[str, SkinnyConfig]], hidden: int, intermediate: int
) -> dict[tuple[int, int, int], SkinnyConfig]:
    products = bert_products(hidden, intermediate)
    return {(m, *products[name]): cfg for m, configs in rows.items() for name, cfg in configs.items()}


def skinny_table(hidden: int, intermediate: int) -> dict[tuple[int, int, int], SkinnyConfig]:
    """(M, N, K) → configuration: :data:`SKINNY_H200`'s rows for a model of these widths (other widths: none)."""
    return _by_shape(SKINNY_H200.get((hidden, intermediate), {}), hidden, intermediate)


def model_dims(module: torch.nn.Module) -> tuple[int, int, int] | None:
    """(hidden, intermediate, heads) of the model's FastBert layers; None without any."""
    from miaohui.models.fast_bert import FastBertLayer

    for layer in module.modules():
        if isinstance(layer, FastBertLayer):
            return int(layer.attn_out.in_features), int(layer.ffn_in.out_features), int(layer.heads)
    return None


def tables_for(
    capability: tuple[int, int] | None, dims: tuple[int, int, int]
) -> tuple[dict[Any, SkinnyConfig], dict[Any, AttnConfig]]:
    """The measured entries for a model of these (hidden, intermediate, heads) on a GPU of this compute capability
    (None: no GPU): only the H200 (9.0) has tables, and only BERT-base- and e5-small-shaped models have entries."""
    if capability != (9, 0):
        return {}, {}
    hidden, intermediate, heads = dims
    attn = {k: v for k, v in ATTN_H200.items() if k[1] == heads and k[3] * heads == hidden}
    return skinny_table(hidden, intermediate), attn


def apply(
    capability: tuple[int, int] | None, dims: tuple[int, int, int], pdl: bool = True, pdl_max_rows: int | None = None
) -> dict[str, Any]:
    """Load this GPU's entries for this model into the ops (the attention kernel for the table's shapes only).
    Returns what the manifest records: how many shapes each op runs in Triton, and whether Inductor's kernels use PDL
    (``pdl``, ``BuildConfig.pdl``) and in static programs of up to how many rows (``inductor.program_pdl`` reads it;
    at load the manifest's record decides, not today's table).

    The skinny GEMMs always launch as programmatic dependents, as their rows were measured. That flag is
    process-wide and only ever turned on: an engine loaded later (another model, ``--pdl off``, a model with no
    entries) must not change how an earlier engine's kernels launch when its buckets are captured (session 26 saw
    exactly that: BERT-base 1×128 at 0.406 ms, its skinny GEMMs captured without PDL after a ``--pdl off`` build)."""
    skinny, attn = tables_for(capability, dims)
    ln_split = ln_split_table(dims[0], dims[1]) if skinny else {}
    lt = lt_table(capability, dims[0], dims[1])
    use_pdl = bool(skinny) and pdl
    skinny_gemm.SKINNY_BEST.update(skinny)
    skinny_ln.LN_SPLIT_BEST.update(ln_split)
    skinny_gemm.LT_BEST.update(lt)
    if skinny:
        skinny_gemm.SKINNY_PDL = True
    encoder_attention.ATTN_BEST.update(attn)
    encoder_attention.ATTN_SHAPES_ONLY = True
    info: dict[str, Any] = {
        "skinny_gemm_shapes": len(skinny),
        "ln_split_shapes": len(ln_split),
        "attention_shapes": len(attn),
        "cublaslt_shapes": len(lt),
        "pdl": use_pdl,
    }
    if use_pdl and pdl_max_rows is not None:
        info["pdl_max_rows"] = pdl_max_rows
    return info


def pdl_max_rows(capability: tuple[int, int] | None) -> int | None:
    """This GPU's :data:`PDL_MAX_ROWS_H200` (None: no limit, or no table)."""
    return PDL_MAX_ROWS_H200 if capability == (9, 0) else None


def device_capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]
