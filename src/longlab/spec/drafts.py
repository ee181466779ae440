"""Drafts: who proposes the tokens the target verifies.

- ``lookup`` — prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; the
  ``prompt_lookup_num_tokens`` path of transformers): find the last ``n``-gram of the row's tokens (prompt
  + output, ``n`` from ``max_ngram`` down to 1) earlier in the row, propose the ``num_pred_tokens`` tokens
  that followed its most recent occurrence. No forward at all.
- ``self:KVRECIPE`` — self-speculation (MagicDec, Chen et al. 2024, arXiv:2408.11049; TriForce, Sun et al.
  2024, arXiv:2404.11912): the target drafts while reading a *view* of its own cache chosen by any KV
  eviction policy (``streaming:budget=256``, ``snapkv@0.9``) or decode policy (``quest:budget=1024``). The
  view is a gathered copy of the selected slots only (``budget`` entries per layer, never a second full
  cache), re-selected every ``refresh`` steps; the slots written since the last selection (recent tokens,
  drafts) are always read. Scores that need observation queries (SnapKV) use the last ``window`` queries
  of the target's verification forwards. Draft tokens are written into the target's cache and rolled back.
- ``model:NAME`` — a separate small draft model with the same tokenizer (Leviathan et al. 2023), with its
  own :class:`~longlab.cache.LonglabCache` under ``recipe`` (TriForce's tiny draft with a StreamingLLM
  cache is ``model:NAME`` with ``recipe=streaming:budget=256``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import LayerContext, layer_attention
from ..cache import LonglabCache, left_pad
from ..recipe import LonglabError, Recipe, parse_method, parse_recipe, shorten
from ..registry import MAX_LAYERS, MAX_TOKENS, param
from .base import Draft, Proposal, SpecContext, forward_tokens, register_draft
from .loop import filtered_probs
from .rollback import CacheSnapshot
from .slot_attention import SlotView, attend_kv, kv_slot_bytes

__all__ = ["LookupDraft", "SelfDraft", "ModelDraft", "lookup_proposal"]


def lookup_proposal(tokens: list[int], max_ngram: int, num_pred: int) -> list[int]:
    """Prompt lookup on one row: the tokens that followed the most recent earlier occurrence of the row's
    last ``n``-gram, trying ``n = max_ngram .. 1``; ``[]`` when nothing matches."""
    n_tok = len(tokens)
    if n_tok < 2:
        return []
    ids = torch.tensor(tokens)  # [n_tok]; one vectorised scan per n, not a Python loop over the history
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        windows = ids[: n_tok - 1].unfold(0, n, 1)  # [n_tok - n, n]: n-grams that have a continuation
        hits = (windows == ids[-n:]).all(-1).nonzero()
        if hits.numel():
            j = int(hits[-1])  # the most recent occurrence
            return tokens[j + n : j + n + num_pred]
    return []


def _pad_rows(rows: list[list[int]], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), L), fill, dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            out[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out, torch.tensor([len(r) for r in rows], dtype=torch.long)


@register_draft("lookup")
@dataclass
class LookupDraft(Draft):
    """Prompt lookup: propose what followed the last n-gram's latest earlier occurrence (n = max_ngram..1)."""

    paper = "Saxena 2023, prompt-lookup-decoding; transformers prompt_lookup_num_tokens"
    default_gamma: ClassVar[int] = 10
    # the scan compares every n-gram of the history (memory history x n); transformers uses 2-3, and a
    # match longer than 64 tokens proposes what a 64-token match does
    max_ngram: int = param(3, low=1, high=64, integer=True)
    # tokens proposed per step, all verified in one forward of the target
    num_pred_tokens: int = param(10, low=1, high=1024, integer=True)

    def propose(self, sc: SpecContext, pend: list[list[int]], gamma: int) -> Proposal:
        k = min(gamma, self.num_pred_tokens)
        rows = [lookup_proposal(h, self.max_ngram, k) for h in sc.history]
        fill = pend[0][-1]
        tokens, lengths = _pad_rows(rows, fill)
        return Proposal(tokens, lengths)


def _sample_rows(logits: torch.Tensor, sc: SpecContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] -> (tokens [B], probs [B, V] or None when greedy)."""
    if sc.temperature == 0:
        return logits.argmax(-1), None
    probs = filtered_probs(logits, sc.temperature, sc.top_p)
    return torch.multinomial(probs, 1, generator=sc.generator)[:, 0], probs


def _draft_loop(sc: SpecContext, first_logits_fn, next_logits_fn, gamma: int) -> Proposal:
    """Draw ``gamma`` tokens: ``first_logits_fn() -> [B, V]``, then
    ``next_logits_fn(token [B], i) -> [B, V]``."""
    tokens, probs = [], []
    logits = first_logits_fn()
    for i in range(gamma):
        tok, p = _sample_rows(logits, sc)
        tokens.append(tok)
        if p is not None:
            probs.append(p)
        if i < gamma - 1:
            logits = next_logits_fn(tok, i)
    B = len(sc.history)
    toks = torch.stack(tokens, dim=1)
    return Proposal(toks, torch.full((B,), gamma, dtype=torch.long), torch.stack(probs, 1) if probs else None)


class _Lookahead:
    """Accumulates a draft's attention mass per context position ``[B, n_pos]`` (Dustin's a^D)."""

    def __init__(self) -> None:
        self.mass: torch.Tensor | None = None

    def add(self, probs: torch.Tensor, kpos: torch.Tensor) -> None:
        # probs [B, H, t, S] over keys at positions kpos [B, H_kv, S]; summed over heads and queries
        B, H, t, S = probs.shape
        g = H // kpos.shape[1]
        mass = probs.reshape(B, kpos.shape[1], g * t, S).sum(2)  # [B, H_kv, S]
        pos = kpos.long().clamp(min=0)
        n = int(pos.max()) + 1 if pos.numel() else 1
        acc = torch.zeros(B, n)
        acc.scatter_add_(1, pos.reshape(B, -1).cpu(), (mass * (kpos >= 0)).reshape(B, -1).float().cpu())
        if self.mass is None:
            self.mass = acc
        else:
            if self.mass.shape[1] < n:
                self.mass = torch.nn.functional.pad(self.mass, (0, n - self.mass.shape[1]))
            self.mass[:, :n] += acc

    def take(self) -> torch.Tensor | None:
        mass, self.mass = self.mass, None
        return mass


class _ViewAttention:
    """The attention the target runs while drafting: over its layer's view (see :class:`SelfDraft`)."""

    def __init__(self, draft: SelfDraft) -> None:
        self.draft = draft

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        d, layer, sc = self.draft, ctx.layer, self.draft._sc
        policy = d._policy
        slot_bytes = kv_slot_bytes(layer)
        T = layer.index.shape[-1]
        if ctx.sliding_window is not None or T <= d._min_slots:
            sc.stats.draft_kv_bytes += T * slot_bytes
            return layer.attend(ctx) if hasattr(layer, "key_store") else layer_attention(ctx, None)
        if policy.kind == "decode":  # the policy reads the cache itself (Quest pages)
            out = policy.attend(ctx)
            read = policy.slots_read(ctx, T)
            sc.stats.draft_kv_bytes += read * slot_bytes
            return out
        view = d._views.get(ctx.layer_idx)
        if view is None:
            view = d._views[ctx.layer_idx] = d._build_view(ctx)
        k, v, pos = view.read(layer)
        want = sc.collect_lookahead and ctx.layer_idx >= ctx.num_layers - d.lookahead_layers
        out, _, probs = attend_kv(ctx.q, k, v, pos, ctx.query_index, ctx.scaling, None, want_probs=want)
        if want:
            d._lookahead.add(probs, pos)
        sc.stats.draft_kv_bytes += (view.pos.shape[-1] + T - view.base) * slot_bytes
        return out.to(ctx.q.dtype)


@register_draft("self")
@dataclass
class SelfDraft(Draft):
    """The target drafts over a view of its own cache chosen by the KV or decode policy ``view``.

    Why the per-layer views (``_views``, keyed by layer index) live on this object and not on the cache
    layer (``layer.state`` / ``layer.extras``, the rule for method state): they are controller state of one
    speculative run, not state the cache needs to go on decoding. (1) They must not outlive the run or
    travel with the cache: ``Stream.fork`` and ``LonglabLayer.clone`` copy ``state``/``extras``, so a fork
    of a stream that once drafted would inherit (and pay memory for) a stale view. (2) Drafting runs inside
    a :class:`~longlab.spec.rollback.CacheSnapshot` whose ``restore`` puts every layer's attribute
    dictionaries back: a view stored on the layer during a draft would be rolled back with the draft tokens
    at every step, defeating the ``refresh`` interval. (3) A view is derived data (a gathered copy of slots
    the layer still holds, plus ``base``), re-selectable from the layer at any time, and ``layer.state``
    holds ``[B, ...]`` tensors only. The views are dropped at every refresh and by :meth:`start`; the
    layer list is fixed for a run (a policy that replaces a layer is refused in :meth:`_build_view`)."""

    paper = "MagicDec arXiv:2408.11049; TriForce arXiv:2404.11912"
    view: str = "streaming:budget=256"
    # speculation steps between view selections
    refresh: int = param(16, low=1, high=MAX_TOKENS, integer=True)
    # verification queries kept per layer for scorers with an observation window
    window: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    # last layers whose attention feeds Dustin's lookahead signal
    lookahead_layers: int = param(2, low=1, high=MAX_LAYERS, integer=True)
    _policy: Any = field(default=None, init=False, repr=False)

    @classmethod
    def from_rest(cls, rest: str) -> SelfDraft:
        if not rest.strip():
            raise LonglabError(
                "self: needs a KV recipe for the draft's view, e.g. 'self:streaming:budget=256'"
            )
        return cls(view=rest.strip())

    def format_spec(self) -> str:
        """``self:VIEW``, what :meth:`from_rest` reads (``refresh``, ``window``, ``lookahead_layers`` are set
        from the API only)."""
        return f"self:{self.view}"

    def validate(self) -> None:
        try:
            policy = parse_method(self.view)
        except LonglabError as exc:
            raise LonglabError(f"self:{shorten(self.view)}: {exc}") from None
        if policy.kind not in ("kv", "decode") or policy.name == "full":
            raise LonglabError(
                f"self: the view must be a KV eviction policy (e.g. streaming:budget=256, snapkv@0.9) or a "
                f"decode policy (quest:budget=1024), got {shorten(self.view)} (kind {policy.kind})"
            )
        if policy.kind == "kv" and (policy.acts_during_decode or policy.reads_attention):
            raise LonglabError(
                f"self: view {shorten(self.view)} acts at decode steps; give a prefill-time policy"
            )
        self._policy = policy

    def start(self, sc: SpecContext) -> None:
        self._sc = sc
        self._views: dict[int, SlotView] = {}
        self._steps = 0
        self._queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lookahead = _Lookahead()
        self._attn = _ViewAttention(self)
        self._recipe = Recipe(prefill=self._attn, decode=self._attn)  # type: ignore[arg-type]
        # a view smaller than the layer is what makes drafting cheap; tiny layers are read whole
        self._min_slots = int(getattr(self._policy, "budget", None) or 0)

    def _build_view(self, ctx: LayerContext) -> SlotView:
        """Select this layer's view with the policy; queries: the last verification queries (or this one)."""
        layer = ctx.layer
        base = self._base_slots[ctx.layer_idx]
        q, qidx = self._queries.get(ctx.layer_idx, (ctx.q, ctx.query_index))
        sel_ctx = LayerContext(
            ctx.layer_idx, ctx.num_layers, ctx.module, "prefill", q, ctx.scaling, qidx, None, layer, ctx.cache
        )
        try:
            keep = self._policy.select(sel_ctx)
        except (KeyError, AttributeError) as exc:
            raise LonglabError(f"self:{self.view}: the policy cannot select a view here ({exc})") from None
        if ctx.layer is not layer or ctx.cache.layers[ctx.layer_idx] is not layer:
            raise LonglabError(f"self:{self.view}: the policy replaced the cache layer; it cannot be a view")
        take = layer.index[..., :base] >= 0 if keep is None else keep[..., :base]  # [B, H_kv, base]
        return SlotView.gather(ctx, take, base)

    def propose(self, sc: SpecContext, pend: list[list[int]], gamma: int) -> Proposal:
        stream, cache = sc.stream, sc.cache
        if self._steps % self.refresh == 0:
            self._views = {}
            self._base_slots = [
                layer.index.shape[-1] if layer.is_initialized else 0 for layer in cache.layers
            ]
        self._steps += 1
        snapshot = CacheSnapshot(cache)
        device = stream.device
        first, valid = left_pad(pend)
        state = {"seen": stream.seen_mask, "pos": stream.next_pos}

        def run(tok: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
            logits = forward_tokens(
                sc.model, cache, tok.to(device), state["seen"], state["pos"], self._recipe, ok.to(device)
            )
            state["seen"] = torch.cat([state["seen"], ok.to(device)], 1)
            state["pos"] = state["pos"] + ok.to(device).sum(-1)
            sc.stats.draft_forwards += 1
            return logits[:, -1].cpu()

        one = torch.ones(len(pend), 1, dtype=torch.bool)
        try:
            prop = _draft_loop(sc, lambda: run(first, valid), lambda tok, i: run(tok[:, None], one), gamma)
        finally:
            kept = self._page_state(cache)
            snapshot.restore()
            self._restore_page_state(cache, kept, snapshot.n_slots)
        prop.lookahead = self._lookahead.take()
        return prop

    def _page_state(self, cache: Any) -> dict[int, dict[str, torch.Tensor]]:
        """Quest's page summaries (``layer.state["quest.*"]``, page axis 2) computed while drafting."""
        if self._policy.name != "quest":
            return {}
        return {
            i: {k: v for k, v in layer.state.items() if k.startswith("quest.")}
            for i, layer in enumerate(cache.layers)
            if layer.is_initialized
        }

    def _restore_page_state(self, cache: Any, kept: dict, n_slots: list[int]) -> None:
        """Keep the summaries of pages made only of committed slots (drafted slots are rolled back), so
        the next step summarises new pages only, as Quest does incrementally."""
        P = getattr(self._policy, "page_size", 1)
        for i, state in kept.items():
            n = n_slots[i] // P
            # contiguous: Quest's page_select reads them in place (a strided view would be copied per call)
            cache.layers[i].state.update({k: v[:, :, :n].contiguous() for k, v in state.items()})

    def observe_queries(self, layer_idx: int, q: torch.Tensor, qidx: torch.Tensor) -> None:
        """Keep the last ``window`` verification queries of a layer (observation window for scorers)."""
        old = self._queries.get(layer_idx)
        if old is not None and old[0].shape[:2] == q.shape[:2]:
            q, qidx = torch.cat([old[0], q], dim=2), torch.cat([old[1], qidx.to(old[1].dtype)], dim=1)
        self._queries[layer_idx] = (q[:, :, -self.window :], qidx[:, -self.window :])


class _CaptureAttention:
    """Dense attention for the draft model's own cache that also records lookahead attention."""

    def __init__(self, draft: ModelDraft) -> None:
        self.draft = draft

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        d, layer = self.draft, ctx.layer
        d._sc.stats.draft_kv_bytes += layer.index.shape[-1] * kv_slot_bytes(layer)
        if d._collect and ctx.layer_idx >= ctx.num_layers - d.lookahead_layers and ctx.q.shape[-2] == 1:
            _, _, probs = attend_kv(
                ctx.q,
                ctx.k,
                ctx.v,
                ctx.key_index,
                ctx.query_index,
                ctx.scaling,
                ctx.sliding_window,
                want_probs=True,
            )
            d._lookahead.add(probs, ctx.key_index)
        if hasattr(layer, "key_store"):
            return layer.attend(ctx)
        return layer_attention(ctx, None)


@register_draft("model")
@dataclass
class ModelDraft(Draft):
    """A separate draft model (same tokenizer) with its own cache under ``recipe``."""

    paper = "Leviathan et al. 2023, arXiv:2211.17192; TriForce arXiv:2404.11912 (tiny draft + StreamingLLM)"
    model_name: str = ""
    recipe: str = "full"
    lookahead_layers: int = param(2, low=1, high=MAX_LAYERS, integer=True)  # as SelfDraft's
    model: Any = field(default=None, repr=False)  # a loaded model (API use); else loaded by model_name
    tokenizer: Any = field(default=None, repr=False)

    @classmethod
    def from_rest(cls, rest: str) -> ModelDraft:
        name, _, params = rest.partition(";")
        if not name.strip():
            raise LonglabError("model: needs a draft model name, e.g. 'model:tiny-llama'")
        kwargs = {}
        for item in filter(None, params.split(";")):
            key, _, value = item.partition("=")
            if key.strip() != "recipe":
                raise LonglabError(f"model: parameters are recipe=...; got {shorten(item)}")
            kwargs["recipe"] = value.strip()
        return cls(model_name=name.strip(), **kwargs)

    def format_spec(self) -> str:
        """``model:NAME[;recipe=R]``, what :meth:`from_rest` reads (a loaded model is named by its class)."""
        name = self.model_name or type(self.model).__name__
        return f"model:{name}" + (f";recipe={self.recipe}" if self.recipe != "full" else "")

    def validate(self) -> None:
        parse_recipe(self.recipe)
        if self.model is None and not self.model_name:
            raise LonglabError("model: give a draft model name or a loaded model")

    def start(self, sc: SpecContext) -> None:
        if self.model is None:
            from ..models import load_model

            self.model, self.tokenizer = load_model(self.model_name)
        check_same_tokenizer(sc.tokenizer, self.tokenizer, self.model_name or type(self.model).__name__)
        self._sc = sc
        self._collect = sc.collect_lookahead
        self._lookahead = _Lookahead()
        self._attn = _CaptureAttention(self)
        self._read = Recipe(prefill=self._attn, decode=self._attn)  # type: ignore[arg-type]
        self.cache = LonglabCache(self.recipe)
        device = next(self.model.parameters()).device
        self._device = device
        B = len(sc.history)
        self._seen = torch.zeros(B, 0, dtype=torch.bool, device=device)
        self._pos = torch.zeros(B, dtype=torch.long, device=device)
        prompts = [h[:-1] for h in sc.history]  # the pending token is fed with the first proposal
        self._feed(prompts, compress=True)
        self._fed = [len(p) for p in prompts]

    def _feed(self, rows: list[list[int]], compress: bool = False) -> torch.Tensor:
        """Left-padded append of one segment per row; returns last logits [B, V]."""
        ids, valid = left_pad(rows)
        ids, valid = ids.to(self._device), valid.to(self._device)
        if compress:
            saved = self.cache.compressing
            mask = torch.cat([self._seen, valid], 1)
            pos = (self._pos[:, None] + valid.long().cumsum(-1) - 1).clamp(min=0)
            self.cache.compressing = True
            try:
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                self.cache.compressing = saved
            logits = out.logits[:, -1].float()
        else:
            logits = forward_tokens(self.model, self.cache, ids, self._seen, self._pos, self._read, valid)[
                :, -1
            ]
        self._seen = torch.cat([self._seen, valid], 1)
        self._pos = self._pos + valid.sum(-1)
        self._sc.stats.draft_forwards += 1
        return logits.cpu()

    def propose(self, sc: SpecContext, pend: list[list[int]], gamma: int) -> Proposal:
        # every token of the history is final: feed the unseen ones for good, then draft and roll back
        V = sc.model.config.vocab_size
        logits = self._feed([h[f:] for h, f in zip(sc.history, self._fed)])[:, :V]
        self._fed = [len(h) for h in sc.history]
        snapshot = CacheSnapshot(self.cache)
        seen, pos = self._seen, self._pos
        try:
            prop = _draft_loop(
                sc, lambda: logits, lambda tok, i: self._feed([[int(t)] for t in tok])[:, :V], gamma
            )
        finally:
            snapshot.restore()
            self._seen, self._pos = seen, pos
        prop.lookahead = self._lookahead.take()
        return prop

    def close(self) -> None:
        cache = getattr(self, "cache", None)
        if cache is not None:
            cache.close()


def check_same_tokenizer(target: Any, draft: Any, name: str) -> None:
    """A draft model must share the target's tokenizer (same vocabulary, same ids)."""
    if target is None or draft is None:
        return
    same = target is draft
    if not same:
        try:
            same = target.get_vocab() == draft.get_vocab()
        except AttributeError:
            same = False
    if not same:
        raise LonglabError(
            f"speculative='model:{str(name)[:80]}': the draft model has another tokenizer than the target "
            "(vocabularies differ); speculation needs the same token ids. Use a draft that shares the "
            "target's tokenizer, 'lookup' or 'self:KVRECIPE'"
        )
