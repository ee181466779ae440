"""Dustin: sparse verification for long-context speculative decoding (Lee et al., arXiv 2606.24957,
ICML 2026; reconstruction in ``specs/prefill-reuse-decoding.md`` §6 — abstract + reconstruction, no code).

Verifying ``L + 1`` drafted tokens still reads the whole KV cache. Dustin verifies over a selected subset:

1. *lookahead* ``a^D(j)``: the draft's attention over context position ``j`` while drafting (summed over the
   drafted tokens, the draft's last ``lookahead_layers`` layers and their heads);
2. *history* ``a^T(j)``: on a few target heads ``H_s`` chosen offline (:func:`select_heads`, the heads whose
   own top pages capture the most attention of all heads — "selection recall"), full attention from the
   committed tokens of each step, kept as an EMA ``a^T <- beta a^T + (1 - beta) attn``;
3. ``score(j) = alpha a^D(j) / |a^D|_1 + (1 - alpha) a^T(j) / |a^T|_1``, pooled to pages of ``page_size``
   positions; keep the top ``budget // page_size`` pages (ranked among the pages not already kept), the
   first ``sink`` positions, the last ``recent`` positions and the current block (drafts). The selection
   is refreshed every ``refresh`` steps, or when a step's acceptance falls below ``drop`` times the
   running mean;
4. every non-scoring head attends only the selected entries (a gathered copy of ``budget`` entries per
   layer, plus everything written since the selection); the scoring heads attend everything (their
   attention is the history signal). Acceptance is the standard rule, so a wrong selection costs
   acceptance, never correctness of the accepted tokens *with respect to the sparse target*.

When the selection covers every held slot of a layer (``budget`` at least the context), that layer is
verified exactly (:func:`longlab.spec.verify.exact_attention`), so Dustin equals ``full``. The first step
(no signal yet) is verified in full; without a head file the scoring heads are chosen from that step's
attention with the same recall criterion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..attention import LayerContext, layer_attention
from ..cache import LonglabCache
from ..recipe import LonglabError, Recipe, check_range
from ..registry import MAX_BLOCK, MAX_TOKENS, param
from .base import Verifier, forward_tokens, register_verifier
from .slot_attention import SlotView, attend_kv, kv_slot_bytes
from .verify import exact_attention

__all__ = ["Dustin", "head_recall", "select_heads", "save_heads", "load_heads", "page_mass"]


def page_mass(probs: torch.Tensor, kpos: torch.Tensor, n_pos: int) -> torch.Tensor:
    """Attention mass per position: probs [B, H, t, S] over keys at kpos [B, H_kv, S] -> [B, H, n_pos]
    (summed over the t queries)."""
    B, H, t, S = probs.shape
    g = H // kpos.shape[1]
    pos = kpos.long().clamp(min=0).repeat_interleave(g, dim=1)  # [B, H, S]
    mass = (probs.sum(2) * (pos >= 0) * (kpos.repeat_interleave(g, dim=1) >= 0)).float()
    out = torch.zeros(B, H, n_pos, dtype=torch.float32, device=probs.device)
    return out.scatter_add_(2, pos.clamp(max=n_pos - 1), mass)


def _pool(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., n_pos] -> [..., ceil(n_pos / page_size)] sums per page."""
    n = x.shape[-1]
    pad = (-n) % page_size
    x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, page_size).sum(-1)


def head_recall(mass: torch.Tensor, page_size: int, budget: int) -> torch.Tensor:
    """Selection recall of every head. mass [B, H, n_pos] attention mass per position (every head of a
    layer, or of several layers stacked on dim 1). Head ``h`` picks its top ``budget // page_size`` pages;
    its recall is the fraction of every head's mass those pages hold, averaged over heads and rows: [H]."""
    pages = _pool(mass, page_size)  # [B, H, P]
    k = max(1, min(pages.shape[-1], budget // page_size))
    top = pages.topk(k, dim=-1).indices  # [B, H, k]
    share = pages / pages.sum(-1, keepdim=True).clamp_min(1e-30)  # [B, H, P]
    chosen = torch.zeros_like(pages).scatter_(-1, top, 1.0)  # [B, H, P] head h's pages
    # recall[b, h] = mean_h' sum_p chosen[b, h, p] * share[b, h', p]
    return (chosen @ share.transpose(-1, -2)).mean(-1).mean(0)  # [H]


def _pick(recall: dict[tuple[int, int], float], n_heads: int, per_layer: int) -> list[tuple[int, int]]:
    chosen, per = [], {}
    for (layer, head), _ in sorted(recall.items(), key=lambda kv: -kv[1]):
        if per.get(layer, 0) < per_layer:
            chosen.append((layer, head))
            per[layer] = per.get(layer, 0) + 1
        if len(chosen) == n_heads:
            break
    return sorted(chosen)


class _Recorder:
    """Prefill attention that measures every head's selection recall on the last ``n_queries`` queries."""

    def __init__(self, page_size: int, budget: int, n_queries: int) -> None:
        self.page_size, self.budget, self.n_queries = page_size, budget, n_queries
        self.recall: dict[tuple[int, int], float] = {}

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        T_q = ctx.q.shape[-2]
        rows = slice(max(0, T_q - self.n_queries), T_q)
        probs = ctx.attention_probs(rows)  # [B, H, t, T]
        n_pos = int(ctx.key_index.max()) + 1
        r = head_recall(page_mass(probs, ctx.key_index, n_pos), self.page_size, self.budget)
        for h, value in enumerate(r.tolist()):
            self.recall[(ctx.layer_idx, h)] = value
        return layer_attention(ctx, None)


@torch.inference_mode()
def select_heads(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    n_heads: int = 4,
    per_layer: int = 2,
    page_size: int = 32,
    budget: int = 1024,
    n_queries: int = 16,
    max_tokens: int = 4096,
) -> dict[str, Any]:
    """Dustin's offline step: run ``text`` (calibration, up to ``max_tokens`` tokens) through the target and
    keep the ``n_heads`` heads (at most ``per_layer`` per layer) with the highest selection recall of the
    last ``n_queries`` queries. Returns a JSON-able dict (see :func:`save_heads`)."""
    for name, value, low, high in (
        ("n_heads", n_heads, 1, 1 << 16),
        ("per_layer", per_layer, 1, 1 << 10),
        ("page_size", page_size, 1, MAX_BLOCK),
        ("budget", budget, 1, MAX_TOKENS),
        ("n_queries", n_queries, 1, MAX_TOKENS),
        ("max_tokens", max_tokens, 2, MAX_TOKENS),
    ):
        check_range(f"select_heads: {name}", value, low, high, integer=True)
    ids = tokenizer(text)["input_ids"][:max_tokens]
    if len(ids) < 2 * page_size:
        raise LonglabError(f"select_heads: calibration text has {len(ids)} tokens; need >= {2 * page_size}")
    rec = _Recorder(page_size, budget, n_queries)
    cache = LonglabCache()
    t = torch.tensor([ids])
    forward_tokens(
        model,
        cache,
        t,
        torch.zeros(1, 0, dtype=torch.bool),
        torch.zeros(1, dtype=torch.long),
        Recipe(prefill=rec, decode=rec),
    )  # type: ignore[arg-type]
    heads = _pick(rec.recall, n_heads, per_layer)
    return {
        "method": "dustin-heads",
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "num_layers": model.config.num_hidden_layers,
        "num_heads": model.config.num_attention_heads,
        "page_size": page_size,
        "budget": budget,
        "calibration_tokens": len(ids),
        "heads": [list(h) for h in heads],
        "recall": {f"{layer}.{head}": round(v, 4) for (layer, head), v in sorted(rec.recall.items())},
    }


def save_heads(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_heads(path: str | Path) -> list[tuple[int, int]]:
    try:
        data = json.loads(Path(path).read_text())
        return [(int(a), int(b)) for a, b in data["heads"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LonglabError(f"dustin: cannot read a head file from {str(path)!r} ({exc})") from None


@register_verifier("dustin")
@dataclass
class Dustin(Verifier):
    """Sparse verification: non-scoring heads read the top pages by draft lookahead + target-head EMA.

    The selection (``_sel``, ``_ema``: per row over positions, shared by all layers) and the per-layer
    gathered views (``_views``, keyed by layer index) are controller state of one speculative run, kept
    here rather than on the cache layers (``layer.state``, the rule for method state) because: the
    verification forward runs inside the loop's :class:`~longlab.spec.rollback.CacheSnapshot`, whose
    ``restore`` would roll layer-held views back after every step (they must persist for ``refresh``
    steps); ``Stream.fork`` / ``LonglabLayer.clone`` copy layer state, so a fork would inherit a stale
    selection; and a view is derived (a gathered copy of slots the layer still holds), rebuilt from the
    layer at every refresh. :meth:`start` resets all of it."""

    paper: ClassVar[str] = "arXiv:2606.24957"
    needs_lookahead: ClassVar[bool] = True
    budget: int = param(1024, low=1, high=MAX_TOKENS, integer=True)
    page_size: int = param(32, low=1, high=MAX_BLOCK, integer=True)
    alpha: float = param(0.5, low=0, high=1)
    beta: float = param(0.9, low=0, high=1)
    sink: int = param(64, low=0, high=MAX_TOKENS, integer=True)
    recent: int = param(128, low=0, high=MAX_TOKENS, integer=True)
    refresh: int = param(8, low=1, high=MAX_TOKENS, integer=True)  # steps between selections
    drop: float = param(0.5, low=0, high=1)
    heads: str = ""  # JSON from select_heads; "" = choose at the first (full) step
    # scoring heads, in all and per layer: no model has 65536 heads in all, nor 1024 in one layer
    n_heads: int = param(4, low=1, high=1 << 16, integer=True)
    per_layer: int = param(2, low=1, high=1 << 10, integer=True)
    _state: dict = field(default_factory=dict, init=False, repr=False)

    # --- per run -----------------------------------------------------------------------------------
    def start(self, sc: Any) -> None:
        self._sc = sc
        self._policies = [p for p in sc.cache.recipe.kv if p.kind == "quant"]
        self._scoring: dict[int, list[int]] | None = None
        if self.heads:
            self._set_heads(load_heads(self.heads))
        self._sel: torch.Tensor | None = None  # [B, n_pos] selected positions
        self._views: dict[int, SlotView] = {}
        self._ema: torch.Tensor | None = None  # [B, n_pos]
        self._since = 0
        self._mean_acc: float | None = None
        self._dropped = False
        self._records: dict[int, torch.Tensor] = {}
        self._calib: dict[tuple[int, int], float] = {}

    def _set_heads(self, heads: list[tuple[int, int]]) -> None:
        self._scoring = {}
        for layer, head in heads:
            self._scoring.setdefault(layer, []).append(head)

    def begin(self, sc: Any, snapshot: Any, proposal: Any) -> None:
        self._snapshot = snapshot
        self._lookahead = proposal.lookahead if proposal is not None else None
        self._records = {}
        if self._sel is None or self._since >= self.refresh or self._dropped:
            self._select(sc, snapshot)
        self._since += 1

    def _select(self, sc: Any, snapshot: Any) -> None:
        n_real = sc.stream.next_pos.cpu()  # [B] positions seen per row
        n_pos = int(n_real.max())
        signals = []
        for sig, w in ((self._lookahead, self.alpha), (self._ema, 1.0 - self.alpha)):
            if sig is not None and w > 0:
                s = torch.nn.functional.pad(sig[:, :n_pos], (0, max(0, n_pos - sig.shape[1])))
                signals.append(w * s / s.sum(-1, keepdim=True).clamp_min(1e-30))
        if not signals or self._scoring is None:
            self._sel = None  # no signal yet: verify this step in full (and learn the heads)
            return
        pos = torch.arange(n_pos)
        always = (pos[None, :] < self.sink) | (pos[None, :] >= (n_real - self.recent)[:, None])  # [B, n_pos]
        pages = _pool(sum(signals), self.page_size)  # [B, P]
        covered = _pool((~always).float(), self.page_size) == 0  # pages kept anyway (sink, recent)
        pages = pages.masked_fill(covered, float("-inf"))
        k = min(int((~covered).sum(-1).max()), self.budget // self.page_size)
        sel_pages = torch.zeros_like(pages, dtype=torch.bool)
        if k:
            top = pages.topk(k, dim=-1)
            sel_pages.scatter_(-1, top.indices, top.values > float("-inf"))  # a row with fewer pages: skip
        sel = sel_pages.repeat_interleave(self.page_size, dim=-1)[:, :n_pos] | always
        self._sel = sel
        self._views = {}
        self._base = list(snapshot.n_slots)
        self._since = 0
        self._dropped = False
        sc.stats.refreshes += 1

    def end(self, sc: Any, keep: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        # history signal: mean attention of the scoring heads from the committed queries
        if self._records:
            T_q = next(iter(self._records.values())).shape[1]
            w = (torch.arange(T_q)[None, :] < keep[:, None]).float()  # [B, T_q]
            n_pos = max(r.shape[-1] for r in self._records.values())
            total = torch.zeros(len(keep), n_pos)
            for rec in self._records.values():  # [B, T_q, n_pos]
                r = torch.nn.functional.pad(rec, (0, n_pos - rec.shape[-1]))
                total += (r * w[..., None]).sum(1)
            total = total / total.sum(-1, keepdim=True).clamp_min(1e-30)
            if self._ema is None:
                self._ema = total
            else:
                ema = torch.nn.functional.pad(self._ema, (0, max(0, n_pos - self._ema.shape[1])))
                self._ema = self.beta * ema[:, :n_pos] + (1 - self.beta) * total
        if self._scoring is None and self._calib:
            self._set_heads(_pick(self._calib, self.n_heads, self.per_layer))
        d = int(drafted.sum())
        if d:
            rate = float(accepted.sum()) / d
            if self._mean_acc is not None and rate < self.drop * self._mean_acc:
                self._dropped = True
            self._mean_acc = rate if self._mean_acc is None else 0.8 * self._mean_acc + 0.2 * rate

    # --- attention ---------------------------------------------------------------------------------
    def _view(self, ctx: LayerContext) -> SlotView:
        view = self._views.get(ctx.layer_idx)
        if view is not None:
            return view
        layer = ctx.layer
        base = self._base[ctx.layer_idx]
        idx = layer.index[..., :base]  # [B, H_kv, base]
        sel = self._sel.to(idx.device)
        take = (idx >= 0) & sel.gather(
            1, idx.long().clamp(min=0).reshape(len(sel), -1).clamp(max=sel.shape[1] - 1)
        ).reshape(idx.shape)
        complete = bool((take == (idx >= 0)).all())
        view = self._views[ctx.layer_idx] = SlotView.gather(ctx, take, base, skip_kv=complete)
        S = view.pos.shape[-1]
        if not complete:  # gathering reads the selected slots (a quantized layer dequantises all of them)
            read = base if hasattr(layer, "key_store") else S
            self._sc.stats.target_kv_bytes += read * kv_slot_bytes(layer)
        return view

    def _record(self, ctx: LayerContext, heads: list[int], probs: torch.Tensor, kpos: torch.Tensor) -> None:
        """probs [B, h_s, t, T] of the scoring heads -> per-query position mass [B, t, n_pos]."""
        g = ctx.q.shape[1] // kpos.shape[1]
        kp = kpos[:, [h // g for h in heads]]  # [B, h_s, T]
        n_pos = int(kpos.max()) + 1
        B, hs, t, T = probs.shape
        pos = kp.long().clamp(min=0)[:, :, None, :].expand(B, hs, t, T)
        mass = torch.zeros(B, hs, t, n_pos, device=probs.device)
        mass.scatter_add_(3, pos, probs * (kp >= 0)[:, :, None, :])
        self._records[ctx.layer_idx] = mass.sum(1).float().cpu()  # [B, t, n_pos]

    def _full_heads(self, ctx: LayerContext, heads: list[int]) -> torch.Tensor:
        """Exact attention of the scoring heads over every held entry; records their attention."""
        g = ctx.q.shape[1] // ctx.key_index.shape[1]
        kv = sorted({h // g for h in heads})
        q = torch.stack([ctx.q[:, h] for h in heads], 1)  # [B, h_s, t, D], one KV head each
        kmap = [kv.index(h // g) for h in heads]
        k, v, kpos = ctx.k[:, kv][:, kmap], ctx.v[:, kv][:, kmap], ctx.key_index[:, kv][:, kmap]
        out, _, probs = attend_kv(q, k, v, kpos, ctx.query_index, ctx.scaling, ctx.sliding_window, True)
        self._record(ctx, heads, probs, ctx.key_index)
        return out

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        stats, layer = self._sc.stats, ctx.layer
        T = layer.index.shape[-1]
        slot = kv_slot_bytes(layer)
        heads = (self._scoring or {}).get(ctx.layer_idx, [])
        state = self._snapshot.layer_state(ctx.layer_idx)
        if self._sel is None or ctx.sliding_window is not None:
            out, read = exact_attention(ctx, state, self._policies)
            stats.target_kv_bytes += read * slot
            if self._scoring is None:  # learn the heads from this full step
                probs = ctx.attention_probs()
                r = head_recall(
                    page_mass(probs, ctx.key_index, int(ctx.key_index.max()) + 1), self.page_size, self.budget
                )
                for h, value in enumerate(r.tolist()):
                    self._calib[(ctx.layer_idx, h)] = value
            elif heads:
                self._full_heads(ctx, heads)
            return out
        view = self._view(ctx)
        if view.complete:  # the selection covers the layer: exact
            out, read = exact_attention(ctx, state, self._policies)
            stats.target_kv_bytes += read * slot
            if heads:
                self._full_heads(ctx, heads)
            return out
        out = self.sparse_attend(ctx, view)
        H_kv = ctx.key_index.shape[1]
        stats.target_kv_bytes += (view.pos.shape[-1] + T - view.base) * slot
        if heads:
            full = self._full_heads(ctx, heads)
            out = out.clone()
            for i, h in enumerate(heads):
                out[:, h] = full[:, i].to(out.dtype)
            g = ctx.q.shape[1] // H_kv
            stats.target_kv_bytes += len({h // g for h in heads}) / H_kv * T * slot
        return out

    def sparse_attend(self, ctx: LayerContext, view: SlotView) -> torch.Tensor:
        """Attention over the view's selected slots plus every slot written since it was selected."""
        k, v, pos = view.read(ctx.layer)
        out, _, _ = attend_kv(ctx.q, k, v, pos, ctx.query_index, ctx.scaling, ctx.sliding_window)
        return out.to(ctx.q.dtype)
