"""Which document tokens each reuse method recomputes, pinned on a tiny model against references written
here (issue 28: inverting a selection rule must fail a test).

Pinned elsewhere: CacheBlend's top value deviation
(``test_reuse.py::test_cacheblend_selects_top_value_deviation``) and ProphetKV's probe formula at layer 0
(``test_reuse.py::test_prophetkv_probe_is_mean_question_attention``).
Here: ProphetKV's choice (single and dual stage) and EPIC's."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.recipe import Recipe
from longlab.reuse import Runner, build_job, doc_segment, encode_document, split_prompt
from longlab.reuse import policies as reuse_methods
from longlab.reuse.policies import EPIC, ProphetKV

DOCS = [" ".join(f"Item {i} is in box {i * 7 % 13}." for i in range(j, j + 6)) for j in (0, 10, 20)]
QUESTION = "Where is item 12?"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model4():
    from longlab.models import build_tiny_model

    return build_tiny_model("tiny-llama", num_hidden_layers=4)


def _job(model, tokenizer):
    """A job with a prefix (so every document's stored KV differs from its in-prompt KV) and 3 documents."""
    prefix, q_ids = split_prompt(tokenizer, QUESTION)
    doc_ids = [list(tokenizer(doc_segment(d), add_special_tokens=False)["input_ids"]) for d in DOCS]
    stored = [encode_document(model, ids) for ids in doc_ids]
    return build_job(Runner(model), prefix, doc_ids, q_ids, stored)


def _record_recomputed(job) -> dict[int, list[int]]:
    """Wrap every cache layer's update: layer -> ctx indices (document tokens) written fresh there."""
    lookup = job.ctx_position_lookup()
    seen: dict[int, list[int]] = {}
    for i, layer in enumerate(job.cache.layers):
        original = layer.update

        def update(*args, _i=i, _orig=original, _layer=layer, **kwargs):
            pos = _layer.pending
            if pos is not None:
                ctx = lookup[pos[0].long().clamp(max=len(lookup) - 1)]
                seen.setdefault(_i, []).extend(int(c) for c in ctx if c >= 0)
            return _orig(*args, **kwargs)

        layer.update = update
    return seen


class _QuestionAttention:
    """Reference relevance (written here, not the method's probe): per layer, the attention of the question
    rows over every document token, averaged over heads and question tokens, normalised to sum 1."""

    kind, name, needs_observe, reads_attention, batch_select_safe = "kv", "reference", True, False, True

    def __init__(self, job) -> None:
        self.lookup, self.n, self.nq = job.ctx_position_lookup(), job.n_ctx, len(job.question_rows)
        self.per_layer: dict[int, torch.Tensor] = {}

    def observe(self, ctx) -> None:
        T_q = ctx.q.shape[-2]
        probs = ctx.attention_probs(slice(T_q - self.nq, T_q)).double().mean(dim=(1, 2))[0]  # [T]
        pos = ctx.key_index[0, 0].long()
        r = torch.zeros(self.n, dtype=torch.float64)
        for slot, p in enumerate(pos.tolist()):
            if 0 <= p < len(self.lookup) and self.lookup[p] >= 0:
                r[self.lookup[p]] += probs[slot]
        self.per_layer[ctx.layer_idx] = r / r.sum()

    def select(self, ctx):
        return None

    def select_decode(self, ctx):
        return None


def _top(scores: torch.Tensor, n: int) -> set[int]:
    order = scores.argsort(descending=True)
    assert float(scores[order[n - 1]] - scores[order[n]]) > 1e-6, "near tie in the reference ranking"
    return set(order[:n].tolist())


@torch.inference_mode()
def test_prophetkv_recomputes_the_tokens_the_question_attends_to_most(model4, tokenizer):
    """Single stage: the recomputed document tokens are the top ceil(ratio N) of the question's attention
    over the stale assembled cache, averaged over the layers (reference computed by an observer here)."""
    ref_job = _job(model4, tokenizer)
    observer = _QuestionAttention(ref_job)
    ref_job.cache.recipe = Recipe(kv=[observer])  # type: ignore[list-item]
    ref_job.forward(ref_job.question_rows)
    relevance = torch.stack([observer.per_layer[i] for i in range(4)]).mean(0)

    job = _job(model4, tokenizer)
    seen = _record_recomputed(job)
    ProphetKV(recompute=0.2).prefill(job)
    n = job.n_ctx
    want = _top(relevance, math.ceil(0.2 * n))
    for layer in range(4):  # the same rows run through every layer
        assert set(seen[layer]) == want, layer
    assert want != set(relevance.argsort()[: len(want)].tolist())  # the least relevant are another set


@torch.inference_mode()
def test_prophetkv_dual_stage_keeps_the_best_of_stage_one_after_the_switch(model4, tokenizer, monkeypatch):
    """Dual stage (4 layers: switch at layer 1): layers 0-1 recompute S1 (top 2 rho N by the probe), layers
    2-3 only the top rho N of S1 by the recomputed question attention fused over layers 0-1."""
    probes = []

    class Probe(reuse_methods._AttentionProbe):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            probes.append(self)

    monkeypatch.setattr(reuse_methods, "_AttentionProbe", Probe)
    job = _job(model4, tokenizer)
    seen = _record_recomputed(job)
    method = ProphetKV(recompute=0.2, dual_stage=True)
    method.prefill(job)
    n = job.n_ctx
    budget, b1 = math.ceil(0.2 * n), math.ceil(0.4 * n)
    assert len(probes) == 2
    s1 = _top(method._fuse(probes[0].scores, 4, n).double(), b1)
    assert set(seen[0]) == set(seen[1]) == s1
    fused = method._fuse(probes[1].scores, 4, n).double()
    in_s1 = torch.isin(torch.arange(n), torch.tensor(sorted(s1)))
    s2 = _top(fused.masked_fill(~in_s1, -1.0), budget)
    assert set(seen[2]) == set(seen[3]) == s2


@torch.inference_mode()
def test_epic_recomputes_the_first_k_tokens_of_every_document(model4, tokenizer):
    job = _job(model4, tokenizer)
    seen = _record_recomputed(job)
    EPIC(k=3).prefill(job)
    want = {s + i for s, _ in job.doc_spans for i in range(3)}
    for layer in range(4):
        assert set(seen[layer]) == want
