"""KV quantization: quantizer bounds, equivalent right shift, packed storage, KIVI and PM-KVQ end to end."""

from __future__ import annotations

import json

import pytest
import torch

from longlab.attention import LayerContext, dense_attention
from longlab.cache import LonglabCache, LonglabLayer
from longlab.engine.stream import Stream
from longlab.generation import generate
from longlab.quant import PMKVQ, ChannelGroupStore, QuantizedLayer, TokenGroupStore, layer_bytes
from longlab.quant.pmkvq import code_bytes
from longlab.quant.quantizer import (
    dequantize_channels,
    dequantize_tokens,
    equivalent_right_shift,
    pack,
    quantize_channels,
    quantize_tokens,
    unpack,
)
from longlab.recipe import LonglabError, parse_method, parse_recipe


def _kv(B=1, H_kv=2, T=300, D=16, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, T, D, generator=g)
    if outlier:
        k[..., 3] = k[..., 3] * 10 + 5  # a key outlier channel, as in real models
    return k, torch.randn(B, H_kv, T, D, generator=g)


def _ctx(layer, q, phase="prefill", layer_idx=0, num_layers=2, cache=None):
    T_q = q.shape[2]
    return LayerContext(
        layer_idx,
        num_layers,
        None,
        phase,
        q,
        q.shape[-1] ** -0.5,
        layer.index[:, 0, -T_q:],
        None,
        layer,
        cache,
    )


def _quantized(recipe: str, k, v, T_q=8, seed=1):
    """A LonglabLayer holding k, v, converted by the recipe's quant policy as the hook would."""
    cache = LonglabCache(recipe)
    layer = LonglabLayer()
    layer.update(k, v)
    cache.layers.append(layer)
    q = torch.randn(
        k.shape[0], 2 * k.shape[1], T_q, k.shape[-1], generator=torch.Generator().manual_seed(seed)
    )
    ctx = _ctx(layer, q, cache=cache, num_layers=1)
    assert cache.recipe.kv[-1].apply(ctx)
    return ctx.layer, ctx


def _owns_its_storage(t: torch.Tensor) -> bool:
    """Not a view into a larger buffer: the bytes counted are the bytes allocated."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


# --- quantizer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 32), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 32 * bits // 8
    assert torch.equal(unpack(packed, bits).long(), codes)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_round_trip_error_within_half_a_step(bits, scale_dtype):
    # |x - x_hat| <= s/2, s the *stored* scale (offset rounded down, scale up: the grid covers [min, max]).
    k, _ = _kv(T=100, D=32)
    codes, scale, offset = quantize_tokens(k, bits, 16, scale_dtype)  # per token, groups of 16 channels
    err = (dequantize_tokens(codes, scale, offset) - k).abs().reshape(1, 2, 100, 2, 16)
    slack = 4e-6 * k.abs().max()  # fp32 arithmetic of (x - lo) / s
    assert bool((err <= scale.float()[..., None] / 2 + slack).all())
    codes, scale, offset = quantize_channels(k, bits, 32, scale_dtype=scale_dtype)  # per channel, 32 tokens
    x_hat = dequantize_channels(codes, scale, offset, 32)
    which = torch.arange(100) // 32
    assert bool(((x_hat - k).abs() <= scale.float()[:, :, which] / 2 + slack).all())
    assert scale.shape == (1, 2, 4, 32)  # ceil(100 / 32) groups; the last has 4 tokens


def test_channel_groups_ignore_empty_slots():
    k, _ = _kv(T=32, D=8)
    valid = torch.ones(1, 2, 32, dtype=torch.bool)
    valid[:, :, 20:] = False
    poisoned = k.clone()
    poisoned[:, :, 20:] = 1e4  # empty slots must not stretch the range
    _, scale, offset = quantize_channels(poisoned, 2, 32, valid)
    _, ref_scale, ref_offset = quantize_channels(k[:, :, :20], 2, 32)
    assert torch.equal(scale, ref_scale) and torch.equal(offset, ref_offset)


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_equivalent_right_shift_is_round_q_over_2b_plus_1_for_every_code(bits):
    # Exhaustive. 2^b' + 1 is odd, so q / (2^b' + 1) is never a tie: the paper's integer formula and
    # round-to-nearest agree on every representable q (no tie-breaking difference to bound).
    h = bits // 2
    q = torch.arange(2**bits, dtype=torch.int64)
    shifted = equivalent_right_shift(q, bits)
    exact = torch.div(
        2 * q + (2**h + 1), 2 * (2**h + 1), rounding_mode="floor"
    )  # floor(q/n + 1/2), integers only
    assert int((shifted - exact).abs().max()) <= 1  # the bound the issue allows at ties ...
    assert torch.equal(shifted, exact)  # ... and in fact there are none
    assert int(shifted.max()) == 2**h - 1 and int(shifted.min()) == 0


def test_progressive_shrink_error_bound():
    # After b -> b/2: |x_hat' - x_hat| <= s'/2 (plus the fp16 rounding of s'), so |x - x_hat'| <= s/2 + s'/2.
    k, _ = _kv(T=64, D=16)
    store = TokenGroupStore(16, 16, "float16", entry_bits=16)
    store.init_empty(1, 2, 16, k.device)
    store.append(k, torch.ones(1, 2, 64, dtype=torch.bool))
    prev_scale = store.scale.float().clone()
    bound = prev_scale / 2
    for bits in (8, 4, 2):
        store.shrink()
        assert store.bits == bits and store.codes.shape[-1] == 16 * bits // 8
        s = store.scale.float()
        bound = bound + s / 2 + (2**bits - 1) * (s - prev_scale * (2**bits + 1)).abs()
        err = (store.dequantize(0, 64) - k).abs()
        assert bool((err <= bound + 1e-5).all())
        prev_scale = s


# --- storage ----------------------------------------------------------------------------------------
def test_kivi_regions_follow_the_paper():
    k, v = _kv(T=300)
    layer, _ = _quantized("kivi2", k, v)
    # Keys: blocks of R = 128 (256 quantized, 44 in full precision); values: exactly the last R in fp.
    assert (layer.key_store.n, layer.keys.shape[-2]) == (256, 44)
    assert (layer.value_store.n, layer.values.shape[-2]) == (172, 128)
    assert layer.key_store.scale.shape == (1, 2, 256 // 32, 16)  # per channel, groups of 32 tokens
    assert layer.value_store.scale.shape == (1, 2, 172, 1)  # per token, one group of head_dim = 16 channels
    assert torch.equal(layer.dequantized_keys()[:, :, 256:], k[:, :, 256:])
    assert torch.equal(layer.dequantized_values()[:, :, 172:], v[:, :, 172:])


def test_kivi_decode_steps_flush_keys_in_blocks_and_slide_values(tokenizer):
    k, v = _kv(T=200)
    layer, ctx = _quantized("kivi4", k, v)
    policy = ctx.cache.recipe.kv[-1]
    for step in range(60):
        layer.update(*[t[:, :, :1] for t in _kv(T=1, seed=step + 10)])
        ctx.layer = layer
        policy.apply(ctx)
        assert layer.values.shape[-2] == 128
        assert layer.keys.shape[-2] == (200 + step + 1) % 128
    assert layer.index[0, 0].tolist() == list(range(260))


def test_nbytes_is_the_bytes_of_the_tensors_held():
    k, v = _kv(B=2, T=300)
    for recipe in ("kivi2", "kivi4", "pmkvq:budget_mb=0.3"):
        layer, _ = _quantized(recipe, k, v)
        layer.extras["state"] = torch.zeros(2, 2, 300)
        held = layer.tensors()
        assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)
        assert all(_owns_its_storage(t) for t in held)
        codes = [t for t in held if t.dtype == torch.uint8]
        assert codes, "packed integer codes are held"
        layer.keep(torch.rand(2, 2, 300, generator=torch.Generator().manual_seed(0)) > 0.4)
        held = layer.tensors()
        assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)
        assert all(_owns_its_storage(t) for t in held)


def test_kivi2_is_about_an_eighth_of_fp32_at_length():
    k, v = _kv(T=4096, D=64, outlier=False)
    layer, _ = _quantized("kivi2", k, v)
    full = 2 * k.numel() * 4
    # codes 2/32 of fp32 + fp16 scales/offsets + the 128-token value residual + int32 index
    assert 0.08 < layer.nbytes() / full < 0.13


def test_pmkvq_bytes_model_matches_nbytes():
    k, v = _kv(T=300)
    # 0.025 MiB: 16-bit code words (38400 B) exceed it, 8-bit ones (22016 B) fit -> one halving
    for budget, bits in ((10.0, 16), (0.025, 8)):
        layer, ctx = _quantized(f"pmkvq:budget_mb={budget}", k, v)
        assert layer.key_store.bits == bits
        w = layer.keys.shape[-2]
        assert layer.nbytes() == layer_bytes(300, bits, 2, 16, window_tokens=w)
        assert layer.code_nbytes() == code_bytes(300, bits, 2, 16, window_tokens=w)
        assert layer.overhead_nbytes() == layer.nbytes() - layer.code_nbytes() > 0
        assert w == (300 - 1) % 128  # sink 1, whole windows of 128 flushed


@pytest.mark.parametrize("recipe", ["kivi2", "kivi4", "pmkvq:budget_mb=0.05"])
def test_attention_over_quantized_layer_equals_attention_over_its_dequantised_copy(recipe):
    k, v = _kv(T=300)
    layer, ctx = _quantized(recipe, k, v, T_q=8)
    layer.chunk_tokens = 64  # several chunks merged by the online softmax
    ours = layer.attend(ctx)
    ref = dense_attention(
        ctx.q, layer.dequantized_keys(), layer.dequantized_values(), ctx.mask(), ctx.scaling
    )
    assert (ours - ref).abs().max() <= 1e-5


def test_keep_moves_per_token_codes_exactly_and_requantizes_key_channels():
    k, v = _kv(T=300)
    layer, ctx = _quantized("kivi4", k, v)
    before_v = layer.dequantized_values()
    mask = torch.zeros(1, 2, 300, dtype=torch.bool)
    mask[0, 0, ::2] = True  # head 0 keeps 150 entries, head 1 keeps 100: padded per-head layout
    mask[0, 1, ::3] = True
    layer.keep(mask)
    # Each region (key main, value main, residuals) is repacked on its own: a shorter head's empty
    # slots sit at the end of each region, and positions stay in stream order.
    assert layer.index[0, 0].tolist() == list(range(0, 300, 2))
    held = layer.index[0, 1] >= 0
    assert layer.index[0, 1][held].tolist() == list(range(0, 300, 3))
    assert int((~held).sum()) == 50
    after_v = layer.dequantized_values()
    assert torch.equal(after_v[0, 0], before_v[0, 0, ::2])  # per-token codes travel with their token
    assert torch.equal(after_v[0, 1][held], before_v[0, 1, ::3])
    # keys were re-quantized per channel in fresh groups: within one 4-bit step of the original
    step = (k.amax(2) - k.amin(2)) / 15  # [B, H, D] an upper bound on any group's scale
    kept_k = layer.dequantized_keys()
    assert bool(((kept_k[0, 0] - k[0, 0, ::2]).abs() <= step[0, 0] * 1.01).all())
    assert bool(((kept_k[0, 1][held] - k[0, 1, ::3]).abs() <= step[0, 1] * 1.01).all())
    ours = layer.attend(_ctx(layer, torch.randn(1, 4, 1, 16), phase="decode"))
    assert torch.isfinite(ours).all()


def test_channel_store_requantizes_a_short_last_group_with_new_tokens():
    k, _ = _kv(T=50, D=8)
    store = ChannelGroupStore(8, 32)
    store.init_empty(1, 2, 8, k.device)
    store.append(k[:, :, :40], torch.ones(1, 2, 40, dtype=torch.bool))  # groups [0, 32), [32, 40)
    first_short = store.scale[:, :, 1:2].float().clone()
    store.append(k[:, :, 40:], torch.ones(1, 2, 50, dtype=torch.bool))  # [32, 50) re-quantized together
    assert store.n == 50 and store.scale.shape[-2] == 2
    which = torch.arange(50) // 32
    bound = store.scale.float()[:, :, which] / 2 + 1e-5
    bound[:, :, 32:40] += first_short / 2  # tokens 32..39 were rounded twice
    assert bool(((store.dequantize(0, 50) - k).abs() <= bound).all())


# --- recipes ------------------------------------------------------------------------------------------
def test_recipes_put_quantization_last_and_round_trip():
    recipe = parse_recipe("kivi2+snapkv@0.5")
    assert [m.name for m in recipe.kv] == ["snapkv", "kivi2"]
    assert recipe.name == "snapkv@0.5+kivi2"
    assert parse_recipe("kivi4:residual=64,group_size=32").name == "kivi4:residual=64"
    assert parse_recipe("pmkvq:budget_mb=8").name == "pmkvq:budget_mb=8"
    assert repr(parse_method("pmkvq:budget_mb=8")).startswith("PMKVQ(")


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("kivi2:residual=100", "multiple of group_size"),
        ("kivi2:scale_dtype=int8", "scale_dtype"),
        ("pmkvq", "exactly one of"),
        ("pmkvq:budget_mb=-1", r"budget_mb must be in \(0, "),
        ("pmkvq:budget_mb=1,init_bits=3", "init_bits"),
        ("pmkvq:allocation=/no/such/file.json", "not found"),
    ],
)
def test_bad_parameters_raise_clear_errors(spec, fragment):
    with pytest.raises(LonglabError, match=fragment):
        parse_recipe(spec)


# --- end to end on tiny-llama ----------------------------------------------------------------------------
def _decode_steps(model, recipe, ids, steps, check=None):
    stream = Stream(model, LonglabCache(recipe), 1)
    logits = stream.feed([ids], chunk_size=128)
    out, all_logits = [], [logits]
    for _ in range(steps):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = stream.feed([[token]], compress="none")
        all_logits.append(logits)
        if check is not None:
            check(stream.cache)
    return out, torch.cat(all_logits), stream.cache


def test_pmkvq_keeps_its_code_words_within_the_per_block_budget_while_decoding(llama, tokenizer, text):
    ids = tokenizer(text)["input_ids"][:700]
    budget_mb = 0.07  # two layers: 35.8 KiB of code words per layer; 850 entries need 2 bits at the end
    per_layer = PMKVQ(budget_mb=budget_mb).budget_mb * 2**20 / 2
    widths = []

    def check(cache):
        bits = [layer.key_store.bits for layer in cache.layers]
        for layer, before in zip(cache.layers, widths[-1] if widths else bits):
            assert isinstance(layer, QuantizedLayer)
            # one halving per update at most; over budget only right after a halving (the next ones catch up)
            assert layer.key_store.bits in (before, before // 2)
            assert layer.code_nbytes() <= per_layer or layer.key_store.bits < before
        widths.append(bits)

    _decode_steps(llama, f"pmkvq:budget_mb={budget_mb}", ids, 150, check)
    first = [w[0] for w in widths]
    assert first[-1] == 2 and first == sorted(first, reverse=True)  # progressive: never widens
    assert all(layer.code_nbytes() <= per_layer < layer.nbytes() for layer in _decode_steps(
        llama, f"pmkvq:budget_mb={budget_mb}", ids, 150)[2].layers)  # overheads are outside the budget


def test_pmkvq_with_a_16_bit_budget_gives_the_unquantized_outputs(llama, tokenizer, text):
    # The budget never forces a shift below 16 bits: main holds 16-bit integer codes (and the sink and
    # window are float16, or the model's fp32), so logits match the full-precision cache up to 16-bit
    # rounding and greedy tokens are identical.
    ids = tokenizer(text)["input_ids"][:400]
    full_tokens, full_logits, _ = _decode_steps(llama, "full", ids, 40)
    for recipe, tol in (("pmkvq:budget_mb=100", 1e-2), ("pmkvq:budget_mb=100,fp_dtype=model", 1e-3)):
        tokens, logits, cache = _decode_steps(llama, recipe, ids, 40)
        assert all(layer.key_store.bits == 16 and layer.key_store.n > 0 for layer in cache.layers)
        assert tokens == full_tokens
        assert (logits - full_logits).abs().max() <= tol


def test_pmkvq_raises_when_two_bits_do_not_fit(llama, tokenizer, text):
    with pytest.raises(LonglabError, match="over its budget"):
        # one halving per update (16 -> 8 -> 4 -> 2), then the next update over budget raises
        generate(llama, tokenizer, text, "Where?", "pmkvq:budget_mb=0.001", max_new_tokens=8)


@pytest.mark.parametrize("recipe", ["snapkv@0.5+kivi2", "kivi4", "h2o@0.5+kivi2", "pmkvq:budget_mb=0.2"])
def test_quantized_recipes_generate_on_tiny_llama(llama, tokenizer, text, recipe):
    result = generate(llama, tokenizer, text, "Where is item 5?", recipe, max_new_tokens=8, chunk_size=256)
    assert len(result.token_ids[0]) >= 1
    assert all(isinstance(layer, QuantizedLayer) for layer in result.cache.layers)
    assert result.kv_bytes_after < result.kv_bytes_before / 3
    if recipe.startswith("snapkv"):
        snap = generate(
            llama, tokenizer, text, "Where is item 5?", "snapkv@0.5", max_new_tokens=8, chunk_size=256
        )
        assert result.kv_bytes_after < snap.kv_bytes_after / 2
        assert [int(n) for n in result.cache.lengths()[0].flatten()] == [
            int(n) for n in snap.cache.lengths()[0].flatten()
        ]


def test_batch_with_padding_runs(llama, tokenizer, text):
    result = generate(llama, tokenizer, [text, text[:500]], ["Where?", "Which?"], "kivi2", max_new_tokens=4)
    assert len(result.token_ids) == 2


def test_allocation_file_sets_budgets_and_smoothing(llama, tokenizer, text, tmp_path):
    H_kv, D = 2, 16
    lam = torch.linspace(0.5, 2.0, D).repeat(H_kv, 1)
    alloc = {
        "format": "longlab.pmkvq.allocation",
        "version": 1,
        "layers": [
            {"layer": 0, "bits": 8, "budget_bytes": 300_000, "smooth_scale": lam.tolist()},
            {"layer": 1, "bits": 2, "budget_bytes": 110_000, "smooth_scale": None},
        ],
    }
    path = tmp_path / "alloc.json"
    path.write_text(json.dumps(alloc))
    result = generate(
        llama, tokenizer, text, "Where?", f"pmkvq:allocation={path}", max_new_tokens=4, chunk_size=256
    )
    first, second = result.cache.layers
    assert first.nbytes() <= 300_000 and second.nbytes() <= 110_000
    assert first.key_store.bits > second.key_store.bits
    assert torch.equal(first.key_store.channel_scale[0, :, 0], lam)
    assert second.key_store.channel_scale is None


def test_pmkvq_code_bytes_packs_each_entry_whole():
    """Code words are packed per entry (D * bits / 8 bytes per head), so a count of main entries that
    is not a multiple of 8 / bits is not rounded down: 1 KV head, D=16, 2 bits, sink 1 + window 3 kept at
    fp16, 6 main entries -> 2 * (4 * 16 * 2 + 6 * 4) = 304 bytes (K and V)."""
    assert code_bytes(10, 2, 1, 16, sink=1, window=4, window_tokens=3) == 304
    # and the total adds, per main entry, fp16 scale + offset per group for K and V, plus the int32 index
    total = layer_bytes(10, 2, 1, 16, sink=1, window=4, window_tokens=3, group_size=16)
    assert total == 304 + 6 * 2 * 2 * 2 + 10 * 4


def test_kivi_value_window_slides_in_its_buffer_and_stays_exact():
    """Decode steps under kivi4: the value residual (exactly the last R values) moves one slot a step in
    one buffer, no copy (its storage stays put), every allocated byte is held or spare, the residual is
    the last R values appended and the main region is quantize + pack of those that left it, in order."""
    from longlab.quant.quantizer import pack, quantize_tokens

    k, v = _kv(T=300, D=32)
    layer, ctx = _quantized("kivi4", k, v)
    policy = ctx.cache.recipe.kv[-1]
    g = torch.Generator().manual_seed(5)
    values = [v[:, :, t : t + 1] for t in range(300)]
    storages = set()
    for _ in range(40):
        k1, v1 = torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g)
        values.append(v1)
        layer.update(k1, v1)
        policy.step(ctx, layer)
        storages.add(layer.values.untyped_storage().data_ptr())
        held = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values, layer.index))
        allocated = sum(t.untyped_storage().nbytes() for t in (layer.keys, layer.values, layer.index))
        assert LonglabLayer.spare_nbytes(layer) == allocated - held  # nothing allocated goes unreported
    assert len(storages) == 1  # one buffer for 40 steps: the window never copied
    R = layer.values.shape[-2]
    assert R == 128 and torch.equal(layer.values, torch.cat(values[-R:], dim=2))
    left = torch.cat(values[:-R], dim=2)
    codes, scale, offset = quantize_tokens(left, 4, layer.value_store.group)
    store = layer.value_store
    assert store.n == left.shape[2] and torch.equal(store.codes, pack(codes, 4))
    assert torch.equal(store.scale, scale) and torch.equal(store.offset, offset)
