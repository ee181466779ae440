"""Integer KV quantization primitives: asymmetric round-to-nearest, bit packing, equivalent right shift.

**Asymmetric quantizer** (KIVI, Liu et al. 2024, arXiv:2402.02750, eq. 1; PM-KVQ, ICLR 2026). For a
group of values ``x`` with ``lo = min x`` and ``hi = max x``::

    s = (hi - lo) / (2^b - 1),   q = clamp(round((x - lo) / s), 0, 2^b - 1),   x_hat = q * s + lo

so ``|x - x_hat| <= s / 2``. The offset ``lo`` is the zero point as a float (PM-KVQ writes it
``zero = -lo`` and ``x_hat = q * s - zero``; the two are the same). Scales and offsets are *stored*
in ``scale_dtype`` (float16 by default, as both papers do); they are rounded *before* the codes are
computed, with ``lo`` rounded down and ``s`` rounded up, so the stored grid still covers
``[lo, hi]`` and the bound ``|x - x_hat| <= s_stored / 2`` holds for the stored values.

**Groups.** :func:`quantize_tokens` groups ``group`` consecutive channels of one token (per-token
quantization: KIVI's values, PM-KVQ's keys and values); :func:`quantize_channels` groups ``group``
consecutive tokens of one channel (per-channel quantization: KIVI's keys, whose outlier channels
would otherwise stretch every token's range).

**Packing.** Codes of ``b`` bits are packed along the last axis into ``uint8``: ``8 / b`` codes per
byte for ``b`` in {1, 2, 4, 8} (planar: byte ``j`` holds codes ``j, j + P, ...``); two bytes per code
(a plane of low bytes, then a plane of high bytes) for ``b = 16``.

**Equivalent right shift** (PM-KVQ): halving the width ``b -> b' = b / 2`` of integer codes without
leaving integer arithmetic. Because ``2^b - 1 = (2^b' - 1)(2^b' + 1)``, the same range at ``b'`` bits
has scale ``s' = s * (2^b' + 1)`` (offset unchanged) and code ``round(q / (2^b' + 1))``, computed as::

    q' = ((q * (2^(2b') - 2^b' + 1) + 2^(3b'-1) - 2^(2b'-1) + 2^(b'-1)) >> 3b') & (2^b' - 1)

(``(2^(2b') - 2^b' + 1) / 2^(3b') ~ 1 / (2^b' + 1)``). ``2^b' + 1`` is odd, so ``q / (2^b' + 1)`` is
never a tie; the formula equals ``round(q / (2^b' + 1))`` for every representable ``q`` (checked
exhaustively in the tests). The shifted value is within ``s' / 2`` of the unshifted one.
"""

from __future__ import annotations

import torch

__all__ = [
    "SUPPORTED_BITS",
    "SCALE_DTYPES",
    "pack",
    "unpack",
    "quantize_tokens",
    "quantize_channels",
    "dequantize_tokens",
    "dequantize_channels",
    "equivalent_right_shift",
    "qparams",
]

SUPPORTED_BITS = (1, 2, 4, 8, 16)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes in ``[0, 2^bits)`` along the last axis: ``[..., N] -> uint8 [..., N * bits / 8]``.

    Planar layout (fast to unpack): with ``per = 8 / bits`` codes per byte and ``P = N / per`` bytes,
    byte ``j`` holds codes ``j, j + P, j + 2P, ...`` in its low-to-high bit fields."""
    _check_bits(bits)
    N = codes.shape[-1]
    if (N * bits) % 8:
        raise ValueError(f"cannot pack {N} codes of {bits} bits into whole bytes")
    if bits == 16:
        c = codes.to(torch.int32)
        return torch.cat([c & 0xFF, c >> 8], dim=-1).to(torch.uint8)
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], per, N // per)  # [..., per, P]
    out = c[..., 0, :].clone()
    for i in range(1, per):
        out |= c[..., i, :] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., P] -> [..., P * 8 / bits]`` (uint8 codes; int32 for 16 bits)."""
    _check_bits(bits)
    if bits == 16:
        half = packed.shape[-1] // 2
        return packed[..., :half].to(torch.int32) | (packed[..., half:].to(torch.int32) << 8)
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    return torch.cat([(packed >> s) & mask for s in range(0, 8, bits)], dim=-1)


def _directed(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` towards +inf (``up``) or -inf; returns a ``dtype`` tensor."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    yf = y.float()
    wrong = yf < x if up else yf > x
    toward = torch.full_like(y, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, toward), y)


def qparams(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(scale, offset)`` covering ``[lo, hi]`` at ``bits`` bits: offset rounded down, scale up."""
    offset = _directed(lo.float(), scale_dtype, up=False)
    scale = _directed((hi.float() - offset.float()).clamp_min(0) / (2**bits - 1), scale_dtype, up=True)
    if not (bool(torch.isfinite(offset).all()) and bool(torch.isfinite(scale).all())):
        raise scales_overflow(scale_dtype)
    return scale, offset


def scales_overflow(scale_dtype: torch.dtype) -> ValueError:
    """The error for KV values whose scale or offset is not finite in ``scale_dtype``."""
    return ValueError(f"KV values overflow the {scale_dtype} scales; use scale_dtype='float32' or 'bfloat16'")


def _codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale.float()
    q = torch.round((x.float() - offset.float()) / torch.where(s > 0, s, torch.ones_like(s)))
    return q.clamp_(0, 2**bits - 1).to(torch.int32)


def quantize_tokens(
    x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantization in groups of ``group`` channels.

    x: [B, H, T, D] -> codes int32 [B, H, T, D], scale and offset [B, H, T, D / group]."""
    _check_bits(bits)
    B, H, T, D = x.shape
    if D % group:
        raise ValueError(f"head_dim {D} is not a multiple of the group size {group}")
    xg = x.float().reshape(B, H, T, D // group, group)
    scale, offset = qparams(xg.amin(-1), xg.amax(-1), bits, scale_dtype)  # [B, H, T, D/group]
    codes = _codes(xg, scale[..., None], offset[..., None], bits).reshape(B, H, T, D)
    return codes, scale, offset


def dequantize_tokens(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """codes [B, H, T, D], scale/offset [B, H, T, D / group] -> fp32 [B, H, T, D]."""
    B, H, T, D = codes.shape
    n_groups = scale.shape[-1]
    cg = codes.float().reshape(B, H, T, n_groups, D // n_groups)
    return torch.addcmul(offset.float()[..., None], cg, scale.float()[..., None]).reshape(B, H, T, D)


def quantize_channels(
    x: torch.Tensor,
    bits: int,
    group: int,
    valid: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel quantization over groups of ``group`` consecutive tokens (the last group may be short).

    x: [B, H, T, D]; valid: [B, H, T] bool (empty slots are left out of every min/max) ->
    codes int32 [B, H, T, D], scale and offset [B, H, ceil(T / group), D]."""
    _check_bits(bits)
    B, H, T, D = x.shape
    n_groups = -(-T // group)
    pad = n_groups * group - T
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, pad))  # [B, H, n_groups * group, D]
    ok = torch.ones(B, H, T, dtype=torch.bool, device=x.device) if valid is None else valid.to(torch.bool)
    ok = torch.nn.functional.pad(ok, (0, pad), value=False)[..., None]  # [B, H, n_groups * group, 1]
    xg = xf.reshape(B, H, n_groups, group, D)
    okg = ok.reshape(B, H, n_groups, group, 1)
    lo = xg.masked_fill(~okg, float("inf")).amin(-2)  # [B, H, n_groups, D]
    hi = xg.masked_fill(~okg, float("-inf")).amax(-2)
    empty = ~okg.any(-2)  # groups with no valid token: any finite parameters will do
    lo = lo.masked_fill(empty, 0.0)
    hi = hi.masked_fill(empty, 0.0)
    scale, offset = qparams(lo, hi, bits, scale_dtype)
    codes = _codes(xg, scale[..., None, :], offset[..., None, :], bits).reshape(B, H, n_groups * group, D)
    return codes[:, :, :T], scale, offset


def dequantize_channels(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, start: int = 0
) -> torch.Tensor:
    """codes [B, H, t, D] of tokens ``start .. start + t``; scale/offset [B, H, n_groups, D] of the whole
    region -> fp32 [B, H, t, D]. Works on whole groups (broadcast, no gathered scales), then slices."""
    B, H, t, D = codes.shape
    g0, g1 = start // group, -(-(start + t) // group)
    lead = start - g0 * group
    c = torch.nn.functional.pad(codes.float(), (0, 0, lead, (g1 - g0) * group - lead - t))
    c = c.reshape(B, H, g1 - g0, group, D)
    x = torch.addcmul(offset[:, :, g0:g1, None].float(), c, scale[:, :, g0:g1, None].float())
    return x.reshape(B, H, (g1 - g0) * group, D)[:, :, lead : lead + t]


def equivalent_right_shift(q: torch.Tensor, bits: int) -> torch.Tensor:
    """PM-KVQ's integer-only ``b -> b / 2`` code shift (module docstring). q: int codes of ``bits``."""
    if bits not in (2, 4, 8, 16):
        raise ValueError(f"equivalent right shift halves 16, 8, 4 or 2 bits, got {bits!r}")
    h = bits // 2
    q64 = q.to(torch.int64)
    mult = (1 << (2 * h)) - (1 << h) + 1
    bias = (1 << (3 * h - 1)) - (1 << (2 * h - 1)) + (1 << (h - 1))
    return ((q64 * mult + bias) >> (3 * h)) & ((1 << h) - 1)
