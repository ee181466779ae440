"""``track``: pick a drifting target among distractors through occlusions, the layers-lab proxy of
TAPTRv3's long-video point tracking (Qu et al., arXiv 2411.18671, ICLR 2026; spec: remaining-seeds §37)
[recon: the generator is ours].

Per video (``length`` frames): the target's feature ``f_t`` (unit vector in ``R^F``) drifts by a random
walk on the sphere (``f_{t+1} = normalise(f_t + drift·ε/√F)``). Occlusions start with probability
``occ_rate`` per visible frame (the first within frames 10–20) and last ``occ_min``–``occ_max`` frames;
during one the tracker observes the **occluder**, a fixed random unit vector, and visibility ``v = 0``;
otherwise it observes ``f_t`` plus noise and ``v = 1``. The input of frame ``t`` is ``x_t = [o_t, v_t]``
(``input_dim = F + 1``).

At every frame the candidates are the target, the last occluder (it stays in the scene after the
occlusion ends: a tracker whose template drifted towards it picks it) and random unit distractors, in
random order (``[B, T, M+1, F]``). The model's output at frame ``t`` (``output_dim = F``) is its query for
frame ``t+1``: ``logit_i = out_t · c_{t+1, i}``; the loss is the cross-entropy of the target at every
visible next frame. Scored (``answer``): the **reacquisition** frames, the first visible frame after an
occlusion of at least ``score_min_occ`` frames: the frames where only memory from before the occlusion
can find the target (a visible frame right after a visible one is found by copying the observation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import Batch, Task, _check, register_task

__all__ = ["TrackBatch", "TrackTask"]


@dataclass
class TrackBatch(Batch):
    """A ``track`` batch: ``cands: [B, T, M+1, F]``, ``label: [B, T]`` (the target's candidate index),
    ``visible: [B, T]`` and ``occ_len: [B, T]`` (at a reacquisition frame: the occlusion's length, else 0)."""

    cands: torch.Tensor | None = None
    label: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    occ_len: torch.Tensor | None = None


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


@register_task("track")
@dataclass
class TrackTask(Task):
    """Target tracking through occlusions (see the module docstring)."""

    feat: int = 16
    distractors: int = 6
    drift: float = 0.05
    noise: float = 0.05
    occ_rate: float = 0.03
    occ_min: int = 5
    occ_max: int = 40
    score_min_occ: int = 1

    def __post_init__(self) -> None:
        _check(self.name, "feat", self.feat, 2)
        _check(self.name, "distractors", self.distractors, 1)
        _check(self.name, "occ_min", self.occ_min, 1)
        _check(self.name, "occ_max", self.occ_max, self.occ_min)
        _check(self.name, "score_min_occ", self.score_min_occ, 1)
        for f, hi in (("drift", 10.0), ("noise", 10.0), ("occ_rate", 1.0)):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= hi:
                raise LonglabError(f"task track: {f} must be a number in [0, {hi}], got {v!r}")

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def input_dim(self) -> int:
        return self.feat + 1

    @property
    def output_dim(self) -> int:
        return self.feat

    def min_length(self) -> int:
        return 20 + self.occ_max + 2  # room for the first occlusion and a reacquisition

    def _visibility(self, length: int, gen: torch.Generator) -> tuple[list[int], list[tuple[int, int]]]:
        """Per-frame visibility (0/1) and the occlusions as (start, length)."""
        vis = [1] * length
        occs = []
        t = 10 + int(torch.randint(0, 11, (1,), generator=gen))
        first = True
        while t < length - 1:
            if first or float(torch.rand(1, generator=gen)) < self.occ_rate:
                n = int(torch.randint(self.occ_min, self.occ_max + 1, (1,), generator=gen))
                n = min(n, length - 1 - t)  # a visible frame after it
                if n <= 0:
                    break
                vis[t : t + n] = [0] * n
                occs.append((t, n))
                t += n + 2  # at least two visible frames between occlusions
                first = False
            else:
                t += 1
        return vis, occs

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        f_dim, m = self.feat, self.distractors
        steps = torch.randn(batch, length, f_dim, generator=gen) * (self.drift / math.sqrt(f_dim))
        f = _unit(torch.randn(batch, f_dim, generator=gen))
        target = torch.empty(batch, length, f_dim)
        for t in range(length):
            target[:, t] = f
            f = _unit(f + steps[:, t])
        cands = _unit(torch.randn(batch, length, m + 1, f_dim, generator=gen))
        obs = target + self.noise * torch.randn(batch, length, f_dim, generator=gen) / math.sqrt(f_dim)
        visible = torch.ones(batch, length, dtype=torch.bool)
        occ_len = torch.zeros(batch, length, dtype=torch.long)
        for b in range(batch):
            vis, occs = self._visibility(length, gen)
            visible[b] = torch.tensor(vis, dtype=torch.bool)
            for i, (s, n) in enumerate(occs):
                u = _unit(torch.randn(f_dim, generator=gen))  # the occluder
                obs[b, s : s + n] = u + self.noise * torch.randn(n, f_dim, generator=gen) / math.sqrt(f_dim)
                end = occs[i + 1][0] if i + 1 < len(occs) else length
                cands[b, s + n : end, 1] = u  # stays in the scene until the next occlusion
                occ_len[b, s + n] = n
        cands[:, :, 0] = target
        order = torch.argsort(torch.rand(batch, length, m + 1, generator=gen), dim=-1)  # random slots
        cands = cands.gather(2, order[..., None].expand(-1, -1, -1, f_dim))
        label = order.argsort(-1)[..., 0]  # where the target (index 0) went
        x = torch.cat([obs, visible[..., None].float()], dim=-1)  # [B, T, F + 1]
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, :-1] = occ_len[:, 1:] >= self.score_min_occ  # position t scores frame t + 1
        return TrackBatch(x, torch.full((batch, length), -100), answer, cands=cands, label=label,
                          visible=visible, occ_len=occ_len)

    def logits(self, out: torch.Tensor, batch: TrackBatch) -> torch.Tensor:
        """``[B, T−1, M+1]``: the query at frame ``t`` against the candidates of frame ``t + 1``."""
        return torch.einsum("btf,btmf->btm", out[:, :-1].float(), batch.cands[:, 1:])

    def loss(self, out, batch):
        """Cross-entropy of the target at every visible next frame."""
        lg = self.logits(out, batch)
        keep = batch.visible[:, 1:]
        return torch.nn.functional.cross_entropy(lg[keep], batch.label[:, 1:][keep])

    def correct(self, out: torch.Tensor, batch: TrackBatch) -> torch.Tensor:
        """``[B, T−1]`` bool: the pick at frame ``t + 1`` is the target."""
        return self.logits(out, batch).argmax(-1) == batch.label[:, 1:]

    def score(self, logits, batch):
        """Reacquisition accuracy per sample ``[B]`` (0 where a video has no scored frame)."""
        m = batch.answer[:, :-1]
        right = self.correct(logits, batch) & m
        return right.sum(-1).float() / m.sum(-1).clamp_min(1).float()

    def metrics(self, out, batch):
        right = self.correct(out, batch)[0]
        vis = batch.visible[0, 1:]
        return {"visible_acc": float(right[vis].float().mean()) if bool(vis.any()) else 0.0,
                "reacquisitions": int(batch.answer[0, :-1].sum())}
