"""Which pages the decode-time sparse readers read, against brute-force attention written here (issue 28:
inverting a selection rule must fail a test).

Pinned elsewhere: Quest's top pages by its bound (``test_kv_seeds.py::test_quest_small_budget_reads_top_
pages_plus_the_last``), LoSA's active queries (``test_spec_losa.py::test_reuse_is_exact_when_the_input_is_
unchanged``). Here: RetroAttention's newly loaded pages and LoSA's per-query pages."""

from __future__ import annotations

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabLayer
from longlab.decode.losa import LoSA
from longlab.decode.quest import page_slots
from longlab.decode.retro import RetroAttention, _Window

D, P = 8, 8
SCALE = D**-0.5
pytestmark = pytest.mark.usefixtures("one_thread")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[int]) -> tuple[torch.Tensor, float]:
    """Exact attention of q [D] over the listed key positions of k, v [T, D]: (out [D], lse), float64."""
    if not keys:
        return torch.zeros(D, dtype=torch.float64), float("-inf")
    logits = q.double() @ k[keys].double().T * SCALE
    return torch.softmax(logits, -1) @ v[keys].double(), float(torch.logsumexp(logits, -1))


def test_retro_merges_exactly_the_pages_each_window_query_has_not_seen():
    """Window tokens at positions 37 and 38; ``Last[h, p]`` says when page p was last read, so token tau has
    seen the pages with ``Last >= tau``. This step reads head 0's pages {0, 3} (+ the last page 4) and head
    1's {1, 2} (+ 4). After the merge each window output must be exact attention over (pages seen) + (pages
    read now), keys at positions <= tau: the pages already seen are not counted twice."""
    T, pos = 40, [37, 38]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    layer = LonglabLayer()
    layer.update(k, v)
    last = torch.tensor([[[37, 30, 38, -1, 36], [38, 38, 20, 37, 36]]])  # [B, H, n_pages]
    pages = torch.tensor([[[0, 3], [1, 2]]])  # this step's Quest pages per head
    loaded = torch.zeros(1, 2, 5, dtype=torch.bool)
    loaded.scatter_(-1, pages, True)
    loaded[..., -1] = True
    wq = torch.randn(1, 2, 2, D, generator=g)  # the window tokens' queries [B, H, m, D]
    o = torch.zeros(1, 2, 2, D)
    lse = torch.zeros(1, 2, 2)

    def keys_of(page_set: set[int], tau: int) -> list[int]:
        return [j for j in range(T) if j // P in page_set and j <= tau]

    want = torch.zeros(1, 2, 2, D, dtype=torch.float64)
    for h in range(2):
        for i, tau in enumerate(pos):
            seen = {p for p in range(5) if int(last[0, h, p]) >= tau}
            out, s = _attend(wq[0, h, i], k[0, 0], v[0, 0], keys_of(seen, tau))
            o[0, h, i], lse[0, h, i] = out.float(), s
            now = seen | {p for p in range(5) if bool(loaded[0, h, p])}
            want[0, h, i] = _attend(wq[0, h, i], k[0, 0], v[0, 0], keys_of(now, tau))[0]
    st = _Window(layer)
    st.q, st.o, st.lse, st.pos, st.last = wq, o, lse, torch.tensor([pos]), last
    q_now = torch.randn(1, 2, 1, D, generator=g)
    ctx = LayerContext(2, 4, None, "decode", q_now, SCALE, torch.tensor([[T - 1]]), None, layer)
    RetroAttention(budget=3 * P, page_size=P)._supplement(ctx, st, page_slots(pages, P, T), loaded)
    torch.testing.assert_close(st.o.double(), want, atol=1e-5, rtol=1e-5)


def test_losa_each_query_reads_its_top_quest_pages():
    """LoSA's first step (every query active): query i of head h reads the prefix pages with the k highest
    Quest bounds ``U_p = sum_d max(q_d M_pd, q_d m_pd)`` (k = budget / P = 2 of 8 full pages), the prefix's
    partial last page and the block causally. Reference: exact attention over exactly those keys."""
    g = torch.Generator().manual_seed(1)
    H, H_kv, Tp, n = 2, 1, 8 * P + 5, 4
    T = Tp + n
    q = torch.randn(1, H, n, D, generator=g)
    k, v = torch.randn(1, H_kv, T, D, generator=g), torch.randn(1, H_kv, T, D, generator=g)
    kidx = torch.arange(T, dtype=torch.int32).expand(1, H_kv, T).clone()
    qidx = kidx[:, 0, Tp:].clone()
    out = LoSA(budget=2 * P, page_size=P, rho=1.0).block_attention(0, q, k, v, kidx, qidx, SCALE, Tp)
    kp = k[0, 0, : 8 * P].reshape(8, P, D)
    hi, lo = kp.amax(1), kp.amin(1)
    for h in range(H):
        for i in range(n):
            qi = q[0, h, i]
            u = torch.stack([torch.maximum(qi * hi[p], qi * lo[p]).sum() for p in range(8)])
            order = u.argsort(descending=True).tolist()
            assert float(u[order[1]] - u[order[2]]) > 1e-5  # no near tie at the cut
            keys = [j for p in order[:2] for j in range(p * P, (p + 1) * P)]
            keys += list(range(8 * P, Tp)) + list(range(Tp, Tp + i + 1))  # partial page + causal block
            want, _ = _attend(qi, k[0, 0], v[0, 0], sorted(keys))
            torch.testing.assert_close(out[0, h, i].double(), want, atol=1e-5, rtol=1e-5)
