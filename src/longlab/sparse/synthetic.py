"""Rotate-half RoPE and synthetic post-RoPE q/k/v with planted attention structure (tests, benchmarks)."""

from __future__ import annotations

import math

import torch

__all__ = ["rope_angles", "apply_rope", "synthetic_qkv"]


def rope_angles(positions: torch.Tensor, D: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles ``pos · base^(-2i/D)`` in the rotate-half layout. -> ([T, D], [T, D])"""
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64, device=positions.device) / D)  # [D/2]
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)  # [T, D]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama layout: pair (i, i + D/2)). x: [B, H, T, D] -> [B, H, T, D]"""
    T, D = x.shape[2], x.shape[3]
    if positions is None:
        positions = torch.arange(T, device=x.device)
    cos, sin = rope_angles(positions, D, base)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def synthetic_qkv(
    B: int = 1,
    H: int = 9,
    H_kv: int = 3,
    T: int = 4096,
    D: int = 64,
    seed: int = 0,
    n_verticals: int = 8,
    base: float = 10000.0,
    noise: float = 0.4,
    sink_logit: float = 10.0,
    vertical_logit: float = 8.0,
    local_logit: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random RoPE'd inputs with an attention sink, a local (slash) band and a few vertical lines.

    Pre-RoPE q and k share a per-kv-head vector ``c`` (so ``q_p · k_j`` after RoPE is a sum of cosines in
    ``p - j``, peaked on the diagonal: a local band); post-RoPE, a shared direction ``w`` is added to every
    query and, with larger weight, to key 0 (sink) and ``n_verticals`` random keys (vertical lines).
    Logit magnitudes (after the ``1/sqrt(D)`` scaling) are set by the ``*_logit`` arguments, scaled per head
    by a random factor in [0.5, 1.5]; ``noise`` is the logit standard deviation of the random part.
    -> q [B, H, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D] (float32)
    """
    g = torch.Generator().manual_seed(seed)
    s = 1.0 / math.sqrt(D)
    sigma = math.sqrt(noise / (s * math.sqrt(D)))  # per-channel std giving logit std ≈ noise
    head_scale = 0.5 + torch.rand(H, generator=g)  # [H]
    # local band: c concentrated on the mid/high-frequency pairs, shared by q and k of a kv group
    c = torch.randn(H_kv, D, generator=g)
    c[:, D // 4 : D // 2] = 0
    c[:, 3 * D // 4 :] = 0  # keep pairs [0, D/4): faster rotation, sharper locality
    c = c / c.norm(dim=-1, keepdim=True) * math.sqrt(local_logit / s)
    grp = torch.arange(H) // (H // H_kv)
    q_pre = sigma * torch.randn(B, H, T, D, generator=g) + (head_scale[:, None] * c[grp])[None, :, None, :]
    k_pre = sigma * torch.randn(B, H_kv, T, D, generator=g) + c[None, :, None, :]
    q, k = apply_rope(q_pre, base=base), apply_rope(k_pre, base=base)
    w = torch.randn(H_kv, D, generator=g)
    w = w / w.norm(dim=-1, keepdim=True)  # [H_kv, D]
    gamma = math.sqrt(1.0 / s)
    q = q + (gamma * head_scale[:, None] * w[grp])[None, :, None, :]
    k[:, :, 0] += (sink_logit / (s * gamma)) * w
    if n_verticals:
        cols = torch.randint(1, T, (n_verticals,), generator=g)
        k[:, :, cols] += (vertical_logit / (s * gamma)) * w[None, :, None, :].squeeze(0)
    v = torch.randn(B, H_kv, T, D, generator=g)
    return q.contiguous(), k.contiguous(), v
