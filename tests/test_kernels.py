"""Every kernel x every mask equals naive fp64 attention (forward and backward), within dtype tolerance."""

from __future__ import annotations

import pytest
import torch

from longlab.ops.kernels import (
    KERNELS,
    attention,
    backward_unsupported_reason,
    flops,
    prepare,
    run,
    unavailable_reason,
)
from longlab.ops.masks import MASKS, SliceMask, make_mask
from longlab.recipe import LonglabError

T = 203
BLOCK = 64
KW = {
    "FULL_DOCUMENT": {"lengths": [37, 5, 60, 1, 70, 30]},
    "CAUSAL_DOCUMENT": {"lengths": [37, 5, 60, 1, 70, 30]},
    "PREFIX_LM_DOCUMENT": {"lengths": [37, 5, 60, 1, 70, 30]},
    "BLOCK_CAUSAL_DOCUMENT": {"lengths": [37, 5, 60, 1, 70, 30], "block": 16},
    "SLIDING_WINDOW": {"window": 40},
    "SLIDING_WINDOW_CAUSAL": {"window": 40},
    "SHARE_QUESTION": {"question": 50, "answers": [40, 13, 100]},
    "CAUSAL_BLOCKWISE": {"block": 48},
    "PREFIX_LM_CAUSAL": {"prefix": 70},
    "GLOBAL_SLIDING_WINDOW": {"n_global": 9, "window": 40},
    "RANDOM_BLOCK_0.2": {"block": BLOCK, "seed": 3},
    "RANDOM_BLOCK_0.5": {"block": BLOCK, "seed": 3},
    "RANDOM_BLOCK_0.8": {"block": BLOCK, "seed": 3},
}
CPU_KERNELS = ["naive", "sdpa-math", "sdpa", "flex-eager", "gather", "grouped", "executor-gather",
               "executor-flex", "executor-split", "executor-grouped", "executor-flash"]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _mask(name: str) -> SliceMask:
    return make_mask(name, T, **KW.get(name, {}))


def _qkv(dtype=torch.float32, H=4, H_kv=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, D, generator=g)
    k = torch.randn(1, H_kv, T, D, generator=g)
    v = torch.randn(1, H_kv, T, D, generator=g)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _reference(q, k, v, mask: SliceMask):
    """fp64 masked softmax attention with autograd. -> out [B, H, T, D], grads of (q, k, v) for a fixed dO"""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    dense = mask.to_sdpa_mask()
    logits = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    p = torch.softmax(logits.masked_fill(~dense, float("-inf")), -1)
    out = p @ v64.repeat_interleave(g, 1)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out.backward(dout)
    return out.detach(), dout, (q64.grad, k64.grad, v64.grad)


def _skip_if_unavailable(kernel, mask):
    reason = unavailable_reason(kernel, mask, "cpu", BLOCK)
    if reason is not None:
        assert kernel.startswith("executor") and ("to_block_sparse" in reason or kernel == "executor-flash")
        pytest.skip(reason)


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_kernel_forward_backward_equal_naive_fp64(kernel, name):
    mask = _mask(name)
    _skip_if_unavailable(kernel, mask)
    q, k, v = _qkv()
    ref, dout, grads = _reference(q, k, v, mask)
    no_bwd = backward_unsupported_reason(kernel, "cpu")
    if no_bwd:
        q, k, v = (x.detach() for x in (q, k, v))
    out = attention(q, k, v, mask, kernel, block=BLOCK)
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max() <= TOL[torch.float32]
    if no_bwd:
        assert "flex" in kernel or kernel in ("executor-split", "grouped", "executor-grouped",
                                              "executor-flash")
        return
    out.backward(dout.float())
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert (got.double() - want).abs().max() <= 10 * TOL[torch.float32]


@pytest.mark.parametrize("name", ["CAUSAL", "CAUSAL_DOCUMENT", "SLIDING_WINDOW", "SHARE_QUESTION"])
@pytest.mark.parametrize("kernel", ["naive", "sdpa", "flex-eager", "gather", "grouped"])
def test_kernel_bf16_within_tolerance(kernel, name):
    mask = _mask(name)
    q, k, v = _qkv(torch.bfloat16)
    ref, _, _ = _reference(q, k, v, mask)
    out = attention(q.detach(), k.detach(), v.detach(), mask, kernel, block=BLOCK)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= TOL[torch.bfloat16]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
def test_compiled_flex_forward_equal_naive_fp64(name):
    mask = _mask(name)
    q, k, v = _qkv()
    ref, _, _ = _reference(q, k, v, mask)
    out = attention(q.detach(), k.detach(), v.detach(), mask, "flex", block=BLOCK)
    assert (out.double() - ref).abs().max() <= TOL[torch.float32]


@pytest.mark.slow
def test_compiled_flex_one_document_mask():
    mask = _mask("CAUSAL_DOCUMENT")
    q, k, v = (x.detach() for x in _qkv(H=2, H_kv=1, D=16))
    ref, _, _ = _reference(q, k, v, mask)
    assert (attention(q, k, v, mask, "flex", block=BLOCK).double() - ref).abs().max() <= TOL[torch.float32]


def test_gqa_heads_read_their_kv_head():
    # H=6 over H_kv=2: heads 0-2 read KV head 0; changing KV head 1 leaves them unchanged
    mask = _mask("CAUSAL_DOCUMENT")
    q, k, v = (x.detach() for x in _qkv(H=6, H_kv=2))
    prep = prepare("gather", mask, block=BLOCK)
    a = run(q, k, v, prep)
    k2, v2 = k.clone(), v.clone()
    k2[:, 1] += 1.0
    v2[:, 1] *= 2.0
    b = run(q, k2, v2, prep)
    assert torch.equal(a[:, :3], b[:, :3]) and not torch.allclose(a[:, 3:], b[:, 3:])


def test_rows_without_keys_are_zero():
    # a hand-made mask whose rows 0..3 see nothing
    mask = SliceMask([[4, 10]], [[0, 10]], ["causal"], 10, 10)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    kerns = ("naive", "sdpa-math", "sdpa", "gather")
    outs = {kern: attention(q, k, v, mask, kern, block=4) for kern in kerns}
    for kern, o in outs.items():
        assert torch.equal(o[:, :, :4], torch.zeros_like(o[:, :, :4])), kern
        assert (o - outs["naive"]).abs().max() < 1e-5, kern


def test_flops_from_unmasked_area():
    m = make_mask("CAUSAL", 100)
    assert flops(m, H=9, D=64) == 4 * (100 * 101 // 2) * 9 * 64
    assert flops(m, H=9, D=64, backward=True) == 2.5 * flops(m, H=9, D=64)


def test_unavailable_kernels_say_why():
    assert "CUDA" in unavailable_reason("flash-attn", device="cpu")
    assert "CUDA" in unavailable_reason("flashinfer", device="cpu")
    assert unavailable_reason("sdpa") is None
    with pytest.raises(LonglabError, match="kernel must be one of"):
        unavailable_reason("fa9")
    with pytest.raises(LonglabError, match="CUDA"):
        prepare("flash-attn", make_mask("CAUSAL", 16))
    with pytest.raises(LonglabError, match="to_block_sparse"):
        prepare("executor-gather", make_mask("FULL", 256))
    assert set(CPU_KERNELS) | {"flex", "flash-attn", "flashinfer"} == set(KERNELS)


def test_bad_shapes_name_the_problem():
    m = make_mask("CAUSAL", 16)
    q = torch.randn(1, 3, 16, 8)
    k = torch.randn(1, 2, 16, 8)
    with pytest.raises(LonglabError, match="multiple of H_kv"):
        attention(q, k, k, m)
    with pytest.raises(LonglabError, match="mask is 16x16"):
        attention(torch.randn(1, 2, 8, 8), k[:, :, :8], k[:, :, :8], m)


# (B, H, H_kv, T_q, T_k, D, bq, bk): block sizes that differ, tails, chunked prefill (cached keys first)
SPLIT_CASES = [(2, 4, 2, 256, 256, 32, 64, 64), (1, 6, 2, 1000, 1000, 32, 128, 128),
               (1, 4, 1, 300, 1000, 32, 64, 64), (1, 4, 4, 512, 512, 32, 64, 32),
               (1, 2, 1, 77, 513, 32, 32, 64), (1, 3, 3, 200, 200, 16, 32, 64)]


def _split_id(c):
    return "B{}-H{}-Hkv{}-Tq{}-Tk{}-D{}-bq{}-bk{}".format(*c)


@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "head-shared"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=_split_id)
def test_split_executor_equals_masked_softmax(case, shared):
    from longlab.ops.kernels import split_block_sparse_attention
    from longlab.sparse.blockmask import BlockSparseMask, enforce_required

    B, H, H_kv, T_q, T_k, D, bq, bk = case
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, H, T_q, D, generator=g), torch.randn(B, H_kv, T_k, D, generator=g), \
        torch.randn(B, H_kv, T_k, D, generator=g)
    raw = torch.rand(B, H, -(-T_q // bq), -(-T_k // bk), generator=g) < 0.4
    if shared:  # every head the same blocks; batch row 0 keeps only the required ones
        raw = raw[:, :1].expand(B, H, -1, -1).clone()
        raw[0] = False
    mask = enforce_required(BlockSparseMask(raw, bq, bk, T_q, T_k))
    elem = mask.to_element_mask()  # [B, H, T_q, T_k]
    kr, vr = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
    ref = torch.softmax((q @ kr.transpose(-1, -2) * 0.2).masked_fill(~elem, float("-inf")), -1) @ vr
    out = split_block_sparse_attention(q, k, v, mask, 0.2)
    assert (out - ref).abs().max() < 2e-5


@pytest.mark.parametrize("name", list(MASKS))
def test_gather_inference_path_equals_naive_fp64(name):
    # without autograd, "gather" runs full and partial blocks as two fused calls merged by log-sum-exp
    mask = _mask(name)
    q, k, v = (x.detach() for x in _qkv())
    ref, _, _ = _reference(q, k, v, mask)
    with torch.inference_mode():
        out = attention(q, k, v, mask, "gather", block=BLOCK)
    assert (out.double() - ref).abs().max() <= TOL[torch.float32]


def test_gather_inference_path_zeroes_rows_without_keys():
    mask = SliceMask([[4, 10], [0, 2]], [[0, 10], [12, 16]], ["causal", "full"], 10, 16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 10, 8, generator=g)
    k, v = torch.randn(1, 1, 16, 8, generator=g), torch.randn(1, 1, 16, 8, generator=g)
    with torch.inference_mode():
        fast = attention(q, k, v, mask, "gather", block=4)
    assert torch.isfinite(fast).all()
    assert (fast - attention(q, k, v, mask, "naive")).abs().max() < 1e-5


def test_executor_split_backend_equals_gather_backend():
    from longlab.sparse.blockmask import BlockSparseMask
    from longlab.sparse.executor import block_sparse_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 6, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g), \
        torch.randn(1, 2, 300, 32, generator=g)
    mask = BlockSparseMask(torch.rand(1, 6, 5, 5, generator=g) < 0.5, 64, 64, 300, 300)
    a = block_sparse_attention(q, k, v, mask, 0.1, backend="split")
    b = block_sparse_attention(q, k, v, mask, 0.1, backend="gather")
    assert (a - b).abs().max() < 1e-5


def test_gather_inference_merge_ignores_a_part_a_row_sees_nothing_in():
    # rows 2-3 see block 0 fully but nothing of the partial block 1: that part must weigh 0 in the merge
    # (aten's CPU flash kernel reports lse 0, not -inf, for a row whose keys are all masked)
    mask = SliceMask([[0, 8], [0, 2]], [[0, 4], [4, 6]], ["full", "full"], 8, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(3))
    with torch.inference_mode():
        fast = attention(q, k, v, mask, "gather", block=4)
    assert (fast - attention(q, k, v, mask, "naive")).abs().max() < 1e-5


@pytest.mark.parametrize("mask", [
    SliceMask([[4, 10], [0, 2]], [[0, 10], [12, 16]], ["causal", "full"], 10, 16),  # rows 2-3 see nothing
    SliceMask([[0, 8], [0, 2]], [[0, 4], [4, 6]], ["full", "full"], 8, 8),  # rows 2-7 see no partial key
], ids=["empty-rows", "empty-part"])
def test_grouped_kernel_rows_without_keys_and_empty_parts(mask):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, mask.q_len, 8, generator=g)
    k, v = (torch.randn(1, 1, mask.k_len, 8, generator=g) for _ in range(2))
    fast = attention(q, k, v, mask, "grouped", block=4)
    assert torch.isfinite(fast).all()
    assert (fast - attention(q, k, v, mask, "naive")).abs().max() < 1e-5


def test_grouped_kernel_checks_the_gqa_it_was_prepared_for():
    mask = _mask("CAUSAL")
    q, k, v = (x.detach() for x in _qkv())
    with pytest.raises(LonglabError, match="gqa"):
        run(q, k, v, prepare("grouped", mask, "cpu", BLOCK, gqa=1))
