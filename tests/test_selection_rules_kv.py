"""Which entries each KV eviction policy keeps, pinned on small hand-built cases against brute-force
references written here (loops over queries and keys), so that inverting or randomising a policy's rule
fails a test (issue 28; the mutation check in ``tests/mutation.py`` applies such inversions).

Policies pinned elsewhere (not repeated here): ``knorm`` and ``snapkv`` (``test_kept_indices.py``,
``test_kv_baselines.py``), ``streaming``, ``tova``, ``h2o`` (``test_kv_baselines.py``), ``indexmem``
(``test_indexmem.py::test_keeps_sinks_window_and_top_by_importance``)."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabLayer
from longlab.kv import kept_indices
from longlab.recipe import parse_method

D = 8
pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(B=1, H=4, H_kv=2, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, T, D, generator=g, dtype=torch.float64)
    return q.float(), k.float(), v.float()


def _probs(q_row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax of one query [D] over keys [n, D], in float64."""
    return torch.softmax(q_row.double() @ keys.double().T * D**-0.5, -1)


def _assert_top(kept: list[int], scores: dict[int, float], n: int, margin: float | None = 1e-5) -> None:
    """``kept`` (among the keys of ``scores``) are ``n`` entries with the highest scores, and the case is
    not a near-tie (the last kept beats the first dropped by ``margin``), so an inverted rule fails;
    ``margin=None``: ties allowed, every kept score >= every dropped one."""
    chosen = set(kept) & set(scores)
    assert len(chosen) == n, (sorted(chosen), n)
    ranked = sorted(scores, key=lambda j: -scores[j])
    if margin is None:  # ties allowed (max pooling copies a peak to its neighbours): a valid top-n
        low = min(scores[j] for j in chosen)
        high = max(scores[j] for j in scores if j not in chosen)
        assert low >= high - 1e-9 and scores[ranked[0]] > high, (low, high)
        return
    assert scores[ranked[n - 1]] - scores[ranked[n]] > margin, "hand-built case has a near tie"
    assert chosen == set(ranked[:n]), (sorted(chosen), sorted(ranked[:n]))


def _window_scores(q, k, b, h, W, groups, reduce="sum"):
    """Per query head of KV head ``h``: sum (or mean) over the last W queries of their attention over the
    keys they see; -> list of [T] float64 tensors."""
    T = k.shape[2]
    out = []
    for qh in range(h * groups, (h + 1) * groups):
        s = torch.zeros(T, dtype=torch.float64)
        for t in range(T - W, T):
            s[: t + 1] += _probs(q[b, qh, t], k[b, h, : t + 1])
        out.append(s / W if reduce == "mean" else s)
    return out


def _pool(s: torch.Tensor, region: int, kernel: int, mode: str) -> torch.Tensor:
    """Pool ``s`` over slots ``[0, region)`` only, ``kernel`` wide, centred (zero padding counted for avg)."""
    r = kernel // 2
    out = torch.zeros(region, dtype=torch.float64)
    for j in range(region):
        vals = [s[i] for i in range(j - r, j + r + 1) if 0 <= i < region]
        out[j] = max(vals) if mode == "max" else sum(vals) / kernel
    return out


# ------------------------------------------------------------------------------------------------ random
def test_random_is_seeded_uniform_and_not_a_fixed_rule():
    """``random`` keeps a seeded uniform draw: the same seed gives the same set, other seeds other sets, each
    position is kept about budget/T of the time, and the set is neither the oldest nor the newest tokens."""
    T, budget = 40, 8
    q, k, v = _qkv(H=2, H_kv=1, T=T)
    first = kept_indices(f"random:budget={budget},seed=0", q, k, v)[0][0].tolist()
    assert first == kept_indices(f"random:budget={budget},seed=0", q, k, v)[0][0].tolist()
    assert first not in (list(range(budget)), list(range(T - budget, T)))
    counts = torch.zeros(T)
    sets = set()
    n = 300
    for seed in range(n):
        kept = kept_indices(f"random:budget={budget},seed={seed}", q, k, v)[0][0]
        counts[kept] += 1
        sets.add(tuple(kept.tolist()))
    assert len(sets) > n * 0.95  # C(40, 8) sets: repeats are rare
    p = budget / T
    # every position's frequency within 5 standard deviations of p (a fixed rule gives 0 or 1)
    assert float((counts / n - p).abs().max()) < 5 * math.sqrt(p * (1 - p) / n)


# ------------------------------------------------------------------------------------------------ pyramidkv
def test_pyramidkv_keeps_the_top_max_pooled_window_attention_per_kv_head():
    """PyramidKV = SnapKV scores with max pooling (kernel 7) over the non-window slots, group mean, with a
    per-layer budget; layer 0 of 2 keeps the window (8) + the best ``len - 8`` others (brute force)."""
    T, W, K = 48, 8, 7
    q, k, v = _qkv(T=T, seed=1)
    kept = kept_indices("pyramidkv:budget=16", q, k, v, layer_idx=0, num_layers=2)
    for h in range(2):
        heads = _window_scores(q, k, 0, h, W, 2)
        score = sum(_pool(s, T - W, K, "max") for s in heads) / 2
        got = kept[0][h].tolist()
        assert set(range(T - W, T)) <= set(got)
        n_rest = len(got) - W
        assert n_rest == 16  # C=16, W=8, beta=20, L=2 (official rule): k_0 = 2*8 - floor(8/20) = 16, + window
        _assert_top(got, {j: float(score[j]) for j in range(T - W)}, n_rest, margin=None)
        # max pooling spreads a peak to its neighbours: the kept set is unions of 7-wide runs, and the
        # top slot of the raw scores is kept together with its neighbours
        raw = sum(heads) / 2
        peak = int(raw[: T - W].argmax())
        assert {j for j in range(peak - 3, peak + 4) if 0 <= j < T - W} <= set(got)


# ------------------------------------------------------------------------------------------------ adakv
def _planted_two_heads(T=64, hot=(5, 9, 13), strength=10.0, seed=0):
    """KV head 0: every query points at three hot keys (concentrated); KV head 1: no hot key (diffuse)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, T, D, generator=g) * 0.1
    k[..., 0] = 0
    k[0, 0, list(hot), 0] = strength
    q = torch.randn(1, 2, T, D, generator=g) * 0.1
    q[..., 0] = strength
    return q, k, torch.randn_like(k)


def test_adakv_gives_the_concentrated_head_the_smaller_budget():
    """Layer budget 2 x (C - W) = 32 non-window entries. The top 32 window-attention scores of the layer:
    3 in head 0 (its hot keys take all its mass), 29 in head 1. With alpha = 0.2: raw budgets
    0.8 * (3, 29) + 0.2 * 16 = (5.6, 26.4) -> floors (5, 26), the spare entry to the larger remainder
    (head 0): (6, 26); plus the window of 4 each: (10, 30)."""
    C, W = 20, 4
    q, k, v = _planted_two_heads()
    kept = kept_indices(f"adakv:budget={C},window_size={W},kernel_size=1,alpha=0.2", q, k, v)[0]
    assert [len(kept[0]), len(kept[1])] == [10, 30]
    assert {5, 9, 13} | set(range(60, 64)) <= set(kept[0].tolist())
    # within each head the kept non-window entries are its top scores (mean window attention)
    for h, n in ((0, 6), (1, 26)):
        (s,) = _window_scores(q, k, 0, h, W, 1, reduce="mean")
        _assert_top(kept[h].tolist(), {j: float(s[j]) for j in range(64 - W)}, n, margin=0)


# ------------------------------------------------------------------------------------------------ OBCache
def _obc_value(q, k, v, b, h, rows, groups):
    """S^V_j = sum over query heads of KV head h and query rows i of A_ij^2 ||v_j||^2 (brute force)."""
    T = k.shape[2]
    s = torch.zeros(T, dtype=torch.float64)
    for qh in range(h * groups, (h + 1) * groups):
        for t in rows:
            a = _probs(q[b, qh, t], k[b, h, : t + 1])
            s[: t + 1] += a**2 * (v[b, h, : t + 1].double() ** 2).sum(-1)
    return s


@pytest.mark.parametrize("pipeline", ["snapkv", "tova", "h2o"])
def test_obcache_value_score_keeps_the_largest_output_change(pipeline):
    """``{snapkv,tova,h2o}-obcv``: the kept entries are the top of the exact value saliency
    ``sum_i A_ij^2 ||v_j||^2`` over the pipeline's queries (window of 4 / last query / every query)."""
    T, W, C = 32, 4, 12
    q, k, v = _qkv(T=T, seed=3)
    spec = {
        "snapkv": f"snapkv-obcv:budget={C},window_size={W},kernel_size=1",
        "tova": f"tova-obcv:budget={C}",
        "h2o": f"h2o-obcv:budget={C}",
    }[pipeline]
    kept = kept_indices(spec, q, k, v)
    for h in range(2):
        got = kept[0][h].tolist()
        if pipeline == "snapkv":
            s, cand, n = _obc_value(q, k, v, 0, h, range(T - W, T), 2), range(T - W), C - W
            assert set(range(T - W, T)) <= set(got)
        elif pipeline == "tova":
            s, cand, n = _obc_value(q, k, v, 0, h, [T - 1], 2), range(T), C
        else:  # h2o: half the budget is the recent window, the rest the top accumulated score
            s, cand, n = _obc_value(q, k, v, 0, h, range(T), 2), range(T - C // 2), C - C // 2
            assert set(range(T - C // 2, T)) <= set(got)
        _assert_top(got, {j: float(s[j]) for j in cand}, n)


# ------------------------------------------------------------------------------------------------ ReST-KV
@pytest.mark.parametrize("gqa", ["query", "mean"])
def test_restkv_keeps_the_largest_reconstruction_error(gqa):
    """ReST-KV without W_o, pooling or EMA memory (alpha = 1: the last window query's attention a_j):
    ``s_j = a_j / (1 - a_j) ||o_bar - v_j||`` with ``o_bar = sum_{j < T-W} a_j v_j``; keep the window plus
    the top C - W per query head (``gqa=query``) or by the group mean (``gqa=mean``)."""
    T, W, C = 40, 4, 12
    q, k, v = _qkv(T=T, seed=4)
    spec = f"restkv:budget={C},window_size={W},use_wo=false,pooling=none,alpha=1,gqa={gqa}"
    kept = kept_indices(spec, q, k, v)[0]
    per_head = []
    for qh in range(4):
        h = qh // 2
        a = _probs(q[0, qh, T - 1], k[0, h])  # the last query sees every key
        o_bar = (a[: T - W, None] * v[0, h, : T - W].double()).sum(0)
        s = a / (1 - a) * (o_bar[None] - v[0, h].double()).norm(dim=-1)
        per_head.append(s)
    if gqa == "query":
        assert len(kept) == 4
        for qh in range(4):
            got = kept[qh].tolist()
            assert set(range(T - W, T)) <= set(got)
            _assert_top(got, {j: float(per_head[qh][j]) for j in range(T - W)}, C - W)
    else:
        assert len(kept) == 2
        for h in range(2):
            s = (per_head[2 * h] + per_head[2 * h + 1]) / 2
            _assert_top(kept[h].tolist(), {j: float(s[j]) for j in range(T - W)}, C - W)


# ------------------------------------------------------------------------------------------------ decode time
def _decode_ctx(layer: LonglabLayer, q: torch.Tensor) -> LayerContext:
    pos = int(layer.n_real[0]) - 1
    return LayerContext(0, 1, None, "decode", q, D**-0.5, torch.tensor([[pos]]), None, layer)


def _run_decode(spec: str, k0, v0, steps):
    """Prefill ``k0, v0`` (the policy observes the prefill as the hook would), then decode ``steps``
    (``(q [1, H, 1, D], k, v [1, H_kv, 1, D])``); returns the held positions per KV head after each step."""
    policy = parse_method(spec)
    layer = LonglabLayer()
    layer.update(k0, v0)
    T0 = k0.shape[2]
    H = steps[0][0].shape[1]
    q0 = steps[0][0].new_zeros(1, H, T0, D) if policy.needs_observe else None
    if q0 is not None:
        g = torch.Generator().manual_seed(9)
        q0 = torch.randn(1, H, T0, D, generator=g)
        pre = LayerContext(0, 1, None, "prefill", q0, D**-0.5, layer.index[:, 0, -T0:], None, layer)
        policy.observe(pre)
        assert policy.select(pre) is None  # decode-time policies leave the prefill alone
    held = []
    for q, k, v in steps:
        layer.update(k, v)
        ctx = _decode_ctx(layer, q)
        if policy.needs_observe:
            policy.observe(ctx)
        keep = policy.select_decode(ctx)
        if keep is not None:
            layer.keep(keep)
        idx = layer.index[0]
        held.append([sorted(idx[h][idx[h] >= 0].tolist()) for h in range(idx.shape[0])])
    return held, q0


def _steps(n, H=2, H_kv=1, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, H, 1, D, generator=g), torch.randn(1, H_kv, 1, D, generator=g),
         torch.randn(1, H_kv, 1, D, generator=g))
        for _ in range(n)
    ]


def test_tova_stream_evicts_the_entry_the_current_query_attends_to_least():
    """Once the budget is reached, each decode step drops the entry with the lowest head-averaged attention
    of the current query (brute force over the held entries)."""
    T0, budget = 10, 8
    g = torch.Generator().manual_seed(6)
    k0, v0 = torch.randn(1, 1, T0, D, generator=g), torch.randn(1, 1, T0, D, generator=g)
    steps = _steps(4)
    held, _ = _run_decode(f"tova-stream:budget={budget}", k0, v0, steps)
    keys = {j: k0[0, 0, j] for j in range(T0)}
    mine = list(range(T0))
    for i, (q, k, _) in enumerate(steps):
        pos = T0 + i
        keys[pos] = k[0, 0, 0]
        mine.append(pos)
        kk = torch.stack([keys[j] for j in mine])
        a = sum(_probs(q[0, h, 0], kk) for h in range(q.shape[1])) / q.shape[1]
        scores = {j: float(a[n]) for n, j in enumerate(mine)}
        if len(mine) >= budget + 1:
            ranked = sorted(mine, key=lambda j: -scores[j])
            assert scores[ranked[budget - 1]] - scores[ranked[budget]] > 1e-5
            mine = sorted(ranked[:budget])
        assert held[i][0] == mine, i


def test_h2o_stream_evicts_the_lowest_accumulated_attention_outside_the_recent_half():
    """H2O streaming: attention accumulated per held entry over every query (prefill and decode, over the
    entries held at the time); at the budget, keep the recent half and the heaviest hitters."""
    T0, budget = 10, 8
    g = torch.Generator().manual_seed(7)
    k0, v0 = torch.randn(1, 1, T0, D, generator=g), torch.randn(1, 1, T0, D, generator=g)
    steps = _steps(4)
    held, q0 = _run_decode(f"h2o-stream:budget={budget}", k0, v0, steps)
    H = q0.shape[1]
    keys = {j: k0[0, 0, j] for j in range(T0)}
    acc = {j: 0.0 for j in range(T0)}
    for t in range(T0):  # prefill: query t over keys 0..t, mean over the query heads
        for h in range(H):
            a = _probs(q0[0, h, t], k0[0, 0, : t + 1])
            for j in range(t + 1):
                acc[j] += float(a[j]) / H
    mine = list(range(T0))
    n_recent = budget // 2
    for i, (q, k, _) in enumerate(steps):
        pos = T0 + i
        keys[pos], acc[pos] = k[0, 0, 0], 0.0
        mine.append(pos)
        kk = torch.stack([keys[j] for j in mine])
        for h in range(H):
            a = _probs(q[0, h, 0], kk)
            for n, j in enumerate(mine):
                acc[j] += float(a[n]) / H
        if len(mine) >= budget + 1:
            recent = [j for j in mine if j >= pos + 1 - n_recent]
            rest = sorted((j for j in mine if j not in recent), key=lambda j: -acc[j])
            n_heavy = budget - len(recent)
            assert acc[rest[n_heavy - 1]] - acc[rest[n_heavy]] > 1e-5
            mine = sorted(recent + rest[:n_heavy])
        assert held[i][0] == mine, i


def test_decoding_observes_the_newest_decode_queries():
    """``decoding`` hands its base the last ``window_size`` *decode* queries. Step 1's query looks at
    position 1, steps 2 and 3 at position 3; with a window of one query, SnapKV (budget 2: its window of
    one plus one more) compressing at step 3 keeps position 3 (the newest query's choice), not 1."""
    T0 = 6
    g = torch.Generator().manual_seed(8)
    k0 = torch.randn(1, 1, T0, D, generator=g) * 0.1
    k0[..., :2] = 0
    k0[0, 0, 1, 0] = 6.0  # direction e0 at position 1
    k0[0, 0, 3, 1] = 6.0  # direction e1 at position 3
    v0 = torch.randn(1, 1, T0, D, generator=g)
    steps = []
    for direction in (0, 1, 1):
        q = torch.randn(1, 2, 1, D, generator=g) * 0.1
        q[..., direction] = 6.0
        k = torch.randn(1, 1, 1, D, generator=g) * 0.1
        k[..., :2] = 0
        steps.append((q, k, torch.randn(1, 1, 1, D, generator=g)))
    spec = "decoding:base=snapkv:window_size=1;kernel_size=1,budget=2,interval=7,window_size=1"
    held, _ = _run_decode(spec, k0, v0, steps)
    assert held[0][0] == list(range(7)) and held[1][0] == list(range(8))  # below budget + interval
    assert held[2][0] == [3, 8]
