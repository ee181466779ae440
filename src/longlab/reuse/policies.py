"""KV reuse methods: how a prompt ``[prefix][doc_1]...[doc_m][question]`` is prefilled from stored documents.

Each method is a small registered dataclass (``@register_reuse("cacheblend")``) whose ``prefill(job)`` runs
partial forwards over an assembled cache (:class:`~longlab.reuse.assemble.ReuseJob`) and returns the first
token's logits. Names parse like every method (:mod:`longlab.registry`): ``cacheblend:recompute=0.15``,
``prophetkv:recompute=0.2,dual_stage=true`` (``@`` is refused: it means the fraction *removed*).
The shared prefix (system prompt / chat header) is always prefilled fresh first; the question is always
recomputed through every layer. ``N`` below is the number of document tokens.

Why a separate ``reuse=`` axis and not a recipe part: a recipe says what the attention computes and what the
cache keeps *for a given token stream*; reuse says how the stream's KV is *produced* (from a store, which
rows are recomputed). They compose in that order: the reuse method produces the cache, then the recipe's KV
policies compress it once, query-aware, and decoding runs under the recipe
(``reuse_prefill(..., recipe="snapkv@0.5")``, ``generate(docs=..., reuse=..., recipe=...)``; the shape and
what does not compose: :mod:`longlab.reuse.compose`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..attention import LayerContext, StandIn
from ..recipe import LonglabError, Recipe
from ..registry import MAX_LAYERS, MAX_TOKENS, REGISTRY, Registered, param
from .assemble import QUESTION, ReuseJob

__all__ = [
    "ReuseMethod",
    "REUSE_METHODS",
    "register_reuse",
    "parse_reuse",
    "format_reuse",
    "FullPrefill",
    "NoRecompute",
    "EPIC",
    "CacheBlend",
    "ProphetKV",
    "APE",
]


@dataclass
class ReuseMethod(Registered):
    """Base of the reuse methods (family ``reuse``); fields are hyper-parameters, checked on construction.
    A recompute fraction is the parameter ``recompute`` (``cacheblend:recompute=0.15``): ``@`` means the
    fraction *removed* everywhere in longlab, and a reuse method removes nothing."""

    family: ClassVar[str] = "reuse"
    at_hint: ClassVar[str] = "a reuse method's recompute fraction is its parameter recompute= (e.g. " \
        "cacheblend:recompute=0.15)"
    uses_store: ClassVar[bool] = True  # reads stored documents (False: the full-prefill reference)
    parallel: ClassVar[bool] = False  # documents share positions after the prefix and are encoded after it

    def prefill(self, job: ReuseJob) -> torch.Tensor:  # -> logits [1, V]
        raise NotImplementedError

    def attention_recipe(self, job: ReuseJob) -> Recipe | None:
        """A recipe the cache keeps for decoding (APE's scaled attention); None: plain attention."""
        return None


#: The reuse family of the one registry (a live view ``name -> class``).
REUSE_METHODS = REGISTRY.view("reuse")


def register_reuse(name: str):
    """Class decorator: ``@register_reuse("cacheblend")`` puts the method in the one registry (family
    ``reuse``), known to ``reuse=``, ``--reuse`` and ``longlab methods``."""
    return REGISTRY.register(name, "reuse")


def parse_reuse(spec: str | ReuseMethod | None) -> ReuseMethod:
    """``"cacheblend:recompute=0.15"`` -> ``CacheBlend(recompute=0.15)``;
    ``"prophetkv:recompute=0.2,dual_stage=true"``; ``None`` -> the full-prefill reference."""
    if spec is None:
        return FullPrefill()
    if isinstance(spec, str) and not spec.strip():
        raise LonglabError("reuse is empty; valid methods: " + ", ".join(sorted(REUSE_METHODS)))
    return REGISTRY.parse("reuse", spec)


def format_reuse(method: ReuseMethod) -> str:
    """Inverse of :func:`parse_reuse` (non-default fields only)."""
    return REGISTRY.format(method)


def _budget(recompute: float, n: int) -> int:
    """Tokens recomputed at fraction ``recompute`` of ``n``: ``ceil(recompute * n)`` (0 at 0, n at 1)."""
    return min(n, max(0, math.ceil(recompute * n - 1e-9)))


def _rows(job: ReuseJob, ctx_selected: torch.Tensor) -> torch.Tensor:
    """Token-table rows of the selected document tokens (ctx indices) plus the question, ascending."""
    ctx_rows = job.ctx_rows[ctx_selected.to(torch.long)]
    return torch.cat([ctx_rows.sort().values, job.question_rows])


# ------------------------------------------------------------------------------------------ the methods


@register_reuse("full-prefill")
@dataclass
class FullPrefill(ReuseMethod):
    """Reference: prefill the whole prompt, no stored KV."""

    paper: ClassVar[str] = "reference"
    uses_store: ClassVar[bool] = False

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        h, _ = job.forward(torch.arange(len(job.ids)), name="full")
        return job.logits(h)


@register_reuse("no-recompute")
@dataclass
class NoRecompute(ReuseMethod):
    """Lower bound: concatenate the stored documents (RoPE fixed), recompute only the question."""

    paper: ClassVar[str] = "naive concatenation"

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        h, _ = job.forward(job.question_rows, name="question")
        return job.logits(h)


@register_reuse("epic")
@dataclass
class EPIC(ReuseMethod):
    """EPIC / LegoLink (Hu et al. 2024, arXiv 2410.15332): recompute the first ``k`` tokens of every
    document (the attention-sink tokens the isolated prefill created) plus the question; reuse the rest.

    ``recompute`` (optional) sets ``k_i = ceil(recompute * n_i)`` for document ``i`` of ``n_i`` tokens
    instead, to place EPIC on the same
    recompute axis as the others. Every document counts as a non-first chunk: the shared prefix is the
    first chunk and is prefilled fresh."""

    paper: ClassVar[str] = "arXiv 2410.15332"
    k: int = param(16, low=0, high=MAX_TOKENS, integer=True)  # tokens per document
    recompute: float | None = param(None, low=0, high=1)  # a fraction of each document instead of k

    def per_doc(self, job: ReuseJob) -> list[int]:
        """Tokens recomputed at the start of each document."""
        if self.recompute is None:
            return [min(self.k, n) for _, n in job.doc_spans]
        return [_budget(self.recompute, n) for _, n in job.doc_spans]

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        ks = self.per_doc(job)
        chosen = [torch.arange(s, s + k) for (s, _), k in zip(job.doc_spans, ks)]
        h, _ = job.forward(_rows(job, torch.cat(chosen)), name=f"epic-k{max(ks)}")
        return job.logits(h)


@register_reuse("cacheblend")
@dataclass
class CacheBlend(ReuseMethod):
    """CacheBlend (Yao et al., EuroSys'25, arXiv 2405.16444): layer 0 is recomputed for every token; at
    ``check_layer`` the deviation ``dev_j = ||V_new_j - V_cached_j||^2`` (summed over heads and dims) ranks
    the document tokens, the top ``ceil(recompute * N)`` (plus the question) propagate through the remaining
    layers, the others keep their stored KV.

    ``gradual=true``: the paper's gradual filtering — at ``check_layer`` keep
    ``ceil(min(1, gradual_factor * recompute) * N)`` tokens, then at each of the next ``gradual_layers``
    layers re-rank the survivors by their deviation at that layer and shrink the set linearly to
    ``recompute``."""

    paper: ClassVar[str] = "arXiv 2405.16444"
    recompute: float = param(0.16, low=0, high=1)
    check_layer: int = param(1, low=1, high=MAX_LAYERS, integer=True)  # the model's last layer if beyond
    gradual: bool = param(False, choices=(True, False))
    # the first set is min(1, gradual_factor x recompute): beyond 1000 it is every token for any recompute
    # above 0.001
    gradual_factor: float = param(2.0, low=1, high=1000)
    gradual_layers: int = param(3, low=1, high=MAX_LAYERS, integer=True)

    def schedule(self, job: ReuseJob) -> dict[int, int]:
        """Layer -> number of document tokens kept from that layer on."""
        n, L = job.n_ctx, job.num_layers
        first = min(self.check_layer, L - 1)
        if not self.gradual:
            return {first: _budget(self.recompute, n)}
        top = min(1.0, self.gradual_factor * self.recompute)
        steps = max(1, min(self.gradual_layers, L - 1 - first))
        out = {}
        for s in range(steps + 1):
            r = top + (self.recompute - top) * s / steps
            out[first + s] = _budget(r, n)
        return out

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        plan = self.schedule(job)
        runner = job.runner

        def before_layer(i: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
            if i not in plan:
                return None
            is_doc = job.kind[rows] != QUESTION
            keep = ~is_doc
            doc_local = is_doc.nonzero()[:, 0]
            count = min(plan[i], int(doc_local.numel()))
            if count == 0:
                return keep
            ctx_idx = job.ctx[rows[doc_local]]
            v_new = runner.fresh_values(i, h[:, doc_local.to(h.device)]).float()  # [1, H_kv, R_doc, D]
            v_old = job.stale_values[i][:, :, ctx_idx.to(h.device)].float()
            dev = (v_new - v_old).pow(2).sum(dim=(0, 1, 3))  # [R_doc]
            top = dev.topk(count).indices.cpu()
            keep[doc_local[top]] = True
            return keep

        h, _ = job.forward(
            torch.cat([job.ctx_rows, job.question_rows]), before_layer=before_layer, name="blend"
        )
        return job.logits(h)


class _AttentionProbe(StandIn):
    """Stand-in KV policy (observe only): per layer, the mean attention of the question rows (the last
    ``n_query`` rows of the forward) over document tokens, normalised to sum 1: ``r_l [N]``."""

    name = "reuse-probe"
    needs_observe = True

    def __init__(self, job: ReuseJob, n_query: int, layers: set[int] | None = None) -> None:
        self.lookup = job.ctx_position_lookup()
        self.n_ctx = job.n_ctx
        self.n_query = n_query
        self.layers = layers
        self.scores: dict[int, torch.Tensor] = {}

    def observe(self, ctx: LayerContext) -> None:
        if self.layers is not None and ctx.layer_idx not in self.layers:
            return
        T_q = ctx.q.shape[-2]
        probs = ctx.attention_probs(slice(T_q - self.n_query, T_q))  # [1, H, n_query, T]
        per_slot = probs.mean(dim=(1, 2))[0]  # [T]
        slot_pos = ctx.key_index[0, 0].long().cpu()  # heads share slots here
        ctx_idx = torch.where(slot_pos >= 0, self.lookup[slot_pos.clamp(min=0)], -1)
        r = torch.zeros(self.n_ctx)
        ok = ctx_idx >= 0
        r.index_add_(0, ctx_idx[ok], per_slot.cpu()[ok].float())
        total = float(r.sum())
        self.scores[ctx.layer_idx] = r / total if total > 0 else r

    def select(self, ctx: LayerContext) -> None:
        return None

    def select_decode(self, ctx: LayerContext) -> None:
        return None


def _with_probe(job: ReuseJob, probe: _AttentionProbe, run) -> Any:
    saved = job.cache.recipe
    # the probe alone observes; KV policies already there (the recorder of longlab.reuse.compose) stay
    job.cache.recipe = Recipe(kv=[probe, *saved.kv])  # type: ignore[list-item]
    try:
        return run()
    finally:
        job.cache.recipe = saved


@register_reuse("prophetkv")
@dataclass
class ProphetKV(ReuseMethod):
    """ProphetKV (Wang et al., ICML'26, arXiv 2602.02579; reconstruction from the abstract): rank document
    tokens by their relevance to the question, not by KV deviation.

    Stage 1 (probe): the question rows alone run through every layer against the stale assembled KV;
    ``r_l(j)`` = mean over heads and question tokens of ``softmax(Q_u K^T s)[:, j]``, normalised to sum 1;
    fused ``R(j) = sum_l w_l r_l(j)`` with uniform ``w_l`` over ``layers`` (``all`` or ``middle``: the middle
    half). Stage 2: the top ``ceil(recompute * N)`` tokens by ``R`` (plus each document's first token when
    ``sink_guard``) and the question are recomputed through every layer (a real partial forward).

    ``dual_stage=true``: the probe runs only through layers ``< switch_layer`` (default ``L // 3``) and
    selects ``S1`` of ``ceil(stage1_recompute * N)`` tokens (default ``min(1, 2 recompute)``); ``S1`` and
    the question are recomputed up to ``switch_layer``, where the *recomputed* question attention (fused
    over layers ``0..switch_layer``) re-ranks ``S1``; the top ``ceil(recompute * N)`` continue. (The
    spec's ``S2 ⊂ S1 ∪ new`` is realised as ``S2 ⊂ S1``: a token outside ``S1`` has no fresh hidden
    state to continue from.)"""

    paper: ClassVar[str] = "arXiv 2602.02579"
    recompute: float = param(0.2, low=0, high=1)
    layers: str = param("all", choices=("all", "middle"))
    sink_guard: bool = param(False, choices=(True, False))
    dual_stage: bool = param(False, choices=(True, False))
    switch_layer: int | None = param(None, low=1, high=MAX_LAYERS, integer=True)  # None: L // 3
    stage1_recompute: float | None = param(None, low=0, high=1)  # None: min(1, 2 recompute)

    def _fuse(self, scores: dict[int, torch.Tensor], L: int, n: int) -> torch.Tensor:
        chosen = sorted(scores)
        if self.layers == "middle":
            mid = [i for i in chosen if L // 4 <= i < L - L // 4]
            chosen = mid or chosen
        if not chosen:
            return torch.zeros(n)
        return torch.stack([scores[i] for i in chosen]).mean(0)

    def _guard(self, job: ReuseJob, selected: torch.Tensor) -> torch.Tensor:
        if not self.sink_guard:
            return selected
        firsts = torch.tensor([s for s, _ in job.doc_spans], dtype=torch.long)
        return torch.unique(torch.cat([selected, firsts]))

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        L, n, nq = job.num_layers, job.n_ctx, len(job.question_rows)
        switch = L
        if self.dual_stage:
            switch = self.switch_layer if self.switch_layer is not None else max(1, L // 3)
        switch = min(switch, L)
        probe = _AttentionProbe(job, nq)
        _with_probe(job, probe, lambda: job.forward(job.question_rows, stop=switch, name="probe"))
        relevance = self._fuse(probe.scores, L, n)
        budget = _budget(self.recompute, n)
        if not self.dual_stage or switch >= L:
            selected = self._guard(
                job, relevance.topk(budget).indices if budget else torch.zeros(0, dtype=torch.long)
            )
            h, _ = job.forward(_rows(job, selected), name="recompute")
            return job.logits(h)
        r1 = self.stage1_recompute if self.stage1_recompute is not None else min(1.0, 2 * self.recompute)
        b1 = max(budget, _budget(r1, n))
        s1 = self._guard(job, relevance.topk(b1).indices if b1 else torch.zeros(0, dtype=torch.long))
        probe2 = _AttentionProbe(job, nq, layers=set(range(switch + 1)))

        def before_layer(i: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
            if i != switch + 1 or switch + 1 >= L:
                return None
            fused = self._fuse(probe2.scores, L, n)
            is_q = job.kind[rows] == QUESTION
            keep = is_q.clone()
            doc_local = (~is_q).nonzero()[:, 0]
            count = min(budget, int(doc_local.numel()))
            if count:
                top = fused[job.ctx[rows[doc_local]]].topk(count).indices
                keep[doc_local[top]] = True
            if self.sink_guard:
                firsts = torch.tensor([s for s, _ in job.doc_spans])
                keep |= torch.isin(job.ctx[rows], firsts) & ~is_q
            return keep

        h, _ = _with_probe(
            job, probe2, lambda: job.forward(_rows(job, s1), before_layer=before_layer, name="dual-recompute")
        )
        return job.logits(h)


@dataclass
class APEAttention:
    """APE's attention for queries after the parallel documents. With document logits ``s_D`` (keys in
    position range ``[lo, hi)``), the documents as a group get the log-mass ``T * logsumexp(s_D / T) +
    log S`` and share it by ``softmax(s_D / T)``; prefix and later keys keep their logits. Equivalently
    each document logit becomes ``s_j / T + (T - 1) * logsumexp(s_D / T) + log S`` before one softmax
    (``T = S = 1``: plain attention). Used as the cache's prefill and decode policy."""

    name: ClassVar[str] = "ape-attention"
    kind: ClassVar[str] = "prefill"
    batch_select_safe: ClassVar[bool] = True
    reads_attention: ClassVar[bool] = False
    needs_observe: ClassVar[bool] = False
    lo: int = 0
    hi: int = 0
    temperature: float = 1.0
    scale: float = 1.0

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        # q: [1, H, T_q, D]; k, v: [1, H_kv, T, D] -> [1, H, T_q, D]
        g = ctx.groups
        k = ctx.k.repeat_interleave(g, dim=1)
        v = ctx.v.repeat_interleave(g, dim=1)
        logits = torch.matmul(ctx.q.float(), k.float().transpose(-1, -2)) * ctx.scaling  # [1, H, T_q, T]
        cap = getattr(getattr(ctx.module, "config", None), "attn_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        mask = ctx.mask()
        if mask.shape[1] > 1:
            mask = mask.repeat_interleave(g, dim=1)
        mask = mask | ~mask.any(-1, keepdim=True)
        logits = logits.masked_fill(~mask, float("-inf"))
        kidx = ctx.key_index[:, :1]  # [1, 1, T]
        is_doc = ((kidx >= self.lo) & (kidx < self.hi))[:, :, None, :]  # [1, 1, 1, T]
        t = self.temperature
        doc = (logits / t).masked_fill(~is_doc, float("-inf"))
        lse = torch.logsumexp(doc, dim=-1, keepdim=True)  # [1, H, T_q, 1]; -inf when no document is visible
        shift = (t - 1.0) * lse + math.log(self.scale)
        shift = torch.where(torch.isfinite(lse), shift, torch.zeros_like(lse))
        logits = torch.where(is_doc, doc + shift, logits)
        probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs.to(v.dtype), v)


@register_reuse("ape")
@dataclass
class APE(ReuseMethod):
    """APE, adaptive parallel encoding (Yang et al., ICLR'25, arXiv 2502.05431), training-free: every
    document is encoded once after the shared prefix, all at the same positions ``P .. P+n_i-1`` (the
    prefix holds the attention sink, so no document grows its own); the question starts at ``P + max n_i``
    and, with every generated token, attends to the documents with APE's temperature and scale
    (:class:`APEAttention`). Nothing is recomputed (``temperature = scale = 1``: plain parallel encoding)."""

    paper: ClassVar[str] = "arXiv 2502.05431"
    parallel: ClassVar[bool] = True
    # T divides the document logits: at 0.01 the documents' attention is already an argmax, at 100 uniform
    temperature: float = param(1.0, low=0.01, high=100)
    # S multiplies the documents' attention mass (log S is added to their logits); the paper's values are
    # near 1: 1e6 (log S ~ 13.8) bounds it far outside any useful setting
    scale: float = param(1.0, low=0, high=1e6, low_open=True)

    def attention_recipe(self, job: ReuseJob) -> Recipe:
        rows = job.ctx_rows
        lo, hi = int(job.pos[rows].min()), int(job.pos[rows].max()) + 1
        att = APEAttention(lo, hi, self.temperature, self.scale)
        return Recipe(prefill=att, decode=att)  # type: ignore[arg-type]

    def prefill(self, job: ReuseJob) -> torch.Tensor:
        h, _ = job.forward(job.question_rows, name="question")
        return job.logits(h)
