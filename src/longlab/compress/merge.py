"""Merging and reference methods: HiCo-style ToMe merging of input embeddings, and the TPP rule.

- ``hico@r``: within chunks of ``chunk`` context tokens, ToMe bipartite soft matching (Bolya et al.,
  ICLR 2023) as VideoChat-Flash's HiCo applies it, repeated until each chunk keeps ``ceil((1 - r) c)``
  tokens: the metric is the L2-normalised input embeddings, alternate tokens form sets A and B, each
  ``a`` is matched to its most similar ``b``, and the best pairs merge by size-weighted mean
  ``x <- (s_a x_a + s_b x_b) / (s_a + s_b)``, ``s <- s_a + s_b``. The result is a shorter sequence of
  input embeddings (:attr:`Compressed.embeds`) read at consecutive positions.
- ``tpp@r``: the MM-TPP similarity rule on text segments (sentences): the builder walks backward from
  the newest sentence; a sentence whose token-set Jaccard similarity with its reference (the next
  sentence kept in full) is at least ``tau`` becomes a short reference ``marker``. ``tau`` is the highest
  value in [``min_similarity``, 1] that removes the fraction r (bisection); below ``min_similarity``
  nothing is replaced, so on text without redundancy fewer tokens go than asked (the row records it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import register
from ..registry import MAX_TOKENS, param
from .base import Compressed, ContextCompressor, Prompt, Unit, check_prompt, keep_budget

__all__ = ["HiCo", "TPP", "tome_merge", "tpp_replace", "sentences"]


def tome_merge(
    x: torch.Tensor, size: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """ToMe bipartite soft matching of ``x [T, D]`` (sizes ``[T]``) repeated until ``keep`` rows remain.

    Returns (merged ``[keep, D]``, sizes ``[keep]``, the original index of each surviving row, in order).
    Each round merges at most ``|A|`` pairs; size-weighted sums ``sum size * x`` and ``sum size`` are
    conserved exactly (up to float rounding)."""
    x = x.clone()
    size = size.clone().to(x.dtype)
    index = list(range(x.shape[0]))
    while x.shape[0] > keep:
        T = x.shape[0]
        metric = torch.nn.functional.normalize(x.float(), dim=-1)  # [T, D]
        a, b = metric[0::2], metric[1::2]  # [Ta, D], [Tb, D]
        if b.shape[0] == 0:
            break
        sim = a @ b.T  # [Ta, Tb]
        best, match = sim.max(-1)  # [Ta]
        r = min(T - keep, a.shape[0])
        merged_a = best.argsort(descending=True)[:r]  # A rows that merge into B
        xs = x * size[:, None]  # size-weighted rows [T, D]
        sums = xs[1::2].clone()
        weights = size[1::2].clone()
        sums.index_add_(0, match[merged_a], xs[0::2][merged_a])
        weights.index_add_(0, match[merged_a], size[0::2][merged_a])
        gone = set((2 * merged_a).tolist())
        new_x, new_s, new_i = [], [], []
        for t in range(T):
            if t in gone:
                continue
            if t % 2 == 1:
                j = t // 2
                new_x.append(sums[j] / weights[j])
                new_s.append(weights[j])
            else:
                new_x.append(x[t])
                new_s.append(size[t])
            new_i.append(index[t])
        x, size, index = torch.stack(new_x), torch.stack(new_s), new_i
    return x, size, index


@register("hico")
@dataclass
class HiCo(ContextCompressor):
    """HiCo-style token merging (Li et al., "VideoChat-Flash: Hierarchical Compression for Long-Context
    Video Modeling", arXiv 2501.00574, ICLR 2026; ToMe: Bolya et al., "Token Merging: Your ViT But
    Faster", ICLR 2023): ToMe merging of the context's input embeddings within chunks of ``chunk``
    tokens, each chunk keeping ``ceil((1 - r) chunk)`` (see the module docstring). The layer-wise
    attention dropping of HiCo's video level is not implemented here."""

    paper: ClassVar[str] = (
        "VideoChat-Flash (HiCo), Li et al., arXiv 2501.00574; ToMe, Bolya et al., ICLR 2023"
    )
    needs_scorer: ClassVar[bool] = True  # reads the model's input embeddings

    chunk: int = param(64, low=2, high=MAX_TOKENS, integer=True)

    def compress(self, prompt: Prompt, scorer: object) -> Compressed:
        check_prompt(prompt)
        if self.compression_ratio == 0:
            return self.identity(prompt)
        model = scorer.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        with torch.inference_mode():
            emb = model.get_input_embeddings()(torch.tensor([prompt.ids], device=device))[0]  # [T, D]
        emb = emb.detach().clone()
        outs, sizes, source = [], [], []
        special = set(getattr(prompt.tokenizer, "all_special_ids", []) or [])
        for a in range(0, len(prompt.ids), self.chunk):
            piece = emb[a : a + self.chunk]
            ids = prompt.ids[a : a + self.chunk]
            if any(t in special for t in ids):  # a special token (BOS) stays alone, unmerged
                keep_idx = [i for i, t in enumerate(ids) if t in special]
                for i in keep_idx:
                    outs.append(piece[i : i + 1])
                    sizes.append(1.0)
                    source.append(a + i)
                rest = [i for i in range(len(ids)) if i not in keep_idx]
                if not rest:
                    continue
                piece = piece[rest]
                offsets = rest
            else:
                offsets = list(range(len(ids)))
            keep = keep_budget(piece.shape[0], self.compression_ratio)
            merged, size, index = tome_merge(piece, torch.ones(piece.shape[0]), keep)
            outs.append(merged)
            sizes.extend(float(s) for s in size)
            source.extend(a + offsets[i] for i in index)
        embeds = torch.cat(outs)
        order = sorted(range(len(source)), key=lambda i: source[i])  # special tokens back in place
        embeds = embeds[order]
        source = [source[i] for i in order]
        sizes = [sizes[i] for i in order]
        return Compressed([prompt.ids[s] for s in source], source, len(prompt.ids), embeds=embeds,
                          sizes=[int(round(s)) for s in sizes])


def sentences(unit_list: list[Unit]) -> list[list[int]]:
    """Unit indices of each sentence: a unit ending in ``.``, ``!``, ``?`` or holding a newline ends one."""
    out: list[list[int]] = [[]]
    for k, u in enumerate(unit_list):
        out[-1].append(k)
        t = u.text or ""
        if t.rstrip(" ").endswith((".", "!", "?")) or "\n" in t:
            out.append([])
    return [s for s in out if s]


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def tpp_replace(token_sets: list[set[int]], tau: float) -> list[bool]:
    """The backward builder: walk from the newest segment; segment ``i`` is replaced (True) when its
    Jaccard similarity to its reference — the nearest later segment kept in full — is >= ``tau``.
    The newest segment is always kept."""
    replaced = [False] * len(token_sets)
    ref = len(token_sets) - 1
    for i in range(len(token_sets) - 2, -1, -1):
        if _jaccard(token_sets[i], token_sets[ref]) >= tau:
            replaced[i] = True
        else:
            ref = i
    return replaced


@register("tpp")
@dataclass
class TPP(ContextCompressor):
    """The similarity-compression rule of MM-TPP (Li, Zhong, Li, Zhou, Kong, "Long-range Modeling and
    Processing of Multimodal Event Sequences", arXiv 2602.01125, ICLR 2026), on text: a sentence similar
    to its reference (the next sentence kept, builder walking backward from the newest) is replaced by
    ``marker`` (their single ``<|similar_event|>`` token). Similarity is the Jaccard overlap of token-id
    sets (their ``|dt_i - dt_ref| < tau`` on inter-event times, here on content)."""

    paper: ClassVar[str] = "MM-TPP, Li et al., arXiv 2602.01125, ICLR 2026"

    min_similarity: float = param(0.5, low=0, high=1)  # a Jaccard similarity
    marker: str = " [similar]"

    def compress(self, prompt: Prompt, scorer: object = None) -> Compressed:
        check_prompt(prompt)
        if self.compression_ratio == 0:
            return self.identity(prompt)
        U, n = prompt.units, len(prompt.ids)
        sents = sentences(U)
        spans = [(U[s[0]].start, U[s[-1]].end) for s in sents]
        sets = [set(prompt.ids[a:b]) for a, b in spans]
        mark = prompt.encode(self.marker)
        target = n - keep_budget(n, self.compression_ratio)

        def removed(tau: float) -> int:
            rep = tpp_replace(sets, tau)
            return sum(max(0, (b - a) - len(mark)) for (a, b), r in zip(spans, rep) if r)

        lo, hi = self.min_similarity, 1.0
        if removed(hi) >= target:
            tau = hi
        elif removed(lo) < target:
            tau = lo
        else:
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if removed(mid) >= target else (lo, mid)
            tau = lo
        rep = tpp_replace(sets, tau)
        ids, source, count = [], [], 0
        for (a, b), r in zip(spans, rep):
            if r and b - a > len(mark):
                count += 1
                ids.extend(mark)
                source.extend([-1] * len(mark))
            else:
                ids.extend(prompt.ids[a:b])
                source.extend(range(a, b))
        out = Compressed(ids, source, n)
        out.info = {"tau": tau, "segments": len(sents), "replaced": count}
        return out
