"""``meg``: a 16-channel token signal with a slowly switching latent state, pretrained by MEG-XL's
block-masked objective (Jayalath & Parker Jones, arXiv 2602.02494, ICML 2026; spec: remaining-seeds §36)
[recon: the generator is ours].

**Generator** (task seed fixes the patterns; every sequence draws its own states, events and tokens):

- a latent state ``s_t ∈ {0..S−1}`` that switches to a uniformly drawn other state with probability
  ``1/dwell`` per step (mean dwell 200 steps);
- background tokens: channel ``c`` at time ``t`` emits code ``k ~ p_{s_t,c} = softmax(b_c + sep·z_{s,c})``
  over ``K`` codes (``b_c``, ``z_{s,c}`` standard normal): the state shifts every channel's code
  distribution a little (``sep``), so it is read from many steps, not one;
- "word" events: now and then (mean gap ``event_gap`` steps) a word ``w`` (uniform over ``W``) occupies
  ``2·event_len`` steps: first its **response**, where every channel emits ``A[(w + s) mod W, c]``, then
  its **echo**, where every channel emits ``B[w, c]`` (``A``, ``B``: random patterns over ``E`` event
  codes that the background never uses, so an event token is recognisable as one). The response alone
  gives only ``(w + s) mod W``: the word is decodable from it **only given the current state**, which
  the background (weakly, over many steps) and the other events (a response with its echo gives ``s``)
  tell. Masked prediction needs the state whenever a mask cuts an event between response and echo.

Token ids are per channel (``c·(K + E) + k``, the lab's stand-in for MEG-XL's sensor embedding); the
mask token of channel ``c`` is ``C·(K + E) + c`` (MEG-XL's one learned mask token plus the channel's
sensor embedding).
A sequence of ``length = T·C`` tokens is time-major (token ``t·C + c``), for the ``crisscross`` mixer.

**Objective** [code]: the ``T`` steps are cut into subsegments of ``segment`` steps (10: at T = 500 the
paper's 50 subsegments); ``round(mask_frac · T/segment)`` of them (20 of 50) are replaced by mask tokens
**across all channels**; the loss is the cross-entropy of the original tokens there (answers).

**Probe** (:func:`event_probe`): a window of ``T`` steps with a word event at its centre whose echo is
masked (the word must come from the state-dependent response); the feature is the encoder's final
(normed) hidden state averaged over the event's steps and channels; a multinomial logistic regression
is fitted on a few labelled events (the spec's 1 % of labels) and scored on held-out ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...recipe import LonglabError
from .base import IGNORE, Batch, Task, _check, register_task

__all__ = ["MEGTask", "event_probe", "fit_linear_probe", "probe_features"]


@register_task("meg")
@dataclass
class MEGTask(Task):
    """Block-masked pretraining on the switching-state token signal (see the module docstring)."""

    channels: int = 16
    codes: int = 8  # background codes per channel
    event_codes: int = 8  # codes only events use (an event token is recognisable as one)
    states: int = 4
    dwell: float = 200.0
    words: int = 8
    event_len: int = 4  # steps of the response, and of the echo
    event_gap: int = 12
    sep: float = 0.05
    segment: int = 10
    mask_frac: float = 0.4

    def __post_init__(self) -> None:
        for f, lo in (("channels", 1), ("codes", 2), ("event_codes", 1), ("states", 1), ("words", 2),
                      ("event_len", 1),
                      ("event_gap", 1), ("segment", 1)):
            _check(self.name, f, getattr(self, f), lo)
        for f, lo, hi in (("dwell", 1.0, 1e9), ("sep", 0.0, 100.0), ("mask_frac", 0.0, 1.0)):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
                raise LonglabError(f"task meg: {f} must be a number in [{lo}, {hi}], got {v!r}")
        g = torch.Generator().manual_seed(40_000 + int(self.seed))
        base = torch.randn(1, self.channels, self.codes, generator=g)
        z = torch.randn(self.states, self.channels, self.codes, generator=g)
        self.probs = torch.softmax(base + float(self.sep) * z, dim=-1)  # [S, C, K]
        ev = (self.words, self.channels)
        self.response = self.codes + torch.randint(0, self.event_codes, ev, generator=g)  # A [W, C]
        self.echo = self.codes + torch.randint(0, self.event_codes, ev, generator=g)  # B [W, C]

    @property
    def vocab_size(self) -> int:
        return self.channels * self.per_channel + self.channels  # per-channel codes, per-channel masks

    @property
    def per_channel(self) -> int:
        """Codes of one channel: background then event codes."""
        return self.codes + self.event_codes

    def min_length(self) -> int:
        return self.channels * self.segment

    def mask_ids(self, steps: int) -> torch.Tensor:
        """``[T·C]``: the mask token of each position's channel."""
        return (self.channels * self.per_channel + torch.arange(self.channels)).repeat(steps)

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length % (self.channels * self.segment):
            raise LonglabError(
                f"task meg: length {length} must be a multiple of channels × segment = "
                f"{self.channels * self.segment} (whole subsegments of {self.segment} steps)"
            )

    def signal(self, batch: int, steps: int, gen: torch.Generator, centre: bool = False):
        """``batch`` grids of ``steps`` time steps: codes ``[B, T, C]``, states ``[B, T]``, the word at each
        step ``[B, T]`` (−1 outside events) and the echo steps ``[B, T]`` bool; with ``centre``, one event's
        response starts at :meth:`centre_start`, alone in ``± 2·event_len`` steps."""
        s_cnt, w_cnt, el = self.states, self.words, self.event_len
        span = 2 * el
        switch = torch.rand(batch, steps, generator=gen) < 1.0 / float(self.dwell)
        jump = torch.randint(1, max(2, s_cnt), (batch, steps), generator=gen)
        state = torch.empty(batch, steps, dtype=torch.long)
        cur = torch.randint(0, s_cnt, (batch,), generator=gen)
        for t in range(steps):
            cur = torch.where(switch[:, t], (cur + jump[:, t]) % s_cnt, cur) if s_cnt > 1 else cur
            state[:, t] = cur
        words = torch.full((batch, steps), -1, dtype=torch.long)
        echo = torch.zeros(batch, steps, dtype=torch.bool)
        starts = (torch.rand(batch, steps, generator=gen) < 1.0 / self.event_gap).tolist()
        wdraw = torch.randint(0, w_cnt, (batch, steps), generator=gen)
        c0 = self.centre_start(steps)
        for b in range(batch):
            t = 0
            while t + span <= steps:
                if centre and c0 - span < t < c0 + span:  # keep the centre event alone
                    t = c0 + span + 1
                elif starts[b][t]:
                    words[b, t : t + span] = wdraw[b, t]
                    echo[b, t + el : t + span] = True
                    t += span + 1
                else:
                    t += 1
            if centre:
                words[b, c0 : c0 + span] = wdraw[b, c0]
                echo[b, c0 + el : c0 + span] = True
        # background codes by inverse CDF of p_{s_t, c}
        cdf = self.probs.cumsum(-1)[state]  # [B, T, C, K]
        u = torch.rand(batch, steps, self.channels, 1, generator=gen)
        codes = (u > cdf).sum(-1).clamp_max(self.codes - 1)  # [B, T, C]
        w = words.clamp_min(0)
        resp = self.response[(w + state) % w_cnt]  # [B, T, C]
        codes = torch.where((words >= 0)[..., None], torch.where(echo[..., None], self.echo[w], resp), codes)
        return codes, state, words, echo

    def centre_start(self, steps: int) -> int:
        """First step of the centre event's response in a probe window of ``steps`` steps."""
        return steps // 2 - self.event_len

    def token_ids(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes: [B, T, C]`` -> flattened time-major token ids ``[B, T·C]`` (``c·(K + E) + code``)."""
        c = torch.arange(self.channels)
        return (codes + c * self.per_channel).flatten(1)

    def block_mask(self, batch: int, steps: int, gen: torch.Generator) -> torch.Tensor:
        """``[B, T]`` bool: ``round(mask_frac · T/segment)`` whole subsegments per sequence, uniformly."""
        n_seg = steps // self.segment
        n_mask = int(round(self.mask_frac * n_seg))
        mask = torch.zeros(batch, n_seg, dtype=torch.bool)
        for b in range(batch):
            mask[b, torch.randperm(n_seg, generator=gen)[:n_mask]] = True
        return mask.repeat_interleave(self.segment, dim=1)

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        steps = length // self.channels
        codes, _, _, _ = self.signal(batch, steps, gen)
        ids = self.token_ids(codes)  # [B, T·C]
        masked = self.block_mask(batch, steps, gen).repeat_interleave(self.channels, dim=1)  # [B, T·C]
        tokens = torch.where(masked, self.mask_ids(steps).expand(batch, -1), ids)
        targets = torch.where(masked, ids, IGNORE)
        return Batch(tokens, targets, masked)


def probe_features(model: nn.Module, task: MEGTask, ids: torch.Tensor, start: int,
                   batch: int = 8) -> torch.Tensor:
    """``[N, D]``: the encoder's final normed hidden state averaged over the event's ``2·event_len`` steps
    from ``start`` and all channels; ``ids: [N, T·C]`` tokens."""
    c, span = task.channels, 2 * task.event_len
    feats = []
    with torch.no_grad():
        for s in range(0, ids.shape[0], batch):
            h = model.norm(model.hidden_states(ids[s : s + batch])[-1])  # [b, T·C, D]
            feats.append(h[:, start * c : (start + span) * c].mean(1))
    return torch.cat(feats)


def fit_linear_probe(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float = 1e-2,
                     iters: int = 200) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on standardised ``x: [N, D]`` with labels ``y: [N]`` (L-BFGS,
    ``l2`` on the weights): returns ``(mean, std, W [D, classes], b [classes])``."""
    x = x.double()
    mean = x.mean(0)
    std = x.std(0).clamp_min(1e-6) if x.shape[0] > 1 else torch.ones(x.shape[1], dtype=torch.float64)
    z = (x - mean) / std
    w = torch.zeros(z.shape[1], classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return mean, std, w.detach(), b.detach()


def event_probe(model: nn.Module, task: MEGTask, steps: int, n_train: int, n_test: int, seed: int,
                l2: float = 1e-2) -> dict[str, list[float]]:
    """Word decoding by a linear probe on frozen features at context ``steps``: fitted on ``n_train``
    labelled events, scored on ``n_test`` others (windows with the event at the centre, its echo masked,
    so the word must come from the state-dependent response and the state). Returns the
    per-test-event correctness (0/1) and the latent state at each test event."""
    g = torch.Generator().manual_seed(50_000 + seed)
    codes, state, words, echo = task.signal(n_train + n_test, steps, g, centre=True)
    start = task.centre_start(steps)
    ids = task.token_ids(codes)
    hide = torch.zeros_like(echo)
    hide[:, start + task.event_len : start + 2 * task.event_len] = True  # the centre event's echo
    hide = hide.repeat_interleave(task.channels, dim=1)
    ids = torch.where(hide, task.mask_ids(steps).expand(ids.shape[0], -1), ids)
    feats = probe_features(model, task, ids, start)
    labels = words[:, start]
    mean, std, w, b = fit_linear_probe(feats[:n_train], labels[:n_train], task.words, l2)
    pred = (((feats[n_train:].double() - mean) / std) @ w + b).argmax(-1)
    return {"correct": (pred == labels[n_train:]).double().tolist(),
            "state_at_event": state[n_train:, start].tolist()}
