"""PyramidKV against its official code (KVCache-Factory ``PyramidKVCluster``; issue 35, item 5).

Per-layer budgets are written out by hand from the official formula (window 8, beta 20, floor of the step),
kept sets on hand-built attention are written out position by position, and a small reference written here
from the official selection (``topk`` of the max-pooled prefix) checks every layer on random tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longlab.kv import kept_indices
from longlab.kv.attention_scores import pyramid_layer_budget
from longlab.recipe import LonglabError, parse_method

D = 8
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run on one thread


def _lengths(spec, T, num_layers, H=1, H_kv=1):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (H, H_kv, H_kv))
    kept = [kept_indices(spec, q, k, v, layer_idx=i, num_layers=num_layers) for i in range(num_layers)]
    return [len(layer[0][0]) for layer in kept]


# Official rule, n = 1000 tokens, W = 8, beta = 20 (C = max_capacity_prompt, window included):
#   lo = (C - W) // 20, hi = 2 (C - W) - lo, step = (hi - lo) // (L - 1), layer l keeps hi - l*step + W.
# C=100, L=4: lo = 92//20 = 4,   hi = 180, step = 176//3 = 58  -> 180 122 64 6            (+8)
# C=64,  L=4: lo = 56//20 = 2,   hi = 110, step = 108//3 = 36  -> 110 74 38 2             (+8)
# C=128, L=8: lo = 120//20 = 6,  hi = 234, step = 228//7 = 32  -> 234 202 170 138 106 74 42 10  (+8)
# C=64,  L=8: lo = 2,            hi = 110, step = 108//7 = 15  -> 110 95 80 65 50 35 20 5      (+8)
BUDGETS = [
    (100, 4, [188, 130, 72, 14]),
    (64, 4, [118, 82, 46, 10]),
    (128, 8, [242, 210, 178, 146, 114, 82, 50, 18]),
    (64, 8, [118, 103, 88, 73, 58, 43, 28, 13]),
]


@pytest.mark.parametrize("C, L, want", BUDGETS)
def test_layer_budgets_follow_the_official_formula_on_every_layer(C, L, want):
    assert [pyramid_layer_budget(C, 1000, 8, i, L) for i in range(L)] == want
    assert _lengths(f"pyramidkv:budget={C}", 1000, L) == want  # the kept sets really have those sizes
    # the floor of the step leaves the surplus to the last layers: the mean is C or a little more
    assert C <= sum(want) / L < C + (L - 1) / 2


def test_budget_regimes_for_short_prompts():
    # n < C: keep everything; C <= n < 2(C - W) = 184: SnapKV's uniform C on every layer
    assert [pyramid_layer_budget(100, 90, 8, i, 4) for i in range(4)] == [90] * 4
    assert [pyramid_layer_budget(100, 150, 8, i, 4) for i in range(4)] == [100] * 4
    assert [pyramid_layer_budget(100, 183, 8, i, 4) for i in range(4)] == [100] * 4
    # n = 186: hi = 180 >= n - W = 178, so hi = 178, lo = 184 - 178 = 6, step = 172//3 = 57
    assert [pyramid_layer_budget(100, 186, 8, i, 4) for i in range(4)] == [186, 129, 72, 15]
    # n = 184 = 2(C - W): the pyramid starts (hi = 176, lo = 8, step = 56)
    assert [pyramid_layer_budget(100, 184, 8, i, 4) for i in range(4)] == [184, 128, 72, 16]
    # beta is a parameter: beta = 4 -> lo = 23, hi = 161, step = 46
    assert [pyramid_layer_budget(100, 1000, 8, i, 4, beta=4) for i in range(4)] == [169, 123, 77, 31]


def test_compression_ratio_sets_max_capacity_prompt_to_the_kept_fraction():
    # @0.9 on 1000 tokens: max_capacity_prompt = ceil(0.1 * 1000) = 100, the C=100 pyramid above
    assert _lengths("pyramidkv@0.9", 1000, 4) == [188, 130, 72, 14]
    # @0.3: C = 700 and n = 1000 < 2 (700 - 8): the official code keeps C on every layer
    assert _lengths("pyramidkv@0.3", 1000, 4) == [700] * 4


def _planted(T, H, hot):
    """Query head h points along channel h % 2; one KV head; ``hot``: {(channel, position): key value}."""
    q = torch.zeros(1, H, T, D)
    for h in range(H):
        q[0, h, :, h % 2] = 2.0
    k = torch.zeros(1, 1, T, D)
    for (channel, pos), value in hot.items():
        k[0, 0, pos, channel] = value
    return q, k, torch.randn(1, 1, T, D)


def test_kept_sets_on_a_hand_built_case_every_layer():
    # n = 36, W = 8, C = 25, L = 4: hi = 34 >= n - W = 28 -> hi = 28, lo = 2*17 - 28 = 6,
    # step = 22//3 = 7: 28, 21, 14, 7 prefix entries (36, 29, 22, 15 kept). Hot keys at 3, 10, 17, 24
    # (attention 24 > 10 > 17 > 3, every other key equal); max pooling with k = 7 copies each peak onto
    # p-3..p+3, so the prefix 0..27 is four groups of 7 and each layer keeps whole groups.
    T = 36
    q, k, v = _planted(T, 2, {(0, 24): 6.0, (0, 10): 5.0, (0, 17): 4.0, (0, 3): 3.0})
    q[0, 1, :, 1] = 0.0
    q[0, 1, :, 0] = 2.0  # both query heads look along e0
    window = list(range(28, 36))
    want = [
        list(range(36)),  # layer 0: everything
        list(range(7, 28)) + window,  # groups of 24, 10, 17
        list(range(7, 14)) + list(range(21, 28)) + window,  # groups of 24, 10
        list(range(21, 28)) + window,  # group of 24
    ]
    for layer in range(4):
        got = kept_indices("pyramidkv:budget=25", q, k, v, layer_idx=layer, num_layers=4)
        assert got[0][0].tolist() == want[layer], layer


def test_gqa_mean_keeps_one_set_per_kv_head_and_gqa_query_one_per_query_head():
    # n = 40, W = 8, C = 16, L = 3: lo = 0, hi = 16, step = 8 -> 16, 8, 0 prefix entries; kernel_size=1.
    # Query head 0 attends to A (channel 0, strong), query head 1 to B (channel 1, weaker).
    A, B = [2, 6, 11, 15, 19, 23, 27, 30], [0, 4, 9, 13, 17, 21, 25, 29]
    hot = {(0, p): 6.0 for p in A} | {(1, p): 3.0 for p in B}
    q, k, v = _planted(40, 2, hot)
    window = list(range(32, 40))
    spec = "pyramidkv:budget=16,kernel_size=1"
    mean0 = kept_indices(spec, q, k, v, layer_idx=0, num_layers=3)
    mean1 = kept_indices(spec, q, k, v, layer_idx=1, num_layers=3)
    per_query = kept_indices(spec + ",gqa=query", q, k, v, layer_idx=1, num_layers=3)
    assert [t.tolist() for t in mean0[0]] == [sorted(A + B) + window]  # one KV head, 16 + 8
    assert [t.tolist() for t in mean1[0]] == [A + window]  # the group mean favours head 0's strong keys
    assert [t.tolist() for t in per_query[0]] == [A + window, B + window]  # each query head its own


def _official(q, k, C, W, layer, L, kernel=7, beta=20):
    """The official selection, written here from its behaviour: K/V repeated to the query heads, the last
    W queries' causal attention summed over the window, max-pooled over the prefix, topk plus the window."""
    B, H, T, _ = q.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    rest = C - W
    lo = rest // beta
    hi = 2 * rest - lo
    if hi >= T - W:
        hi, lo = T - W, 2 * rest - (T - W)
    n_top = rest if T < 2 * rest else hi - layer * ((hi - lo) // (L - 1))
    logits = q[..., -W:, :] @ k.transpose(2, 3) / math.sqrt(D)
    logits[..., -W:] += torch.full((W, W), torch.finfo(logits.dtype).min).triu(1)
    s = F.max_pool1d(torch.softmax(logits, -1)[..., : T - W].sum(-2), kernel, padding=kernel // 2, stride=1)
    top = s.topk(n_top, dim=-1).indices
    return [sorted(top[0, h].tolist() + list(range(T - W, T))) for h in range(H)], s


@pytest.mark.parametrize("C", [20, 40])
@pytest.mark.parametrize("H_kv, extra", [(4, ""), (2, ",gqa=query")])
def test_kept_sets_equal_the_official_selection_on_every_layer(C, H_kv, extra):
    T, L, ties_cut = 160, 6, 0
    for layer in range(L):
        g = torch.Generator().manual_seed(layer)
        q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (4, H_kv, H_kv))
        want, s = _official(q, k, C, 8, layer, L)
        got = kept_indices(f"pyramidkv:budget={C}{extra}", q, k, v, layer_idx=layer, num_layers=L)
        assert [t.tolist() for t in got[0]] == want, layer
        n_top = len(want[0]) - 8
        kth = s.sort(-1, descending=True).values[..., n_top - 1 : n_top + 1]
        ties_cut += int((kth[..., 0] == kth[..., 1]).sum())  # a max-pool tie group straddles the cut
    assert ties_cut > 0  # so the case tells torch.topk's tie order from a lowest-position-first order


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("pyramidkv:budget=8", "must be > window_size (8)"),
        ("pyramidkv:budget=20,window_size=32", "must be > window_size (32)"),
        ("pyramidkv@0.5:gqa=kv", "gqa"),
        ("pyramidkv@0.5:beta=0.5", "beta"),
    ],
)
def test_bad_parameters_are_refused(spec, fragment):
    with pytest.raises(LonglabError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_method(spec)
