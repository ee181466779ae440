"""Fused decode attention over packed KV codes, and paged sparse decode (``qdecode.cpp``, CPU).

**Quantized decode** (:func:`quant_decode`): one decode query per row against a quantized layer's slots
``[ sink (fp) | main (packed codes) | residual (fp) ]`` (KIVI, Liu et al. 2024, arXiv:2402.02750: per-channel
keys, per-token values, a full-precision residual window; PM-KVQ, ICLR 2026: per-token keys and values with
key smoothing ``lambda``, 16/8/4/2-bit widths), reading the packed codes and their scales in place, with
an online softmax (Dao et al. 2022), so no dequantised copy of the cache is ever made. The scales fold
into the query and the probabilities:

    per-channel keys (group i):  q.k_t = sum_c (q_c s_ic) code_tc + sum_c q_c o_ic
    per-token keys (groups r):   q.k_t = sum_r [s_tr sum_(c in r) q_c lambda_c code_tc
                                                + o_tr sum_(c in r) q_c lambda_c]
    per-token values:            sum_t p_t v_tc = sum_t (p_t s_t,r(c)) code_tc + sum_t p_t o_t,r(c)

so each code is converted once and used in one multiply-add per query head of its KV head (GQA).

**Per-token quantization** (:func:`quantize_tokens_packed`): :func:`longlab.quant.quantizer.quantize_tokens`
followed by :func:`~longlab.quant.quantizer.pack` in one call, bit for bit the same codes, scales and offsets:
the step that moves a KIVI value into the packed store at every decode step.

**Paged decode** (:func:`paged_decode`): each query head attends over its own slot list (Quest's top pages
plus the last page, RetroAttention's loaded pages), reading only those K/V rows, in place; returns the
output and the log-sum-exp (RetroAttention merges by it).

**Page selection** (:func:`page_select`): Quest's page bounds ``U_p = q.center_p + |q|.radius_p`` for every
query head (or the largest over a KV head's group), the top ``k`` pages and their slots in one call, from one
read of the page summaries; :func:`page_marks_match` checks that summarised pages were not repacked.

All run through :mod:`longlab.ops.build` (compiled once per machine, about a minute; ``LONGLAB_QDECODE=0``
switches the extension off). Callers check :func:`available` and keep their pure-PyTorch path
(``QuantizedLayer``'s chunked dequantise-and-attend, Quest's gather) as the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from longlab.ops import build

__all__ = ["KERNEL", "Packed", "available", "unavailable_reason", "quant_decode", "paged_decode",
           "page_select", "page_marks_match", "quantize_tokens_packed"]

KERNEL = build.Kernel("qdecode", (Path(__file__).with_name("qdecode.cpp"),), "LONGLAB_QDECODE",
                      ("quant_decode", "paged_decode", "page_select", "page_marks_match",
                       "quantize_tokens_packed"), tuple(build.cpu_flags()))
_SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SPLIT_MIN = 2048  # slots per parallel range below which a (row, KV head) is not split


@dataclass
class Packed:
    """One packed store: ``codes uint8 [B, H_kv, n, D * bits / 8]`` (planar, as ``quant.quantizer.pack``),
    ``scale, offset`` (per token: ``[B, H_kv, n, D / group]``; per channel, ``channel=True``:
    ``[B, H_kv, ceil(n / group), D]``), ``smoothing [H_kv, D]`` fp32 or None (per-token keys only)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group: int
    channel: bool
    smoothing: torch.Tensor | None = None


def unavailable_reason(q: torch.Tensor | None = None) -> str | None:
    """Why the fused kernels cannot run on ``q`` here (None when they can); builds on first call."""
    if q is not None:
        if q.device.type != "cpu":
            return f"CPU only (q is on {q.device.type})"
        if q.requires_grad and torch.is_grad_enabled():
            return "forward only (q requires grad)"
    return build.reason(KERNEL)


def available(q: torch.Tensor | None = None) -> bool:
    """Whether :func:`quant_decode` / :func:`paged_decode` can run on ``q`` on this machine."""
    return unavailable_reason(q) is None


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype``, contiguous; itself when it already is (a no-op ``.to()`` still costs a call)."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _split(B: int, H_kv: int, T: int) -> int:
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    return max(1, min(T // _SPLIT_MIN, -(-2 * threads // (B * H_kv))))


def quant_decode(q: torch.Tensor, query_pos: torch.Tensor, key_index: torch.Tensor, sink_k: torch.Tensor,
                 sink_v: torch.Tensor, keys: Packed, values: Packed, res_k: torch.Tensor, res_v: torch.Tensor,
                 scaling: float, sliding_window: int | None = None) -> torch.Tensor:
    """Exact attention of one decode query per row over a packed layer (module docstring).

    q: [B, H, 1, D]; query_pos: [B]; key_index: [B, H_kv, T] int32 (-1 = empty slot); sink_k/v:
    [B, H_kv, S, D]; keys/values: main regions of ``n_k`` / ``n_v`` slots after the sink; res_k/v:
    [B, H_kv, T - S - n_k (n_v), D] (fp32/fp16/bf16, last dim contiguous). A key is visible when
    ``0 <= pos <= query_pos`` (and ``query_pos - pos < sliding_window``); a row that sees none gets zeros.
    Returns [B, H, 1, D] in ``q.dtype``."""
    ext = build.load(KERNEL)
    if ext is None:
        raise RuntimeError(f"quant_decode: {unavailable_reason()}")
    B, H, _, D = q.shape

    def c(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def packed(t: torch.Tensor) -> torch.Tensor:  # rows packed; a view of a buffer's first rows is fine
        ok = t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == t.shape[3])
        return t if ok else t.contiguous()

    def pair(s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, o = packed(s), packed(o)
        return (s, o) if s.stride() == o.stride() else (s.contiguous(), o.contiguous())

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t if t.shape[2] == 0 or t.stride(-1) == 1 else t.contiguous()

    def as_type(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # a no-op .to() still costs a call
        return t if t.dtype == dtype else t.to(dtype)

    lam = None if keys.smoothing is None else c(keys.smoothing.float().reshape(-1, D))
    index = as_type(key_index if key_index.stride(-1) == 1 else key_index.contiguous(), torch.int32)
    # the extension builds no autograd graph: its output never requires grad
    out = ext.quant_decode(
        c(as_type(q.reshape(B, H, D), torch.float32)), index, c(as_type(query_pos, torch.int64)),
        rows(sink_k), rows(sink_v),
        packed(keys.codes), *pair(keys.scale, keys.offset), lam, keys.bits, keys.group, keys.channel,
        packed(values.codes), *pair(values.scale, values.offset), values.bits, values.group,
        values.channel,
        rows(res_k), rows(res_v), float(scaling), int(sliding_window or 0),
        _split(B, key_index.shape[1], key_index.shape[2]))
    return as_type(out.reshape(B, H, 1, D), q.dtype)


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_index: torch.Tensor,
                 query_pos: torch.Tensor, slots: torch.Tensor, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query head over its own slots only (read in place, fp32 math).

    q: [B, H, 1, D]; k, v: [B, H_kv, T, D] float32; key_index: [B, H_kv, T] int32; query_pos: [B];
    slots: [B, H, S] slot ids (-1: none), or [B, H_kv, S]: one list shared by the query heads of each KV
    head, whose K/V rows are then read once for all of them. Returns ``(out [B, H, 1, D] in q.dtype,
    lse [B, H, 1] fp32)``; a head with no visible key gets 0 and -inf, as
    :func:`longlab.decode.quest.attend_slots`."""
    ext = build.load(KERNEL)
    if ext is None:
        raise RuntimeError(f"paged_decode: {unavailable_reason()}")
    B, H, _, D = q.shape
    kk = k if k.stride(-1) == 1 else k.contiguous()
    vv = v if v.stride(-1) == 1 else v.contiguous()
    with torch.no_grad():
        out, lse = ext.paged_decode(q.reshape(B, H, D).float().contiguous(), kk, vv,
                                    key_index.to(torch.int32), query_pos.to(torch.int64).contiguous(),
                                    slots.to(torch.int64).contiguous(), float(scaling))
    return out.reshape(B, H, 1, D).to(q.dtype), lse.reshape(B, H, 1)


def page_select(q: torch.Tensor, center: torch.Tensor, radius: torch.Tensor, ok: torch.Tensor, k: int,
                page_size: int, T: int, group: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's top ``k`` pages and the slots to read (:meth:`longlab.decode.quest.Quest.select`).

    q: [B, H, D]; center, radius: [B, H_kv, n, D] (the page summaries); ok: [B, H_kv, n] bool; ``0 < k <= n``,
    ``n <= (T - 1) // page_size`` (complete pages before the last one). Scores
    ``U_p = q.center_p + |q|.radius_p`` (fp32; -inf where not ``ok``), per query head or, ``group=True``, the
    largest over each KV head's query heads; keeps the top ``k`` (ties: the lower page), ascending. Returns
    ``(slots [B, R, k * page_size + tail] int64, pages [B, R, k] int64)``, ``R = H_kv`` if ``group`` else
    ``H``; the slots are the pages' slots then the last page's ``last * page_size .. T - 1``, as
    :func:`longlab.decode.quest.page_slots`."""
    ext = build.load(KERNEL)
    if ext is None:
        raise RuntimeError(f"page_select: {unavailable_reason()}")

    f32 = torch.float32
    with torch.no_grad():
        slots, pages = ext.page_select(_dense(q, f32), _dense(center, f32), _dense(radius, f32),
                                       _dense(ok, torch.bool), int(k), int(page_size), int(T), bool(group))
    return slots, pages


def page_marks_match(index: torch.Tensor, marks: torch.Tensor, page_size: int) -> bool:
    """Whether each summarised page still starts and ends at the slots' positions it was summarised with:
    ``marks[..., p, :] == (index[..., p * P], index[..., p * P + P - 1])`` for every page ``p``.
    index: [B, H_kv, T] int32; marks: [B, H_kv, n, 2] int32, ``n * page_size <= T``."""
    ext = build.load(KERNEL)
    if ext is None:
        raise RuntimeError(f"page_marks_match: {unavailable_reason()}")
    index = index if index.dtype == torch.int32 else index.to(torch.int32)  # any strides
    return bool(ext.page_marks_match(index, _dense(marks, torch.int32), int(page_size)))


def quantize_tokens_packed(x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Per-token quantization in groups of ``group`` channels, codes packed: bit-identical to
    ``pack(quantize_tokens(x, bits, group, scale_dtype)[0], bits)`` and its scale and offset.

    x: [B, H, t, D] (CPU) -> ``(codes uint8 [B, H, t, D * bits / 8], scale, offset [B, H, t, D / group]
    in scale_dtype, finite)``; ``finite`` is False when a scale or offset overflowed (or ``x`` held NaN):
    the caller refuses those as :func:`~longlab.quant.quantizer.qparams` does. bits: 1, 2, 4 or 8."""
    ext = build.load(KERNEL)
    if ext is None:
        raise RuntimeError(f"quantize_tokens_packed: {unavailable_reason()}")
    return ext.quantize_tokens_packed(x.detach(), int(bits), int(group), _SCALE_KINDS[scale_dtype])
