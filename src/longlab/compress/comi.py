"""COMI, training-free hard variant: merge context token embeddings by marginal information gain.

COMI (Tang et al., ICLR 2026, arXiv 2602.01719; code Twilightaaa/COMI) is a trained soft-compression
method: an encoder's hidden states are merged into memory vectors that a LoRA-tuned decoder reads. This
is its training-free *hard* variant (issue #13): the same two MIG stages, computed on the scorer model's
hidden states ``h`` at layer ``layer`` of ``[context; question]``, applied to the context's **input
embeddings** ``e`` (which the model reads as :attr:`Compressed.embeds`). With ``h_q`` the mean of the
question's hidden states and ``cos`` the cosine similarity:

1. **Coarse group reallocation** (inter-group MIG): ``n_g = ceil((1 - r) n)`` equal contiguous groups;
   ``rel_g = max_{t in g} cos(h_t, h_q)`` with representative ``rep_g`` its argmax,
   ``red_g = max_{g' != g} cos(h_rep_g, h_rep_g')``, ``MIG_g = alpha rel_g - beta red_g``;
   ``pi = softmax(-MIG)``; each group keeps one token and the other ``n - n_g`` are handed out by
   ``pi`` (floor, then largest remainder) — high-MIG groups get fewer tokens (less compression). The
   sequence is re-partitioned contiguously with these sizes. (The paper's sizes are ``floor(n pi_g)``;
   the one-token floor here keeps every group non-empty, so the number of groups is unchanged.)
2. **Fine merging** (intra-group MIG): ``mig_t = alpha cos(h_t, h_q) - beta max_{t' in g, t' != t}
   cos(h_t, h_t')``; ``w = softmax_g(mig)``; memory ``m_g = sum_t w_t e_t``.

The trained soft variant (fusion layer + LoRA decoder) is not implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import LonglabError, register
from .base import Compressed, ContextCompressor, Prompt, check_prompt, keep_budget

__all__ = ["COMI", "reallocate", "group_weights"]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T


def reallocate(h: torch.Tensor, hq: torch.Tensor, n_groups: int, alpha: float = 1.0, beta: float = 1.0
               ) -> list[int]:
    """Coarse stage: new group sizes (sum ``n``, each >= 1) from ``h [n, D]`` and ``hq [D]``."""
    n = h.shape[0]
    bounds = [round(i * n / n_groups) for i in range(n_groups + 1)]
    rel_to_q = _cos(h, hq[None])[:, 0]  # [n]
    rel, rep = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        k = int(rel_to_q[a:b].argmax())
        rel.append(float(rel_to_q[a + k]))
        rep.append(a + k)
    reps = _cos(h[rep], h[rep])  # [n_g, n_g]
    reps.fill_diagonal_(-math.inf)
    red = reps.max(-1).values if n_groups > 1 else torch.zeros(1)
    mig = alpha * torch.tensor(rel) - beta * red  # [n_g]
    pi = torch.softmax(-mig, dim=0)
    spare = n - n_groups
    raw = pi * spare
    sizes = [1 + int(math.floor(x)) for x in raw.tolist()]
    for k in sorted(range(n_groups), key=lambda k: float(raw[k] - math.floor(raw[k])), reverse=True):
        if sum(sizes) >= n:
            break
        sizes[k] += 1
    return sizes


def group_weights(hg: torch.Tensor, hq: torch.Tensor, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """Fine stage: ``softmax(alpha cos(h_t, h_q) - beta max_{t' != t} cos(h_t, h_t'))`` over a group
    ``hg [s, D]`` -> ``[s]``."""
    rel = _cos(hg, hq[None])[:, 0]  # [s]
    if hg.shape[0] == 1:
        return torch.ones(1)
    sim = _cos(hg, hg)
    sim.fill_diagonal_(-math.inf)
    return torch.softmax(alpha * rel - beta * sim.max(-1).values, dim=0)


@register("comi")
@dataclass
class COMI(ContextCompressor):
    """COMI's marginal-information-gain merging, training-free hard variant (Tang et al., ICLR 2026,
    arXiv 2602.01719): see the module docstring."""

    paper: ClassVar[str] = "COMI, Tang et al., ICLR 2026, arXiv 2602.01719 (training-free hard variant)"
    needs_scorer: ClassVar[bool] = True
    query_aware: ClassVar[bool] = True

    scorer: str = "self"
    layer: int = -1  # hidden-state layer of the scorer (-1: the last)
    alpha: float = 1.0
    beta: float = 1.0

    def validate(self) -> None:
        super().validate()
        self.check("alpha", 0, None)
        self.check("beta", 0, None)

    def compress(self, prompt: Prompt, scorer: object) -> Compressed:
        check_prompt(prompt)
        if not prompt.question or not prompt.question.strip():
            raise LonglabError("comi is query-aware: it needs a question")
        if self.compression_ratio == 0:
            return self.identity(prompt)
        model = scorer.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        q = prompt.encode(" " + prompt.question.strip())
        n = len(prompt.ids)
        with torch.inference_mode():
            x = torch.tensor([prompt.ids + q], device=device)
            out = model(input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1)
            hs = out.hidden_states
            if not -len(hs) <= self.layer < len(hs):
                raise LonglabError(f"comi: layer must be in [{-len(hs)}, {len(hs) - 1}], got {self.layer}")
            h = hs[self.layer][0].float()  # [n + n_q, D]
            emb = model.get_input_embeddings()(x[:, :n])[0]  # [n, D]
        hc, hq = h[:n], h[n:].mean(0)
        n_groups = keep_budget(n, self.compression_ratio)
        sizes = reallocate(hc, hq, n_groups, self.alpha, self.beta)
        memories, source = [], []
        a = 0
        for s in sizes:
            w = group_weights(hc[a : a + s], hq, self.alpha, self.beta)  # [s]
            memories.append((w[:, None].to(emb.dtype) * emb[a : a + s]).sum(0))
            source.append(a + int(w.argmax()))
            a += s
        out_c = Compressed([prompt.ids[i] for i in source], source, n, embeds=torch.stack(memories),
                           sizes=sizes)
        out_c.info = {"groups": n_groups, "largest_group": max(sizes)}
        return out_c
