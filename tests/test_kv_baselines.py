"""Each baseline keeps exactly its budget and the right entries on hand-built cases (invariants 3, 5)."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabLayer
from longlab.recipe import RECIPE_METHODS, LonglabError, get_method_class, parse_method, parse_recipe

D = 8


def make_ctx(q, k, v=None, layer_idx=0, num_layers=2):
    """q: [B, H, T_q, D] (the last T_q positions); k, v: [B, H_kv, T, D]."""
    layer = LonglabLayer()
    layer.update(k, v if v is not None else torch.randn_like(k))
    T_q = q.shape[2]
    return LayerContext(
        layer_idx, num_layers, None, "prefill", q, D**-0.5, layer.index[:, 0, -T_q:], None, layer
    )


def kept(ctx, policy):
    mask = policy.select(ctx)
    return [sorted(torch.nonzero(mask[0, h]).flatten().tolist()) for h in range(mask.shape[1])]


def planted(T=40, H=2, H_kv=1, hot=(5, 11, 17, 23), strength=8.0, seed=0):
    """Keys orthogonal to a direction e0 except the hot ones; every query points along e0."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, H_kv, T, D, generator=g) * 0.1
    k[..., 0] = 0
    k[:, :, list(hot), 0] = strength
    q = torch.randn(1, H, T, D, generator=g) * 0.1
    q[..., 0] = strength
    return q, k


def test_snapkv_keeps_the_keys_the_window_attends_to_most():
    q, k = planted()
    policy = parse_method("snapkv:budget=8,window_size=4,kernel_size=1")
    assert kept(make_ctx(q, k), policy) == [[5, 11, 17, 23, 36, 37, 38, 39]]


def test_streaming_keeps_sinks_and_recent():
    q, k = planted()
    assert kept(make_ctx(q, k), parse_method("streaming:budget=10")) == [[0, 1, 2, 3, 34, 35, 36, 37, 38, 39]]


def test_knorm_keeps_smallest_key_norms():
    q, k = planted()
    k[0, 0, :, 1:] = torch.arange(40, dtype=torch.float32)[:, None].flip(0) * 0.01  # norms fall with position
    k[0, 0, :, 0] = 0
    assert kept(make_ctx(q, k), parse_method("knorm:budget=5")) == [[35, 36, 37, 38, 39]]


def test_tova_keeps_what_the_last_query_attends_to():
    q, k = planted(hot=(3, 30))
    q[:, :, :-1, 0] = 0  # only the last query looks at the hot keys
    assert kept(make_ctx(q, k), parse_method("tova:budget=2")) == [[3, 30]]  # no recent window in TOVA


def test_h2o_accumulates_attention_and_keeps_recent_half():
    q, k = planted(hot=(2, 7))
    ctx = make_ctx(q, k)
    policy = parse_method("h2o:budget=6")
    policy.observe(ctx)
    acc = ctx.layer.extras["h2o_acc"]
    probs = ctx.attention_probs().sum(2).mean(1, keepdim=True)  # brute force, one KV head
    assert torch.allclose(acc, probs, atol=1e-5)
    result = kept(ctx, policy)[0]  # budget 6: 3 recent + 3 heavy hitters
    assert {2, 7} <= set(result) and result[-3:] == [37, 38, 39] and len(result) == 6


def test_adakv_head_budgets_sum_to_the_layer_budget_with_floor():
    # KV head 0 concentrates on 3 keys, KV head 1 is diffuse: head 0 needs fewer entries.
    T, C, W = 64, 20, 4
    q, k = planted(T=T, H=2, H_kv=2, hot=(5, 9, 13), strength=10.0)
    k[0, 1, :, 0] = 0.0  # head 1: no hot keys, attention spread out
    policy = parse_method(f"adakv:budget={C},window_size={W},kernel_size=1,alpha=0.2")
    ctx = make_ctx(q, k)
    mask = policy.select(ctx)
    per_head = mask[0].sum(-1).tolist()
    assert sum(per_head) == 2 * C  # the layer total is exact
    assert per_head[0] != per_head[1]  # budgets really differ per head
    floor = math.floor(0.2 * (C - W)) + W
    assert min(per_head) >= floor
    assert {5, 9, 13} <= set(torch.nonzero(mask[0, 0]).flatten().tolist())


def test_pyramidkv_layer_budgets_follow_the_formula():
    # the official code (KVCache-Factory PyramidKVCluster), C=100, W=8, beta=20, L=4: min = 92 // 20 = 4,
    # max = 2*92 - 4 = 180, step = (180 - 4) // 3 = 58 -> 180, 122, 64, 6 non-window, + W = 188, 130, 72, 14
    # (more cases in tests/test_pyramidkv.py)
    policy = parse_method("pyramidkv:budget=100")
    q, k = planted(T=1000)
    budgets = [int(policy.target(make_ctx(q[:, :, -8:], k, layer_idx=i, num_layers=4))[0]) for i in range(4)]
    assert budgets == [188, 130, 72, 14]
    assert abs(sum(budgets) / 4 - 100) <= 1


@pytest.mark.parametrize(
    "name", ["snapkv", "streaming", "knorm", "tova", "h2o", "random", "pyramidkv", "adakv"]
)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_ratio_keeps_ceil_of_remaining_fraction_per_head_on_average(name, ratio):
    T, H_kv = 97, 2
    q, k = planted(T=T, H=4, H_kv=H_kv)
    ctx = make_ctx(q, k)
    policy = get_method_class(name)(compression_ratio=ratio)
    if policy.needs_observe:
        policy.observe(ctx)
    mask = policy.select(ctx)
    expected = math.ceil((1 - ratio) * T)
    if name == "pyramidkv":  # per-layer budgets: layer 0 of 2 keeps more, the average over layers is C
        budgets = [int(policy.target(make_ctx(q, k, layer_idx=i))[0]) for i in range(2)]
        assert abs(sum(budgets) / 2 - expected) <= 1
        held = [T] * H_kv if mask is None else mask[0].sum(-1).tolist()  # None: nothing to evict
        assert held == [budgets[0]] * H_kv
    else:
        assert mask[0].sum().item() == expected * H_kv


def test_every_method_cites_its_paper_and_documents_its_formula():
    get_method_class("full")
    for name, cls in RECIPE_METHODS.items():
        assert cls.paper, name
        assert cls.__doc__ and len(cls.__doc__.strip()) > 20, name


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("snapkv@1.0", "compression_ratio must be in [0, 1)"),
        ("snapkv@-0.1", "compression_ratio must be in [0, 1)"),
        ("snapkv:budget=0", "budget must be an integer in [1, 1048576]"),
        ("snapkv@0.5:budget=10", "not both"),
        ("nosuch@0.5", "unknown recipe method 'nosuch'; valid names:"),
        ("snapkv:window=3", "has no parameter window"),
        ("adakv:alpha=2", "alpha must be in [0, 1]"),
    ],
)
def test_bad_recipes_name_the_argument_and_range(spec, fragment):
    with pytest.raises(LonglabError, match=None) as info:
        parse_recipe(spec)
    assert fragment in str(info.value)


def test_recipe_names_round_trip():
    for spec in ["full", "snapkv@0.5", "streaming:budget=512", "adakv@0.75", "snapkv@0.5+knorm:budget=64"]:
        assert parse_recipe(spec).name == spec
