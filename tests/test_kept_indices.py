"""``longlab.kv.kept_indices``: a registered eviction policy on raw tensors, no model."""

from __future__ import annotations

import pytest
import torch

from longlab.kv import kept_indices
from longlab.recipe import RECIPE_METHODS, LonglabError

D = 8
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run on one thread


def _qkv(B=2, H=4, H_kv=2, T=40, T_q=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q or T, D, generator=g)
    return q, torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g)


def test_knorm_equals_brute_force_top_k_of_negative_key_norms():
    q, k, v = _qkv()
    kept = kept_indices("knorm:budget=7", q, k, v)
    assert len(kept) == 2 and all(len(row) == 2 for row in kept)
    for b in range(2):
        for h in range(2):
            want = sorted((-k[b, h].norm(dim=-1)).topk(7).indices.tolist())
            assert kept[b][h].tolist() == want  # sorted LongTensor positions
            assert kept[b][h].dtype == torch.long


def test_snapkv_equals_brute_force_window_attention_top_k():
    # kernel_size=1: no pooling, so the score is the plain window attention (summed over the W = 4 last
    # queries, averaged over the 2 query heads of each KV head); keep the top 6 of the prefix + the window
    T, W, C = 30, 4, 10
    q, k, v = _qkv(T=T, seed=1)
    kept = kept_indices(f"snapkv:budget={C},window_size={W},kernel_size=1", q, k, v)
    for b in range(2):
        for h in range(2):
            s = torch.zeros(T - W)
            for g in range(2):
                qh = q[b, 2 * h + g]  # query head of KV head h
                for t in range(T - W, T):  # window query at position t sees keys 0..t
                    logits = qh[t] @ k[b, h, : t + 1].T * D**-0.5
                    s += torch.softmax(logits, -1)[: T - W] / 2
            want = sorted(s.topk(C - W).indices.tolist() + list(range(T - W, T)))
            assert kept[b][h].tolist() == want


def test_query_positions_budget_and_layers():
    q, k, v = _qkv(T=40, T_q=8, seed=2)
    default = kept_indices("snapkv:budget=12,window_size=4", q, k, v)
    explicit = kept_indices("snapkv:budget=12,window_size=4", q, k, v, queries=torch.arange(32, 40))
    assert all(torch.equal(a, b) for ra, rb in zip(default, explicit) for a, b in zip(ra, rb))
    assert all(len(t) == 40 for row in kept_indices("snapkv:budget=100", q, k, v) for t in row)  # fits
    assert all(t.tolist() == list(range(40)) for row in kept_indices("full", q, k, v) for t in row)
    # per-layer budgets: PyramidKV's layer 0 of 4 keeps more than layer 3
    first = kept_indices("pyramidkv:budget=16", q, k, v, layer_idx=0, num_layers=4)
    last = kept_indices("pyramidkv:budget=16", q, k, v, layer_idx=3, num_layers=4)
    assert len(first[0][0]) > len(last[0][0])
    # restkv selects per query head by default: one list per query head
    assert len(kept_indices("restkv@0.5:use_wo=false", q, k, v)[0]) == 4


EVICTION = sorted(
    name for name, cls in RECIPE_METHODS.items()
    if cls.kind == "kv" and name not in ("indexmem",)  # indexmem needs trained weights (module.config)
)


@pytest.mark.parametrize("name", EVICTION)
def test_every_registered_eviction_policy_runs_on_raw_tensors(name):
    q, k, v = _qkv(B=1, T=48, seed=3)
    spec = {"full": "full", "decoding": "decoding:budget=8", "restkv": "restkv@0.5:use_wo=false"}.get(name)
    spec = spec or (f"{name}:budget=8" if name.endswith("-stream") else f"{name}@0.5")
    kept = kept_indices(spec, q, k, v, num_layers=2)
    for row in kept:
        for t in row:
            assert t.dtype == torch.long and bool((t[1:] > t[:-1]).all()) and 0 <= int(t.min())
            assert int(t.max()) < 48


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        (("kivi2",), {}, "kivi2"),  # quantization only
        (("snapkv@0.5+kivi2",), {}, "kivi2"),
        (("quest",), {}, "quest"),
        (("nosuch@0.5",), {}, "unknown recipe method"),
        (("snapkv@0.5",), {"layer_idx": 2, "num_layers": 2}, "layer_idx"),
        (("snapkv@0.5",), {"queries": [1, 2]}, "queries"),
        (("restkv@0.5",), {}, "module"),  # use_wo reads o_proj
    ],
)
def test_bad_recipes_and_arguments_raise_longlab_errors(args, kwargs, fragment):
    q, k, v = _qkv(B=1, T=20)
    with pytest.raises(LonglabError, match=fragment):
        kept_indices(*args, q, k, v, **kwargs)


@pytest.mark.parametrize(
    "shapes, fragment",
    [
        (((1, 4, 20), (1, 2, 20, D), (1, 2, 20, D)), "4-d"),
        (((1, 4, 20, D), (1, 2, 20, D + 1), (1, 2, 20, D)), "expected q"),
        (((1, 4, 20, D), (1, 3, 20, D), (1, 3, 20, D)), "multiple of H_kv"),
        (((1, 4, 30, D), (1, 2, 20, D), (1, 2, 20, D)), "T_q <= T"),
        (((2, 4, 20, D), (1, 2, 20, D), (1, 2, 20, D)), "expected q"),
    ],
)
def test_bad_shapes_raise_longlab_errors(shapes, fragment):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(LonglabError, match=fragment):
        kept_indices("snapkv@0.5", q, k, v)
    with pytest.raises(LonglabError, match="4-d"):
        kept_indices("snapkv@0.5", q.tolist(), k, v)
