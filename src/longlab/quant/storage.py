"""Quantized KV storage: :class:`QuantizedLayer`, a :class:`~longlab.cache.LonglabLayer` that holds
packed integers, and the two packed stores it is built from.

Slot layout of one layer (every tensor is ``[B, H_kv, ., .]``; slots run in stream order)::

    [ sink (full precision) | main (packed integers) | residual (full precision) ]
      0 .. S                  S .. S + n_main          S + n_main .. T

Keys and values are stored separately and their main regions may differ in length (KIVI keeps up
to R recent *keys* in full precision but exactly the last R *values*); ``index [B, H_kv, T]`` (true
token positions, -1 = empty slot) is shared. ``self.keys``/``self.values`` are the full-precision
*residual* tensors: they are what :meth:`update` appends to and returns to transformers, so
:func:`longlab.cache.active_layer` still finds the layer by ``keys.data_ptr()``.

Reading: attention (:meth:`QuantizedLayer.attend`, called by the hook instead of dense attention). A
decode step (one query per row) runs the fused kernel :func:`longlab.ops.qdecode.quant_decode` where it
is available (CPU, the C++ extension built; ``fused=True``, the default of every quant policy): it reads
the packed codes and scales in place, scales folded into the query and the probabilities, online
softmax. Otherwise (prefill chunks, no compiler, ``fused=false``, ``LONGLAB_QDECODE=0``) the pure-PyTorch
path dequantises ``chunk_tokens`` slots at a time and merges the chunks with a running log-sum-exp
(online softmax); neither ever holds a full-precision copy of the layer. Eviction scorers that run
after quantization read :meth:`dequantized_keys`/:meth:`dequantized_values` through
``LayerContext.k``/``.v``: a transient dequantised view, freed after scoring.

Eviction after quantization (:meth:`keep`) moves per-token codes exactly (per-token groups travel
with their token). Per-channel groups (KIVI keys) mix tokens, so the surviving quantized keys are
dequantised, gathered and re-quantized in fresh groups (a second rounding: error
``<= s_old / 2 + s_new / 2``). Recipes quantize after eviction in each chunk, so only entries kept
from earlier chunks are re-quantized.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..cache import DECODE_RESERVE, SHORT_APPEND, LonglabLayer
from ..ops import qdecode
from .quantizer import (
    SCALE_DTYPES,
    dequantize_channels,
    dequantize_tokens,
    equivalent_right_shift,
    pack,
    quantize_channels,
    quantize_tokens,
    scales_overflow,
    unpack,
)

__all__ = ["TokenGroupStore", "ChannelGroupStore", "QuantizedLayer", "chunked_attention"]

_MAX_SCORE_BYTES = 64 * 2**20  # bound on one [B, H, T_q, chunk] fp32 score block


def _gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t: [B, H, T, ...] (3-D or 4-D); order: [B, H, n] slot ids -> [B, H, n, ...]."""
    if t.dim() == 3:
        return t.gather(2, order)
    return t.gather(2, order[..., None].expand(-1, -1, -1, t.shape[-1]))


class _GroupStore:
    """What both stores share: packed ``codes uint8 [B, H_kv, T, D * bits / 8]`` (one row per token)
    and per-group ``scale, offset`` (their layout is the subclass's), batch mapping and byte listing."""

    def __init__(self, bits: int, group: int, scale_dtype: str = "float16") -> None:
        self.bits = bits
        self.group = group
        self.scale_dtype = scale_dtype
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.offset: torch.Tensor | None = None
        self.head_dim = 0
        self._bufs: tuple[torch.Tensor, ...] | None = None  # spare rows for decode appends
        self._views: tuple[torch.Tensor, ...] = ()  # the codes/scale/offset views of _bufs last set
        self.fast = True  # the C++ quantizer where it runs (QuantizedLayer.fused sets it)

    @property
    def n(self) -> int:
        return 0 if self.codes is None else self.codes.shape[-2]

    def _alloc(self, B: int, H: int, D: int, scale_width: int, device: torch.device) -> None:
        self.head_dim = D
        self.codes = torch.empty(B, H, 0, D * self.bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.empty(B, H, 0, scale_width, dtype=SCALE_DTYPES[self.scale_dtype], device=device)
        self.offset = torch.empty_like(self.scale)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.offset) if t is not None]

    def spare_nbytes(self) -> int:
        """Bytes of spare rows allocated past the held ones for decode appends (not in ``tensors()``)."""
        if self._bufs is None or self.codes is None or self.codes.data_ptr() != self._bufs[0].data_ptr():
            return 0
        return sum((buf.shape[2] - self.n) * buf[:, :, :1].numel() * buf.element_size() for buf in self._bufs)

    def map(self, fn) -> None:
        """Apply a batch-axis function (beam reorder) to every per-row tensor."""
        self.codes, self.scale, self.offset = (fn(t) for t in (self.codes, self.scale, self.offset))


class TokenGroupStore(_GroupStore):
    """Per-token quantization in groups of ``group`` channels (KIVI values; PM-KVQ keys and values).

    Holds ``codes uint8 [B, H_kv, T, D * bits / 8]`` and ``scale, offset [B, H_kv, T, D / group]``.
    New tokens are quantized at ``entry_bits`` and lowered to ``bits`` with the equivalent right
    shift (PM-KVQ moves window chunks into main at 16 bits, then shifts; KIVI uses
    ``entry_bits == bits``). ``channel_scale [1, H_kv, 1, D]`` (optional, fp32) is PM-KVQ's key
    smoothing ``lambda``: ``x / lambda`` is quantized and ``lambda * x_hat`` is read back.
    """

    def __init__(
        self,
        bits: int,
        group: int,
        scale_dtype: str = "float16",
        entry_bits: int | None = None,
        channel_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__(bits, group, scale_dtype)
        self.entry_bits = entry_bits if entry_bits is not None else bits
        self.channel_scale = channel_scale

    def init_empty(self, B: int, H: int, D: int, device: torch.device) -> None:
        if D % self.group:
            raise ValueError(f"head_dim {D} is not a multiple of the quantization group {self.group}")
        self._alloc(B, H, D, D // self.group, device)

    def append(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Quantize ``x [B, H, t, D]`` and append it (``valid`` is unused: per-token groups never mix)."""
        if x.shape[-2] == 0:
            return
        if self.channel_scale is not None:
            x = x.float() / self.channel_scale
        if self.fast and self.entry_bits == self.bits and self.bits <= 8 and qdecode.available(x):
            # one C++ call, bit-identical to quantize_tokens + pack (a decode step's new value otherwise
            # costs some forty small PyTorch ops per layer)
            codes, scale, offset, finite = qdecode.quantize_tokens_packed(
                x, self.bits, self.group, SCALE_DTYPES[self.scale_dtype]
            )
            if not finite:
                raise scales_overflow(SCALE_DTYPES[self.scale_dtype])
            self._append_rows(codes, scale, offset)
            return
        codes, scale, offset = quantize_tokens(x, self.entry_bits, self.group, SCALE_DTYPES[self.scale_dtype])
        bits = self.entry_bits
        while bits > self.bits:  # PM-KVQ: enter at 16 bits, shift down to the current width
            codes, scale = equivalent_right_shift(codes, bits), _widen(scale, bits)
            bits //= 2
        self._append_rows(pack(codes, self.bits), scale, offset)

    def _append_rows(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """Append rows ``[B, H, t, .]`` to codes/scale/offset. A short append (a decode step) goes into
        spare rows of buffers grown by ``DECODE_RESERVE`` rows at a time, so decoding does not copy the
        store each step (as :class:`~longlab.cache.LonglabLayer` does for its slots); ``codes``/``scale``/
        ``offset`` stay views of the held rows. Any other assignment of them (take, shrink, batch
        selection) leaves the buffers, which are then re-allocated on the next append."""
        n, t = self.n, codes.shape[-2]
        bufs, views = self._bufs, self._views
        fits = (  # codes/scale/offset are still the views this method made (nothing reassigned them)
            bufs is not None
            and self.codes is views[0]
            and self.scale is views[1]
            and self.offset is views[2]
            and bufs[0].shape[-2] >= n + t
        )
        if not fits:
            spare = DECODE_RESERVE if t <= SHORT_APPEND else 0
            bufs = tuple(
                torch.empty(*cur.shape[:2], n + t + spare, *cur.shape[3:], dtype=cur.dtype, device=cur.device)
                for cur in (self.codes, self.scale, self.offset)
            )
            for buf, cur in zip(bufs, (self.codes, self.scale, self.offset)):
                buf[:, :, :n] = cur
            self._bufs = bufs
        for buf, new in zip(bufs, (codes, scale, offset)):
            buf.narrow(2, n, t).copy_(new)
        self.codes, self.scale, self.offset = self._views = tuple(buf.narrow(2, 0, n + t) for buf in bufs)

    def dequantize(self, a: int, b: int) -> torch.Tensor:
        """Tokens ``a .. b`` of the store, fp32 ``[B, H, b - a, D]``."""
        x = dequantize_tokens(
            unpack(self.codes[:, :, a:b], self.bits), self.scale[:, :, a:b], self.offset[:, :, a:b]
        )
        return x * self.channel_scale if self.channel_scale is not None else x

    def shrink(self) -> None:
        """Halve every code's width with the equivalent right shift (PM-KVQ's progressive step)."""
        if self.bits <= 1:
            raise ValueError("cannot shrink below 1 bit")
        q = unpack(self.codes, self.bits)
        self.codes = pack(equivalent_right_shift(q, self.bits), self.bits // 2)
        self.scale = _widen(self.scale, self.bits)
        self.bits //= 2

    def take(self, order: torch.Tensor, ok: torch.Tensor) -> None:
        """Keep tokens ``order [B, H, n]`` (slot ids in this store); exact: codes move with their token."""
        self.codes, self.scale, self.offset = (
            _gather_slots(t, order) for t in (self.codes, self.scale, self.offset)
        )

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + ([self.channel_scale] if self.channel_scale is not None else [])


def _widen(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Scale after halving ``bits``: ``s' = s * (2^(bits/2) + 1)`` (stored in the same dtype)."""
    return (scale.float() * ((1 << (bits // 2)) + 1)).to(scale.dtype)


class ChannelGroupStore(_GroupStore):
    """Per-channel quantization over groups of ``group`` consecutive tokens (KIVI keys).

    Holds ``codes uint8 [B, H_kv, T, D * bits / 8]`` (one packed row per token) and
    ``scale, offset [B, H_kv, ceil(T / group), D]``. A short last group (after an eviction) is
    re-quantized together with the next tokens appended, so groups always start at multiples of
    ``group``. Empty slots are left out of every min/max.
    """

    def init_empty(self, B: int, H: int, D: int, device: torch.device) -> None:
        if (D * self.bits) % 8:
            raise ValueError(f"head_dim {D} cannot be packed at {self.bits} bits")
        self._alloc(B, H, D, D, device)

    def _set(self, x: torch.Tensor, valid: torch.Tensor, start_group: int) -> None:
        """(Re)quantize ``x`` = tokens from ``start_group * group`` to the end."""
        codes, scale, offset = quantize_channels(
            x, self.bits, self.group, valid, SCALE_DTYPES[self.scale_dtype]
        )
        keep_tokens = start_group * self.group
        self.codes = torch.cat([self.codes[:, :, :keep_tokens], pack(codes, self.bits)], dim=-2)
        self.scale = torch.cat([self.scale[:, :, :start_group], scale], dim=-2)
        self.offset = torch.cat([self.offset[:, :, :start_group], offset], dim=-2)

    def append(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        """Append ``x [B, H, t, D]``; ``valid [B, H, n + t]`` covers the whole store after the append."""
        if x.shape[-2] == 0:
            return
        n = self.n
        start_group = n // self.group
        tail = start_group * self.group
        if tail < n:  # re-quantize the short last group with the new tokens
            x = torch.cat([self.dequantize(tail, n).to(x.dtype), x], dim=-2)
        self._set(x, valid[..., tail:], start_group)

    def dequantize(self, a: int, b: int) -> torch.Tensor:
        """Tokens ``a .. b`` of the store, fp32 ``[B, H, b - a, D]``."""
        return dequantize_channels(
            unpack(self.codes[:, :, a:b], self.bits), self.scale, self.offset, self.group, a
        )

    def take(self, order: torch.Tensor, ok: torch.Tensor) -> None:
        """Keep tokens ``order [B, H, n]``: dequantise, gather, re-quantize in fresh groups."""
        x = _gather_slots(self.dequantize(0, self.n), order)
        self.codes, self.scale, self.offset = (
            self.codes[:, :, :0],
            self.scale[:, :, :0],
            self.offset[:, :, :0],
        )
        if x.shape[-2]:
            self._set(x, ok, 0)


def chunked_attention(
    q: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    read_kv,
    scaling: float,
    sliding_window: int | None = None,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Exact softmax attention over slots read ``chunk_tokens`` at a time (online softmax).

    q: [B, H, T_q, D]; query_index: [B, T_q]; key_index: [B, H_kv, T] (-1 = empty slot);
    ``read_kv(a, b) -> (k, v)``, each [B, H_kv, b - a, D]. Returns [B, H, T_q, D] in ``q.dtype``.
    A key is visible when ``0 <= pos_k <= pos_q`` (and ``pos_q - pos_k < sliding_window``).
    Rows with no visible key (padding queries) get zeros.
    """
    B, H, T_q, D = q.shape
    H_kv, T = key_index.shape[1], key_index.shape[2]
    g = H // H_kv
    qf = q.float().reshape(B, H_kv, g * T_q, D) * scaling  # query heads of one KV head side by side
    qpos = query_index.to(torch.int64)[:, None, :, None]  # [B, 1, T_q, 1]
    step = max(16, min(chunk_tokens, _MAX_SCORE_BYTES // max(1, B * H * T_q * 4)))
    m = torch.full((B, H_kv, g * T_q, 1), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc: torch.Tensor | None = None
    for a in range(0, T, step):
        b = min(T, a + step)
        k, v = read_kv(a, b)
        s = torch.matmul(qf, k.float().transpose(-1, -2))  # [B, H_kv, g*T_q, t]
        kpos = key_index[:, :, None, a:b].to(torch.int64)  # [B, H_kv, 1, t]
        vis = (kpos >= 0) & (kpos <= qpos)  # [B, H_kv, T_q, t]
        if sliding_window is not None:
            vis &= kpos > qpos - sliding_window
        vis = vis[:, :, None].expand(B, H_kv, g, T_q, b - a).reshape(B, H_kv, g * T_q, b - a)
        if not bool(vis.all()):
            s = s.masked_fill(~vis, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        pv = torch.matmul(p, v.float())  # [B, H_kv, g*T_q, D]
        acc = pv if acc is None else acc * alpha + pv
        l = l * alpha + p.sum(-1, keepdim=True)
        m = m_new
    if acc is None:
        return torch.zeros_like(q)
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, H_kv, g, T_q, -1).reshape(B, H, T_q, -1).to(q.dtype)


class QuantizedLayer(LonglabLayer):
    """A cache layer whose older entries are packed integers (see the module docstring for the layout).

    Created from a full-precision layer with :meth:`from_layer`; quant policies move entries from
    the residual into the packed main region with :meth:`quantize_keys`/:meth:`quantize_values`.
    ``fp_dtype`` is the dtype of the sink and residual (None: the model's dtype).
    """

    batchable: ClassVar[bool] = False  # sink, packed stores and residual cannot be stacked by padding

    def __init__(
        self,
        key_store: TokenGroupStore | ChannelGroupStore,
        value_store: TokenGroupStore | ChannelGroupStore,
        sink: int = 0,
        fp_dtype: torch.dtype | None = None,
        chunk_tokens: int = 4096,
        fused: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.key_store = key_store
        self.value_store = value_store
        self.fused = fused  # decode steps (and per-token quantization) through longlab.ops.qdecode
        self.sink = sink  # sink slots wanted; n_sink slots held (fewer only after an eviction)
        self.n_sink = 0
        self.fp_dtype = fp_dtype
        self.model_dtype: torch.dtype | None = None
        self.chunk_tokens = chunk_tokens
        self.sink_keys: torch.Tensor | None = None  # [B, H_kv, n_sink, D]
        self.sink_values: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        """Whether decode steps read the packed codes with :func:`longlab.ops.qdecode.quant_decode` and new
        per-token entries are quantized by its C++ quantizer (where the extension runs): one switch, kept
        on the stores (``fast``) so setting it later reaches both paths."""
        return self.value_store.fast

    @fused.setter
    def fused(self, on: bool) -> None:
        self.key_store.fast = self.value_store.fast = bool(on)

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_layer(cls, layer: LonglabLayer, key_store, value_store, **kwargs: Any) -> QuantizedLayer:
        """Take over a full-precision layer (its entries become sink + residual; nothing quantized yet)."""
        layer.keep(layer.valid)  # drop padding slots first, so the sink holds each row's first tokens
        new = cls(key_store, value_store, **kwargs)
        new.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("keys", "values")})
        new.key_store, new.value_store = key_store, value_store
        # Method state travels with the entries: per-slot extras [B, H_kv, T] (H2O's scores) and per-layer
        # state [B, ...] (Quest pages, decode query buffers, RetroAttention's window, IndexMem's memory).
        new.extras, new.state = dict(layer.extras), dict(layer.state)
        B, H_kv, T, D = layer.keys.shape
        new.model_dtype = layer.keys.dtype
        dtype = new.fp_dtype or layer.keys.dtype
        new.n_sink = min(new.sink, T)
        new.sink_keys = layer.keys[:, :, : new.n_sink].to(dtype).clone()
        new.sink_values = layer.values[:, :, : new.n_sink].to(dtype).clone()
        new.keys = layer.keys[:, :, new.n_sink :].to(dtype).clone()
        new.values = layer.values[:, :, new.n_sink :].to(dtype).clone()
        key_store.init_empty(B, H_kv, D, layer.keys.device)
        value_store.init_empty(B, H_kv, layer.values.shape[-1], layer.keys.device)
        return new

    # --- transformers' protocol --------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H_kv, _, D = key_states.shape
        self.model_dtype = key_states.dtype
        dtype = self.fp_dtype or key_states.dtype
        self.keys, self.values = self.keys.to(dtype), self.values.to(dtype)
        self.sink_keys, self.sink_values = self.keys.clone(), self.values.clone()
        self.n_sink = 0
        self.key_store.init_empty(B, H_kv, D, key_states.device)
        self.value_store.init_empty(B, H_kv, value_states.shape[-1], key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # New entries join the full-precision residual; returns the residual tensors ([B, H_kv, t, D]).
        repeat = getattr(self, "kv_repeat", 1)  # heads repeated per query head (kv.base.repeat_kv_heads)
        if repeat > 1 and self.is_initialized and key_states.shape[1] * repeat == self.index.shape[1]:
            key_states = key_states.repeat_interleave(repeat, dim=1)
            value_states = value_states.repeat_interleave(repeat, dim=1)
        if self.is_initialized and self.keys.dtype != key_states.dtype:
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.sink_keys = self.sink_values = None
        self.n_sink = 0
        for store in (self.key_store, self.value_store):
            store.codes = store.scale = store.offset = None

    def _select_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        super()._select_batch(fn)
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.key_store.map(fn)
        self.value_store.map(fn)

    @property
    def full_element_size(self) -> int:
        """Bytes per element of the model's own K/V (what an uncompressed cache would hold)."""
        return torch.empty(0, dtype=self.model_dtype or self.keys.dtype).element_size()

    # --- regions -----------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.index.shape[-1]

    def _region_valid(self, store) -> torch.Tensor:
        return self.index[..., self.n_sink : self.n_sink + store.n] >= 0

    def quantize_keys(self, n: int) -> None:
        """Move the ``n`` oldest residual keys into the packed main region."""
        n = min(n, self.keys.shape[-2])
        if n <= 0:
            return
        x, self.keys = self.keys[:, :, :n], self.keys[:, :, n:].clone()
        self.key_store.append(x, self._main_valid(self.key_store, n))

    def quantize_values(self, n: int) -> None:
        """Move the ``n`` oldest residual values into the packed main region."""
        n = min(n, self.values.shape[-2])
        if n <= 0:
            return
        if n <= SHORT_APPEND:  # a decode step: the window moves on in its buffer, no copy
            x = self.values[:, :, :n]
            self._drop_front("values", n)
        else:  # a prefill chunk: the rest is copied out, so the quantized entries' fp rows are freed now
            x, self.values = self.values[:, :, :n], self.values[:, :, n:].clone()
        self.value_store.append(x, self._main_valid(self.value_store, n))

    def _main_valid(self, store, n: int) -> torch.Tensor | None:
        """Which slots of ``store``'s main region hold entries once ``n`` more join it ``[B, H_kv, n_main
        + n]``: per-channel groups need it (empty slots stay out of their min/max); per-token groups never
        mix tokens, so they get None (no O(T) pass per decode step)."""
        if not isinstance(store, ChannelGroupStore):
            return None
        return self.index[..., self.n_sink : self.n_sink + store.n + n] >= 0

    def _read(self, sink: torch.Tensor, store, resid: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Slots ``a .. b`` of one of K or V, dequantised to the model dtype: [B, H_kv, b - a, D]."""
        S, M = self.n_sink, self.n_sink + store.n
        dtype = self.model_dtype or resid.dtype
        parts = []
        if a < S:
            parts.append(sink[:, :, a : min(b, S)].to(dtype))
        if max(a, S) < min(b, M):
            parts.append(store.dequantize(max(a, S) - S, min(b, M) - S).to(dtype))
        if b > M:
            parts.append(resid[:, :, max(a, M) - M : b - M].to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def key_slice(self, a: int, b: int) -> torch.Tensor:
        return self._read(self.sink_keys, self.key_store, self.keys, a, b)

    def value_slice(self, a: int, b: int) -> torch.Tensor:
        return self._read(self.sink_values, self.value_store, self.values, a, b)

    def dequantized_keys(self) -> torch.Tensor:
        """All keys, dequantised, in slot order: ``[B, H_kv, T, D]`` (a transient copy for scorers)."""
        return self.key_slice(0, self.n_slots)

    def dequantized_values(self) -> torch.Tensor:
        """All values, dequantised, in slot order: ``[B, H_kv, T, D]``."""
        return self.value_slice(0, self.n_slots)

    # --- attention -----------------------------------------------------------------------------------
    def attend(self, ctx) -> torch.Tensor:
        """Attention of ``ctx.q [B, H, T_q, D]`` over every held entry: the fused kernel for a decode step
        where it runs (:meth:`fused_decode`), else dequantising chunk by chunk."""
        if self.uses_fused(ctx.q):
            return self.fused_decode(ctx.q, ctx.query_index[:, -1], ctx.scaling, ctx.sliding_window)
        return chunked_attention(
            ctx.q,
            ctx.query_index,
            self.index,
            lambda a, b: (self.key_slice(a, b), self.value_slice(a, b)),
            ctx.scaling,
            ctx.sliding_window,
            self.chunk_tokens,
        )

    def uses_fused(self, q: torch.Tensor) -> bool:
        """Whether a forward with queries ``q [B, H, T_q, D]`` runs :func:`longlab.ops.qdecode.quant_decode`:
        one query per row, ``fused`` on, values without smoothing, the kernel available here."""
        if not self.fused or q.shape[-2] != 1:
            return False
        if isinstance(self.value_store, TokenGroupStore) and self.value_store.channel_scale is not None:
            return False
        return qdecode.available(q)

    def _packed(self, store) -> qdecode.Packed:
        channel = isinstance(store, ChannelGroupStore)
        smoothing = None if channel or store.channel_scale is None else store.channel_scale
        return qdecode.Packed(store.codes, store.scale, store.offset, store.bits, store.group, channel,
                              smoothing)

    def fused_decode(self, q: torch.Tensor, query_pos: torch.Tensor, scaling: float,
                     sliding_window: int | None = None) -> torch.Tensor:
        """Decode attention read straight from the packed storage. q: [B, H, 1, D]; query_pos: [B] ->
        [B, H, 1, D] (equal to :func:`chunked_attention` to float rounding; tested)."""
        return qdecode.quant_decode(q, query_pos, self.index, self.sink_keys, self.sink_values,
                                    self._packed(self.key_store), self._packed(self.value_store),
                                    self.keys, self.values, scaling, sliding_window)

    # --- eviction ------------------------------------------------------------------------------------
    def keep(self, mask: torch.Tensor) -> None:
        """Keep the slots where ``mask [B, H_kv, T]`` is True, region by region (see module docstring)."""
        mask = mask & self.valid
        T = mask.shape[-1]
        if bool(mask.all()):
            return
        S, nk, nv = self.n_sink, self.key_store.n, self.value_store.n
        cuts = sorted({0, S, S + nk, S + nv, T})
        segments = []  # (a, b, order [B, H, n] absolute slot ids, ok [B, H, n])
        for a, b in zip(cuts[:-1], cuts[1:]):
            m = mask[..., a:b]
            counts = m.sum(-1)
            n = int(counts.max()) if m.numel() else 0
            arange = torch.arange(b - a, device=mask.device)
            order = ((~m).long() * (b - a) + arange).argsort(dim=-1)[..., :n] + a
            ok = torch.arange(n, device=mask.device) < counts[..., None]
            segments.append((a, b, order, ok))

        def region(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
            inside = [(o, k) for a, b, o, k in segments if r0 <= a and b <= r1]
            if not inside:
                empty = mask.new_zeros(*mask.shape[:2], 0)
                return empty.long(), empty
            return torch.cat([o for o, _ in inside], -1) - r0, torch.cat([k for _, k in inside], -1)

        order, ok = region(0, T)
        self.index = torch.where(
            ok, self.index.gather(2, order), torch.full_like(order, -1, dtype=torch.int32)
        )
        self.extras = {k: v.gather(2, order) for k, v in self.extras.items()}
        o, _ = region(0, S)
        self.sink_keys, self.sink_values = (
            _gather_slots(self.sink_keys, o),
            _gather_slots(self.sink_values, o),
        )
        self.n_sink = o.shape[-1]
        for store, r_end, attr in ((self.key_store, S + nk, "keys"), (self.value_store, S + nv, "values")):
            o, k = region(S, r_end)
            store.take(o, k)
            o, _ = region(r_end, T)
            setattr(self, attr, _gather_slots(getattr(self, attr), o))

    def trim_to_window(self, window: int, slack: int = 64) -> None:
        if self.n_slots <= window + slack:
            return
        newest = self.index.amax(dim=(1, 2), keepdim=True)
        self.keep(self.index > newest - window)

    # --- accounting ----------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (what :meth:`nbytes` counts)."""
        held = [self.keys, self.values, self.sink_keys, self.sink_values, self.index, *self.extras.values()]
        held += list(self.state.values())  # per-layer method state (Quest pages, query buffers, ...)
        return [t for t in held if t is not None] + self.key_store.tensors() + self.value_store.tensors()

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def spare_nbytes(self) -> int:
        """Spare capacity for decode appends: the slot buffers' and the packed stores' spare rows."""
        return super().spare_nbytes() + self.key_store.spare_nbytes() + self.value_store.spare_nbytes()

    def code_nbytes(self) -> int:
        """Bytes of the K/V code words alone: packed main codes plus the full-precision sink and residual
        (what PM-KVQ's budget counts); :meth:`overhead_nbytes` is the rest of :meth:`nbytes`."""
        if not self.is_initialized:
            return 0
        held = [self.keys, self.values, self.sink_keys, self.sink_values, self.key_store.codes,
                self.value_store.codes]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def overhead_nbytes(self) -> int:
        """Scales, offsets, smoothing vector, position index and method state: ``nbytes - code_nbytes``."""
        return self.nbytes() - self.code_nbytes()
