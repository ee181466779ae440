"""Context-parallel attention on gloo process groups (world sizes 2 and 4): outputs and gradients equal one
process's fp64 attention for FULL, CAUSAL and DOCUMENT masks, for Ulysses, Ring-P2P, Ring-AllGather, USP."""

from __future__ import annotations

import zlib

import pytest
import torch

from longlab.ops.context_parallel import (
    STRATEGIES,
    CommStats,
    Layout,
    Mesh,
    context_parallel_attention,
    spawn,
    theoretical_bytes,
)
from longlab.ops.masks import make_mask
from longlab.recipe import LonglabError

T = 64
DOCS = [10, 3, 25, 26]
MASK_KW = {"CAUSAL_DOCUMENT": {"lengths": DOCS}, "FULL_DOCUMENT": {"lengths": DOCS},
           "SLIDING_WINDOW_CAUSAL": {"window": 9}}
MASK_NAMES = ["FULL", "CAUSAL", "CAUSAL_DOCUMENT", "FULL_DOCUMENT", "SLIDING_WINDOW_CAUSAL"]
HEADS = {"gqa": (4, 2), "mha": (4, 4)}


def _reference(q, k, v, mask, dout):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    dense = mask.to_sdpa_mask()
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    out = torch.softmax(s.masked_fill(~dense, float("-inf")), -1) @ v.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _case(rank, world, strategy, mask_name, heads, meshes, balanced=True, u=None, fallback="error"):
    H, H_kv = heads
    g = torch.Generator().manual_seed(zlib.crc32(f"{mask_name}/{H}/{H_kv}".encode()))
    q = torch.randn(1, H, T, 16, generator=g)
    k = torch.randn(1, H_kv, T, 16, generator=g)
    v = torch.randn(1, H_kv, T, 16, generator=g)
    dout = torch.randn(1, H, T, 16, generator=g)
    mask = make_mask(mask_name, T, **MASK_KW.get(mask_name, {}))
    ref = _reference(q, k, v, mask, dout)
    lay = Layout(T, world, balanced)
    ql, kl, vl = (lay.shard(x, rank).requires_grad_() for x in (q, k, v))
    stats = CommStats()
    uu = u or (2 if world >= 4 else 1)
    uu = world if strategy == "ulysses" else 1 if strategy.startswith("ring") else uu
    if uu not in meshes:
        meshes[uu] = Mesh.build(uu, world)
    out = context_parallel_attention(ql, kl, vl, mask, lay, strategy, ulysses_size=uu, mesh=meshes[uu],
                                     stats=stats, head_fallback=fallback)
    out.backward(lay.shard(dout, rank))
    errs = [float((a.detach().double() - lay.shard(b, rank)).abs().max()) for a, b in
            zip((out, ql.grad, kl.grad, vl.grad), ref)]
    return {"out": errs[0], "dq": errs[1], "dk": errs[2], "dv": errs[3], "fwd_bytes": stats.total("fwd"),
            "bwd_bytes": stats.total("bwd")}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    meshes: dict[int, Mesh] = {}
    res = {}
    for strategy in STRATEGIES:
        for mask_name in MASK_NAMES:
            for hname, heads in HEADS.items():
                key = f"{strategy}/{mask_name}/{hname}"
                res[key] = _case(rank, world, strategy, mask_name, heads, meshes)
    res["ring-p2p/CAUSAL/gqa/unbalanced"] = _case(rank, world, "ring-p2p", "CAUSAL", (4, 2), meshes, False)
    res["ulysses/CAUSAL/h6kv2/pad"] = _case(rank, world, "ulysses", "CAUSAL", (6, 2), meshes, fallback="pad")
    try:
        _case(rank, world, "ulysses", "CAUSAL", (6, 2) if world == 4 else (3, 1), meshes)
        res["error"] = ""
    except LonglabError as exc:
        res["error"] = str(exc)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ws{w}")
def results(request):
    world = request.param
    per_rank = spawn(_worker, world, start_method="fork")
    return world, per_rank


def test_every_strategy_mask_and_head_layout_equals_one_process(results):
    world, per_rank = results
    keys = [k for k in per_rank[0] if k != "error"]
    assert len(keys) == len(STRATEGIES) * len(MASK_NAMES) * len(HEADS) + 2
    worst = {}
    for key in keys:
        for r in per_rank:
            for what in ("out", "dq", "dk", "dv"):
                worst[(key, what)] = max(worst.get((key, what), 0.0), r[key][what])
    bad = {k: v for k, v in worst.items() if v > 2e-5}
    assert not bad, f"world {world}: {bad}"


def test_heads_that_do_not_fit_ulysses_raise_a_clear_error(results):
    world, per_rank = results
    for r in per_rank:
        assert "Ulysses over" in r["error"] and "head_fallback='pad'" in r["error"]


def test_measured_traffic_matches_the_volume_formulas(results):
    # FULL mask, MHA, balanced: forward bytes sent per rank equal the paper's formula for Ulysses and rings
    world, per_rank = results
    H, H_kv, D = 4, 4, 16
    for strategy in ("ulysses", "ring-p2p", "ring-allgather"):
        want = theoretical_bytes(strategy, T, world, H, H_kv, D, 4)
        for r in per_rank:
            assert r[f"{strategy}/FULL/mha"]["fwd_bytes"] == want, strategy
    for r in per_rank:
        assert r["ring-p2p/FULL/mha"]["bwd_bytes"] == theoretical_bytes("ring-p2p", T, world, H, H_kv, D, 4,
                                                                         backward=True)
        if world == 4:  # USP: Ulysses over pairs of ranks, a ring of 2 groups
            assert r["usp/FULL/mha"]["fwd_bytes"] == theoretical_bytes("usp", T, world, H, H_kv, D, 4, u=2)


def test_layout_head_tail_and_bad_input():
    lay = Layout(16, 2)
    assert lay.positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert lay.positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(torch.cat([lay.positions(r) for r in range(2)]).sort().values, torch.arange(16))
    assert Layout(16, 2, balanced=False).positions(1).tolist() == list(range(8, 16))
    with pytest.raises(LonglabError, match="multiple of 4"):
        Layout(10, 2)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(LonglabError, match="strategy must be one of"):
        context_parallel_attention(q, q, q, make_mask("CAUSAL", 8), Layout(8, 1), "tree")


def test_single_process_is_plain_attention():
    # world size 1 without a process group: every strategy is local attention
    mask = make_mask("CAUSAL_DOCUMENT", 32, lengths=[5, 27])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    dout = torch.randn(1, 2, 32, 8, generator=g)
    ref = _reference(q, k, v, mask, dout)
    for strategy in STRATEGIES:
        out = context_parallel_attention(q, k, v, mask, Layout(32, 1), strategy)
        assert (out.double() - ref[0]).abs().max() < 1e-5
