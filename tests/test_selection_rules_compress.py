"""Which context tokens each context compressor and token dropper keeps, on hand-built cases (issue 28:
inverting a selection rule must fail a test).

Pinned elsewhere (``test_compress.py``): ``select_units`` (best units within the budget), COMI's coarse and
fine MIG (``test_comi_mig_formulas_by_hand``), TPP's backward builder. Here: ``hico-drop`` (stage by stage,
cumulative), ``hico-forward`` (against the attention of a plain forward), LLMLingua's document and token
ranking and LongLLMLingua's question ranking and contrastive score (with a scorer whose token scores are set
by hand), HiCo's ToMe merging order, and the guidance pool match."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabCache, LonglabLayer
from longlab.compress.base import Prompt
from longlab.compress.drop import HiCoDrop
from longlab.compress.guidance import Guidance, PoolEntry
from longlab.compress.hico_forward import HiCoForward
from longlab.compress.lingua import LLMLingua, LongLLMLingua
from longlab.compress.merge import tome_merge
from longlab.compress.scorer import Scorer
from longlab.engine.stream import Stream
from longlab.prompt import encode_prompts
from longlab.recipe import Recipe

D = 8
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ hico-drop
def _last_query_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Head-averaged attention of the last query over every key (brute force, float64): [T]."""
    H, g = q.shape[1], q.shape[1] // k.shape[1]
    T = k.shape[2]
    out = torch.zeros(T, dtype=torch.float64)
    for h in range(H):
        out += torch.softmax(q[0, h, -1].double() @ k[0, h // g].double().T * D**-0.5, -1) / H
    return out


def _top(scores: torch.Tensor, n: int, among: list[int], margin: float = 1e-6) -> set[int]:
    ranked = sorted(among, key=lambda j: -float(scores[j]))
    assert float(scores[ranked[n - 1]] - scores[ranked[n]]) > margin, "near tie at the cut"
    return set(ranked[:n])


def test_hico_drop_keeps_the_most_attended_tokens_stage_by_stage():
    """3 layers, stages at 1/3 and 2/3 (layers 1 and 2), r = 0.75: layer 0 keeps all 16 tokens, layer 1 the
    8 the last query attends to most there, layer 2 the best 4 *of those 8* by layer 2's attention
    (cumulative: layer 2's own top 4 includes a token stage 1 dropped, which must not come back)."""
    T, H, H_kv = 16, 4, 2
    g = torch.Generator().manual_seed(0)
    layers, qs = [], []
    for _ in range(3):
        k, v = torch.randn(1, H_kv, T, D, generator=g), torch.randn(1, H_kv, T, D, generator=g)
        layer = LonglabLayer()
        layer.update(k, v)
        layers.append(layer)
        qs.append(torch.randn(1, H, T, D, generator=g) * 2)
    cache = SimpleNamespace(layers=layers)
    policy = HiCoDrop(compression_ratio=0.75)
    kept = []
    for i, layer in enumerate(layers):
        ctx = LayerContext(i, 3, None, "prefill", qs[i], D**-0.5, layer.index[:, 0], None, layer, cache)
        mask = policy.select(ctx)
        kept.append(set(range(T)) if mask is None else set(torch.nonzero(mask[0, 0]).flatten().tolist()))
        if mask is not None:
            assert torch.equal(mask[0, 0], mask[0, 1])  # every head keeps the same tokens
    s1 = _last_query_scores(qs[1], layers[1].keys)
    s2 = _last_query_scores(qs[2], layers[2].keys)
    stage1 = _top(s1, 8, list(range(T)))
    assert kept[0] == set(range(T)) and kept[1] == stage1
    assert kept[2] == _top(s2, 4, sorted(stage1))
    assert _top(s2, 4, list(range(T))) - stage1, "case must test cumulative dropping"


# ---------------------------------------------------------------------------------------------- hico-forward
CTX = " ".join(f"Record {i} says the shelf {i * 5 % 11} holds item {i * 3 % 17}." for i in range(30))


class _LastQueryAttention:
    """Reference (a stand-in KV policy written here): the head-averaged attention of the forward's last query
    at one layer of a plain prefill."""

    kind, name, needs_observe, reads_attention, batch_select_safe = "kv", "reference", True, False, True

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx, self.scores = layer_idx, None

    def observe(self, ctx) -> None:
        if ctx.layer_idx == self.layer_idx and ctx.phase == "prefill":
            self.scores = ctx.attention_probs(slice(-1, None))[0, :, 0].double().mean(0)  # [T]

    def select(self, ctx):
        return None

    def select_decode(self, ctx):
        return None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_hico_forward_keeps_the_tokens_the_last_query_attends_to_most(tokenizer, name):
    """One stage boundary at layer 3 of 6: the kept rows are the protected question tail plus the top
    ceil(0.4 n) context tokens by the last query's head-averaged attention at layer 2 of a plain forward."""
    from longlab.models import build_tiny_model

    model = build_tiny_model(name, num_hidden_layers=6)
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], ["Which shelf holds item 7?"], [""])
    ids, nq = ctx + q, len(q)
    ref = _LastQueryAttention(2)
    with torch.inference_mode():
        Stream(model, LonglabCache(Recipe(kv=[ref])), 1).feed([ids], chunk_size=len(ids), compress="none")
    method = HiCoForward(0.6, stages=(0.5,), protect=nq)
    with torch.inference_mode():
        method.prefill(Stream(model, LonglabCache("full"), 1), [ids])
    (kept,) = method.info["kept_positions"][0]
    n = len(ids) - nq
    # the same float32 forward up to layer 2 on both sides: a gap far above float32 rounding is enough
    want = _top(ref.scores, math.ceil(0.4 * n - 1e-9), list(range(n)), margin=1e-9)
    assert set(kept[:-nq]) == want and kept[-nq:] == list(range(n, n + nq))


# ------------------------------------------------------------------------------------------------ LLMLingua
class _Key:
    """A weak-referenceable stand-in model (the scorer's memo is keyed by the model)."""


class _History:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def crop(self, n: int) -> None:
        del self.tokens[n:]


class HandScorer(Scorer):
    """A scorer whose nll of a token is ``fn(char, history chars)``, set by hand (no model)."""

    def __init__(self, tokenizer, fn) -> None:
        self.model, self.chunk, self.forwards, self.tokens, self.memo_s = _Key(), 512, 0, 0, 0.0
        self.tok, self.fn = tokenizer, fn

    def _cache(self):
        return _History()

    def run(self, ids, cache, start, last_logits=None):
        out = []
        for t in ids:
            out.append(self.fn(self.tok.decode([t]), self.tok.decode(cache.tokens)))
            cache.tokens.append(t)
        self.forwards += 1
        self.tokens += len(ids)
        return torch.tensor(out), None


def _prompt(tokenizer, text: str, question: str | None = None) -> Prompt:
    return Prompt(list(tokenizer(text, add_special_tokens=False)["input_ids"]), question, [], tokenizer)


def _text(tokenizer, out) -> str:
    return tokenizer.decode(out.ids)


LETTERS = {"a": 9.0, "b": 1.0, "c": 8.0, "d": 2.0, "e": 7.0, "f": 3.0, "g": 6.0, "h": 4.0}


@pytest.mark.parametrize("iterative", [True, False])
def test_llmlingua_keeps_the_highest_self_information_words(tokenizer, iterative):
    """One document of 8 words of 4 tokens (space + 3 letters); nll of a letter set by hand, of a space 0;
    half the tokens kept: the 4 words with the highest mean nll (aaa 6.75, ccc 6, eee 5.25, ggg 4.5)."""
    scorer = HandScorer(tokenizer, lambda ch, _: LETTERS.get(ch, 0.0))
    prompt = _prompt(tokenizer, " aaa bbb ccc ddd eee fff ggg hhh")
    out = LLMLingua(0.5, iterative=iterative).compress(prompt, scorer)
    assert _text(tokenizer, out) == " aaa ccc eee ggg"


def test_llmlingua_budget_controller_keeps_the_highest_perplexity_document(tokenizer):
    """Four sentences (documents of 9 tokens, cut at sentence ends with segment=8); coarse=1 leaves room for
    exactly one: the one with the highest mean nll (``ccc eee``), not the lowest (``bbb ddd``)."""
    nll = {"a": 4.0, "b": 1.0, "c": 9.0, "d": 2.0, "e": 8.0}
    scorer = HandScorer(tokenizer, lambda ch, _: nll.get(ch, 0.5))
    prompt = _prompt(tokenizer, " aaa bbb. bbb ddd. ccc eee. aaa ddd.")
    out = LLMLingua(0.75, coarse=1.0, segment=8).compress(prompt, scorer)
    assert out.info["documents"] == 4 and out.info["documents_kept"] == 1
    assert _text(tokenizer, out) == " ccc eee."


def _long_fn(ch: str, history: str) -> float:
    """Question letters (Q) are predictable after a document holding 'z'; context letters get a bonus after
    the question (Q in the history): their contrastive score grows with the bonus."""
    if ch == "Q":
        return 1.0 if "z" in history else 4.0
    bonus = {"k": 0.9, "m": 0.1, "p": 0.7, "r": 0.2, "s": 0.8, "t": 0.3, "u": 0.6, "w": 0.05}
    return 1.0 - (bonus.get(ch, 0.0) if "Q" in history else 0.0)


def test_longllmlingua_keeps_the_document_that_makes_the_question_likely(tokenizer):
    """Three documents; the question's nll is lowest after the one holding 'z' (rank 0). With room for one
    document (r = 2/3, coarse = 1) that document is kept whole."""
    scorer = HandScorer(tokenizer, _long_fn)
    text = " aaa bbb ccc ddd. zzz kkk mmm ppp. eee fff ggg hhh."
    out = LongLLMLingua(2 / 3, coarse=1.0, doc_tokens=16).compress(_prompt(tokenizer, text, "QQQ"), scorer)
    assert out.info["documents"] == 3 and out.info["ranking"][0] == 1
    assert _text(tokenizer, out) == " zzz kkk mmm ppp."


def test_longllmlingua_keeps_the_words_the_question_makes_more_likely(tokenizer):
    """One document; contrastive score ``exp(nll(x)) - exp(nll(x | question))`` grows with the hand-set bonus:
    half the tokens keep the 4 words of the largest bonus (kkk, sss, ppp, uuu), in their order."""
    scorer = HandScorer(tokenizer, _long_fn)
    prompt = _prompt(tokenizer, " kkk mmm ppp rrr sss ttt uuu www", "QQQ")
    out = LongLLMLingua(0.5).compress(prompt, scorer)
    assert _text(tokenizer, out) == " kkk ppp sss uuu"


# ------------------------------------------------------------------------------------------------ HiCo (ToMe)
def test_tome_merges_the_most_similar_pairs_first():
    """Rows alternate A (even) and B (odd). a0 is nearly b0 (cos 0.995), a2 is close to b2 (cos 0.71), a1 is
    orthogonal to every B row. One merge takes a0 into b0; two merges take a0 and a2 — never a1."""
    e = torch.eye(4, dtype=torch.float64)
    x = torch.stack([e[0], e[0] + 0.1 * e[1], e[3], e[1], e[2] + e[3], e[2]])
    size = torch.ones(6, dtype=torch.float64)
    assert tome_merge(x, size, keep=5)[2] == [1, 2, 3, 4, 5]
    merged, s, index = tome_merge(x, size, keep=4)
    assert index == [1, 2, 3, 5] and s.tolist() == [2.0, 1.0, 1.0, 2.0]
    torch.testing.assert_close(merged[0], (x[0] + x[1]) / 2)


# ------------------------------------------------------------------------------------------------ guidance
def test_guidance_commits_the_best_matching_sentence():
    """Two pool prefixes both clear the threshold; the one with the higher word F1 wins."""
    pool = [PoolEntry([1], ["the", "archive", "is"], 1), PoolEntry([2], ["the", "archive", "holds"], 2),
            PoolEntry([3], ["a", "b", "c"], 3)]
    g = Guidance(threshold=0.5)
    assert g.match(["the", "archive", "holds", "keys"], pool) == 1
    assert g.match(["the", "archive", "is", "old"], pool) == 0
    assert g.match(["x", "y", "z"], pool) is None
