"""HiCo's hierarchical token dropping *inside* the forward pass: later layers run on fewer tokens.

VideoChat-Flash (Li et al., arXiv 2501.00574, ICLR 2026) drops tokens inside the LLM at a few layers
with cumulative keep ratios, scored by the attention of the last prompt token, so the layers after a
drop point compute (and cache) only the kept tokens. :class:`HiCoForward` does this for one prefill
forward on the spine (a :class:`~longlab.engine.stream.Stream` over a :class:`~longlab.cache.LonglabCache`,
the longlab attention hook), without patching any model class:

- ``stages`` (layer fractions, default 1/3 and 2/3) give the first layers ``b_1 < ... < b_S`` of the
  stages; stage ``s`` keeps ``k_s = ceil((1 - r)^(s / S) n)`` of the ``n`` droppable tokens of the
  forward (the last ``protect`` tokens, e.g. the question, are always kept, as HiCo keeps the text
  tokens), chosen among the tokens stage ``s - 1`` kept (cumulative: a dropped token never comes back);
- the score of token ``t`` for boundary ``b_s`` is ``mean_h softmax(q_last k_t^T * scaling)`` at layer
  ``b_s - 1`` (the last layer that still reads it; head-averaged, as FastV/PDrop score before a drop),
  recorded by a stand-in KV policy placed first in the cache's recipe for the forward (as
  :class:`~longlab.hook.ChunkRecorder` is), which keeps every entry;
- a forward pre-hook on decoder layer ``b_s`` (registered only inside :meth:`HiCoForward.applied`)
  gathers the kept rows of the hidden states, and on every layer ``>= b_1`` the kept rows of the
  position ids and RoPE ``(cos, sin)``, so each token keeps its true RoPE position;
- the cache layer appends the kept tokens with consecutive slot indices (their ranks), which order them
  exactly as their true positions do, so the hook's causal mask (``k_pos <= q_pos``) is the same; right
  after the layer's attention the stand-in rewrites those slots' indices to the true positions in place
  (``query_index`` is a view of them) and counts the dropped tokens as seen (``n_real``, ``n_seen``),
  before any KV policy of the recipe runs, so decoding and KV policies see ordinary positions.

``r = 0`` keeps every token: the logits equal a plain prefill's bit for bit (tested), as does a reference
that runs layers ``>= b`` by hand on the kept rows of the plain forward's hidden states (tested). The
KV memory is that of the KV policy ``hico-drop@r`` (layers before ``b_1`` hold every token); the
prefill compute of layer ``l`` scales with the tokens it runs on. Requirements: one forward over the
whole segment (one prefill chunk), rows without padding, no sliding-window layers (a window counted in
ranks would differ from one in positions); anything else is refused.

**As a recipe part**: ``hico-forward@r`` (registered, kind ``context``, ``transforms_prefill``) composes
with every KV recipe (``hico-forward@0.5+snapkv@0.5``) from :func:`longlab.generate`, the CLI and
``longlab eval``. It removes nothing before the prefill (its :meth:`HiCoForward.compress` is the
identity); :meth:`longlab.compress.api.Squeeze.feed` runs the prompt's prefill through
:meth:`HiCoForward.prefill` instead, as one forward, protecting every token fed after the context (the
question, query-aware) or, when the context is fed alone, the last ``protect`` tokens. The eval harness
gives such a recipe a prefill of its own (never a shared prefix or a replayed tail:
:func:`longlab.eval.planner.transforms_prefill`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import StandIn
from ..recipe import LonglabError, Recipe, register
from ..registry import MAX_TOKENS, param
from .base import Compressed, ContextCompressor, Prompt

__all__ = ["HiCoForward", "decoder_layers"]


def decoder_layers(model: Any) -> Any:
    """The model's decoder layer list (``model.model.layers`` for Llama/Qwen2-style models)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise LonglabError(f"hico-forward: no decoder layer list found on {type(model).__name__}")
    return layers


class _StageScores(StandIn):
    """Stand-in KV policy (first in the recipe for the prefill forward): records the last query's
    head-averaged attention at each scoring layer, then gives the kept slots their true positions."""

    name = "hico-forward-scores"

    def __init__(self, owner: HiCoForward) -> None:
        self.owner = owner

    def select(self, ctx: Any) -> None:
        o = self.owner
        T_q = ctx.q.shape[2]
        if ctx.phase != "prefill" or T_q != (o._n if o._pos is None else o._pos.shape[1]):
            return None
        if ctx.layer_idx in o._score_layers:
            probs = ctx.attention_probs(slice(-1, None))[:, :, 0]  # [B, H, T], the last query
            o._scores[ctx.layer_idx] = probs.mean(1)[:, -T_q:]  # [B, T_q], this forward's tokens
        if ctx.layer_idx >= o._bounds[0] and o._pos is not None:
            layer = ctx.layer
            start = layer.n_real - T_q  # [B] real tokens before this forward
            true = (start[:, None] + o._pos).to(torch.int32)  # [B, T_q]
            layer.index[..., -T_q:] = true[:, None, :]  # in place: ctx.query_index is a view
            layer.index_changed()
            gone = o._n - T_q
            layer.n_real += gone
            layer.n_seen += gone
        return None

    def select_decode(self, ctx: Any) -> None:
        return None


@register("hico-forward")
@dataclass
class HiCoForward(ContextCompressor):
    """HiCo hierarchical token dropping inside the prefill forward (Li et al., "VideoChat-Flash",
    arXiv 2501.00574): see the module docstring. ``compression_ratio`` r: the last stage keeps
    ``ceil((1 - r) n)`` of the ``n`` droppable tokens; ``protect``: trailing tokens never dropped (at
    least the scoring token; as a recipe part, also every token fed after the context)."""

    paper: ClassVar[str] = ("VideoChat-Flash (HiCo), Li et al., arXiv 2501.00574, ICLR 2026; "
                            "FastV-style scoring")
    transforms_prefill: ClassVar[bool] = True  # its work happens inside the prefill forward (Squeeze.feed)
    query_aware: ClassVar[bool] = True  # the last prompt token (the question's, when fed with it) scores

    compression_ratio: float = param(0.0, low=0, high=1, high_open=True)
    stages: tuple[float, ...] = (1 / 3, 2 / 3)  # increasing layer fractions in (0, 1): checked in validate
    protect: int = param(1, low=1, high=MAX_TOKENS, integer=True)  # at least the scoring token
    info: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def validate(self) -> None:
        fracs = list(self.stages)
        if not fracs or any(not 0 < f < 1 for f in fracs) or fracs != sorted(set(fracs)):
            raise LonglabError(
                f"hico-forward: stages must be increasing layer fractions in (0, 1), got {fracs}")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stages = tuple(self.stages)
        self._pos: torch.Tensor | None = None  # [B, T_cur] forward-relative positions of the running tokens
        self._scores: dict[int, torch.Tensor] = {}
        self._bounds: list[int] = []
        self._score_layers: set[int] = set()
        self._n = 0

    def compress(self, prompt: Prompt, scorer: Any) -> Compressed:
        """Nothing is removed before the prefill: the dropping happens inside it (:meth:`prefill`)."""
        out = self.identity(prompt)
        out.info["prefill_transform"] = True
        return out

    def keep_counts(self, n_tokens: int, protect: int | None = None) -> list[int]:
        """Tokens each stage runs on (stage 0 = all ``n_tokens``), the ``protect`` trailing tokens
        (default: the field) included."""
        p = self.protect if protect is None else protect
        n = n_tokens - p
        S = len(self.stages)
        return [n_tokens] + [
            min(n, max(0, math.ceil((1 - self.compression_ratio) ** (s / S) * n - 1e-9))) + p
            for s in range(1, S + 1)
        ]

    @contextlib.contextmanager
    def applied(self, stream: Any, n_tokens: int, protect: int | None = None) -> Iterator[None]:
        """Inside the block, the next forward of ``stream``'s model over ``n_tokens`` new tokens per
        row drops tokens at the stage boundaries (hooks removed and the recipe restored on exit);
        ``protect``: trailing tokens never dropped (default: the field)."""
        protect = self.protect if protect is None else protect
        model, cache = stream.model, stream.cache
        layers = decoder_layers(model)
        L = len(layers)
        bounds = [round(f * L) for f in self.stages]
        if any(b < 1 or b >= L for b in bounds) or len(set(bounds)) != len(bounds):
            raise LonglabError(f"hico-forward: stages {list(self.stages)} give layers {bounds} of {L}: need "
                               "distinct layers in [1, num_layers - 1]")
        for layer in layers:
            if getattr(getattr(layer, "self_attn", None), "sliding_window", None):
                raise LonglabError("hico-forward: models with sliding-window layers are not supported")
        if isinstance(protect, bool) or not isinstance(protect, int) or protect < 1:
            raise LonglabError(f"hico-forward: protect must be >= 1 (the scoring token), got {protect}")
        if n_tokens <= protect:
            raise LonglabError(
                f"hico-forward: {n_tokens} tokens leave nothing to drop (protect={protect})")
        counts = self.keep_counts(n_tokens, protect)
        self._bounds, self._score_layers = bounds, {b - 1 for b in bounds}
        self._n, self._scores = n_tokens, {}
        self.info = {"layers": bounds, "tokens_per_stage": counts, "kept_positions": []}
        B = stream.batch_size
        device = stream.device

        def pre_hook(module: Any, args: tuple, kwargs: dict, idx: int) -> tuple[tuple, dict]:
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] != (n_tokens if self._pos is None else self._pos.shape[1]):
                return args, kwargs  # not the forward this block is for (e.g. a decode step)
            if self._pos is None:
                self._pos = torch.arange(n_tokens, device=device).expand(B, n_tokens)
            if idx in bounds:
                s = bounds.index(idx) + 1
                score = self._scores.pop(idx - 1)  # [B, T_cur]
                T_cur = score.shape[1]
                k = counts[s] - protect
                body = score[:, : T_cur - protect]
                pick = body.topk(k, dim=-1).indices.sort(-1).values if k > 0 else body[:, :0].long()
                tail = torch.arange(T_cur - protect, T_cur, device=device).expand(B, protect)
                rel = torch.cat([pick, tail], dim=1)  # [B, k_s], rows of the running tokens kept
                hidden = hidden.gather(1, rel[..., None].expand(-1, -1, hidden.shape[-1]))
                self._pos = self._pos.gather(1, rel)
                self.info["kept_positions"].append(self._pos.tolist())
                args = (hidden, *args[1:]) if args else args
                if not args:
                    kwargs = {**kwargs, "hidden_states": hidden}
            pos = self._pos
            if pos.shape[1] != n_tokens:
                kwargs = dict(kwargs)
                pe = kwargs.get("position_embeddings")
                if pe is not None:
                    kwargs["position_embeddings"] = tuple(
                        t.gather(1, pos[..., None].expand(-1, -1, t.shape[-1])) if t.shape[0] == B
                        else t[:, pos[0]] for t in pe)  # (cos, sin): [B, T, d]
                for name in ("position_ids", "cache_position"):
                    t = kwargs.get(name)
                    if isinstance(t, torch.Tensor) and t.shape[-1] == n_tokens:
                        two_d = t.dim() == 2 and t.shape[0] == B
                        kwargs[name] = t.gather(-1, pos) if two_d else t[..., pos[0]]
                if isinstance(kwargs.get("attention_mask"), torch.Tensor):
                    raise LonglabError("hico-forward: padded rows are not supported (equal-length rows only)")
            return args, kwargs

        handles = [layers[i].register_forward_pre_hook(
            lambda m, a, kw, i=i: pre_hook(m, a, kw, i), with_kwargs=True) for i in range(bounds[0], L)]
        saved = cache.recipe
        cache.recipe = Recipe(prefill=saved.prefill, kv=[_StageScores(self), *saved.kv],  # type: ignore[list-item]
                              decode=saved.decode, context=saved.context)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            cache.recipe = saved
            self._pos, self._scores = None, {}

    def prefill(self, stream: Any, rows: list[list[int]], protect: int | None = None,
                compress: str = "end") -> torch.Tensor:
        """Feed ``rows`` (equal lengths, no padding) as one forward with dropping; the cache's own KV
        policies compress at its end (``compress`` ``"end"`` or ``"chunk"``: the same for one chunk;
        ``"none"``: not at all). ``protect``: trailing tokens never dropped (default: the field).
        Returns the last logits ``[B, V]``."""
        n = len(rows[0]) if rows else 0
        if not rows or any(len(r) != n for r in rows):
            raise LonglabError("hico-forward: rows must be non-empty and of equal length "
                               "(batch rows of different lengths are not supported)")
        with self.applied(stream, n, protect):
            return stream.feed(rows, chunk_size=n, compress=compress)
