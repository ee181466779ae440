"""LLMLingua and LongLLMLingua: hard deletion of low-information context units, scored by a small LM.

Both score with :class:`~longlab.compress.scorer.Scorer` (``scorer="self"``: the model being evaluated;
or a model name that :func:`longlab.load_model` knows, e.g. ``smollm2-135m``) and drop whole
:class:`~longlab.compress.base.Unit` s (words, numbers, characters), never parts of them. The budget is
``ceil((1 - r) n)`` context tokens, shared out as below; ``r = 0`` returns the prompt unchanged.
Written from the papers; the ``llmlingua`` package is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_TOKENS, param
from .base import (
    Compressed,
    ContextCompressor,
    Prompt,
    Unit,
    check_prompt,
    gather,
    keep_budget,
    select_units,
    split_documents,
)
from .scorer import IncrementalScorer, Scorer

__all__ = ["LLMLingua", "LongLLMLingua", "unit_scores", "coarse_keep", "recover_subsequences"]


def unit_scores(unit_list: list[Unit], token_scores: torch.Tensor, offset: int = 0) -> list[float]:
    """Mean token score of each unit (``token_scores[u.start - offset : u.end - offset]``); a special
    token's unit scores +inf (always kept)."""
    out = []
    for u in unit_list:
        if u.text is None:
            out.append(math.inf)
        else:
            out.append(float(token_scores[u.start - offset : u.end - offset].mean()))
    return out


def coarse_keep(order: list[int], sizes: list[int], low: int, high: int) -> list[int]:
    """Budget controller's coarse stage: take items (documents) in ``order`` (best first) while the
    total stays within ``high`` tokens, and at least until it reaches ``low`` (the final budget, so the
    fine stage has enough to choose from). Returns the chosen items."""
    chosen, total = [], 0
    for k in order:
        if total >= low and total + sizes[k] > high:
            continue
        chosen.append(k)
        total += sizes[k]
    return chosen


def _shares(sizes: list[int], budget: int) -> list[int]:
    """Split ``budget`` over items proportionally to ``sizes`` (largest remainder), each <= its size."""
    total = sum(sizes)
    if total <= budget:
        return list(sizes)
    raw = [budget * s / total for s in sizes]
    out = [min(s, math.floor(r)) for s, r in zip(sizes, raw)]
    for k in sorted(range(len(sizes)), key=lambda k: raw[k] - math.floor(raw[k]), reverse=True):
        if sum(out) >= budget:
            break
        if out[k] < sizes[k]:
            out[k] += 1
    return out


@register("llmlingua")
@dataclass
class LLMLingua(ContextCompressor):
    """LLMLingua (Jiang et al., "LLMLingua: Compressing Prompts for Accelerated Inference of Large
    Language Models", EMNLP 2023, arXiv 2310.05736).

    1. **Budget controller** (coarse): the context is split into documents (blank lines; else sentence
       groups of ~``segment`` tokens); one scorer pass gives each document its perplexity
       ``exp(mean_i -log p(x_i | x_<i))``; documents are kept, highest perplexity first, within
       ``n - coarse (n - K)`` tokens (``K = ceil((1 - r) n)``), the rest dropped whole.
    2. **Iterative token-level compression** (fine): the kept documents, in order, are cut into segments
       of ``segment`` tokens; segment ``j`` is scored given the *compressed* segments before it,
       ``s_i = -log p(x_i | x~_<j, x_j,<i)`` (self-information), and keeps its top units by mean ``s``
       within its share of the budget (the percentile threshold of the paper), which is then appended to
       the compressed prefix. ``iterative=false`` scores every token once, given the full context.
    """

    paper: ClassVar[str] = "LLMLingua, Jiang et al., EMNLP 2023, arXiv 2310.05736"
    needs_scorer: ClassVar[bool] = True

    scorer: str = "self"
    segment: int = param(128, low=8, high=MAX_TOKENS, integer=True)
    coarse: float = param(0.5, low=0, high=1)  # share of the removal done by dropping whole documents
    iterative: bool = param(True, choices=(True, False))

    def compress(self, prompt: Prompt, scorer: Scorer) -> Compressed:
        check_prompt(prompt)
        if self.compression_ratio == 0:
            return self.identity(prompt)
        U, n = prompt.units, len(prompt.ids)
        K = keep_budget(n, self.compression_ratio)
        nll = scorer.nll(prompt.ids)  # [n]
        docs = split_documents(U, self.segment)
        sizes = [sum(U[k].size for k in d) for d in docs]
        ppl = [float(nll[U[d[0]].start : U[d[-1]].end].mean()) for d in docs]
        order = sorted(range(len(docs)), key=lambda k: -ppl[k])
        kept_docs = sorted(coarse_keep(order, sizes, K, n - round(self.coarse * (n - K)))) if len(docs) > 1 \
            else [0]
        pool = [k for d in kept_docs for k in docs[d]]  # unit indices, in order
        # segments of ~segment tokens over the kept units
        segments: list[list[int]] = [[]]
        size = 0
        for k in pool:
            if size >= self.segment:
                segments.append([])
                size = 0
            segments[-1].append(k)
            size += U[k].size
        shares = _shares([sum(U[k].size for k in s) for s in segments], K)
        inc = IncrementalScorer(scorer) if self.iterative else None
        chosen: list[int] = []
        for seg, share in zip(segments, shares):
            seg_units = [U[k] for k in seg]
            if inc is not None:
                ids = [t for u in seg_units for t in prompt.ids[u.start : u.end]]
                s = inc.score(ids)  # [len(ids)], given the compressed prefix
                offset, flat = 0, []
                for u in seg_units:
                    flat.append(s[offset : offset + u.size])
                    offset += u.size
                scores = [math.inf if u.text is None else float(f.mean()) for u, f in zip(seg_units, flat)]
            else:
                scores = unit_scores(seg_units, nll)
            forced = [i for i, u in enumerate(seg_units) if u.text is None]
            picked = [seg[i] for i in select_units(seg_units, scores, share, forced)]
            chosen.extend(picked)
            if inc is not None:
                inc.append([t for k in picked for t in prompt.ids[U[k].start : U[k].end]])
        out = gather(prompt, U, chosen)
        out.info = {"documents": len(docs), "documents_kept": len(kept_docs), "scorer_tokens": scorer.tokens,
                    "scorer_forwards": scorer.forwards}
        return out


@register("longllmlingua")
@dataclass
class LongLLMLingua(ContextCompressor):
    """LongLLMLingua (Jiang et al., "LongLLMLingua: Accelerating and Enhancing LLMs in Long Context
    Scenarios via Prompt Compression", ACL 2024, arXiv 2310.06839). Query-aware:

    1. **Document ranking**: ``r_k = -(1/N_q) sum_i log p(q_i | D_k, restrict)``, the question's mean nll
       after document ``k`` and the sentence ``restrict``; lower is more relevant (rank 0).
    2. **Coarse stage**: documents kept in rank order within ``n - coarse (n - K)`` tokens; with
       ``reorder`` the kept documents are placed most relevant first.
    3. **Dynamic ratio**: document ``k`` keeps the fraction
       ``tau_k = clip((1 - 2 rank_k / N_d) delta_tau + tau_doc, 0, 1)``, ``tau_doc`` solved (bisection) so
       that the kept tokens sum to ``K``.
    4. **Contrastive perplexity**: token score ``s_i = ppl(x_i | x_<i) - ppl(x_i | q, x_<i)`` with
       ``ppl = exp(nll)`` within the document; units keep by mean ``s``.
    5. **Subsequence recovery** (``recover``): a run of the answer's words that matches consecutive
       kept units is replaced by the original text those units span (:func:`recover_subsequences`).
    """

    paper: ClassVar[str] = "LongLLMLingua, Jiang et al., ACL 2024, arXiv 2310.06839"
    needs_scorer: ClassVar[bool] = True
    query_aware: ClassVar[bool] = True

    scorer: str = "self"
    delta_tau: float = param(0.3, low=0, high=1)  # spread of the per-document kept fractions
    coarse: float = param(0.5, low=0, high=1)
    reorder: bool = param(True, choices=(True, False))
    recover: bool = param(True, choices=(True, False))
    doc_tokens: int = param(256, low=16, high=MAX_TOKENS, integer=True)
    restrict: str = "We can get the answer to this question in the given documents."

    def compress(self, prompt: Prompt, scorer: Scorer) -> Compressed:
        check_prompt(prompt)
        if not prompt.question or not prompt.question.strip():
            raise LonglabError(
                "longllmlingua is query-aware: it needs a question (use llmlingua without one)"
            )
        if self.compression_ratio == 0:
            return self.identity(prompt)
        U, n = prompt.units, len(prompt.ids)
        K = keep_budget(n, self.compression_ratio)
        q_ids = prompt.encode(" " + prompt.question.strip())
        tail = prompt.encode(" " + self.restrict) + q_ids
        docs = split_documents(U, self.doc_tokens)
        relevance, plain, cond = [], [], []
        for d in docs:
            ids = prompt.ids[U[d[0]].start : U[d[-1]].end]
            own, after = scorer.nll_then((), ids, tail)  # nll(x_i | x_<i) in the document; of the tail
            relevance.append(float(after[-len(q_ids):].mean()))
            plain.append(own)
            cond.append(scorer.nll(ids, prefix=q_ids))  # nll(x_i | q, x_<i)
        rank_order = sorted(range(len(docs)), key=lambda k: relevance[k])
        rank = {k: r for r, k in enumerate(rank_order)}
        sizes = [sum(U[k].size for k in d) for d in docs]
        kept = coarse_keep(rank_order, sizes, K, n - round(self.coarse * (n - K))) if len(docs) > 1 \
            else [0]
        kept = kept if self.reorder else sorted(kept)
        N = len(docs)
        base = [(1 - 2 * rank[k] / N) * self.delta_tau for k in kept]

        def total(tau: float) -> float:
            return sum(min(1.0, max(0.0, b + tau)) * sizes[k] for b, k in zip(base, kept))

        lo, hi = -1.0, 2.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(mid) < K else (lo, mid)
        taus = [min(1.0, max(0.0, b + hi)) for b in base]
        chosen: list[int] = []
        for k, tau in zip(kept, taus):
            d = docs[k]
            start = U[d[0]].start
            s = plain[k].exp() - cond[k].exp()  # contrastive perplexity [len(doc)]
            doc_units = [U[j] for j in d]
            scores = unit_scores(doc_units, s, offset=start)
            forced = [i for i, u in enumerate(doc_units) if u.text is None]
            chosen.extend(d[i] for i in select_units(doc_units, scores, round(tau * sizes[k]), forced))
        out = gather(prompt, U, chosen)
        out.info = {"documents": N, "documents_kept": len(kept), "ranking": rank_order[:64],
                    "scorer_tokens": scorer.tokens, "scorer_forwards": scorer.forwards}
        return out

    def postprocess(self, text: str, prompt: Prompt, compressed: Compressed) -> str:
        return recover_subsequences(text, prompt, compressed) if self.recover else text


def _norm(word: str) -> str:
    return word.strip().strip(".,;:!?\"'()").lower()


def recover_subsequences(text: str, prompt: Prompt, compressed: Compressed, min_words: int = 2) -> str:
    """LongLLMLingua's subsequence recovery: each maximal run (>= ``min_words``) of the answer's words
    equal to consecutive kept units of the compressed prompt is replaced by the original context text
    from the first to the last of those units (restoring the words compression dropped between them)."""
    U = prompt.units
    start_of = {u.start: k for k, u in enumerate(U)}
    kept_units = []  # original unit indices in compressed order, one per word-bearing unit
    for s in compressed.source:
        if s in start_of and U[start_of[s]].text and _norm(U[start_of[s]].text):
            kept_units.append(start_of[s])
    words_c = [_norm(U[k].text or "") for k in kept_units]
    answer = text.split()
    out, i = [], 0
    while i < len(answer):
        best = (0, 0)
        for s in range(len(words_c)):
            m = 0
            while i + m < len(answer) and s + m < len(words_c) and _norm(answer[i + m]) == words_c[s + m] \
                    and (m == 0 or kept_units[s + m] > kept_units[s + m - 1]):
                m += 1
            if m > best[0]:
                best = (m, s)
        m, s = best
        if m >= min_words and kept_units[s + m - 1] - kept_units[s] + 1 > m:
            a, b = U[kept_units[s]].start, U[kept_units[s + m - 1]].end
            original = prompt.tokenizer.decode(prompt.ids[a:b]).strip()
            tail = answer[i + m - 1][len(answer[i + m - 1].rstrip(".,;:!?")):]
            out.append(original.rstrip(".,;:!?") + tail)
            i += m
        else:
            out.append(answer[i])
            i += 1
    return " ".join(out)
