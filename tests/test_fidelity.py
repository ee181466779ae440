"""Fidelity to the papers' official code (issue 10, item 4), each pinned on a small hand-built case.

Each reference below is written here from the official code's behaviour (named per test), on the same
tensors longlab gets; the tests compare kept positions (or scores) exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longlab.attention import LayerContext
from longlab.cache import LonglabCache, LonglabLayer
from longlab.decode.quest import Quest
from longlab.kv import kept_indices
from longlab.kv.attention_scores import AdaKV
from longlab.quant.pmkvq import code_bytes, layer_bytes, memory_report
from longlab.recipe import LonglabError

D = 8
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors and models run on one thread


def _tensors(B=1, H=4, H_kv=2, T=64, seed=0, hot=()):
    """Random q, k, v; ``hot``: (query heads, position, strength) planted along channel 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H_kv, T, D, generator=g) * 0.5
    v = torch.randn(B, H_kv, T, D, generator=g)
    for heads, pos, strength in hot:
        for h in heads:
            q[:, h, :, 0] = 3.0
            k[:, h // (H // H_kv), pos, 0] = strength
    return q, k, v


def _sets(kept):
    """kept_indices output -> per (row, head) Python sets."""
    return [[set(t.tolist()) for t in row] for row in kept]


def _window_probs(q, k, W):
    """The last W queries' causal attention over every key, per query head, fp32: [B, H, W, T]."""
    B, H, T, _ = q.shape
    kr = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = q[:, :, -W:] @ kr.transpose(-1, -2) * D**-0.5
    rows = torch.arange(T - W, T)[:, None]
    logits = logits.masked_fill(torch.arange(T)[None, :] > rows, float("-inf"))
    return torch.softmax(logits.float(), dim=-1)


def _top_plus_window(scores, n, T, W):
    """scores [B, h, T - W] -> per (row, head) set of the top ``n`` plus the last W positions."""
    top = scores.topk(n, dim=-1).indices
    return [[set(top[b, h].tolist()) | set(range(T - W, T)) for h in range(top.shape[1])]
            for b in range(top.shape[0])]


# ------------------------------------------------------------------------------------------------- SnapKV
def _snapkv_reference(q, k, W, kernel, C):
    """FasterDecoding/SnapKV ``snapkv_utils.SnapKVCluster.update_kv`` with kvpress's GQA rule: the window
    attention over the prefix ``[:-W]`` summed over the window queries, ``avg_pool1d(kernel,
    padding=kernel//2, stride=1)`` (zero padding counted), mean over each KV head's query heads, then the
    top ``C - W`` prefix positions plus the window."""
    B, H, T, _ = q.shape
    s = _window_probs(q, k, W)[..., : T - W].sum(2)  # [B, H, T - W]
    s = F.avg_pool1d(s, kernel_size=kernel, padding=kernel // 2, stride=1)
    s = s.reshape(B, k.shape[1], -1, T - W).mean(2)
    return _top_plus_window(s, C - W, T, W)


def _snapkv_old_rule(q, k, W, kernel, C):
    """What longlab did before: group mean, then pooling over every slot (window included) with the
    padding not counted. Kept here only to show the hand case tells the two apart."""
    B, H, T, _ = q.shape
    s = _window_probs(q, k, W).sum(2).reshape(B, k.shape[1], -1, T).mean(2)
    s = F.avg_pool1d(s, kernel, stride=1, padding=kernel // 2, count_include_pad=False)[..., : T - W]
    return _top_plus_window(s, C - W, T, W)


def test_snapkv_pools_only_the_non_window_part_with_padding_counted():
    T, W, kernel, C = 48, 8, 5, 14
    # heavy attention on the first window token (its pooled mass used to leak into slots 38, 39) and on
    # the first prompt token (pooled over 3 slots, not 5, it used to win by the missing padding)
    q, k, v = _tensors(T=T, hot=(((0, 1, 2, 3), T - W, 4.0), ((0, 1, 2, 3), 0, 3.0), ((0, 1), 20, 2.5)))
    want = _snapkv_reference(q, k, W, kernel, C)
    got = _sets(kept_indices(f"snapkv:budget={C},window_size={W},kernel_size={kernel}", q, k, v))
    assert got == want
    assert _snapkv_old_rule(q, k, W, kernel, C) != want  # the case discriminates the two rules
    for seed in range(3):  # and on plain random tensors
        q, k, v = _tensors(B=2, T=T, seed=seed)
        assert _sets(kept_indices(f"snapkv:budget={C},window_size={W}", q, k, v)) == _snapkv_reference(
            q, k, W, 5, C
        )


# ------------------------------------------------------------------------------------ PyramidKV, AdaKV
def _kvpress_order(q, k, W, kernel, reduce):
    """kvpress's order: scores per query head -> 1-D pooling over the prefix -> mean over the GQA group."""
    B, H, T, _ = q.shape
    probs = _window_probs(q, k, W)[..., : T - W]
    s = probs.sum(2) if reduce == "sum" else probs.mean(2)  # [B, H, T - W]
    s = F.max_pool1d(s, kernel_size=kernel, padding=kernel // 2, stride=1)
    return s.reshape(B, k.shape[1], -1, T - W).mean(2)  # [B, H_kv, T - W]


def _two_heads_hot_nearby(T=64):
    # the two query heads of KV head 0 attend to positions 20 and 23: max-pooling each head before the
    # mean favours the slots both pools cover (20..23 with k=7); the mean before pooling does not
    return _tensors(T=T, hot=(((0,), 20, 3.0), ((1,), 23, 3.0), ((2, 3), 40, 2.0)))


def test_pyramidkv_pools_per_query_head_before_the_group_mean():
    T, W, kernel = 64, 8, 7
    q, k, v = _two_heads_hot_nearby(T)
    spec = f"pyramidkv:budget=16,window_size={W},kernel_size={kernel}"
    got = _sets(kept_indices(spec, q, k, v, layer_idx=1, num_layers=4))
    n_keep = len(got[0][0])  # the layer's pyramid budget (its formula is tested in test_kv_baselines)
    want = _top_plus_window(_kvpress_order(q, k, W, kernel, "sum"), n_keep - W, T, W)
    assert got == want
    B, H, _, _ = q.shape
    mean_first = _window_probs(q, k, W).sum(2).reshape(B, 2, 2, T).mean(2)[..., : T - W]
    mean_first = F.max_pool1d(mean_first, kernel, padding=kernel // 2, stride=1)
    assert _top_plus_window(mean_first, n_keep - W, T, W) != want  # the order matters on this case


def test_adakv_scores_pool_per_query_head_before_the_group_mean():
    T, W, kernel = 64, 8, 7
    q, k, v = _two_heads_hot_nearby(T)
    layer = LonglabLayer()
    layer.update(k, v)
    ctx = LayerContext(0, 1, None, "prefill", q, D**-0.5, layer.index[:, 0, :], None, layer)
    policy = AdaKV(budget=24, window_size=W, kernel_size=kernel)
    got = policy.score(ctx)[..., : T - W]
    torch.testing.assert_close(got, _kvpress_order(q, k, W, kernel, "mean"))
    assert torch.equal(policy.score(ctx)[..., T - W :], torch.zeros(1, 2, W))  # the window is not scored


# -------------------------------------------------------------------------------------------- ReST-KV
def _restkv_reference(q, k, v, wo, W, C, alpha=0.3, pooling="none", kernel=5, gqa="query"):
    """an-yongqi/rest-kv ``RestKVCluster.update_kv`` (``metric_mode="after"``, ``use_ema``, ``use_wo``),
    on K/V repeated to the H query heads as its KVCache-Factory base does: EMA of the window attention
    over the prefix, ``o_bar = a . v``, ``s = a/(1-a) ||W_o^h (o_bar - v_j)||``, optional ``avgpool``,
    then the top ``C - W`` per query head (``gqa="mean"``: of the group-mean score, per KV head)."""
    B, H, T, _ = q.shape
    g = H // k.shape[1]
    vr = v.repeat_interleave(g, dim=1)
    A = _window_probs(q, k, W)[..., : T - W]  # [B, H, W, T - W]
    acc = A[:, :, 0]
    for i in range(1, W):
        acc = alpha * A[:, :, i] + (1 - alpha) * acc
    o_bar = torch.einsum("bhl,bhld->bhd", acc, vr[:, :, : T - W])
    Wo = wo.reshape(-1, H, D)  # o_proj.weight [hidden, H*D] -> [hidden, H, D]
    proj_o = torch.einsum("bhd,chd->bhc", o_bar, Wo)
    proj_v = torch.einsum("bhld,chd->bhlc", vr[:, :, : T - W], Wo)
    s = acc / (1 - acc) * (proj_o[:, :, None] - proj_v).norm(dim=-1)
    if pooling == "avg":
        s = F.avg_pool1d(s, kernel_size=kernel, padding=kernel // 2, stride=1)
    if gqa == "mean":
        s = s.reshape(B, k.shape[1], g, T - W).mean(2)
    return _top_plus_window(s, C - W, T, W)


@pytest.mark.parametrize("pooling", ["none", "avg"])
def test_restkv_selects_per_query_head_as_the_official_code(pooling):
    T, W, C, hidden = 64, 8, 20, 16
    q, k, v = _tensors(T=T, seed=3, hot=(((0,), 12, 3.0), ((1,), 30, 3.0)))
    module = torch.nn.Module()
    module.o_proj = torch.nn.Linear(4 * D, hidden, bias=False)
    torch.nn.init.normal_(module.o_proj.weight, generator=torch.Generator().manual_seed(4))
    wo = module.o_proj.weight.detach()
    spec = f"restkv:budget={C},window_size={W},pooling={pooling}"
    got = _sets(kept_indices(spec, q, k, v, module=module))
    want = _restkv_reference(q, k, v, wo, W, C, pooling=pooling)
    assert len(got[0]) == 4 and got == want  # one token set per query head
    assert got[0][0] != got[0][1]  # the two query heads of KV head 0 keep different tokens
    mean = _sets(kept_indices(spec + ",gqa=mean", q, k, v, module=module))
    assert len(mean[0]) == 2 and mean == _restkv_reference(q, k, v, wo, W, C, pooling=pooling, gqa="mean")


def test_restkv_per_query_head_layer_keeps_decoding(tiny_models, tokenizer, text):
    """End to end: the expanded layer ([B, H, T, D]) takes the model's [B, H_kv, 1, D] decode entries."""
    from longlab.generation import generate

    model, _ = tiny_models["tiny-llama"]
    res = generate(model, tokenizer, text[:700], "Where?", "restkv@0.75", max_new_tokens=4, chunk_size=128)
    layer = res.cache.layers[0]
    assert layer.keys.shape[1] == 4 and layer.kv_repeat == 2  # one KV head per query head
    n = res.context_tokens[0]
    assert res.kv_bytes_before == 2 * 2 * (2 * n * 16 * 4)  # 2 layers x K, V over the model's 2 KV heads
    assert res.kv_bytes_after < res.kv_bytes_before  # 2 x 25 % of the entries, plus the index


# -------------------------------------------------------------------------------------------- OBCache
def _obc_joint_reference(q, k, v):
    """OBCache ``KVScoreTracker`` (TOVA preset: the last query only): per head
    ``S^VK_j = A_j^2 ||v_j||^2 + (A_j z_j)^2 ||v_j - o||^2 + 2 A_j^2 z_j (||v_j||^2 - v_j.o)``,
    summed over the query heads of a KV head: [B, H_kv, T]."""
    B, H, T, _ = q.shape
    g = H // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    z = (q[:, :, -1:] @ kr.transpose(-1, -2))[:, :, 0] * D**-0.5  # [B, H, T]
    A = torch.softmax(z, -1)
    o = (A[..., None] * vr).sum(2, keepdim=True)  # [B, H, 1, D]
    vn = (vr * vr).sum(-1)
    vo = (vr * o).sum(-1)
    vmo = ((vr - o) ** 2).sum(-1)
    s = A**2 * vn + (A * z) ** 2 * vmo + 2 * A**2 * z * (vn - vo)
    return s.reshape(B, k.shape[1], g, T).sum(2)


def test_tova_obc_evicts_per_kv_head_by_default_as_the_obcache_code():
    T, n = 40, 10
    q, k, v = _tensors(T=T, seed=5, hot=(((0, 1), 7, 3.0), ((2, 3), 25, 3.0)))
    s = _obc_joint_reference(q, k, v)
    per_head = [[set(s[0, h].topk(n).indices.tolist()) for h in range(2)]]
    got = _sets(kept_indices(f"tova-obcvk:budget={n}", q, k, v))
    assert got == per_head and per_head[0][0] != per_head[0][1]
    shared = set(s.sum(1)[0].topk(n).indices.tolist())  # share_heads: one token set for the layer
    assert _sets(kept_indices(f"tova-obcvk:budget={n},share_heads=true", q, k, v)) == [[shared, shared]]


# --------------------------------------------------------------------------------------------- PM-KVQ
def _pmkvq_layer(recipe, T=300, scale_dtype=None):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
    cache = LonglabCache(recipe)
    layer = LonglabLayer()
    layer.update(k, v)
    cache.layers.append(layer)
    q = torch.randn(1, 4, 8, 16, generator=g)
    ctx = LayerContext(0, 1, None, "prefill", q, 0.25, layer.index[:, 0, -8:], None, layer, cache)
    policy = cache.recipe.kv[-1]
    policy.apply(ctx)
    return cache, ctx, policy, k


def test_pmkvq_budget_counts_code_words_and_shrinks_once_per_update():
    # T=300, H_kv=2, D=16, sink 1, window 43 left after flushing 256 entries into main:
    # code words 38400 B at 16 bits, 22016 B at 8, 13824 B at 4 (PM-KVQ's own count: numel of the codes x 2)
    assert [code_bytes(300, b, 2, 16, window_tokens=43) for b in (16, 8, 4)] == [38400, 22016, 13824]
    budget_mb = 0.015  # 15728 B: needs 4 bits, i.e. two halvings
    cache, ctx, policy, _ = _pmkvq_layer(f"pmkvq:budget_mb={budget_mb}")
    layer = cache.layers[0]
    assert layer.key_store.bits == 8  # one halving in this update, not a loop down to 4
    policy.apply(ctx)  # the next update (a decode step would do the same) halves once more
    assert layer.key_store.bits == 4
    policy.apply(ctx)
    assert layer.key_store.bits == 4  # within budget: no further shrink
    # the budget compares code words only: at 0.025 MiB (26214 B) 8 bits fit although nbytes does not
    cache, _, _, _ = _pmkvq_layer("pmkvq:budget_mb=0.025")
    layer = cache.layers[0]
    assert layer.key_store.bits == 8
    assert layer.code_nbytes() == 22016 <= 0.025 * 2**20 < layer.nbytes()
    assert layer.nbytes() == layer_bytes(300, 8, 2, 16, window_tokens=43)
    (row,) = memory_report(cache)  # overheads (scales, offsets, index) reported apart from the codes
    assert row == {"bits": 8, "code_bytes": 22016, "overhead_bytes": layer.nbytes() - 22016,
                   "total_bytes": layer.nbytes()}


def test_pmkvq_bf16_scales_as_the_official_code():
    cache, _, _, k = _pmkvq_layer("pmkvq:budget_mb=0.025,scale_dtype=bfloat16")
    layer = cache.layers[0]
    assert layer.key_store.scale.dtype == torch.bfloat16 and layer.key_store.offset.dtype == torch.bfloat16
    err = (layer.dequantized_keys().float() - k).abs().max()
    assert 0 < err < 0.1  # 8-bit codes with bf16 scales: a small, nonzero error
    with pytest.raises(LonglabError, match="scale_dtype"):
        LonglabCache("pmkvq:budget_mb=1,scale_dtype=int8")


# ---------------------------------------------------------------------------------------------- Quest
@pytest.mark.parametrize(
    "budget, page, dense_up_to",
    [(20, 16, 48), (1000, 16, 992), (1024, 16, 1024), (64, 16, 64)],
    ids=["budget-below-min-pages", "budget-not-a-page-multiple", "budget-multiple", "small"],
)
def test_quest_reads_densely_exactly_when_the_slots_span_at_most_k_pages(budget, page, dense_up_to):
    """Dense is decided by pages, not by the budget: every page is read iff T <= K * P,
    K = max(min_pages, budget // P); Quest's code likewise takes top-min(K, n_pages) pages."""
    quest = Quest(budget=budget, page_size=page)
    assert quest.n_pages * page == dense_up_to

    class Ctx:
        pass

    for T, dense in ((dense_up_to, True), (dense_up_to + 1, False)):
        layer = LonglabLayer()
        layer.update(torch.randn(1, 2, T, D), torch.randn(1, 2, T, D))
        ctx = Ctx()
        ctx.layer, ctx.k, ctx.q = layer, layer.keys, torch.randn(1, 4, 1, D)
        slots, pages = quest.select(ctx)
        assert (slots is None) == dense, (T, budget)
