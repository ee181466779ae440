"""Which blocks each sparse prefill selector keeps, against brute-force references written here with loops
(issue 28: inverting a selection rule must fail a test).

Pinned elsewhere (``test_sparse_selectors.py``): SALE's mask against a brute-force relative attention score,
vertical-slash's planted column and diagonal, XAttention's antidiagonal scores, Prism's planted high-band
block; A-shape's static pattern by the dense-equality and density tests. Here: BlockTopK, FlexPrefill (both
patterns), XAttention's cumulative threshold, Prism's two top-p bands."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.sparse import make_selector
from longlab.sparse.blockmask import causal_allowed, required_blocks
from longlab.sparse.prism import band_dims
from longlab.sparse.synthetic import synthetic_qkv
from longlab.sparse.xattention import antidiagonal_block_scores

T, B_SZ, D = 128, 16, 16
N_B = T // B_SZ
SCALE = 1 / math.sqrt(D)
ALLOWED = causal_allowed(T, T, B_SZ, B_SZ)
REQUIRED = required_blocks(T, T, B_SZ, B_SZ)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qk():
    q, k, _ = synthetic_qkv(B=1, H=2, H_kv=1, T=T, D=D, seed=5)
    return q, k


def _finish(mask: torch.Tensor) -> torch.Tensor:
    """What every selector returns: its blocks plus the sink column and the diagonal, causal."""
    return (mask | REQUIRED) & ALLOWED


def _keep_mass(values: list[float], target: float, start: float = 0.0) -> list[int]:
    """Indices kept by the top-p rule: in descending order, keep while start + mass before < target."""
    order = sorted(range(len(values)), key=lambda j: -values[j])
    kept, before = [], start
    for j in order:
        if before < target:
            kept.append(j)
        before += values[j]
    return kept


def _pool(x: torch.Tensor, b: int) -> torch.Tensor:
    """[T, ...] -> [T/b, ...] block means (T is a multiple of b here)."""
    return x.double().reshape(-1, b, *x.shape[1:]).mean(1)


def _top_n(values: torch.Tensor, n: int) -> set[int]:
    order = values.argsort(descending=True).tolist()
    assert n >= len(order) or float(values[order[n - 1]] - values[order[n]]) > 1e-9, "near tie at the cut"
    return set(order[:n])


# ------------------------------------------------------------------------------------------------ BlockTopK
def test_blocktopk_keeps_the_highest_pooled_scores_per_query_block(qk):
    q, k = qk
    mask = make_selector("blocktopk", bq=B_SZ, bk=B_SZ, top_k=2).select(q, k, SCALE).mask[0]
    kp = _pool(k[0, 0], B_SZ)
    for h in range(2):
        qp = _pool(q[0, h], B_SZ)
        want = torch.zeros(N_B, N_B, dtype=torch.bool)
        for i in range(N_B):
            s = (qp[i] @ kp.T) * SCALE
            for j in _top_n(s[: i + 1], min(2, i + 1)):
                want[i, j] = True
        assert torch.equal(mask[h], _finish(want)), h


# ------------------------------------------------------------------------------------------------ FlexPrefill
def _last_block_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The last bq queries' causal attention over every key, float64: [bq, T]."""
    L = B_SZ
    a = torch.zeros(L, T, dtype=torch.float64)
    for i in range(L):
        p = T - L + i
        a[i, : p + 1] = torch.softmax(q[T - L + i].double() @ k[: p + 1].double().T * SCALE, -1)
    return a


def _vertical_slash(q_h: torch.Tensor, k: torch.Tensor, gamma: float, n_fixed: int | None) -> torch.Tensor:
    a = _last_block_attention(q_h, k)
    L = a.shape[0]
    a_v = a.mean(0)  # [T]
    a_s = torch.zeros(T, dtype=torch.float64)  # by offset o = pos_i - j
    for i in range(L):
        p = T - L + i
        for j in range(p + 1):
            a_s[p - j] += a[i, j] / L

    def n_blocks(x: torch.Tensor) -> int:
        if n_fixed is not None:
            return n_fixed
        cover = len(_keep_mass(x.tolist(), gamma * float(x.sum())))
        return min(max(cover // B_SZ + 1, 1), N_B)

    v_sel = _top_n(a_v.reshape(N_B, B_SZ).sum(-1), n_blocks(a_v)) | {0}
    s_sel = _top_n(a_s.reshape(N_B, B_SZ).sum(-1), n_blocks(a_s)) | {0}
    want = torch.zeros(N_B, N_B, dtype=torch.bool)
    for i in range(N_B):
        last = ((i + 1) * B_SZ - 1) // B_SZ
        for j in range(N_B):
            want[i, j] = j in v_sel or (last - j >= 0 and last - j in s_sel)
    return want


def test_flexprefill_vertical_slash_heads_keep_the_top_columns_and_diagonals(qk):
    """tau = 0: every head is vertical-slash. Budgets from the gamma-cover of the last block's mean
    attention (columns) and diagonal sums (offsets), then the top-n_v column blocks and top-n_s diagonal
    blocks of the sum-pooled scores."""
    q, k = qk
    sel = make_selector("flexprefill", bq=B_SZ, bk=B_SZ, gamma=0.6, tau=0.0, min_budget=0)
    mask = sel.select(q, k, SCALE).mask[0]
    for h in range(2):
        want = _finish(_vertical_slash(q[0, h], k[0, 0], 0.6, None))
        assert torch.equal(mask[h], want), h
        assert not bool(mask[h][ALLOWED].all())  # really sparse


def test_flexprefill_query_aware_heads_add_the_top_mass_blocks(qk):
    """tau = 1 (above any JS distance): every head is query-aware: the minimum vertical-slash (one block
    each) plus the blocks of the pooled block attention, in descending order, until gamma * n_qb mass."""
    q, k = qk
    gamma = 0.5
    sel = make_selector("flexprefill", bq=B_SZ, bk=B_SZ, gamma=gamma, tau=1.0, min_budget=0)
    mask = sel.select(q, k, SCALE).mask[0]
    kp = _pool(k[0, 0], B_SZ)
    for h in range(2):
        qp = _pool(q[0, h], B_SZ)
        flat = []
        for i in range(N_B):
            logits = (qp[i] @ kp.T) * SCALE
            logits[i + 1 :] = float("-inf")
            flat += torch.softmax(logits, -1).tolist()
        qa = torch.zeros(N_B * N_B, dtype=torch.bool)
        qa[_keep_mass(flat, gamma * N_B)] = True
        want = _finish(_vertical_slash(q[0, h], k[0, 0], gamma, 1) | qa.reshape(N_B, N_B))
        assert torch.equal(mask[h], want), h
        assert not bool(mask[h][ALLOWED].all())


# ------------------------------------------------------------------------------------------------ XAttention
def test_xattention_keeps_blocks_by_descending_score_until_tau_of_the_row(qk):
    """Per q-block row: the sink column and the diagonal are forced; the other causal blocks are taken in
    descending antidiagonal score while forced mass + mass before < tau * row total."""
    q, k = qk
    tau, stride = 0.8, 4
    mask = make_selector("xattention", bq=B_SZ, bk=B_SZ, stride=stride, tau=tau).select(q, k, SCALE).mask[0]
    scores = antidiagonal_block_scores(q, k, SCALE, stride, B_SZ, B_SZ)[0].double()  # [H, n_qb, n_kb]
    for h in range(2):
        want = REQUIRED.clone()
        for i in range(N_B):
            row = [float(scores[h, i, j]) if bool(ALLOWED[i, j]) else 0.0 for j in range(N_B)]
            forced = [j for j in range(N_B) if bool(REQUIRED[i, j] & ALLOWED[i, j])]
            rest = [0.0 if j in forced else row[j] for j in range(N_B)]
            for j in _keep_mass(rest, tau * sum(row), start=sum(row[j] for j in forced)):
                want[i, j] = True
        want &= ALLOWED
        assert torch.equal(mask[h], want), h
        assert not bool(mask[h][ALLOWED].all())


# ------------------------------------------------------------------------------------------------ Prism
def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean().sqrt()


def test_prism_keeps_the_top_p_blocks_of_each_frequency_band(qk):
    """Each band (rotary pairs of high / low frequency): pooled blocks, logits ``Q_x K_x^T / (sqrt(d_x) t_x)``
    with the energy temperature ``t_x = sqrt(d_x/D) rms(Q_x)/rms(Q) rms(K_x)/rms(K)``, causal row softmax,
    top-p (thr) per row; the mask is the union of the two bands."""
    q, k = qk
    thr = 0.7
    mask = make_selector("prism", bq=B_SZ, bk=B_SZ, thr_high=thr, thr_low=thr).select(q, k).mask[0]
    kp = _pool(k[0, 0], B_SZ)
    for h in range(2):
        qp = _pool(q[0, h], B_SZ)
        want = torch.zeros(N_B, N_B, dtype=torch.bool)
        for dims in band_dims(D):
            qb, kb = qp[:, dims], kp[:, dims]
            t = math.sqrt(len(dims) / D) * float(_rms(qb) / _rms(qp) * _rms(kb) / _rms(kp))
            for i in range(N_B):
                logits = (qb[i] @ kb.T) / (math.sqrt(len(dims)) * t)
                logits[i + 1 :] = float("-inf")
                for j in _keep_mass(torch.softmax(logits, -1).tolist(), thr):
                    want[i, j] = True
        assert torch.equal(mask[h], _finish(want)), h
        assert not bool(mask[h][ALLOWED].all())
