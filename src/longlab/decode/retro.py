"""RetroAttention: retrospective sparse attention on top of Quest.

"Retrospective Sparse Attention for Efficient Long-Context Generation", arXiv:2508.09001, ICLR 2026.
The repository (csh3695/RetroAttention) is empty; this follows the reconstruction of
``specs/kv-cache.md`` §4 (abstract, reviews, notes).

Sparse decoding reads a different page set at each step, so the outputs of recent tokens were computed
over pages they never saw. RetroAttention keeps, per layer, an output cache over the last ``window - 1``
tokens ``tau`` (their queries ``q_tau``, outputs ``o_tau`` and log-sum-exps ``lse_tau``) and a per-head
page table ``Last[h, p]`` (the last step page ``p`` was loaded). At step ``t`` (Quest selects ``S_t``):

1. ``o_t, lse_t`` over ``S_t`` (Quest, the last page included);
2. for each ``tau`` in the window, the new pages ``N = {p in S_t : Last[h, p] < tau}`` (never seen by
   ``q_tau``), keys at positions ``<= tau``: supplementary attention ``(o', lse')`` of ``q_tau`` over ``N``,
   merged by log-sum-exp:  ``lse* = logaddexp(lse_tau, lse')``,
   ``o_tau <- e^(lse_tau - lse*) o_tau + e^(lse' - lse*) o'`` — exact attention over the union of the
   two disjoint key sets;
3. ``Last[h, p] <- t`` for ``p in S_t``;
4. refresh (``refresh=true``): the corrected ``o_tau`` goes through ``o_proj``, the residual and the MLP
   of this layer, giving a refreshed residual stream ``h_tau`` for the layer above, whose K/V cache rows
   for ``tau`` are overwritten (and whose window query ``q_tau`` is recomputed), then so on upward: the
   window tokens flow through the stack as a mini-batch with attention replaced by the corrected
   output cache;
5. ``t`` enters the window with ``(q_t, o_t, lse_t)`` and the oldest token leaves.

Implementation notes. The refresh needs each window token's residual-stream input of every layer and
the decoder-layer modules; they are captured by forward pre-hooks on the decoder layers, installed
once per model the first time RetroAttention decodes with a model attached to the cache
(``cache.model_ref``, set by :class:`longlab.pipeline.Stream`); the hooks do nothing for other
recipes. Supported decoder layers are the pre-norm Llama family (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``: Llama, SmolLM2, Qwen2/3, Mistral); elsewhere, or without a
model, only steps 1-3 and 5 run, which do not change the generated tokens (a warning says so).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import dense_attention
from ..recipe import LonglabError, register
from .quest import Quest, attend_slots

__all__ = ["RetroAttention", "lse_merge"]


def lse_merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets: o: [..., D], lse: [...]. Exact when each ``(o, lse)`` is
    the softmax attention over its set; an empty set has ``lse = -inf``."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - safe).nan_to_num(0.0)[..., None]
    return w1 * o1.nan_to_num(0.0) + w2 * o2.nan_to_num(0.0), lse


@dataclass
class _Window:
    """Per-layer RetroAttention state for the last ``m <= window - 1`` tokens."""

    q: torch.Tensor | None = None  # [B, H, m, D] this layer's (refreshed) queries
    o: torch.Tensor | None = None  # [B, H, m, D] fp32 output cache
    lse: torch.Tensor | None = None  # [B, H, m]
    pos: torch.Tensor | None = None  # [B, m] positions
    h: torch.Tensor | None = None  # [B, m, hidden] residual-stream inputs of this layer (refresh)
    cos: torch.Tensor | None = None  # [B, m, D] RoPE of the window tokens
    sin: torch.Tensor | None = None
    last: torch.Tensor | None = None  # [B, H, n_pages] step that last loaded each page (-1: never)
    h_cur: Any = None  # (h [B, 1, hidden], cos, sin) captured for the current token by the pre-hook
    decoder: Any = None  # the decoder-layer module (captured by the pre-hook)

    @property
    def m(self) -> int:
        return 0 if self.pos is None else self.pos.shape[1]


_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LonglabLayer -> _Window
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> hook handles


def _window(layer) -> _Window:
    st = _STATE.get(layer)
    if st is None:
        st = _STATE[layer] = _Window()
    return st


def _is_prenorm_decoder(module) -> bool:
    parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return all(hasattr(module, a) for a in parts) and not hasattr(module, "pre_feedforward_layernorm")


def _capture(module, args, kwargs) -> None:
    """Decoder-layer pre-hook: keep the residual input and RoPE of a decode token for RetroAttention."""
    from ..cache import LonglabCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, LonglabCache) or not isinstance(cache.recipe.decode, RetroAttention):
        return
    h = args[0] if args else kwargs.get("hidden_states")
    idx = getattr(module.self_attn, "layer_idx", None)
    if h is None or h.shape[1] != 1 or idx is None or idx >= len(cache.layers):
        return
    cos, sin = kwargs.get("position_embeddings", (None, None))
    st = _window(cache.layers[idx])
    st.h_cur, st.decoder = (h.detach(), cos, sin), module


def _install_hooks(model) -> None:
    if model in _HOOKED:
        return
    layers = [m for m in model.modules() if _is_prenorm_decoder(m)]
    _HOOKED[model] = [m.register_forward_pre_hook(_capture, with_kwargs=True) for m in layers]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@register("retro")
@dataclass
class RetroAttention(Quest):
    """RetroAttention (arXiv:2508.09001) on Quest pages: an output cache over the last ``window - 1``
    tokens, corrected by log-sum-exp merges of supplementary attention over newly loaded pages, and
    K/V rows of the layer above refreshed from the corrected outputs."""

    paper = "arXiv:2508.09001"
    window: int = 8
    refresh: bool = True

    def validate(self) -> None:
        super().validate()
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise LonglabError(f"{self.name}: window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.refresh, bool):
            raise LonglabError(f"{self.name}: refresh must be true or false, got {self.refresh!r}")

    def attend(self, ctx) -> torch.Tensor:  # [B, H, 1, D]
        if not self.is_sparse_layer(ctx) or ctx.q.shape[-2] != 1:
            return dense_attention(ctx.q, ctx.k, ctx.v, ctx.mask(), ctx.scaling)
        refresh = self.refresh and self._hooks_ready(ctx)
        st = _window(ctx.layer)
        out, lse, slots, pages = self.attend_lse(ctx)  # [B, H, 1, D], [B, H, 1]
        loaded = self._loaded_pages(ctx, st, pages)  # [B, H, n_pages]
        if st.m:
            self._supplement(ctx, st, slots, loaded)
        t = ctx.query_index[:, -1].to(torch.long)  # [B]
        st.last = torch.where(loaded, t[:, None, None], st.last)
        if refresh and st.m and st.h is not None:
            self._refresh_above(ctx, st)
        self._push(ctx, st, out, lse, refresh)
        return out

    # --- steps 1-3 ---------------------------------------------------------------------------------
    def _loaded_pages(self, ctx, st: _Window, pages: torch.Tensor | None) -> torch.Tensor:
        """[B, H, n_pages] bool: pages read at this step; resizes the page table."""
        B, H = ctx.q.shape[:2]
        n = -(-ctx.k.shape[-2] // self.page_size)
        if st.last is None or st.last.shape[:2] != (B, H) or st.last.shape[-1] > n:
            st.last = torch.full((B, H, n), -1, dtype=torch.long, device=ctx.q.device)
        elif st.last.shape[-1] < n:
            grow = st.last.new_full((B, H, n - st.last.shape[-1]), -1)
            st.last = torch.cat([st.last, grow], dim=-1)
        if pages is None:  # dense step: every page was read
            return torch.ones(B, H, n, dtype=torch.bool, device=ctx.q.device)
        loaded = torch.zeros(B, H, n, dtype=torch.bool, device=ctx.q.device)
        loaded.scatter_(-1, pages, True)
        loaded[..., -1] = True  # the last page is always read
        return loaded

    def _supplement(self, ctx, st: _Window, slots: torch.Tensor | None, loaded: torch.Tensor) -> None:
        """Merge each window query's attention over the pages it has not seen into its cached output."""
        new = loaded[:, :, None, :] & (st.last[:, :, None, :] < st.pos[:, None, :, None])  # [B, H, m, n]
        if not bool(new.any()):
            return
        B, H, m, _ = new.shape
        if slots is None:
            page_of = torch.arange(ctx.k.shape[-2], device=new.device) // self.page_size  # [T]
            allowed = new[..., page_of]  # [B, H, m, T]
        else:
            page_of = (slots // self.page_size)[:, :, None, :].expand(B, H, m, -1)  # [B, H, m, S]
            allowed = new.gather(-1, page_of)
        o2, lse2 = attend_slots(st.q, ctx.k, ctx.v, ctx.key_index, st.pos, ctx.scaling, slots, allowed)
        st.o, st.lse = lse_merge(st.o, st.lse, o2, lse2)

    # --- step 4: refresh the layer above -----------------------------------------------------------
    def _hooks_ready(self, ctx) -> bool:
        ref = getattr(ctx.cache, "model_ref", None)
        model = ref() if ref is not None else None
        if model is None:
            if not getattr(self, "_warned", False):
                warnings.warn("retro: no model attached to the cache (cache.model_ref); K/V refresh is off, "
                              "so the generated tokens equal Quest's", stacklevel=2)
                self._warned = True
            return False
        _install_hooks(model)
        return True

    def _refresh_above(self, ctx, st: _Window) -> None:
        """Run the window tokens' corrected outputs through this layer's o_proj + MLP and overwrite their
        K/V rows (and window queries) in the layer above."""
        nxt_idx = ctx.layer_idx + 1
        cache = ctx.cache
        if nxt_idx >= len(cache.layers) or st.decoder is None or st.cos is None:
            return
        above = _STATE.get(cache.layers[nxt_idx])
        if above is None or above.decoder is None or not _is_prenorm_decoder(st.decoder):
            return
        dl, dl_next = st.decoder, above.decoder
        B, H, m, D = st.o.shape
        attn_out = st.o.to(st.h.dtype).transpose(1, 2).reshape(B, m, H * D)  # [B, m, H*D]
        mid = st.h + dl.self_attn.o_proj(attn_out)  # [B, m, hidden]
        h_next = mid + dl.mlp(dl.post_attention_layernorm(mid))
        attn = dl_next.self_attn
        x = dl_next.input_layernorm(h_next)
        q = attn.q_proj(x).view(B, m, -1, D)
        k = attn.k_proj(x).view(B, m, -1, D)
        v = attn.v_proj(x).view(B, m, -1, D).transpose(1, 2)  # [B, H_kv, m, D]
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if st.cos is not None:
            cos, sin = st.cos[:, None], st.sin[:, None]  # [B, 1, m, D]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        layer = cache.layers[nxt_idx]
        tail = min(layer.index.shape[-1], m + 1)
        idx = layer.index[..., -tail:]  # [B, H_kv, tail]; the window tokens are the newest of the layer above
        eq = idx[:, :, None, :] == st.pos[:, None, :, None].to(idx.dtype)  # [B, H_kv, m, tail]
        found = eq.any(-1)  # [B, H_kv, m]
        slot = layer.index.shape[-1] - tail + eq.float().argmax(-1)  # [B, H_kv, m]
        b, h, j = found.nonzero(as_tuple=True)
        layer.keys[b, h, slot[b, h, j]] = k[b, h, j].to(layer.keys.dtype)
        layer.values[b, h, slot[b, h, j]] = v[b, h, j].to(layer.values.dtype)
        if above.m == m and torch.equal(above.pos, st.pos):
            above.q, above.h = q.to(above.q.dtype), h_next

    # --- step 5 -------------------------------------------------------------------------------------
    def _push(self, ctx, st: _Window, out: torch.Tensor, lse: torch.Tensor, refresh: bool) -> None:
        keep = self.window - 1
        if keep <= 0:
            return
        cur, st.h_cur = st.h_cur, None
        if refresh and cur is None:
            return  # residual input not captured (first step after the hooks were installed): skip the token
        pos = ctx.query_index[:, -1:].to(torch.long)  # [B, 1]
        parts: dict[str, torch.Tensor | None] = {
            "q": ctx.q.detach(), "o": out.float(), "lse": lse, "pos": pos,
            "h": cur[0] if refresh else None,
            "cos": cur[1] if refresh and cur[1] is not None else None,
            "sin": cur[2] if refresh and cur[2] is not None else None,
        }
        dims = {"q": 2, "o": 2, "lse": 2, "pos": 1, "h": 1, "cos": 1, "sin": 1}
        fresh = st.m == 0 or st.pos.shape[0] != pos.shape[0]
        for name, value in parts.items():
            old, d = getattr(st, name), dims[name]
            if fresh:
                new = value
            elif value is None or old is None:
                new = None  # optional fields (refresh inputs) must cover every window token
            else:
                new = torch.cat([old, value], dim=d)
            if new is not None and new.shape[d] > keep:
                new = new.narrow(d, new.shape[d] - keep, keep)
            setattr(st, name, new)
