"""Seed KV methods (issue 4): OBCache, ReST-KV, decode-time eviction, Quest, RetroAttention.

Each paper formula is checked against a brute-force computation on small random tensors; the
policies are run end to end on tiny random models built here."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import spearmanr

from longlab.attention import lse_merge
from longlab.cache import LonglabCache
from longlab.decode.quest import Quest, attend_slots, page_scores, page_summary
from longlab.engine.stream import Stream
from longlab.generation import generate
from longlab.kv.obcache import VARIANTS, obc_scores
from longlab.kv.restkv import adaptive_pool, ema_weights, reconstruction_scores, wo_gram
from longlab.models import build_tiny_model
from longlab.recipe import LonglabError, parse_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("tiny-llama", num_hidden_layers=4)


def _attention(q, k, v):
    # q [B, H, t, D], k/v [B, H, T, D] -> logits, probs, out
    z = q @ k.transpose(-1, -2)
    A = torch.softmax(z, -1)
    return z, A, A @ v


# --------------------------------------------------------------------------------------------- OBCache
@pytest.mark.parametrize("shape", [(2, 3, 5, 24, 8)], ids=["B2-H3-t5-T24-D8"])
def test_obc_value_score_is_exact_output_change(shape):
    B, H, t, T, D = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (t, T, T))
    z, A, o = _attention(q, k, v)
    brute = torch.empty(B, H, T, dtype=torch.float64)
    for j in range(T):
        v2 = v.clone()
        v2[:, :, j] = 0
        brute[..., j] = ((A @ v2 - o) ** 2).sum((-1, -2))
    torch.testing.assert_close(obc_scores(A, z, v, "v").double(), brute, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_type", ["k", "vk"])
def test_obc_key_and_joint_scores_rank_like_brute_force(score_type):
    B, H, t, T, D = 2, 3, 4, 48, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, t, D, generator=g, dtype=torch.float64) * 0.5
    k = torch.randn(B, H, T, D, generator=g, dtype=torch.float64) * 0.5
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    z, A, o = _attention(q, k, v)
    brute = torch.empty(B, H, T, dtype=torch.float64)
    for j in range(T):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, j] = 0
        if score_type == "vk":
            v2[:, :, j] = 0
        brute[..., j] = ((_attention(q, k2, v2)[2] - o) ** 2).sum((-1, -2))
    for cross in (True, False) if score_type == "vk" else (True,):
        s = obc_scores(A, z, v, score_type, cross=cross)
        for b in range(B):
            for h in range(H):
                rho = spearmanr(s[b, h].numpy(), brute[b, h].numpy()).statistic
                assert rho >= 0.9, (score_type, cross, b, h, rho)


def test_obc_p1_value_score_and_validation():
    A = torch.tensor([[[[0.25, 0.75]]]])
    v = torch.tensor([[[[1.0, -2.0], [3.0, 0.5]]]])
    s = obc_scores(A, torch.zeros_like(A), v, "v", p=1)
    torch.testing.assert_close(s, torch.tensor([[[0.25 * 3.0, 0.75 * 3.5]]]))
    with pytest.raises(LonglabError, match="p"):
        parse_recipe("snapkv-obck:p=1")
    with pytest.raises(LonglabError, match="cross"):
        parse_recipe("h2o-obcv:cross=false")


def test_obc_variants_are_registered_and_keep_the_budget(tiny):
    from longlab.models import tiny_tokenizer

    assert len(VARIANTS) == 9
    tok = tiny_tokenizer()
    context = "The quick brown fox jumps over the lazy dog. " * 5
    for name in VARIANTS:
        res = generate(tiny, tok, context, "What?", f"{name}@0.5", max_new_tokens=3, compress="end")
        n = res.context_tokens[0]
        for lengths in res.cache.lengths():
            # ceil(0.5 n) kept at prefill, then the question and the decoded tokens are appended
            assert int(lengths.max()) <= math.ceil(0.5 * n) + 40, name
        assert int(res.cache.lengths()[0].max()) < n
        if name.startswith("tova"):  # per KV head by default (the OBCache code); share_heads: one token set
            index = res.cache.layers[0].index
            assert not torch.equal(index, index[:, :1].expand_as(index)), name
            shared = generate(tiny, tok, context, "What?", f"{name}@0.5:share_heads=true", max_new_tokens=3,
                              compress="end").cache.layers[0].index
            assert torch.equal(shared, shared[:, :1].expand_as(shared)), name


# ---------------------------------------------------------------------------------------------- ReST-KV
def test_restkv_score_equals_output_change_after_removal_and_renormalisation():
    B, H, T, D, hidden = 1, 3, 20, 8, 12
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    o_proj = torch.randn(hidden, H * D, generator=g, dtype=torch.float64)
    _, A, o = _attention(q, k, v)  # o: [B, H, 1, D]
    a = A[:, :, 0]  # [B, H, T]
    s = reconstruction_scores(a, v, o[:, :, 0], wo_gram(o_proj, H).double())
    y = o.transpose(1, 2).reshape(B, H * D) @ o_proj.T  # the layer's output (all heads)
    for h in range(H):
        for j in range(T):
            keep = torch.ones(T, dtype=torch.bool)
            keep[j] = False
            o2 = o.clone()
            o2[:, h] = _attention(q[:, h:h + 1], k[:, h:h + 1, keep], v[:, h:h + 1, keep])[2][:, 0]
            y2 = o2.transpose(1, 2).reshape(B, H * D) @ o_proj.T
            torch.testing.assert_close(s[0, h, j], (y2 - y).norm(), rtol=1e-6, atol=1e-9)
    # without W_o the norm is in value space
    s_v = reconstruction_scores(a, v, o[:, :, 0], None)
    o_rm = (o[:, :, 0, None, :] - a[..., None] * v) / (1 - a[..., None])
    torch.testing.assert_close(s_v, (o_rm - o[:, :, 0, None, :]).norm(dim=-1))


def test_restkv_ema_weights_match_the_recursion():
    x = torch.randn(7, 5)
    acc = x[0]
    for i in range(1, 7):
        acc = 0.3 * x[i] + 0.7 * acc
    torch.testing.assert_close(ema_weights(7, 0.3) @ x, acc)
    assert float(ema_weights(7, 0.3).sum()) == pytest.approx(1.0)


def test_restkv_adaptive_pool_shifts_with_drift():
    scores = torch.zeros(1, 1, 40)
    scores[0, 0, 20] = 5.0
    probs = torch.zeros(1, 4, 40)
    probs[0, :2, 30], probs[0, 2:, 10] = 1.0, 1.0  # top position drifts by +20 tokens
    plain = adaptive_pool(scores, probs, 1, 5, 1e9)  # huge sigma: plain replicate-padded avg-pool k=5
    torch.testing.assert_close(plain[0, 0, 18:23], torch.full((5,), 1.0))
    shifted = adaptive_pool(scores, probs, 1, 5, 10.0)  # drift 20 / sigma 10: k = 5, shift = 2
    assert shifted[0, 0].nonzero().flatten().tolist() == [16, 17, 18, 19, 20]


def test_restkv_keeps_budget_and_window(tiny):
    from longlab.models import tiny_tokenizer

    tok = tiny_tokenizer()
    context = "Alpha beta gamma delta epsilon zeta eta theta. " * 10
    for recipe in ("restkv@0.5", "restkv:budget=100,pyramid=true", "restkv@0.75:use_wo=false,pooling=none"):
        res = generate(tiny, tok, context, None, recipe, max_new_tokens=1, compress="end")
        n = res.context_tokens[0]
        lengths = torch.stack([x.float().mean() for x in res.cache.lengths()])
        if "pyramid" in recipe:
            assert float(lengths.mean()) == pytest.approx(100, abs=2)
        else:
            r = 0.5 if "0.5" in recipe else 0.75
            assert float(lengths.max()) == math.ceil((1 - r) * n)
        last = torch.stack([layer.index[0, :, -32:] for layer in res.cache.layers])
        assert bool((last == torch.arange(n - 32, n, dtype=last.dtype)).all())  # protected window
    with pytest.raises(LonglabError, match="alpha"):
        parse_recipe("restkv:alpha=0")


# ------------------------------------------------------------------------------- decode-time eviction
@pytest.mark.parametrize("recipe,steps,bound", [
    ("decoding:base=snapkv,interval=64,budget=256", 2000, 256 + 64),
    ("h2o-stream:budget=256", 500, 257),
    ("tova-stream:budget=256", 500, 257),
])
def test_decoding_compression_bounds_the_cache_during_generation(recipe, steps, bound):
    model = build_tiny_model("tiny-llama")
    cache = LonglabCache(recipe)
    stream = Stream(model, cache, 1)
    logits = stream.feed([list(range(40, 90))])
    worst = 0
    for _ in range(steps):
        token = int(logits[0].argmax())
        logits = stream.feed([[token]], compress="none")
        worst = max(worst, max(int(x.max()) for x in cache.lengths()))
    assert worst <= bound
    assert cache.layers[0].n_seen == 50 + steps and worst >= 256


def test_decoding_validation():
    with pytest.raises(LonglabError, match="budget"):
        parse_recipe("decoding:base=snapkv")
    with pytest.raises(LonglabError, match="base"):
        parse_recipe("decoding:base=quest,budget=64")
    m = parse_recipe("decoding:base=snapkv:window_size=8;kernel_size=3,budget=64").kv[0]
    assert m._base.window_size == 8 and m._base.kernel_size == 3 and m._base.budget == 64


# ----------------------------------------------------------------------------------------------- Quest
def test_quest_page_bound_dominates_every_key_logit():
    B, H_kv, g, P, n, D = 1, 2, 3, 4, 5, 8
    keys = torch.randn(B, H_kv, n * P, D)
    index = torch.arange(n * P, dtype=torch.int32).expand(B, H_kv, -1).clone()
    index[0, 0, 3] = -1  # an empty slot is ignored

    class Layer:
        pass

    layer = Layer()
    layer.keys, layer.index = keys, index
    summary = page_summary(layer, P, n)
    q = torch.randn(B, H_kv * g, D)
    u = page_scores(q, summary)  # [B, H, n]
    logits = torch.einsum("bhd,bhtd->bht", q, keys.repeat_interleave(g, 1)).reshape(B, H_kv * g, n, P)
    logits = logits.masked_fill((index < 0).repeat_interleave(g, 1).reshape(B, H_kv * g, n, P), -1e9)
    assert bool((u >= logits.amax(-1) - 1e-5).all())


def test_quest_sparse_kernel_with_every_page_equals_dense():
    B, H, H_kv, T, D, P = 2, 4, 2, 37, 8, 4
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    kidx = torch.arange(T, dtype=torch.int32).expand(B, H_kv, T)
    qpos = torch.full((B, 1), T - 1)
    dense, lse = attend_slots(q, k, v, kidx, qpos, 0.3)
    n_cand = (T - 1) // P
    pages = torch.arange(n_cand).expand(B, H, n_cand)
    from longlab.decode.quest import page_slots

    sparse, lse2 = attend_slots(q, k, v, kidx, qpos, 0.3, page_slots(pages, P, T))
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(lse2, lse)
    ref = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(dense, ref)


def _decode_logits(model, recipe, prompt, steps):
    cache = LonglabCache(recipe)
    stream = Stream(model, cache, 1)
    logits = stream.feed([prompt])
    out = [logits]
    for _ in range(steps):
        logits = stream.feed([[int(logits[0].argmax())]], compress="none")
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("recipe", ["quest:budget=4096", "retro:budget=4096,window=4"])
def test_quest_and_retro_with_budget_covering_the_context_equal_full_attention(tiny, recipe):
    prompt = list(range(30, 230))
    full = _decode_logits(tiny, None, prompt, 24)
    torch.testing.assert_close(_decode_logits(tiny, recipe, prompt, 24), full, atol=1e-4, rtol=1e-4)


def test_quest_small_budget_reads_top_pages_plus_the_last(tiny):
    quest = Quest(budget=64, page_size=16)

    class Ctx:  # one decode query over 200 held slots
        pass

    ctx = Ctx()
    B, H, H_kv, T, D = 1, 4, 2, 200, 16

    class Layer:
        pass

    ctx.layer = Layer()
    ctx.layer.keys = torch.randn(B, H_kv, T, D)
    ctx.layer.index = torch.arange(T, dtype=torch.int32).expand(B, H_kv, T).clone()
    ctx.k, ctx.q = ctx.layer.keys, torch.randn(B, H, 1, D)
    slots, pages = quest.select(ctx)
    assert pages.shape == (B, H, 3)  # K = 4 pages: 3 by score + the last (partial) page
    assert slots.shape == (B, H, 3 * 16 + 200 - 192)
    u = page_scores(ctx.q[:, :, 0], page_summary(ctx.layer, 16, (T - 1) // 16))
    assert torch.equal(pages, u.topk(3).indices.sort().values)
    prompt = list(range(30, 230))
    full = _decode_logits(tiny, None, prompt, 4)
    assert not torch.allclose(_decode_logits(tiny, "quest:budget=64", prompt, 4), full)


def test_quest_group_selection_takes_each_kv_heads_pages_by_its_groups_largest_bound():
    """selection=group: one page set per KV head, the top pages by max_j U_p over the group's query heads
    (hand-made: one head of the group bounds page 4 far above everything, so the group reads page 4 although
    its other head ranks it last); every head of the group gets the same pages."""
    B, H, H_kv, P, D = 1, 4, 2, 4, 2
    n = 6  # complete pages before the last one
    T = n * P + 2

    class Layer:
        pass

    class Ctx:
        pass

    keys = torch.zeros(B, H_kv, T, D)
    for p in range(n):  # KV head 0: page p holds keys (p, -p); page 4 also (50, -50) in channel 0
        keys[0, :, p * P:(p + 1) * P] = torch.tensor([float(p), -float(p)])
    keys[0, 0, 4 * P] = torch.tensor([50.0, -50.0])
    ctx = Ctx()
    ctx.layer = Layer()
    ctx.layer.keys, ctx.layer.index = keys, torch.arange(T, dtype=torch.int32).expand(B, H_kv, T).clone()
    ctx.k = keys
    ctx.q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]).reshape(B, H, 1, D)
    head = Quest(budget=3 * P, page_size=P)  # K = 3: two pages by score + the last
    group = Quest(budget=3 * P, page_size=P, selection="group")
    _, per_head = head.select(ctx)
    _, shared = group.select(ctx)
    u = page_scores(ctx.q[:, :, 0], page_summary(ctx.layer, P, n))  # [B, H, n]
    assert per_head[0, 1].tolist() == [0, 1]  # head 1 (q = e_2): the pages with the largest -p... least p
    assert per_head[0, 0].tolist() == [4, 5]
    best = u.reshape(B, H_kv, 2, n).amax(2).topk(2).indices.sort().values  # the rule, recomputed
    assert torch.equal(shared, best.repeat_interleave(2, 1))
    assert shared[0, 0].tolist() == shared[0, 1].tolist() == [4, 5]  # page 4: head 0's bound of 50
    worst = u.reshape(B, H_kv, 2, n).amin(2).topk(2).indices.sort().values
    assert not torch.equal(shared[:, ::2], worst)  # the inverted rule (the group's smallest bound) differs


def test_teacher_forcing_reads_a_decode_time_method_one_token_at_a_time(tiny):
    """A forced answer (``continuation=``) goes through a decode-time method the way decoding does, one
    query at a time: Quest with a budget covering the context equals full attention, Quest with a small
    budget does not (fed in one forward pass, the answer would be a prefill chunk, attended densely, and
    every recipe would score exactly as full attention)."""
    from longlab import Engine, Request
    from longlab.models import tiny_tokenizer

    tok = tiny_tokenizer()
    context = " ".join(f"w{i}" for i in range(300))
    answer = " ".join(f"w{i}" for i in range(7, 19))

    def forced(recipe):
        (res,) = Engine(tiny, tok).run([Request(context=context, question="which words?", recipe=recipe,
                                                 continuation=answer)])
        assert res.finish_reason == "forced" and len(res.forced_ids) > 4
        return res.forced_logprobs

    full = forced("full")
    torch.testing.assert_close(forced("quest:budget=4096"), full, atol=1e-4, rtol=1e-4)
    sparse = forced("quest:budget=32,page_size=8")
    torch.testing.assert_close(sparse[0], full[0])  # the prompt's own last position: before any decoding
    kl = (full[1:].exp() * (full[1:] - sparse[1:])).sum(-1)
    assert float(kl.max()) > 1e-4  # read sparsely along the answer


# ---------------------------------------------------------------------------------------- RetroAttention
def test_retro_merge_of_disjoint_key_sets_equals_attention_over_the_union():
    B, H, t, T, D = 2, 3, 4, 30, 8
    q, k, v = torch.randn(B, H, t, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    kidx = torch.arange(T, dtype=torch.int32).expand(B, H, T)
    qpos = torch.full((B, t), T)
    first = torch.rand(B, H, t, T) < 0.4
    first[..., 0] = True
    o1, l1 = attend_slots(q, k, v, kidx, qpos, 0.5, allowed=first)
    o2, l2 = attend_slots(q, k, v, kidx, qpos, 0.5, allowed=~first)
    merged, lse = lse_merge(o1, l1, o2, l2)
    exact, lse_exact = attend_slots(q, k, v, kidx, qpos, 0.5)
    torch.testing.assert_close(merged, exact)
    torch.testing.assert_close(lse, lse_exact)
    empty = torch.zeros_like(first)  # an empty set changes nothing
    o3, l3 = attend_slots(q, k, v, kidx, qpos, 0.5, allowed=empty)
    torch.testing.assert_close(lse_merge(exact, lse_exact, o3, l3)[0], exact)


def test_retro_refresh_changes_generation_relative_to_quest(tiny):
    prompt = [30 + i % 200 for i in range(300)]
    quest = _decode_logits(tiny, "quest:budget=64", prompt, 12)
    retro = _decode_logits(tiny, "retro:budget=64,window=8", prompt, 12)
    no_refresh = _decode_logits(tiny, "retro:budget=64,window=8,refresh=false", prompt, 12)
    torch.testing.assert_close(no_refresh, quest)  # output-cache bookkeeping alone never changes tokens
    assert not torch.allclose(retro, quest)  # refreshed K/V in the layers above change the next tokens
    assert isinstance(parse_recipe("retro").decode, Quest)
