"""A Llama/Qwen2-style decoder with a *static* KV cache of fixed slots (gpt-fast / nano-vllm style).

The GPU engine (:mod:`miaohui.generation.executors.slot_engine`) compiles and CUDA-graphs this module; on the CPU
it runs eagerly (tests, CI). The cache is one ``[slots, kv_heads, max_len, head_dim]`` tensor per layer
for keys and one for values, allocated once: a sequence owns one *slot* (a row) from prefill to finish,
its tokens sit at positions ``0 .. length-1`` of that row, and nothing is ever copied or concatenated.

* :meth:`StaticKVDecoder.prefill` runs ``n`` prompts right-padded to a common length ``S`` and writes their
  keys/values into the slots given; causal attention inside each prompt (padding comes *after* a
  prompt's tokens, so no real token sees it). Returns the logits of each prompt's last real token.
  :meth:`StaticKVDecoder.prefill_from` does the same for the rest of prompts whose prefix a slot already holds (copied
  there from the prefix cache's pool), from that position on.
* :meth:`StaticKVDecoder.decode` runs one token for each of the rows ``0 .. b-1`` (row = slot) at each
  row's own position, writes its key/value into the cache and attends over the first ``kv_len`` cache
  positions, masked to ``<= position``. Rows that hold no sequence compute harmless garbage (the engine
  pads a batch to a bucket this way; a later prefill overwrites what they wrote). Every shape depends
  only on ``(b, kv_len)``, so one CUDA graph per bucket replays it.
* :func:`miaohui.generation.models.mixed_step.mixed_forward` runs a decode step and prompts' tokens as one batch of rows
  (the cache has one spare *scratch* row, past the slots, for its padding rows).

The layers' arithmetic lives in :mod:`miaohui.generation.models.static_kv_layers` (pure functions, compiled once for
every layer); this module holds the weights, the cache and the loops over layers. Numerics follow HF: RMSNorm and
softmax in fp32, weights and cache in the model dtype (bf16/fp16 on the GPU, fp32 on the CPU). Weights keep HF's
``[out, in]`` layout (``F.linear``), with Q/K/V and gate/up fused into one matmul each; Qwen2's Q/K/V biases are
supported. The LM head is a separate tensor even when tied to the embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from miaohui.errors import ArtifactError
from miaohui.generation.kernels.int8_weights import RopeGemvWeight, Weight, add_residual, int8_head, int8_layer
from miaohui.generation.kernels.w8_layer import w8_gemv_rope_op
from miaohui.generation.models.constants import with_constants
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv_layers import (
    DECODE_ATTENTION,
    attn_in,
    attn_proj_mlp,
    final_logits,
    make_decode_layer,
    prefix_attention,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _Layer(nn.Module):
    def __init__(self, dims: DecoderDims, qkv_bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = dims
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.in_norm = empty(d.hidden)
        self.post_norm = empty(d.hidden)
        self.qkv = empty(q + 2 * kv, d.hidden)
        self.qkv_bias = empty(q + 2 * kv) if qkv_bias else None
        self.o = empty(d.hidden, q)
        self.gate_up = empty(2 * d.intermediate, d.hidden)
        self.down = empty(d.hidden, d.intermediate)


class StaticKVDecoder(nn.Module):
    """Decoder weights + a static slot KV cache; see the module docstring for the two entry points."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(
        self,
        dims: DecoderDims,
        *,
        num_slots: int,
        max_len: int,
        qkv_bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if max_len > dims.max_positions:
            raise ArtifactError(
                f"max_len {max_len} is over the model's {dims.max_positions} positions",
                f"use max_len <= {dims.max_positions}",
            )
        dev = torch.device(device)
        self.dims, self.num_slots, self.max_len, self.dtype = dims, num_slots, max_len, dtype
        self.groups = dims.num_heads // dims.num_kv_heads
        self.embed = nn.Parameter(torch.empty(dims.vocab, dims.hidden, dtype=dtype, device=dev), requires_grad=False)
        self.layers = nn.ModuleList([_Layer(dims, qkv_bias, dtype, dev) for _ in range(dims.num_layers)])
        self.norm = nn.Parameter(torch.empty(dims.hidden, dtype=dtype, device=dev), requires_grad=False)
        self.head = nn.Parameter(torch.empty(dims.vocab, dims.hidden, dtype=dtype, device=dev), requires_grad=False)
        # one row past the slots: the scratch row that padding rows of a mixed step write into (mixed_step.py)
        self.scratch_row = num_slots
        cache = (num_slots + 1, dims.num_kv_heads, max_len, dims.head_dim)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        for i in range(dims.num_layers):  # buffers, so that the compiler sees them as the module's state
            self.register_buffer(f"k_cache_{i}", torch.zeros(cache, dtype=dtype, device=dev), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(cache, dtype=dtype, device=dev), persistent=False)
            self.k_cache.append(getattr(self, f"k_cache_{i}"))
            self.v_cache.append(getattr(self, f"v_cache_{i}"))
        for t in (*self.k_cache, *self.v_cache):
            # one shape for the engine's life: without this, Dynamo's recompile for a second bucket made the cache's
            # dims symbolic and shared the max_len symbol with kv_len's (equal at the first bucket), and Inductor's
            # input check then failed at every other length (the triton attention op's graphs)
            torch._dynamo.mark_static(t)
        inv = 1.0 / (
            dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, dtype=torch.float64, device=dev) / dims.head_dim)
        )
        freqs = torch.arange(max_len, dtype=torch.float64, device=dev)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().float(), persistent=False)
        self.register_buffer("sin_table", emb.sin().float(), persistent=False)

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_cache, *self.v_cache))

    # ---- weights ---------------------------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls,
        config: Mapping[str, Any],
        state: Mapping[str, torch.Tensor],
        *,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StaticKVDecoder:
        """From an HF config dict and an HF-named state dict (``model.layers.0.self_attn.q_proj.weight``...)."""
        dims = DecoderDims.from_hf(SimpleNamespace(**config))
        qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state
        model = cls(dims, num_slots=num_slots, max_len=max_len, qkv_bias=qkv_bias, dtype=dtype, device=device)
        model.load_hf_state(state)
        return model

    @classmethod
    def from_hf(
        cls, hf_model: PreTrainedModel, *, num_slots: int, max_len: int, dtype: torch.dtype | None = None
    ) -> StaticKVDecoder:
        """From a loaded HF Llama/Qwen2 causal LM (weights copied to ``dtype`` on the model's device)."""
        param = next(hf_model.parameters())
        state = hf_model.state_dict()
        if "lm_head.weight" not in state:
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        return cls.from_state_dict(
            hf_model.config.to_dict(),
            state,
            num_slots=num_slots,
            max_len=max_len,
            dtype=dtype or param.dtype,
            device=param.device,
        )

    def load_hf_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (fusing Q/K/V and gate/up); ArtifactError naming a missing tensor."""

        def get(key: str) -> torch.Tensor:
            t = state.get(key)
            if t is None:
                raise ArtifactError(f"weight {key!r} is missing", "rebuild the model from its source")
            return t

        with torch.no_grad():
            self.embed.copy_(get("model.embed_tokens.weight"))
            self.norm.copy_(get("model.norm.weight"))
            head = state.get("lm_head.weight")
            self.head.copy_(head if head is not None else get("model.embed_tokens.weight"))
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, _Layer)
                p = f"model.layers.{i}."
                layer.in_norm.copy_(get(p + "input_layernorm.weight"))
                layer.post_norm.copy_(get(p + "post_attention_layernorm.weight"))
                layer.qkv.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o.copy_(get(p + "self_attn.o_proj.weight"))
                layer.gate_up.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                layer.down.copy_(get(p + "mlp.down_proj.weight"))

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (unfused), e.g. to save an artifact."""
        d = self.dims
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
            "lm_head.weight": self.head,
        }
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            p = f"model.layers.{i}."
            qw, kw, vw = torch.split(layer.qkv, [q, kv, kv])
            out |= {p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw}
            out |= {p + "self_attn.v_proj.weight": vw, p + "self_attn.o_proj.weight": layer.o}
            if layer.qkv_bias is not None:
                qb, kb, vb = torch.split(layer.qkv_bias, [q, kv, kv])
                out |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb}
                out |= {p + "self_attn.v_proj.bias": vb}
            gate, up = torch.split(layer.gate_up, [d.intermediate, d.intermediate])
            out |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
            out |= {p + "mlp.down_proj.weight": layer.down, p + "input_layernorm.weight": layer.in_norm}
            out |= {p + "post_attention_layernorm.weight": layer.post_norm}
        return {k: v.detach().contiguous() for k, v in out.items()}

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (normal(0, std), norms 1) for shape-only benchmarks; say so wherever it is used."""
        gen = torch.Generator(device=self.embed.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)

    _q8: list[dict[str, Weight]] | None = None
    _q8_head: Weight | None = None

    def add_int8(self, kernel: str = "inductor") -> None:
        """Keep an int8 copy (per-output-row scales) of every layer's four GEMM weights and of the LM head, read by
        decode steps of one row (``SlotEngineOptions.int8_batch1``: a lone stream reads half the weight bytes per
        token). Steps of 2+ rows and prefill keep the model-dtype weights, so a sequence's tokens can differ
        depending on whether it decoded alone. ``kernel`` (``SlotEngineOptions.int8_kernel``) decides the copies'
        form (:func:`~miaohui.generation.kernels.int8_weights.int8_layer`)."""
        with torch.no_grad():
            self._q8 = [
                int8_layer(kernel, self.dims.head_dim, lay.qkv, lay.qkv_bias, lay.in_norm, lay.o, lay.gate_up,
                           lay.post_norm, lay.down)
                for lay in self.layers
                if isinstance(lay, _Layer)
            ]  # fmt: skip
            self._q8_head = int8_head(kernel, self.head)

    def _decode_weights(self, b: int) -> tuple[list[tuple[Weight, Weight, Weight, Weight]], Weight]:
        """Per layer (qkv, o, gate_up, down), and the LM head, for a decode step of ``b`` rows."""
        if b == 1 and self._q8 is not None and self._q8_head is not None:
            return [(q["qkv"], q["o"], q["gate_up"], q["down"]) for q in self._q8], self._q8_head
        layers: list[tuple[Weight, Weight, Weight, Weight]] = [
            (lay.qkv, lay.o, lay.gate_up, lay.down) for lay in self.layers if isinstance(lay, _Layer)
        ]
        return layers, self.head

    # ---- compute ---------------------------------------------------------------------------------------

    def use_compiled(self, compile_fn: Any) -> None:
        """Run decode's and prefill's per-layer pieces and the head through ``compile_fn`` (``torch.compile``).

        Compiling one layer's pieces (shared by all layers: weights are arguments) instead of the whole
        unrolled model keeps Inductor's compile to seconds; the launches between them cost nothing once
        the step is a CUDA graph. Decode's layer writes the cache inside its graph (:func:`make_decode_layer`);
        prefill's KV writes and SDPA attention stay eager. Eager, prefill's RMSNorm, RoPE and SwiGLU are ~50 small
        kernels per layer: compiled, a few fused ones."""
        self._attn_in = compile_fn(attn_in)
        self._attn_out_mlp = compile_fn(DECODE_ATTENTION[self.decode_attention])
        layer = make_decode_layer(DECODE_ATTENTION[self.decode_attention])
        self._decode_layer = compile_fn(with_constants(layer, heads=self.dims.num_heads))
        self._attn_proj_mlp = compile_fn(attn_proj_mlp)
        self._final = compile_fn(final_logits)

    decode_attention: str = "matmul"
    """How decode attends (``DECODE_ATTENTION``): set before :meth:`use_compiled` / the first decode."""
    _decode_layer: Any = None  # make_decode_layer(...), compiled by use_compiled
    _mixed_layer: Any = None  # mixed_step.mixed_layer, compiled by mixed_step.use_compiled
    _attn_in: Any = staticmethod(attn_in)
    _attn_out_mlp: Any = None  # DECODE_ATTENTION[decode_attention] unless compiled
    _attn_proj_mlp: Any = staticmethod(attn_proj_mlp)
    _final: Any = staticmethod(final_logits)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for rows ``0..b-1`` (``tokens``/``positions`` [b] int64); fp32 logits [b, vocab]."""
        d = self.dims
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        x = F.embedding(tokens, self.embed)  # [b, hidden]
        cos = self.cos_table[positions][:, None, :]  # [b, 1, D]
        sin = self.sin_table[positions][:, None, :]
        attend = self._attn_out_mlp or DECODE_ATTENTION[self.decode_attention]
        if self.decode_attention == "triton":
            mask = positions  # the triton kernels mask kv > position themselves
        else:
            allowed = torch.arange(kv_len, device=tokens.device)[None, :] <= positions[:, None]  # [b, T]
            mask = torch.where(allowed, 0.0, float("-inf"))[:, None, None, :]  # [b, 1, 1, T]
        weights, head = self._decode_weights(b)
        run = self._decode_layer or with_constants(make_decode_layer(attend), heads=d.num_heads)
        delta = None  # the last layer's MLP output, added by the next one (one-row int8 steps: none)
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(self.layers, weights, strict=True)):
            assert isinstance(layer, _Layer)
            if isinstance(qkv, RopeGemvWeight):
                x = self._rope_gemv_layer(i, x, positions, mask, qkv, o, gate_up, down, attend, kv_len)
                continue
            x, delta = run(
                x, torch.zeros_like(x) if delta is None else delta, self.k_cache[i], self.v_cache[i], rows,
                positions, mask, layer.in_norm, qkv, layer.qkv_bias, cos, sin, o, layer.post_norm, gate_up, down,
                d.rms_eps, kv_len,
            )  # fmt: skip
        return self._final(x if delta is None else add_residual(x, delta), self.norm, head, d.rms_eps)

    def _rope_gemv_layer(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        qkv: RopeGemvWeight,
        o: Weight,
        gate_up: Weight,
        down: Weight,
        attend: Any,
        kv_len: int,
    ) -> torch.Tensor:
        """Layer ``i`` of a one-row step with ``int8_kernel: gemv_layer``: one kernel for RMSNorm → QKV → RoPE →
        cache write (:func:`~miaohui.generation.kernels.w8_layer.w8_gemv_rope`, a custom op that writes the cache in
        place, so it runs outside the compiled graphs; the step's CUDA graph captures it), then ``attend``'s compiled
        half."""
        d, layer = self.dims, self.layers[i]
        assert isinstance(layer, _Layer)
        kc, vc = self.k_cache[i], self.v_cache[i]
        q = w8_gemv_rope_op(
            x, qkv.q, qkv.scale, qkv.bias, positions, self.cos_table, self.sin_table, kc, vc, d.num_heads, d.rms_eps
        )
        return attend(x, q, kc[:1, :, :kv_len], vc[:1, :, :kv_len], mask, o, layer.post_norm, gate_up, down, d.rms_eps)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts ``tokens`` [n, S] with real ``lengths`` [n] into cache rows ``slots`` [n];
        fp32 logits [n, vocab] of each prompt's last real token."""
        d = self.dims
        n, s = tokens.shape
        x = F.embedding(tokens, self.embed)  # [n, S, hidden]
        cos = self.cos_table[:s][None, :, None, :]  # [1, S, 1, D]
        sin = self.sin_table[:s][None, :, None, :]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            q, k, v = self._attn_in(
                x, layer.in_norm, layer.qkv, layer.qkv_bias, cos, sin, d.rms_eps, d.num_heads, d.num_kv_heads
            )
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, S, D]
            self.k_cache[i][slots, :, :s] = k
            self.v_cache[i][slots, :, :s] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups > 1)
            x = self._attn_proj_mlp(x, attn, layer.o, layer.post_norm, layer.gate_up, layer.down, d.rms_eps)
        last = x[torch.arange(n, device=tokens.device), lengths - 1]  # [n, hidden]
        return self._final(last, self.norm, self.head, d.rms_eps)

    def prefill_from(
        self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """:meth:`prefill` of prompts whose first ``starts[i]`` tokens' keys and values cache row ``slots[i]`` already
        holds (a reused prefix, :mod:`miaohui.generation.cache.slot_prefix`): ``tokens`` [n, S] are the rest,
        right-padded, at positions ``starts[i] ..``, with real ``lengths`` [n]; each attends over its row's first
        ``kv_len`` (≥ every ``starts[i] + S``, ≤ ``max_len``) positions up to its own. Logits of each rest's last real
        token."""
        d = self.dims
        n, s = tokens.shape
        positions = starts[:, None] + torch.arange(s, device=tokens.device)[None, :]  # [n, S]
        rows = slots[:, None].expand(n, s).contiguous()  # [n, S]: each token's cache row
        x = F.embedding(tokens, self.embed)  # [n, S, hidden]
        cos = self.cos_table[positions][:, :, None, :]  # [n, S, 1, D]
        sin = self.sin_table[positions][:, :, None, :]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            q, k, v = self._attn_in(
                x, layer.in_norm, layer.qkv, layer.qkv_bias, cos, sin, d.rms_eps, d.num_heads, d.num_kv_heads
            )
            self.k_cache[i][rows, :, positions] = k  # [n, S, KVH, D] at (row, every head, position)
            self.v_cache[i][rows, :, positions] = v
            attn = prefix_attention(q, self.k_cache[i], self.v_cache[i], rows, positions, kv_len)
            x = self._attn_proj_mlp(x, attn, layer.o, layer.post_norm, layer.gate_up, layer.down, d.rms_eps)
        last = x[torch.arange(n, device=tokens.device), lengths - 1]  # [n, hidden]
        return self._final(last, self.norm, self.head, d.rms_eps)
