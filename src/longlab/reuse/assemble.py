"""Assembling stored documents into one :class:`~longlab.cache.LonglabCache`, and partial forwards over it.

A prompt is ``[prefix][doc_1]...[doc_m][question]``. :func:`build_job` places each stored document at its new
absolute positions (non-parallel: one after the other after the prefix; parallel, APE: every document right
after the prefix) and rotates its pre-RoPE keys with the model's RoPE of every layer for those positions, so
slot ``j`` of layer ``l`` holds ``R_l(p_j) k_j`` exactly as a prefill at ``p_j`` would. Gemma3's local and
global layers use their own RoPE bases; sliding layers hold every document token while the prompt is built
(a recomputed token may need any of them) and drop what their window no longer shows when it is done.

:class:`ReuseLayer` adds one operation to :class:`~longlab.cache.LonglabLayer`: a forward whose rows are
given positions (``pending``) *replaces* the stale slots at those positions with the fresh keys/values
instead of appending new positions. Attention masks compare positions (never slot order), so a recomputed
subset of rows attends to exactly what it would see in a full prefill: fresh entries where they were
recomputed, stale ones elsewhere. Only the selected rows propagate through the layers
(:meth:`ReuseJob.forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import LonglabCache, LonglabLayer
from ..recipe import LonglabError
from .modelio import DocKV, Runner

__all__ = ["ReuseLayer", "ReuseCache", "ReuseJob", "build_job", "PREFIX", "DOC", "QUESTION"]

PREFIX, DOC, QUESTION = 0, 1, 2  # row kinds


class ReuseLayer(LonglabLayer):
    """A LonglabLayer whose next update may write given positions (``pending [1, T_new]``), replacing any
    stale slot at those positions; with ``pending`` None it appends as usual (decoding)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pending: torch.Tensor | None = None
        self.hold_window = True  # sliding layers keep every slot until the prompt is assembled

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [1, H_kv, T_new, D] -> the whole layer [1, H_kv, T, D]
        pos, self.pending = self.pending, None
        if pos is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H_kv, T_new, _ = key_states.shape
        if self.index.shape[-1]:
            stale = torch.isin(self.index[:, 0], pos)  # [B, T] slots rewritten by this forward
            if bool(stale.any()):
                self.keep(~stale[:, None, :].expand_as(self.index))
        self._append("keys", key_states)
        self._append("values", value_states)
        self._append("index", pos.to(torch.int32)[:, None, :].expand(B, H_kv, T_new))
        self.index_changed()
        return self.keys, self.values

    def trim_to_window(self, window: int, slack: int = 64) -> None:
        if not self.hold_window:
            super().trim_to_window(window, slack)


class ReuseCache(LonglabCache):
    """A LonglabCache of :class:`ReuseLayer` layers, one per decoder layer."""

    def __init__(self, num_layers: int, recipe: Any = None) -> None:
        super().__init__(recipe, compressing=False)
        self.layers = [ReuseLayer() for _ in range(num_layers)]


@dataclass
class ReuseJob:
    """One prompt being built. Token table (one entry per token, in prompt order): ``ids, pos, kind, ctx``
    each ``[M]`` (``ctx``: index among the documents' tokens, -1 elsewhere). ``stale_values[l]``
    ``[1, H_kv, N_ctx, D]``: the stored values of every document token (CacheBlend's reference)."""

    runner: Runner
    cache: ReuseCache
    ids: torch.Tensor
    pos: torch.Tensor
    kind: torch.Tensor
    ctx: torch.Tensor
    n_positions: int
    doc_spans: list[tuple[int, int]]  # per document: (first ctx index, length)
    stale_values: list[torch.Tensor] | None = None
    token_layers: int = 0  # rows x layers computed (cost, vs M x L for a full prefill)
    doc_token_layers: int = 0  # document rows x layers recomputed
    stages: list[str] = field(default_factory=list)
    parallel: bool = False  # documents share positions after the prefix (APE)

    @property
    def n_ctx(self) -> int:
        return len(self.ctx_rows)

    @property
    def num_layers(self) -> int:
        return self.runner.num_layers

    @property
    def ctx_rows(self) -> torch.Tensor:
        return (self.kind == DOC).nonzero()[:, 0]

    @property
    def question_rows(self) -> torch.Tensor:
        return (self.kind == QUESTION).nonzero()[:, 0]

    @property
    def prefix_rows(self) -> torch.Tensor:
        return (self.kind == PREFIX).nonzero()[:, 0]

    def ctx_position_lookup(self) -> torch.Tensor:
        """``[n_positions]`` ctx index of the document token at each position (-1: none). Not for parallel
        layouts, where documents share positions."""
        lookup = torch.full((self.n_positions,), -1, dtype=torch.long)
        rows = self.ctx_rows
        lookup[self.pos[rows]] = self.ctx[rows]
        return lookup

    def forward(
        self,
        rows: torch.Tensor,
        *,
        stop: int | None = None,
        before_layer: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
        name: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the token rows ``rows [R]`` (indices into the token table, ascending) through layers
        ``0 .. stop-1``; ``before_layer(i, h, rows)`` may return a bool ``[R]`` of rows that go on (the others
        keep their stale entries from layer ``i`` on). Returns ``(h [1, R', hidden], rows [R'])``."""
        runner, device = self.runner, self.runner.device
        rows = rows.to(torch.long)
        ids = self.ids[rows].to(device)[None]
        pos = self.pos[rows].to(device)[None]
        h = runner.embed(ids)
        pe = runner.position_embeddings(h, pos)
        stop = runner.num_layers if stop is None else stop
        for i in range(stop):
            if before_layer is not None:
                keep = before_layer(i, h, rows)
                if keep is not None and not bool(keep.all()):
                    dev_keep = keep.to(device)
                    rows, h, pos = rows[keep], h[:, dev_keep], pos[:, dev_keep]
                    pe = {t: tuple(x[:, dev_keep] for x in cs) for t, cs in pe.items()}
            self.cache.layers[i].pending = pos
            h = runner.layer(i, h, pos, pe, self.cache)
            self.token_layers += int(rows.numel())
            self.doc_token_layers += int((self.kind[rows] == DOC).sum())
        if name:
            self.stages.append(name)
        return h, rows

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[1, V]`` of the last row of ``h`` (the last question token)."""
        return self.runner.logits(h)

    def finish(self) -> None:
        """Every position is now written in every layer: set the stream length, let sliding layers trim."""
        for layer in self.cache.layers:
            if not layer.is_initialized:
                raise LonglabError("internal: a layer was never written during the reuse prefill")
            layer.n_seen = self.n_positions
            layer.n_real = torch.full((1,), self.n_positions, dtype=torch.long, device=layer.index.device)
            layer.hold_window = False
            if layer.sliding_window:
                layer.trim_to_window(layer.sliding_window, slack=0)

    def recompute_fraction(self) -> float:
        """Document rows x layers recomputed over all document tokens x layers (1.0 = full prefill)."""
        total = self.n_ctx * self.num_layers
        return self.doc_token_layers / total if total else 0.0

    def cost_fraction(self) -> float:
        """Token rows x layers computed over a full prefill's (prompt tokens x layers)."""
        return self.token_layers / (len(self.ids) * self.num_layers)


def build_job(
    runner: Runner,
    prefix_ids: list[int],
    doc_ids: list[list[int]],
    question_ids: list[int],
    docs: list[DocKV] | None,
    *,
    parallel: bool = False,
) -> ReuseJob:
    """Lay out the prompt and, when ``docs`` is given, assemble their stored KV (RoPE fixed for the new
    positions) into a fresh :class:`ReuseCache`. ``docs=None`` leaves the cache empty (full prefill)."""
    P, Q = len(prefix_ids), len(question_ids)
    if Q == 0:
        raise LonglabError("question is empty: reuse needs a question (its rows give the first token)")
    if not doc_ids:
        raise LonglabError("docs is empty: give at least one document")
    lens = [len(d) for d in doc_ids]
    if parallel:
        doc_pos = [torch.arange(P, P + n) for n in lens]
        q_start = P + max(lens)
    else:
        starts = [P + sum(lens[:i]) for i in range(len(lens))]
        doc_pos = [torch.arange(s, s + n) for s, n in zip(starts, lens)]
        q_start = P + sum(lens)
    n_positions = q_start + Q
    if runner.max_positions and n_positions > runner.max_positions:
        raise LonglabError(
            f"prompt of {n_positions} positions (prefix {P}, {len(lens)} documents of {sum(lens)} tokens, "
            f"question {Q}) is longer than the model's max_position_embeddings={runner.max_positions}"
        )
    ids = torch.tensor(
        list(prefix_ids) + [t for d in doc_ids for t in d] + list(question_ids), dtype=torch.long
    )
    pos = torch.cat([torch.arange(P), *doc_pos, torch.arange(q_start, n_positions)])
    kind = torch.tensor([PREFIX] * P + [DOC] * sum(lens) + [QUESTION] * Q, dtype=torch.long)
    ctx = torch.full((len(ids),), -1, dtype=torch.long)
    ctx[P : P + sum(lens)] = torch.arange(sum(lens))
    spans = [(sum(lens[:i]), n) for i, n in enumerate(lens)]
    cache = ReuseCache(runner.num_layers)
    job = ReuseJob(runner, cache, ids, pos, kind, ctx, n_positions, spans, parallel=parallel)
    if docs is None:
        return job
    for d, ids_d in zip(docs, doc_ids):
        if d.n_tokens != len(ids_d) or len(d.keys) != runner.num_layers:
            raise LonglabError("internal: a stored document does not match its tokens or the model's layers")
    device, dtype = runner.device, runner.dtype
    stale_values = []
    with torch.inference_mode():
        for layer_idx, layer in enumerate(cache.layers):
            keys = [
                runner.rotate(d.keys[layer_idx][None].to(device, dtype), p.to(device), layer_idx)
                for d, p in zip(docs, doc_pos)
            ]
            k = torch.cat(keys, dim=2)  # [1, H_kv, N_ctx, D]
            v = torch.cat([d.values[layer_idx][None].to(device, dtype) for d in docs], dim=2)
            layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
            layer.keys, layer.values = k, v
            layer.index = (
                torch.cat(doc_pos).to(device, torch.int32)[None, None].expand_as(k[..., 0]).contiguous()
            )
            layer.n_seen = n_positions
            layer.n_real = torch.full((1,), n_positions, dtype=torch.long, device=device)
            stale_values.append(v)
    job.stale_values = stale_values
    return job
