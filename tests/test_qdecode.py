"""The fused decode kernels (longlab.ops.qdecode) against their references.

- quantized decode equals dequantise-then-attend (the layer's own dequantised K/V, masked softmax) on
  random layouts: KIVI (per-channel keys, per-token values) and PM-KVQ (per-token keys with smoothing,
  16-bit sink and window) at every bit width, odd lengths, a residual window partly filled, keys and values
  with main regions of different lengths, GQA, batch > 1 with rows of different lengths, holes left by an
  eviction, a window;
- paged decode equals dense attention masked to the selected slots (and differs from the unmasked one);
- Quest's page selection in one call equals the PyTorch bounds + top-k (and a hand-computed case).
"""

from __future__ import annotations

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabCache, LonglabLayer
from longlab.ops import qdecode
from longlab.quant.storage import ChannelGroupStore, QuantizedLayer, TokenGroupStore, chunked_attention

pytestmark = pytest.mark.skipif(not qdecode.available(), reason=f"qdecode: {qdecode.unavailable_reason()}")


def _reference(layer: QuantizedLayer, q: torch.Tensor, qpos: torch.Tensor, scaling: float,
               window: int | None = None) -> torch.Tensor:
    """Dequantise every slot, then masked softmax attention in float64: q [B, H, 1, D] -> [B, H, 1, D]."""
    k = layer.dequantized_keys().double()
    v = layer.dequantized_values().double()
    B, H, _, D = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    idx = layer.index.long().repeat_interleave(g, 1)[:, :, None, :]  # [B, H, 1, T]
    p = qpos.long().to(q.device)[:, None, None, None]
    vis = (idx >= 0) & (idx <= p)
    if window is not None:
        vis &= idx > p - window
    logits = (q.double() @ k.transpose(-1, -2) * scaling).masked_fill(~vis, float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # a row that sees nothing: zeros
    return (probs @ v).float()


def _layer(B=3, H_kv=2, T=333, D=64, lengths=(333, 290, 17), seed=0, dtype=torch.float32,
           device="cpu") -> LonglabLayer:
    """Rows of different lengths (left padding), random K/V with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, T, D, generator=g, dtype=dtype)
    k[..., 3] *= 8  # an outlier channel (why KIVI quantizes keys per channel)
    v = torch.randn(B, H_kv, T, D, generator=g, dtype=dtype)
    layer = LonglabLayer()
    layer.update(k.to(device), v.to(device))
    valid = torch.zeros(B, T, dtype=torch.bool, device=device)
    for b, n in enumerate(lengths):
        valid[b, T - n:] = True
    layer.mark_padding(valid)
    return layer


def _quantize(layer: LonglabLayer, kind: str, bits: int, sink: int, n_keys: int, n_values: int,
              scale_dtype="float16", fp_dtype=None, lam=None) -> QuantizedLayer:
    D = layer.keys.shape[-1]
    if kind == "kivi":  # per-channel keys in groups of 32 tokens, per-token values in groups of 32 channels
        ks, vs = ChannelGroupStore(bits, 32, scale_dtype), TokenGroupStore(bits, 32, scale_dtype)
    else:  # pmkvq: per-token keys (smoothing) and values, entered at 16 bits and shifted down
        ks = TokenGroupStore(16, min(128, D), scale_dtype, 16, lam)
        vs = TokenGroupStore(16, min(128, D), scale_dtype, 16)
    ql = QuantizedLayer.from_layer(layer, ks, vs, sink=sink, fp_dtype=fp_dtype)
    ql.quantize_keys(n_keys)
    ql.quantize_values(n_values)
    if kind == "pmkvq":
        while ql.key_store.bits > bits:
            ql.key_store.shrink()
            ql.value_store.shrink()
    return ql


def _check(ql: QuantizedLayer, H: int, seed=1, window=None, atol=2e-5):
    B, _, T = ql.index.shape
    D = ql.keys.shape[-1]
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(seed))
    qpos = ql.index.amax(dim=(1, 2)).to(torch.int64)  # the newest token of each row
    scaling = D**-0.5
    ref = _reference(ql, q, qpos, scaling, window)
    out = ql.fused_decode(q, qpos, scaling, window)
    assert out.shape == (B, H, 1, D) and out.dtype == q.dtype
    err = (out - ref).abs().max().item()
    assert err <= atol, f"fused vs dequantise-then-attend: max error {err:.2e}"
    def read(a, b):
        return ql.key_slice(a, b), ql.value_slice(a, b)

    chunked = chunked_attention(q, qpos[:, None], ql.index, read, scaling, window, chunk_tokens=64)
    assert (chunked - ref).abs().max().item() <= atol  # the PyTorch fallback agrees with the same reference
    return out, ref


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["kivi", "pmkvq"])
def test_fused_equals_dequantise_then_attend_at_every_bit_width(kind, bits):
    # B=3 rows of 333, 290, 17 tokens; GQA 3 query heads per KV head; keys main 160 (5 KIVI groups), values
    # main 200 (a window of 133 partly filled); PM-KVQ: 16-bit sink and window, per-token keys with smoothing
    lam = None
    if kind == "pmkvq":
        lam = torch.rand(1, 2, 1, 64, generator=torch.Generator().manual_seed(5)) + 0.5
    fp = torch.float16 if kind == "pmkvq" else None
    ql = _quantize(_layer(), kind, bits, sink=1 if kind == "pmkvq" else 0, n_keys=160, n_values=200,
                   fp_dtype=fp, lam=lam)
    assert ql.key_store.bits == bits and ql.key_store.n == 160 and ql.value_store.n == 200
    _check(ql, H=6)


@pytest.mark.parametrize("D,g,bits,group", [(64, 1, 4, 8), (64, 2, 2, 16), (64, 3, 4, 8), (64, 4, 8, 16),
                                           (64, 6, 4, 32), (128, 3, 4, 16), (128, 5, 2, 64), (32, 3, 2, 8),
                                           (32, 2, 4, 16)])
def test_fused_register_blocked_runs_at_small_scale_groups(D, g, bits, group):
    # per-token keys and values in groups smaller than one pass of the value accumulators (the per-vector
    # group lookup), for head dims 32 / 64 / 128 and 1-6 query heads per KV head (the register-blocked runs
    # and their passes); D=32 at 2 bits falls back to the generic loop
    layer = _layer(D=D, lengths=(333, 290, 17))
    ks = TokenGroupStore(bits, group, "float16")
    vs = TokenGroupStore(bits, group, "float16")
    ql = QuantizedLayer.from_layer(layer, ks, vs)
    ql.quantize_keys(200)
    ql.quantize_values(200)
    _check(ql, H=2 * g)


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_fused_scale_dtypes_and_odd_group_tails(scale_dtype):
    # 101 quantized keys: the last per-channel group holds 5 tokens; no residual values at all
    ql = _quantize(_layer(B=2, T=157, lengths=(157, 101)), "kivi", 4, sink=0, n_keys=101,
                   n_values=157, scale_dtype=scale_dtype)
    assert ql.values.shape[-2] == 0
    _check(ql, H=2)


def test_fused_after_appends_and_an_eviction_with_holes():
    # decode appends into the residual, more keys quantized (the short last group is re-quantized), then an
    # eviction that keeps different slots per head (holes: index -1 inside every region)
    layer = _layer(B=2, H_kv=3, T=200, lengths=(200, 150))
    ql = _quantize(layer, "kivi", 2, sink=4, n_keys=70, n_values=100)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):  # decode steps: each value leaves the window into spare rows of the packed store
        ql.update(torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g))
        ql.quantize_values(1)
    assert ql.value_store.spare_nbytes() > 0 and not ql.value_store.codes.is_contiguous()
    _check(ql, H=9)  # codes read in place from the grown buffers
    ql.quantize_keys(40)
    keep = torch.rand(ql.index.shape, generator=g) < 0.7
    ql.keep(keep)
    assert bool((ql.index < 0).any())
    _check(ql, H=9)  # SmolLM2's grouping: 3 query heads per KV head


def test_fused_sliding_window_and_a_row_that_sees_nothing():
    ql = _quantize(_layer(B=2, T=100, lengths=(100, 60)), "kivi", 4, sink=0, n_keys=64, n_values=80)
    out, ref = _check(ql, H=4, window=37)
    q = torch.randn(2, 4, 1, 64)
    out = ql.fused_decode(q, torch.tensor([99, -1]), 0.125)  # a padding query: no key visible
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(out[0].abs().sum() > 0)


def test_fused_is_the_decode_path_of_the_quant_recipes_and_can_be_switched_off(monkeypatch):
    for recipe, fused in (("kivi4", True), ("kivi2:fused=false", False), ("pmkvq:budget_mb=0.02", True)):
        cache = LonglabCache(recipe)
        layer = _layer(B=1, lengths=(333,))
        cache.layers.append(layer)
        q = torch.randn(1, 6, 1, 64)
        ctx = LayerContext(0, 1, None, "decode", q, 0.125, layer.index[:, 0, -1:], None, layer, cache)
        assert cache.recipe.kv[-1].apply(ctx)
        ql = ctx.layer
        assert isinstance(ql, QuantizedLayer) and ql.uses_fused(q) is fused
        calls = []

        def spy(*args, calls=calls, q=q, **kwargs):
            calls.append(1)
            return torch.zeros_like(q)

        monkeypatch.setattr(qdecode, "quant_decode", spy)
        ql.attend(ctx)
        assert len(calls) == (1 if fused else 0)
        assert not ql.uses_fused(torch.randn(1, 6, 4, 64))  # prefill chunks: the chunked path
        monkeypatch.undo()
    monkeypatch.setenv("LONGLAB_QDECODE", "0")
    assert not qdecode.available() and "LONGLAB_QDECODE=0" in qdecode.unavailable_reason()


# --- per-token quantization ------------------------------------------------------------------------------
def _hard_rows(bits: int) -> torch.Tensor:
    """x [2, 3, 9, 64]: random rows at several scales, plus rows that hit the edge cases: a constant group
    (scale 0), exact ties (round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2), zeros and -0.0, tiny
    subnormal-range spreads, large values."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 9, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0])[None, :, None, None]
    x[0, 0, 0] = 0.75  # constant group
    c = torch.arange(64)  # every group spans [0, 2^bits - 1]: scale 1, offset 0, codes x on exact .5 ties
    x[0, 0, 1] = torch.where(c % 4 == 0, 0.0, torch.where(c % 4 == 1, 2.0**bits - 1, 0.5 + (c // 4 % 3)))
    x[0, 0, 2] = 0.0
    x[0, 0, 2, ::2] = -0.0
    x[0, 0, 3] = torch.randn(64, generator=g) * 1e-6
    x[0, 0, 4] = torch.randn(64, generator=g) * 6e4 / 4
    x[1, 2, 5, :32] = 1.0
    x[1, 2, 5, 32:] = -1.0
    return x


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpp_quantizer_is_bit_identical_to_quantize_tokens_and_pack(bits, scale_dtype):
    """The C++ per-token quantizer gives the same packed codes, scales and offsets as the PyTorch
    reference (directed rounding of the scales, round-half-even codes, planar packing), groups of 16
    and 32."""
    from longlab.quant.quantizer import pack, quantize_tokens

    x = _hard_rows(bits)
    for group in (16, 32):
        codes, scale, offset = quantize_tokens(x, bits, group, scale_dtype)
        got_codes, got_scale, got_offset, finite = qdecode.quantize_tokens_packed(x, bits, group, scale_dtype)
        assert finite and got_scale.dtype == scale.dtype == scale_dtype
        assert torch.equal(got_codes, pack(codes, bits))
        assert torch.equal(got_scale.view(-1).float(), scale.view(-1).float())
        assert torch.equal(got_offset.float(), offset.float())
        assert torch.equal(torch.signbit(got_offset.float()), torch.signbit(offset.float()))
    # a half-precision residual, not contiguous (a slice of a longer window), batch 2
    xh = x.to(torch.bfloat16)[:, :, 2:7]
    codes, scale, offset = quantize_tokens(xh, bits, 32, scale_dtype)
    got_codes, got_scale, got_offset, _ = qdecode.quantize_tokens_packed(xh, bits, 32, scale_dtype)
    assert torch.equal(got_codes, pack(codes, bits)) and torch.equal(got_scale, scale)
    assert torch.equal(got_offset, offset)


def test_cpp_quantizer_refuses_overflow_and_nan_as_the_reference_does():
    from longlab.quant.quantizer import quantize_tokens

    big = torch.zeros(1, 1, 2, 32)
    big[0, 0, 1, 0] = 1e6  # beyond float16
    assert not qdecode.quantize_tokens_packed(big, 4, 32, torch.float16)[3]
    assert qdecode.quantize_tokens_packed(big, 4, 32, torch.bfloat16)[3]
    with pytest.raises(ValueError, match="overflow the torch.float16 scales"):
        quantize_tokens(big, 4, 32, torch.float16)
    nan = torch.zeros(1, 1, 1, 32)
    nan[..., 3] = float("nan")
    assert not qdecode.quantize_tokens_packed(nan, 4, 32, torch.float32)[3]
    store = TokenGroupStore(4, 32)
    store.init_empty(1, 1, 32, torch.device("cpu"))
    with pytest.raises(ValueError, match="overflow the torch.float16 scales"):
        store.append(big, None)


def test_cpp_quantizer_splits_a_prefill_chunk_over_threads_and_still_matches():
    """1,200 rows over 2 threads (grain 256): the same bytes as the reference; a NaN in the last range
    is still reported."""
    from longlab.quant.quantizer import pack, quantize_tokens

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1, 4, 300, 64, generator=torch.Generator().manual_seed(3)) * 4
        codes, scale, offset = quantize_tokens(x, 4, 32)
        got = qdecode.quantize_tokens_packed(x, 4, 32, torch.float16)
        assert got[3] and torch.equal(got[0], pack(codes, 4))
        assert torch.equal(got[1], scale) and torch.equal(got[2], offset)
        x[0, 3, 299, 5] = float("nan")
        assert not qdecode.quantize_tokens_packed(x, 4, 32, torch.float16)[3]
    finally:
        torch.set_num_threads(threads)


def test_value_store_appends_through_the_cpp_quantizer_unless_fused_is_off(monkeypatch):
    """KIVI's value store quantizes each decode step's value with the C++ call; ``fused=false`` (and
    PM-KVQ's 16-bit entry) keep the PyTorch path; both give the same store."""
    calls = []
    real = qdecode.quantize_tokens_packed

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(qdecode, "quantize_tokens_packed", spy)
    x = torch.randn(1, 2, 5, 64)
    stores = []
    for fast in (True, False):
        store = TokenGroupStore(4, 32)
        store.fast = fast
        store.init_empty(1, 2, 64, torch.device("cpu"))
        for t in range(5):
            store.append(x[:, :, t : t + 1], None)
        stores.append(store)
    assert len(calls) == 5
    assert all(torch.equal(a, b) for a, b in zip(stores[0].tensors(), stores[1].tensors()))
    pm = TokenGroupStore(4, 32, entry_bits=16)
    pm.init_empty(1, 2, 64, torch.device("cpu"))
    pm.append(x, None)
    assert len(calls) == 5
    assert _quantize(_layer(B=1, lengths=(40,)), "kivi", 4, 0, 0, 8).value_store.fast
    off = QuantizedLayer(ChannelGroupStore(4, 32), TokenGroupStore(4, 32), fused=False)
    assert not off.value_store.fast and not off.key_store.fast
    later = _quantize(_layer(B=1, lengths=(40,)), "kivi", 4, 0, 0, 8)
    later.fused = False  # one switch: switching it later reaches the quantizer and the decode kernel
    assert not later.value_store.fast and not later.uses_fused(torch.randn(1, 4, 1, 64))


# --- paged sparse decode ------------------------------------------------------------------------------------
def _masked_dense(q, k, v, index, qpos, slots, scaling):
    B, H, _, D = q.shape
    g = H // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    idx = index.long().repeat_interleave(g, 1)
    T = k.shape[2]
    allowed = torch.zeros(B, H, T + 1, dtype=torch.bool)  # column T: where the -1 slots land
    allowed.scatter_(-1, torch.where(slots >= 0, slots, T), True)
    allowed = allowed[..., :T]
    vis = (allowed & (idx >= 0) & (idx <= qpos[:, None, None]))[:, :, None, :]
    logits = (q.double() @ kk.transpose(-1, -2) * scaling).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return (torch.softmax(logits, -1).nan_to_num(0.0) @ vv).float(), lse.float()


@pytest.mark.parametrize("B,H,H_kv,T", [(1, 9, 3, 1000), (3, 4, 2, 517)])
def test_paged_decode_equals_the_masked_dense_reference(B, H, H_kv, T):
    g = torch.Generator().manual_seed(B * T)
    D, P = 64, 16
    buf_k, buf_v = torch.randn(B, H_kv, T + 40, D, generator=g), torch.randn(B, H_kv, T + 40, D, generator=g)
    k, v = buf_k[:, :, :T], buf_v[:, :, :T]  # views with spare slots, as the cache holds them
    index = torch.arange(T, dtype=torch.int32).expand(B, H_kv, T).clone()
    index[-1, :, :50] = -1  # a shorter row
    qpos = torch.full((B,), T - 1)
    n_pages = (T - 1) // P
    pages = torch.stack([torch.randperm(n_pages, generator=g)[:7] for _ in range(B * H)]).reshape(B, H, 7)
    pages = pages.sort(-1).values
    from longlab.decode.quest import page_slots

    slots = page_slots(pages, P, T)
    q = torch.randn(B, H, 1, D, generator=g)
    out, lse = qdecode.paged_decode(q, k, v, index, qpos, slots, 0.125)
    ref, ref_lse = _masked_dense(q, k, v, index, qpos, slots, 0.125)
    assert (out - ref).abs().max() <= 2e-5 and (lse - ref_lse).abs().max() <= 2e-5
    everything = torch.arange(T).expand(B, H, T)
    dense, _ = _masked_dense(q, k, v, index, qpos, everything, 0.125)
    assert (out - dense).abs().max() > 1e-2  # it did read only the selected pages
    empty = torch.full((B, H, 3), -1)
    out0, lse0 = qdecode.paged_decode(q, k, v, index, qpos, empty, 0.125)
    assert torch.equal(out0, torch.zeros_like(out0)) and bool(torch.isinf(lse0).all())


@pytest.mark.parametrize("D", [32, 48, 64, 128])
def test_paged_decode_tiles_any_slot_list_at_every_head_size(D):
    """Slot lists in any order, with -1, out-of-range and hidden slots scattered through the tiles (so a
    tile's visible rows are not a multiple of 8 or 16), longer than several tiles, at the head sizes the
    register paths take (32 / 64 / 128) and one they do not (48): equal to the masked dense reference."""
    g = torch.Generator().manual_seed(D)
    B, H, H_kv, T, S = 2, 6, 2, 700, 301
    k, v = torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g)
    index = torch.arange(T, dtype=torch.int32).expand(B, H_kv, T).clone()
    index[:, :, torch.randperm(T, generator=g)[:90]] = -1  # evicted slots
    qpos = torch.tensor([T - 1, T - 200])  # row 1 cannot see its last 199 positions
    slots = torch.stack([torch.randperm(T, generator=g)[:S] for _ in range(B * H)]).reshape(B, H, S)
    slots[:, :, ::13] = -1
    slots[:, :, 5::29] = T + 3  # out of range: skipped
    q = torch.randn(B, H, 1, D, generator=g) * 2
    out, lse = qdecode.paged_decode(q, k, v, index, qpos, slots, D ** -0.5)
    ref, ref_lse = _masked_dense(q, k, v, index, qpos, slots.masked_fill(slots >= T, -1), D ** -0.5)
    assert (out - ref).abs().max() <= 2e-5 and (lse - ref_lse).abs().max() <= 2e-5
    # one list per KV head, shared by its 3 query heads (read once for them): as if each head had it
    shared = slots[:, ::3].contiguous()  # [B, H_kv, S]
    out, lse = qdecode.paged_decode(q, k, v, index, qpos, shared, D ** -0.5)
    each = shared.repeat_interleave(3, 1)
    ref, ref_lse = _masked_dense(q, k, v, index, qpos, each.masked_fill(each >= T, -1), D ** -0.5)
    assert (out - ref).abs().max() <= 2e-5 and (lse - ref_lse).abs().max() <= 2e-5
    with pytest.raises(RuntimeError, match="slots"):
        qdecode.paged_decode(q, k, v, index, qpos, slots[:, :4].contiguous(), D ** -0.5)


@pytest.mark.parametrize("recipe", ["quest:budget=64,page_size=8",
                                    "quest:budget=64,page_size=8,selection=group",
                                    "retro:budget=64,page_size=8,refresh=false",
                                    "retro:budget=64,page_size=8,selection=group"])
def test_quest_and_retro_read_their_pages_with_the_paged_kernel(recipe, monkeypatch):
    # decode steps of a 300-token layer: the fused page read equals the PyTorch gather (attend_slots) step
    # by step (RetroAttention's output cache and page table included), and the kernel is what ran
    def run(fused: bool):
        cache = LonglabCache(recipe + f",fused={str(fused).lower()}")
        g = torch.Generator().manual_seed(3)
        layer = LonglabLayer()
        layer.update(torch.randn(2, 3, 300, 64, generator=g), torch.randn(2, 3, 300, 64, generator=g))
        layer.mark_padding(torch.arange(300)[None].expand(2, 300) >= torch.tensor([[0], [40]]))
        cache.layers.extend([LonglabLayer(), LonglabLayer(), layer])  # layer 2: past Quest's dense layers
        outs = []
        for _ in range(4):
            layer.update(torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g))
            q = torch.randn(2, 9, 1, 64, generator=g)
            ctx = LayerContext(2, 3, None, "decode", q, 0.125, layer.index[:, 0, -1:], None, layer, cache)
            assert cache.recipe.decode.uses_fused(q, ctx.k) is fused
            outs.append(cache.recipe.decode.attend(ctx))
        return torch.cat(outs, 2), {k: v.clone() for k, v in layer.state.items()}

    calls, selects = [], []
    real, real_select = qdecode.paged_decode, qdecode.page_select
    monkeypatch.setattr(qdecode, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(qdecode, "page_select", lambda *a, **k: selects.append(1) or real_select(*a, **k))
    fused, state_f = run(True)
    assert len(calls) == 4 and len(selects) == 4  # pages chosen and read by the kernels
    plain, state_p = run(False)
    assert len(calls) == 4 and len(selects) == 4
    assert (fused - plain).abs().max() <= 2e-5
    for key in state_p:
        assert (state_f[key].float() - state_p[key].float()).abs().max() <= 2e-5, key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/decode_speed_gpu.sh)")
def test_on_cuda_the_quant_layer_falls_back_to_the_pytorch_path_exactly():
    # no Triton/CUDA kernel yet: a CUDA layer takes the chunked PyTorch path (dequantise in chunks, online
    # softmax), which must equal dequantise-then-attend there too
    ql = _quantize(_layer(device="cuda"), "kivi", 4, sink=0, n_keys=160, n_values=200)
    q = torch.randn(3, 6, 1, 64, device="cuda")
    qpos = ql.index.amax(dim=(1, 2)).to(torch.int64)
    assert not ql.uses_fused(q)
    ctx = LayerContext(0, 1, None, "decode", q, 0.125, qpos[:, None], None, ql, None)
    ref = _reference(ql, q, qpos, 0.125)
    assert (ql.attend(ctx) - ref).abs().max().item() <= 2e-5


@pytest.mark.parametrize("split", [2, 5])
def test_fused_slot_ranges_merged_by_log_sum_exp(split, monkeypatch):
    # with several threads a (row, KV head) is cut into slot ranges merged by log-sum-exp; a range may hold
    # only invisible slots (the short row's padding) or only the residual
    monkeypatch.setattr(qdecode, "_split", lambda B, H_kv, T: split)
    ql = _quantize(_layer(), "kivi", 4, sink=2, n_keys=160, n_values=200)
    _check(ql, H=6, window=150)
    _check(ql, H=6)


# --- Quest page selection in one call -------------------------------------------------------------
def test_page_select_hand_computed_bounds_top_pages_and_ties():
    # U_p = q.center_p + |q|.radius_p, D = 2 (the scalar tail): q = [1, -2]
    center = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [9.0, -9.0]])
    radius = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    ok = torch.tensor([True, True, True, True, False])  # page 4 holds no token: -inf (its bound would be 27)
    c, r, o = center[None, None], radius[None, None], ok[None, None]  # [1, 1, 5, 2]
    q = torch.tensor([[[1.0, -2.0]]])  # [1, 1, 2]: U = [0, 1, -2, 3, -inf]
    T, P = 6 * 4 + 3, 4  # six complete pages, a last one of 3 slots; five summarised
    slots, pages = qdecode.page_select(q, c, r, o, 2, P, T, False)
    assert pages.tolist() == [[[1, 3]]]  # the two largest bounds, ascending (inverted rule: [2, 0])
    assert slots.tolist() == [[[4, 5, 6, 7, 12, 13, 14, 15, 24, 25, 26]]]  # then the last page's slots
    # group: a second query head [-1, 0] scores [0, -1, 0, 1, -]; the group's bound is the max: [0, 1, 0, 3]
    q2 = torch.tensor([[[1.0, -2.0], [-1.0, 0.0]]])
    _, pages = qdecode.page_select(q2, c, r, o, 3, P, T, True)
    assert pages.tolist() == [[[0, 1, 3]]]  # pages 0 and 2 tie at 0: the lower page is kept
    _, pages = qdecode.page_select(q2, c, r, o, 2, P, T, False)  # per head: each its own top 2
    assert pages.tolist() == [[[1, 3], [0, 3]]]
    with pytest.raises(RuntimeError, match="select"):
        qdecode.page_select(q, c, r, o, 6, P, T, False)  # k > n


@pytest.mark.parametrize("D,group", [(64, False), (64, True), (48, False), (48, True)])
def test_page_select_equals_the_pytorch_bounds_and_topk(D, group):
    from longlab.decode.quest import PageSummary, page_scores, page_slots

    gen = torch.Generator().manual_seed(D + group)
    B, H, H_kv, n, k, P = 2, 6, 2, 150, 37, 8
    center, radius = torch.randn(B, H_kv, n, D, generator=gen), torch.rand(B, H_kv, n, D, generator=gen)
    ok = torch.rand(B, H_kv, n, generator=gen) > 0.1
    q = torch.randn(B, H, D, generator=gen)
    T = (n + 1) * P + 5
    slots, pages = qdecode.page_select(q, center, radius, ok, k, P, T, group)
    u = page_scores(q, PageSummary(center, radius, ok, torch.zeros(B, H_kv, n, 2)))  # [B, H, n]
    if group:
        u = u.reshape(B, H_kv, H // H_kv, n).amax(2)
    ref = u.topk(k, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(pages, ref)
    assert torch.equal(slots, page_slots(ref, P, T))
    assert not torch.equal(pages, (-u).topk(k, dim=-1).indices.sort(dim=-1).values)


def test_page_marks_match_sees_a_repacked_page():
    index = torch.arange(40, dtype=torch.int32).expand(2, 3, 40).clone()
    n, P = 4, 8
    idx = index[..., : n * P].reshape(2, 3, n, P)
    marks = torch.stack([idx[..., 0], idx[..., -1]], -1).contiguous()
    assert qdecode.page_marks_match(index, marks, P)
    index[1, 2, 3 * P + P - 1] = -1  # the last page's last slot emptied by an eviction
    assert not qdecode.page_marks_match(index, marks, P)
    index[1, 2, 3 * P + P - 1] = 3 * P + P - 1
    index[0, 0, P + 3] = -1  # a slot inside a page (not a mark) changes nothing the check reads
    assert qdecode.page_marks_match(index, marks, P)
