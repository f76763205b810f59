"""One stream's decode step with its key/value cache written in place, not copied.

An int4 decoder's one-row graph (:mod:`miaohui.generation.build.one_row_graph`) has one ``com.microsoft::
GroupQueryAttention`` a layer. Fed numpy arrays, each step the kernel allocates its ``present`` key and value one slot
longer than the ``past``, zeroes them and copies the whole past into them. When ``past`` and ``present`` are the same
buffer (the kernel compares the pointers: ``past_present_share_buffer``), it writes the new token's key and value at
the row's length and copies nothing: the buffer is ``[1, kv_heads, capacity, head_dim]`` and ``seqlens_k`` (the
mask's sum less one) says how much of it is the row's. :class:`InPlaceRow` binds each layer's past input and present
output to one such buffer with IOBinding; the logits are the same bit for bit, and the step no longer grows with the
row's length (``lab/probes/one_row_kv_share.py`` measures it).

The engine's :class:`~miaohui.generation.executors.base.KVCache` arrays are never modified in place, and still are
not: the arrays a step returns are views ``buffer[:, :, :length]``, and a step writes only at the buffer's end (the
row's length). It does so only when its past *is* the previous step's views (the same objects: nothing has written
past them since); any other past (a prefill's output, a cache selected or joined from a batch, a prefix from the
prefix cache, an older step's views decoded again) is first copied into a new buffer. So every view anybody holds
keeps its contents, and a stream's first step pays the one copy the kernel used to pay every step. A view keeps its
whole buffer alive: a cache the prefix cache retains (:meth:`PrefixKV.retain`) holds up to :data:`HEADROOM` tokens
(or a quarter) more than its ``nbytes`` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from miaohui.generation.models.dims import DecoderDims

HEADROOM = 128
"""Tokens a new buffer holds beyond the row (at least; a quarter of the row's length where that is more): the buffer
is copied into a longer one when the row fills it. Memory against copies: SmolLM2-135M's key/value take 46 KB a
token, so 128 tokens are 6 MB, and a 2,000-token row is copied once per 500 steps."""


def runs_one_row(input_ids: np.ndarray, attention_mask: np.ndarray) -> bool:
    """Whether the decoder graph runs its one-row branch for these inputs: one token, no padding (the condition
    :func:`~miaohui.generation.build.weight_blocks.one_row_switch` writes with ``unpadded_only``)."""
    return int(input_ids.size) == 1 and bool(attention_mask.min() == 1)


class InPlaceRow:
    """One-row steps of ``session`` (a decoder whose one-row branch is the fused ``GroupQueryAttention`` graph) with
    the key/value cache in buffers that the kernel appends to. Not thread-safe: the engine's one caller runs it."""

    def __init__(self, session: Any, dims: DecoderDims, in_names: Sequence[str], out_names: Sequence[str]) -> None:
        from onnxruntime import OrtValue

        self._session = session
        self._dims = dims
        self._io = session.io_binding()
        self._ids_name, self._mask_name, self._pos_name = in_names[:3]
        self._past_names, self._present_names = list(in_names[3:]), list(out_names[1:])
        self._logits = np.empty((1, dims.vocab), dtype=np.float32)
        self._io.bind_ortvalue_output(out_names[0], OrtValue.ortvalue_from_numpy(self._logits))
        self._buffers: list[np.ndarray] = []
        """``[1, kv_heads, capacity, head_dim]`` per layer: key 0, value 0, key 1, ... (bound as past and present)."""
        self._views: list[np.ndarray] = []
        """The arrays the last step returned (``buffer[:, :, :length]``): a past that is them continues in place."""

    @property
    def capacity(self) -> int:
        """Tokens the current buffers hold (0 before the first step)."""
        return int(self._buffers[0].shape[2]) if self._buffers else 0

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits ``[1, vocab]``, presents ``[k0, v0, k1, ...]``) of one token after ``past``, as ``session.run``
        gives them; the caller has checked :func:`runs_one_row`."""
        length = int(past[0].shape[2])
        continues = len(past) == len(self._views) and all(a is b for a, b in zip(past, self._views, strict=True))
        if not continues or length >= self.capacity:
            self._adopt(past, length)
        self._io.bind_cpu_input(self._ids_name, np.ascontiguousarray(input_ids, dtype=np.int64))
        self._io.bind_cpu_input(self._mask_name, np.ascontiguousarray(attention_mask, dtype=np.int64))
        self._io.bind_cpu_input(self._pos_name, np.ascontiguousarray(position_ids, dtype=np.int64))
        self._session.run_with_iobinding(self._io)
        self._views = [b[:, :, : length + 1] for b in self._buffers]
        return self._logits.copy(), list(self._views)

    def _adopt(self, past: Sequence[np.ndarray], length: int) -> None:
        """New buffers holding ``past`` (its ``length`` slots, and room to grow), bound as past and present."""
        from onnxruntime import OrtValue

        d = self._dims
        capacity = min(d.max_positions, length + 1 + max(HEADROOM, (length + 1) // 4))
        self._buffers = [np.empty((1, d.num_kv_heads, capacity, d.head_dim), dtype=np.float32) for _ in past]
        for buffer, array in zip(self._buffers, past, strict=True):
            buffer[:, :, :length] = array
        for past_name, present_name, buffer in zip(self._past_names, self._present_names, self._buffers, strict=True):
            value = OrtValue.ortvalue_from_numpy(buffer)
            self._io.bind_ortvalue_input(past_name, value)
            self._io.bind_ortvalue_output(present_name, value)
        self._views = []
