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

**Soft variant** (``comi@r:fusion=PATH``): COMI trains a fusion layer that turns merged encoder states
into the decoder's memory vectors. Here a :class:`Fusion` layer, trained on longlab's own generated
samples with the target model frozen (``longlab train comi``; weights in a safetensors file,
never a pickle), maps each group's MIG-merged input embedding ``m_g`` and MIG-merged hidden state
``z_g = sum_t w_t h_t`` to ``m_g + W [m_g; z_g rms(m_g) / rms(z_g)] + b`` (``W``, ``b`` zero at
initialisation, so an untrained layer is the hard variant exactly). COMI's LoRA-tuned decoder is not
reproduced: the decoder stays frozen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_LAYERS, param
from .base import Compressed, ContextCompressor, Prompt, check_prompt, keep_budget

__all__ = ["COMI", "Fusion", "reallocate", "group_weights", "load_fusion", "save_fusion", "answer_loss",
           "train_fusion"]


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


class Fusion(torch.nn.Module):
    """COMI-soft's fusion layer: ``m + W [m; z rms(m) / rms(z)] + b`` for merged embeddings ``m [G, D]``
    and merged hidden states ``z [G, D]``; ``W [D, 2D]``, ``b [D]`` start at zero (the hard variant)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2 * dim, dim)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [G, D], [G, D] -> [G, D]
        def rms(t: torch.Tensor) -> torch.Tensor:
            return t.float().pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()

        zn = (z.float() * (rms(m) / rms(z))).to(m.dtype)
        return m + self.proj(torch.cat([m, zn], dim=-1).to(self.proj.weight.dtype)).to(m.dtype)


_FUSIONS: dict[str, Fusion] = {}


def save_fusion(fusion: Fusion, path: str, **metadata: str) -> None:
    """Write the fusion layer's weights as safetensors (``metadata``: what it was trained on)."""
    from ..safeio import save_tensors

    save_tensors({k: v.detach().contiguous().cpu() for k, v in fusion.state_dict().items()}, path,
              metadata={k: str(v) for k, v in metadata.items()})


def load_fusion(path: str, dim: int) -> Fusion:
    """Load (once per process) a fusion layer saved by :func:`save_fusion` for hidden size ``dim``."""
    if path not in _FUSIONS:
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except (OSError, ValueError) as e:  # missing file, not safetensors
            raise LonglabError(f"comi: fusion={path!r} is not a readable safetensors file ({e})") from None
        w = state.get("proj.weight")
        if w is None or tuple(w.shape) != (dim, 2 * dim) or set(state) != {"proj.weight", "proj.bias"}:
            raise LonglabError(f"comi: fusion={path!r} does not hold a fusion layer for hidden size {dim}")
        fusion = Fusion(dim)
        fusion.load_state_dict(state)
        _FUSIONS[path] = fusion.eval()
    return _FUSIONS[path]


def answer_loss(model: object, fusion: Fusion, example: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens when the frozen ``model`` reads
    ``[lead; fusion(memories, states); embed(tail)]`` (teacher-forced). ``example``: ``lead [h, D]``
    (the template head's embeddings), ``memories``/``states`` ``[G, D]``, ``tail [t]`` ids (question
    part, then the answer), ``n_answer`` (int tensor: the answer's last tokens of ``tail``)."""
    table = model.get_input_embeddings()  # type: ignore[attr-defined]
    tail = example["tail"]
    x = torch.cat([example["lead"], fusion(example["memories"], example["states"]), table(tail)])[None]
    k = int(example["n_answer"])
    logits = model(inputs_embeds=x, use_cache=False, logits_to_keep=k + 1).logits[0, :-1]  # type: ignore[operator]
    return torch.nn.functional.cross_entropy(logits.float(), tail[-k:])


def train_fusion(model: object, examples: list[dict[str, torch.Tensor]], steps: int, lr: float = 1e-3,
                 seed: int = 0, log_every: int = 10) -> tuple[Fusion, list[float]]:
    """Train a :class:`Fusion` layer (the model frozen) with Adam on :func:`answer_loss`, one example
    per step in a seeded shuffled order. Returns the layer and the running mean loss every
    ``log_every`` steps."""
    if not examples or steps < 1:
        raise LonglabError("comi: train_fusion needs at least one example and one step")
    dim = examples[0]["memories"].shape[-1]
    fusion = Fusion(dim)
    frozen = [(p, p.requires_grad) for p in model.parameters()]  # type: ignore[attr-defined]
    for p, _ in frozen:
        p.requires_grad_(False)
    opt = torch.optim.Adam(fusion.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    log, window = [], []
    try:
        for _ in range(steps):
            if not order:
                order = torch.randperm(len(examples), generator=gen).tolist()
            loss = answer_loss(model, fusion, examples[order.pop()])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(fusion.parameters(), 1.0)
            opt.step()
            window.append(float(loss.detach()))
            if len(window) == log_every:
                log.append(sum(window) / len(window))
                window = []
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return fusion.eval(), log


@register("comi")
@dataclass
class COMI(ContextCompressor):
    """COMI's marginal-information-gain merging, training-free hard variant (Tang et al., ICLR 2026,
    arXiv 2602.01719): see the module docstring."""

    paper: ClassVar[str] = "COMI, Tang et al., ICLR 2026, arXiv 2602.01719 (training-free hard variant)"
    needs_scorer: ClassVar[bool] = True
    query_aware: ClassVar[bool] = True

    scorer: str = "self"
    # hidden-state layer of the scorer (-1: the last; Python indexing, checked against the model when it runs)
    layer: int = param(-1, low=-MAX_LAYERS, high=MAX_LAYERS, integer=True)
    # weights of cosine similarities (in [-1, 1]) inside a softmax: at 100 the softmax is already a hard
    # max (a cosine gap of 0.1 is a factor e^10); larger weights change nothing but the rounding
    alpha: float = param(1.0, low=0, high=100)
    beta: float = param(1.0, low=0, high=100)
    fusion: str = ""  # a trained Fusion layer (safetensors): the soft variant; "" = the hard variant

    def merge(self, prompt: Prompt, scorer: object
              ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """The two MIG stages: merged input embeddings ``[G, D]``, merged hidden states ``[G, D]``, group
        sizes and each group's representative (its highest-weight token)."""
        model = scorer.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        q = prompt.encode(" " + prompt.question.strip())  # type: ignore[union-attr]
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
        memories, states, source = [], [], []
        a = 0
        for s in sizes:
            w = group_weights(hc[a : a + s], hq, self.alpha, self.beta)  # [s]
            memories.append((w[:, None].to(emb.dtype) * emb[a : a + s]).sum(0))
            states.append((w[:, None] * hc[a : a + s]).sum(0))
            source.append(a + int(w.argmax()))
            a += s
        return torch.stack(memories), torch.stack(states), sizes, source

    def compress(self, prompt: Prompt, scorer: object) -> Compressed:
        check_prompt(prompt)
        if not prompt.question or not prompt.question.strip():
            raise LonglabError("comi is query-aware: it needs a question")
        if self.compression_ratio == 0:
            return self.identity(prompt)
        memories, states, sizes, source = self.merge(prompt, scorer)
        if self.fusion:
            fusion = load_fusion(self.fusion, memories.shape[-1])
            with torch.inference_mode():
                memories = fusion(memories, states)
        out_c = Compressed([prompt.ids[i] for i in source], source, len(prompt.ids), embeds=memories,
                           sizes=sizes)
        out_c.info = {"groups": len(sizes), "largest_group": max(sizes), "soft": bool(self.fusion)}
        return out_c
