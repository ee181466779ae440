"""Block-sparse executor against the dense oracle; quality metrics."""

from __future__ import annotations

import pytest
import torch

from longlab.ops import block_flash
from longlab.sparse.blockmask import BlockSparseMask, enforce_required, full_mask
from longlab.sparse.executor import (
    SPLIT_COMMON,
    block_sparse_attention,
    dense_causal_attention,
    grouped_block_sparse_attention,
    quality_metrics,
)

# (B, H, H_kv, T_q, T_k, D, bq, bk)
CASES = [
    (2, 4, 2, 256, 256, 64, 64, 64),
    (1, 6, 2, 1000, 1000, 64, 128, 128),  # T not a multiple of the block
    (1, 4, 1, 300, 1000, 64, 64, 64),  # chunked prefill: cached keys before the queries
    (1, 4, 4, 512, 512, 32, 64, 32),  # bq != bk, MHA
    (1, 2, 1, 77, 513, 64, 32, 64),
]


def _ids(c: tuple[int, ...]) -> str:
    return "B{}-H{}-Hkv{}-Tq{}-Tk{}-D{}-bq{}-bk{}".format(*c)


def _inputs(B, H, H_kv, T_q, T_k, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, D, generator=g)
    k = torch.randn(B, H_kv, T_k, D, generator=g)
    v = torch.randn(B, H_kv, T_k, D, generator=g)
    return q, k, v


def _random_mask(B, H, T_q, T_k, bq, bk, p=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    n_qb, n_kb = -(-T_q // bq), -(-T_k // bk)
    raw = torch.rand(B, H, n_qb, n_kb, generator=g) < p
    return enforce_required(BlockSparseMask(raw, bq, bk, T_q, T_k))


def _masked_reference(q, k, v, mask, scaling):
    # materialises [B, H, T_q, T_k]: small inputs only
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    logits = (q @ kr.transpose(-1, -2)) * scaling
    return torch.softmax(logits.masked_fill(~mask.to_element_mask(), float("-inf")), -1) @ vr


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gather_full_mask_equals_dense_sdpa(case):
    B, H, H_kv, T_q, T_k, D, bq, bk = case
    q, k, v = _inputs(B, H, H_kv, T_q, T_k, D)
    ref = dense_causal_attention(q, k, v, 0.1)
    out = block_sparse_attention(q, k, v, full_mask(B, H, T_q, T_k, bq, bk), 0.1, backend="gather")
    assert out.shape == (B, H, T_q, D)
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gather_sparse_mask_equals_masked_softmax(case):
    B, H, H_kv, T_q, T_k, D, bq, bk = case
    q, k, v = _inputs(B, H, H_kv, T_q, T_k, D)
    mask = _random_mask(B, H, T_q, T_k, bq, bk)
    out = block_sparse_attention(q, k, v, mask, 0.125, backend="gather")
    assert (out - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 1e-5


def test_dense_chunked_matches_full_prefill_tail():
    q, k, v = _inputs(1, 4, 2, 512, 512, 64)
    full = dense_causal_attention(q, k, v)
    tail = dense_causal_attention(q[:, :, -200:], k, v)
    assert (full[:, :, -200:] - tail).abs().max() <= 1e-5
    mask = full_mask(1, 4, 200, 512, 64, 64)
    out = block_sparse_attention(q[:, :, -200:], k, v, mask, backend="gather")
    assert (full[:, :, -200:] - out).abs().max() <= 1e-5


def test_quality_metrics_full_mask_recall_one_error_zero():
    q, k, v = _inputs(1, 4, 2, 512, 512, 64)
    qm = quality_metrics(q, k, v, full_mask(1, 4, 512, 512, 64, 64), n_sample_rows=32)
    assert qm["density"] == 1.0
    assert qm["recall"] == pytest.approx(1.0, abs=1e-5)
    assert qm["rel_error"] == 0.0
    assert len(qm["recall_per_head"]) == 4


def test_quality_metrics_sparse_mask_consistent_with_executor():
    q, k, v = _inputs(1, 4, 2, 512, 512, 64)
    mask = _random_mask(1, 4, 512, 512, 64, 64, p=0.2)
    out = block_sparse_attention(q, k, v, mask, backend="gather")
    a = quality_metrics(q, k, v, mask, n_sample_rows=64)
    b = quality_metrics(q, k, v, mask, n_sample_rows=64, out=out)
    assert 0.0 < a["recall"] < 1.0 and 0.0 < a["density"] < 1.0
    assert a["rel_error"] > 0.01
    assert b["rel_error"] == pytest.approx(a["rel_error"], rel=1e-4)


def test_bad_backend_and_mismatched_mask_raise():
    q, k, v = _inputs(1, 2, 1, 128, 128, 32)
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, k, v, full_mask(1, 2, 128, 128, 64, 64), backend="triton")
    with pytest.raises(ValueError, match="does not match"):
        block_sparse_attention(q, k, v, full_mask(1, 2, 64, 128, 64, 64), backend="gather")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:3], ids=_ids)
def test_flex_matches_dense_and_gather(case):
    B, H, H_kv, T_q, T_k, D, bq, bk = case
    q, k, v = _inputs(B, H, H_kv, T_q, T_k, D)
    ref = dense_causal_attention(q, k, v, 0.1)
    out = block_sparse_attention(q, k, v, full_mask(B, H, T_q, T_k, bq, bk), 0.1, backend="flex")
    assert (out - ref).abs().max() <= 1e-5
    mask = _random_mask(B, H, T_q, T_k, bq, bk)
    sparse = block_sparse_attention(q, k, v, mask, 0.1, backend="flex")
    assert (sparse - block_sparse_attention(q, k, v, mask, 0.1, backend="gather")).abs().max() <= 1e-5


def test_sparse_prefill_returns_output_and_mask():
    from longlab.sparse import make_selector, sparse_prefill

    q, k, v = _inputs(1, 4, 2, 256, 256, 64)
    sel = make_selector("ashape", n_sink=64, n_local=64, bq=64, bk=64)
    out, mask = sparse_prefill(q, k, v, sel, backend="gather")
    assert out.shape == q.shape and mask.mask.shape == (1, 4, 4, 4)
    assert (out - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 1e-5


# one query; bq > bk; aligned chunk (q_offset a block multiple) with T % block != 0; one-shot with padding
GROUPED_CASES = CASES + [(1, 6, 2, 1, 300, 32, 64, 64), (2, 6, 2, 200, 700, 32, 64, 128),
                         (1, 6, 2, 250, 890, 32, 64, 64), (2, 4, 2, 65, 65, 16, 32, 32)]


def _needs(backend: str) -> None:
    """Skip a ``flash`` case, with the reason, where longlab's C++ kernel cannot be built."""
    if backend == "flash" and not block_flash.available():
        pytest.skip(block_flash.unavailable_reason())


@pytest.mark.parametrize("backend", ["grouped", "flash"])
@pytest.mark.parametrize("sharing", ["per-head", "head-shared", "some-kv-groups-shared"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=_ids)
def test_grouped_backend_equals_masked_softmax(case, sharing, backend):
    # the grouped backend batches q-blocks with equal block counts into one fused call each; flash runs
    # one online softmax per (head, q-block) over its listed blocks
    _needs(backend)
    B, H, H_kv, T_q, T_k, D, bq, bk = case
    q, k, v = _inputs(B, H, H_kv, T_q, T_k, D)
    mask = _random_mask(B, H, T_q, T_k, bq, bk, p=0.4)
    if sharing != "per-head":
        sel = mask.mask.clone()
        g = H // H_kv
        n_shared = H_kv if sharing == "head-shared" else 1  # first KV group's g heads select alike
        for h in range(n_shared * g):
            sel[:, h] = sel[:, (h // g) * g]
        mask = enforce_required(mask.with_mask(sel))
    out = block_sparse_attention(q, k, v, mask, 0.125, backend=backend)
    assert out.shape == (B, H, T_q, D)
    assert (out - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 1e-5


@pytest.mark.parametrize("split_common", [1, 3])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=_ids)
def test_grouped_split_common_equals_masked_softmax(case, split_common):
    # the blocks all g heads of a KV head select run as one packed unit, each head's other blocks apart,
    # the two parts merged by log-sum-exp; masks with a common core plus per-head blocks
    B, H, H_kv, T_q, T_k, D, bq, bk = case
    q, k, v = _inputs(B, H, H_kv, T_q, T_k, D)
    core = _random_mask(B, H_kv, T_q, T_k, bq, bk, p=0.5, seed=2).mask.repeat_interleave(H // H_kv, 1)
    mask = _random_mask(B, H, T_q, T_k, bq, bk, p=0.3)
    mask = enforce_required(mask.with_mask(mask.mask | core))
    out = grouped_block_sparse_attention(q, k, v, mask, 0.125, split_common=split_common)
    assert (out - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 1e-5
    plain = grouped_block_sparse_attention(q, k, v, mask, 0.125, split_common=0)  # pack only alike heads
    assert (plain - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 1e-5
    assert torch.equal(grouped_block_sparse_attention(q, k, v, mask, 0.125, split_common=SPLIT_COMMON),
                       block_sparse_attention(q, k, v, mask, 0.125, backend="grouped"))


@pytest.mark.parametrize("backend", ["grouped", "flash"])
@pytest.mark.parametrize("shape", [(384, 1000), (1000, 1000)])
def test_grouped_backend_full_mask_equals_dense(backend, shape):
    _needs(backend)
    q, k, v = _inputs(1, 6, 2, *shape, 64)
    out = block_sparse_attention(q, k, v, full_mask(1, 6, *shape, 128, 128), backend=backend)
    assert (out - dense_causal_attention(q, k, v)).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["grouped"])
def test_grouped_backends_bf16_within_tolerance_and_keep_dtype(backend):
    q, k, v = _inputs(1, 6, 2, 256, 512, 64)
    mask = _random_mask(1, 6, 256, 512, 64, 64, p=0.4)
    out = block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.125, backend=backend)
    assert out.dtype == torch.bfloat16
    assert (out.float() - _masked_reference(q, k, v, mask, 0.125)).abs().max() <= 3e-2


def test_auto_is_flash_or_grouped_on_cpu_inference_and_differentiable_with_autograd():
    q, k, v = _inputs(1, 6, 2, 300, 700, 32)
    mask = _random_mask(1, 6, 300, 700, 64, 64, p=0.4)
    with torch.no_grad():
        auto = block_sparse_attention(q, k, v, mask, 0.2)
        assert torch.equal(block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.2),
                           block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.2,
                                                  backend="grouped"))  # bf16: not the fp32-only kernel
    fast = "flash" if block_flash.available(q) else "grouped"
    assert torch.equal(auto, block_sparse_attention(q, k, v, mask, 0.2, backend=fast))
    qg = q.clone().requires_grad_()
    out = block_sparse_attention(qg, k, v, mask, 0.2)  # autograd: not a forward-only backend
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert (out.detach() - _masked_reference(q, k, v, mask, 0.2)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="forward only"):
        block_sparse_attention(qg, k, v, mask, 0.2, backend="flash")


@pytest.mark.parametrize("kv_tile", [64, 128, 256, 512, 4096])
def test_flash_key_tiles_and_block_runs_give_the_same_attention(kv_tile):
    # the online softmax over key tiles of any size (a tile may end inside a run of adjacent blocks, hold
    # only diagonal blocks, or hold a row's first visible key), and runs of adjacent blocks as one GEMM
    _needs("flash")
    q, k, v = _inputs(1, 6, 2, 520, 1100, 32)
    sel = _random_mask(1, 6, 520, 1100, 32, 64, p=0.6).mask
    sel[:, 0, :, :8] = True  # a run of 8 adjacent blocks
    mask = enforce_required(BlockSparseMask(sel, 32, 64, 520, 1100))
    out = block_flash.block_flash_attention(q, k, v, mask, 0.2, kv_tile=kv_tile)
    assert (out - _masked_reference(q, k, v, mask, 0.2)).abs().max() <= 1e-5


def test_flash_refuses_what_it_cannot_run_and_can_be_switched_off(monkeypatch):
    q, k, v = _inputs(1, 2, 1, 64, 64, 16)
    mask = full_mask(1, 2, 64, 64, 32, 32)
    assert "float32 only" in block_flash.unavailable_reason(q.double())
    with pytest.raises(RuntimeError, match="float32 only"):
        block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="flash")
    monkeypatch.setenv("LONGLAB_BLOCK_FLASH", "0")
    assert block_flash.unavailable_reason(q) == "disabled by LONGLAB_BLOCK_FLASH=0"
    with torch.no_grad():  # auto falls back to grouped
        assert torch.equal(block_sparse_attention(q, k, v, mask), block_sparse_attention(q, k, v, mask,
                                                                                         backend="grouped"))
