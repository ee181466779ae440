"""SALE: low-bit logit estimates judged against exact sink + local statistics.

Ji et al., "SALE: Low-bit Estimation for Efficient Sparse Attention in Long-context LLM Prefilling",
arXiv 2505.24179 (code BirdChristopher/SALE). The INT4 kernel is emulated in PyTorch: quantized values
are small integers held in fp32, so the matmul is exact; the selection costs a full ``Q K^T`` pass here,
which real INT4 tensor cores make cheap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longlab.recipe import LonglabError, check_range, register
from longlab.registry import MAX_BLOCK, MAX_TOKENS, param
from longlab.sparse.base import BlockSelector, repeat_kv
from longlab.sparse.blockmask import block_geometry, causal_allowed
from longlab.sparse.executor import Backend, block_sparse_attention, dense_causal_attention
from longlab.sparse.prefill import BACKENDS

__all__ = ["SALE", "quantize_symmetric"]


def quantize_symmetric(x: torch.Tensor, group: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integer quantization with one scale per ``group`` consecutive tokens.

    ``scale = max|x| / (2^(bits-1) - 1)`` over the group (all channels); ``x_q = round(x / scale)``.
    x: [B, H, T, D] -> (x_q [B, H, T, D] integer-valued float32, scale [B, H, T])
    """
    B, H, T, D = x.shape
    qmax = 2 ** (bits - 1) - 1
    n = -(-T // group)
    xg = F.pad(x.float(), (0, 0, 0, n * group - T)).view(B, H, n, group, D)
    scale = (xg.abs().amax(dim=(-1, -2), keepdim=True) / qmax).clamp_min(1e-12)  # [B, H, n, 1, 1]
    xq = (xg / scale).round().clamp(-qmax, qmax).view(B, H, n * group, D)[:, :, :T]
    return xq, scale.view(B, H, n, 1).expand(B, H, n, group).reshape(B, H, n * group)[:, :, :T]


@register("sale")
@dataclass
class SALE(BlockSelector):
    """SALE (Ji et al., arXiv 2505.24179): low-bit estimated logits vs exact sink + local statistics.

    1. Smoothing: ``K' = K - mean_t K``, ``Q' = Q - mean_t Q`` (per head); symmetric ``bits``-bit quantization
       (scales per ``q_group`` query rows and per ``k_group`` keys); estimated logit
       ``s̃_ij = σQ_i σK_j <Q'_q,i, K'_q,j> + q̄·K'_j``.
    2. Exact band: per q-block, exact ``x_ij = q_i·K'_j`` over the sink block and the k-blocks within
       ``local_window`` tokens before the block (causal); row max ``m_i`` and ``l_i = Σ exp(s (x_ij - m_i))``.
    3. Relative attention score ``RAS_ij = exp(s (s̃_ij - m_i)) / l_i``; block (i, j) is selected iff some
       element has ``RAS > τ_h``, i.e. ``s̃_ij > m_i + ln(l_i τ_h) / s``. ``τ_h = 0`` makes head h dense.
    ``tau`` is one float or one per query head (see :meth:`calibrate`). Inputs with ``T_q <= min_q_len``
    get a dense mask (repo behaviour).
    """

    paper = "arXiv:2505.24179"
    bq: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(32, low=1, high=MAX_BLOCK, integer=True)
    local_window: int = param(128, low=0, high=MAX_TOKENS, integer=True)
    # threshold on the relative attention score, in [0, 1] (0: a dense head; the paper's are ~1e-3; above 1 a
    # block would have to outweigh the whole exact band): one, or one per query head, so checked in validate
    tau: float | tuple[float, ...] = 0.004
    bits: int = param(4, low=2, high=8, integer=True)
    # query rows / keys per quantization scale: padded to whole groups, so a group is memory like a block
    q_group: int = param(2, low=1, high=MAX_BLOCK, integer=True)
    k_group: int = param(8, low=1, high=MAX_BLOCK, integer=True)
    min_q_len: int = param(1024, low=0, high=MAX_TOKENS, integer=True)
    chunk_q: int = param(128, low=1, high=MAX_TOKENS, integer=True)
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def validate(self) -> None:
        super().validate()
        if isinstance(self.tau, (list, tuple)):
            if not self.tau:
                raise LonglabError(f"{self.field_label('tau')} must be a number in [0, 1] or a non-empty "
                                   "list of them (one per query head), got []")
            for t in self.tau:
                check_range(f"{self.field_label('tau')} (per head)", t, 0.0, 1.0)
            self.tau = tuple(float(t) for t in self.tau)
        else:
            self.check("tau", 0.0, 1.0)

    def _tau_tensor(self, H: int, device: torch.device) -> torch.Tensor:
        if isinstance(self.tau, tuple):
            if len(self.tau) != H:
                raise ValueError(f"SALE.tau has {len(self.tau)} per-head values but the input has H={H}")
            return torch.tensor(self.tau, dtype=torch.float32, device=device)
        return torch.full((H,), float(self.tau), dtype=torch.float32, device=device)

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, T_q, D = q.shape
        T_k = k.shape[2]
        bq, bk = self.bq, self.bk
        allowed = causal_allowed(T_q, T_k, bq, bk, q.device)
        n_qb, n_kb = allowed.shape
        if T_q <= self.min_q_len:
            return allowed.expand(B, H, -1, -1).clone()
        tau = self._tau_tensor(H, q.device)
        log_tau = torch.log(tau)[None, :, None]  # [1, H, 1]; -inf for dense heads
        q = q.float()
        k_s = k.float() - k.float().mean(2, keepdim=True)  # K' [B, H_kv, T_k, D]
        q_mean = q.mean(2, keepdim=True)  # [B, H, 1, D]
        q_int, q_scale = quantize_symmetric(q - q_mean, self.q_group, self.bits)  # [B,H,T_q,D], [B,H,T_q]
        k_int, k_scale = quantize_symmetric(k_s, self.k_group, self.bits)  # [B,H_kv,T_k,D], [B,H_kv,T_k]
        k_s = repeat_kv(k_s, H)  # [B, H, T_k, D]
        qmk = (q_mean @ k_s.transpose(-1, -2)).transpose(-1, -2)  # [B, H, T_k, 1] correction q̄·K'_j
        # One matmul gives s·s̃_ij - thr_i: rows [s·σQ_i·Q'_q,i, s, -thr_i], columns [σK_j·K'_q,j, q̄·K'_j, 1].
        # (σQ σK <Q'_q, K'_q> equals the INT4 product up to fp32 rounding: the operands are small integers.)
        k_aug = torch.cat([repeat_kv(k_int * k_scale[..., None], H), qmk, torch.ones_like(qmk)], dim=-1)
        q_deq = q_int * q_scale[..., None] * scaling  # [B, H, T_q, D]
        g = block_geometry(T_q, T_k, bq, bk, q.device)
        band_lo = torch.clamp(g.q_first - self.local_window, min=0) // bk  # [n_qb] first local k-block
        band_hi = g.q_last // bk  # [n_qb] last (diagonal) k-block
        kb_ids = torch.arange(n_kb, device=q.device)
        band = (kb_ids[None, :] >= band_lo[:, None]) & (kb_ids[None, :] <= band_hi[:, None])  # [n_qb, n_kb]
        out = band.expand(B, H, -1, -1).clone()
        step = max(1, self.chunk_q // bq)
        for i0 in range(0, n_qb, step):
            i1 = min(i0 + step, n_qb)
            r0, r1 = i0 * bq, min(i1 * bq, T_q)
            pos = torch.arange(r0, r1, device=q.device) + (T_k - T_q)  # [c] key position of each row
            row_lo = band_lo[torch.arange(r0, r1, device=q.device) // bq]  # [c]
            hi = int(pos[-1]) + 1  # keys [0, hi) are causally reachable from this chunk
            n_kb_hi = -(-hi // bk)
            # exact sink + local band statistics (in the scaled logit domain)
            lo_key = max(int(band_lo[i0]) * bk, bk)
            dev = q.device
            idx = torch.cat([torch.arange(min(bk, hi), device=dev), torch.arange(lo_key, hi, device=dev)])
            in_band = (idx[None, :] < bk) | (idx[None, :] // bk >= row_lo[:, None])  # [c, n_band]
            in_band &= idx[None, :] <= pos[:, None]
            x = (q[:, :, r0:r1] @ k_s[:, :, idx].transpose(-1, -2)) * scaling  # [B, H, c, n_band]
            x = x.masked_fill(~in_band, float("-inf"))
            m = x.amax(-1)  # [B, H, c]
            thr = m + torch.log(torch.exp(x - m[..., None]).sum(-1)) + log_tau  # s·m + ln(l·τ): [B, H, c]
            s_col = torch.full_like(thr[..., None], scaling)
            q_aug = torch.cat([q_deq[:, :, r0:r1], s_col, -thr[..., None]], -1)  # [B, H, c, D + 2]
            k_end = min(n_kb_hi * bk, T_k)
            est = q_aug @ k_aug[:, :, :k_end].transpose(-1, -2)  # [B, H, c, k_end]: s·s̃ - thr > 0 <=> RAS > τ
            p0 = int(pos[0])  # columns before p0 are visible to every row of the chunk
            future = torch.arange(p0, k_end, device=q.device)[None, :] > pos[:, None]  # [c, k_end - p0]
            est[..., p0:].masked_fill_(future, float("-inf"))
            pad_k, pad_r = n_kb_hi * bk - k_end, (i1 - i0) * bq - (r1 - r0)
            if pad_k or pad_r:
                est = F.pad(est, (0, pad_k, 0, pad_r), value=float("-inf"))
            blocks = est.view(B, H, i1 - i0, bq, n_kb_hi, bk).amax(dim=(3, 5)) > 0  # [B, H, i1 - i0, n_kb_hi]
            out[:, :, i0:i1, :n_kb_hi] |= blocks
        return out & allowed

    def calibrate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        theta: float = 0.4,
        scaling: float | None = None,
        tau_init: float = 0.008,
        tau_min: float = 1e-4,
        max_iter: int = 32,
        backend: Backend = "gather",
    ) -> SALE:
        """Per-head threshold search (SALE's offline calibration on one sample).

        ``τ_h ← tau_init``; repeat: run SALE, and if ``Σ|O_sparse - O_full| < θ · T_q`` (per sample, summed
        over rows and channels of head h) head h is done; else ``τ_h ← τ_h / 2``, and ``τ_h ≤ tau_min`` sets
        ``τ_h = 0`` (dense head). q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D] -> a copy of this selector with
        per-head tau.
        """
        if not theta > 0:
            raise ValueError(f"theta must be in (0, inf), got {theta!r}")
        B, H, T_q, _ = q.shape
        scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
        with torch.no_grad():
            o_full = dense_causal_attention(q, k, v, scaling).float()
        taus = [float(tau_init)] * H
        done = [False] * H
        for _ in range(max_iter):
            sel = dataclasses.replace(self, tau=tuple(taus))
            with torch.no_grad():
                o = block_sparse_attention(q, k, v, sel.select(q, k, scaling), scaling, backend)
            err = (o.float() - o_full).abs().sum(dim=(0, 2, 3))  # [H]
            for h in range(H):
                if done[h]:
                    continue
                if float(err[h]) < theta * T_q * B:
                    done[h] = True
                    continue
                taus[h] /= 2
                if taus[h] <= tau_min:
                    taus[h], done[h] = 0.0, True
            if all(done):
                break
        return dataclasses.replace(self, tau=tuple(taus))
