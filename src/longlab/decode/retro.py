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

Implementation notes. The state (window queries, output cache, log-sum-exps, positions, residual inputs,
RoPE, page table) is kept in each layer's ``layer.state`` under ``retro.*``, batch first, so
:meth:`Stream.fork <longlab.engine.stream.Stream.fork>` copies it, batch selection keeps it right and
``nbytes`` counts it. The refresh needs each window token's residual-stream input of every layer and the
decoder-layer modules; the inputs are captured by forward pre-hooks on the decoder layers, installed the
first time RetroAttention decodes with a model attached to the cache (``cache.model_ref``, set by
:class:`longlab.engine.stream.Stream`). The hooks belong to the cache: they act only for it (and its forks),
are held in ``cache.resources`` and are removed when the last cache sharing them is closed
(``cache.close()``, ``with LonglabCache(...) as cache``) or garbage-collected. Supported decoder layers are
the pre-norm Llama family (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``:
Llama, SmolLM2, Qwen2/3, Mistral); elsewhere, or without a model, only steps 1-3 and 5 run, which do not
change the generated tokens (a warning says so). The hooks are installed inside the first sparse decode
step, after that step's first sparse layer ran its pre-hook, so that layer skips the first decode token
(it never enters its window); a fork shares its parent's hooks and so behaves as an uninterrupted run.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import layer_attention, lse_merge
from ..recipe import register
from ..registry import MAX_TOKENS, param
from .quest import Quest, attend_slots, per_head_slots

__all__ = ["RetroAttention"]


_PREFIX = "retro."
_FIELDS = {"q": 2, "o": 2, "lse": 2, "pos": 1, "h": 1, "cos": 1, "sin": 1}  # name -> its window axis
_CURRENT = ("h_cur", "cos_cur", "sin_cur")  # captured by the pre-hook for the token being decoded
_RESOURCE = "retro.hooks"  # key in cache.resources


class _Window:
    """View of one layer's RetroAttention state in ``layer.state`` (the last ``m <= window - 1`` tokens):

    ``q`` [B, H, m, D] this layer's (refreshed) queries; ``o`` [B, H, m, D] fp32 output cache; ``lse``
    [B, H, m]; ``pos`` [B, m] positions; ``h`` [B, m, hidden] residual-stream inputs of this layer
    (refresh); ``cos``/``sin`` [B, m, D] RoPE of the window tokens; ``last`` [B, H, n_pages] step that
    last loaded each page (-1: never); ``h_cur``/``cos_cur``/``sin_cur`` the current token's, set by the
    pre-hook and consumed by :meth:`RetroAttention._push` in the same forward."""

    __slots__ = ("_state",)

    def __init__(self, layer) -> None:
        object.__setattr__(self, "_state", layer.state)

    def __getattr__(self, name: str) -> torch.Tensor | None:
        if name in _FIELDS or name == "last" or name in _CURRENT:
            return self._state.get(_PREFIX + name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: torch.Tensor | None) -> None:
        if name not in _FIELDS and name != "last" and name not in _CURRENT:
            raise AttributeError(name)
        if value is None:
            self._state.pop(_PREFIX + name, None)
        else:
            self._state[_PREFIX + name] = value

    @property
    def m(self) -> int:
        pos = self.pos
        return 0 if pos is None else pos.shape[1]

    def take_current(self) -> tuple | None:
        """``(h [B, 1, hidden], cos, sin)`` captured for the current token (then cleared), or None."""
        h, cos, sin = self.h_cur, self.cos_cur, self.sin_cur
        self.h_cur = self.cos_cur = self.sin_cur = None
        return None if h is None else (h, cos, sin)


def _is_prenorm_decoder(module) -> bool:
    parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return all(hasattr(module, a) for a in parts) and not hasattr(module, "pre_feedforward_layernorm")


class _PreHooks:
    """Forward pre-hooks on a model's pre-norm decoder layers that capture each decode token's residual
    input and RoPE into the cache layer's state (for the refresh), plus the decoder module of each layer
    index. Shared by a cache and its forks through :class:`_HookLease`; removed with the last lease."""

    def __init__(self, model) -> None:
        self.decoders: dict[int, Any] = {}
        for module in model.modules():
            idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
            if _is_prenorm_decoder(module) and idx is not None:
                self.decoders[int(idx)] = module
        self.model_ref = weakref.ref(model)
        me = weakref.ref(self)  # the model must not keep this object alive through its hooks
        self.handles = [
            m.register_forward_pre_hook(lambda mod, args, kw: _capture(me, mod, args, kw), with_kwargs=True)
            for m in self.decoders.values()
        ]
        self.users = 0

    @property
    def installed(self) -> bool:
        return bool(self.handles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _drop_user(hooks: _PreHooks) -> None:
    hooks.users -= 1
    if hooks.users <= 0:
        hooks.remove()


class _HookLease:
    """One cache's share of a :class:`_PreHooks` (kept in ``cache.resources``). Released by
    ``cache.close()`` or when the cache (hence the lease) is garbage-collected; ``copy.deepcopy`` (a fork)
    takes a new share of the same hooks, so the hooks stay while any cache using them lives."""

    def __init__(self, hooks: _PreHooks) -> None:
        self.hooks = hooks
        hooks.users += 1
        self._finalizer = weakref.finalize(self, _drop_user, hooks)

    @property
    def active(self) -> bool:
        return self._finalizer.alive and self.hooks.installed

    def release(self) -> None:
        self._finalizer()

    def __deepcopy__(self, memo: dict) -> _HookLease:
        return _HookLease(self.hooks)


def _lease(cache) -> _HookLease | None:
    lease = getattr(cache, "resources", {}).get(_RESOURCE)
    return lease if isinstance(lease, _HookLease) and lease.active else None


def _capture(hooks_ref, module, args, kwargs) -> None:
    """Decoder-layer pre-hook: keep the residual input and RoPE of a decode token for RetroAttention."""
    from ..cache import LonglabCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, LonglabCache) or not isinstance(cache.recipe.decode, RetroAttention):
        return
    lease = _lease(cache)
    if lease is None or lease.hooks is not hooks_ref():
        return  # another cache's hooks
    h = args[0] if args else kwargs.get("hidden_states")
    idx = getattr(module.self_attn, "layer_idx", None)
    if h is None or h.shape[1] != 1 or idx is None or idx >= len(cache.layers):
        return
    layer = cache.layers[idx]
    if not getattr(layer, "is_initialized", False) or idx < cache.recipe.decode.dense_layers:
        return  # dense layers keep no window
    if getattr(layer, "sliding_window", None) is not None:
        return
    cos, sin = kwargs.get("position_embeddings", (None, None))
    st = _Window(layer)
    st.h_cur, st.cos_cur, st.sin_cur = h.detach(), cos, sin


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
    window: int = param(8, low=1, high=MAX_TOKENS, integer=True)
    refresh: bool = param(True, choices=(True, False))

    def validate(self) -> None:
        super().validate()
        self.check("window", 1, integer=True)
        self.check("refresh", choices=(True, False))

    def attend(self, ctx) -> torch.Tensor:  # [B, H, 1, D]
        if not self.is_sparse_layer(ctx) or ctx.q.shape[-2] != 1:
            return layer_attention(ctx, None)
        refresh = self.refresh and self._hooks_ready(ctx)
        st = _Window(ctx.layer)
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
            slots = per_head_slots(slots, H)  # selection=group: one list per KV head
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
        if _lease(ctx.cache) is None or _lease(ctx.cache).hooks.model_ref() is not model:
            old = ctx.cache.resources.pop(_RESOURCE, None)
            if old is not None:
                old.release()
            ctx.cache.resources[_RESOURCE] = _HookLease(_PreHooks(model))
        return True

    def _refresh_above(self, ctx, st: _Window) -> None:
        """Run the window tokens' corrected outputs through this layer's o_proj + MLP and overwrite their
        K/V rows (and window queries) in the layer above."""
        nxt_idx = ctx.layer_idx + 1
        cache = ctx.cache
        lease = _lease(cache)
        if nxt_idx >= len(cache.layers) or lease is None or st.cos is None:
            return
        dl, dl_next = lease.hooks.decoders.get(ctx.layer_idx), lease.hooks.decoders.get(nxt_idx)
        layer = cache.layers[nxt_idx]
        if dl is None or dl_next is None or getattr(layer, "dequantized_keys", None) is not None:
            return  # not a pre-norm decoder pair, or packed storage above (K/V rows not plain tensors)
        above = _Window(layer)
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
        cur = st.take_current()
        if refresh and cur is None:
            return  # residual input not captured (first step after the hooks were installed): skip the token
        pos = ctx.query_index[:, -1:].to(torch.long)  # [B, 1]
        parts: dict[str, torch.Tensor | None] = {
            "q": ctx.q.detach(), "o": out.float(), "lse": lse, "pos": pos,
            "h": cur[0] if refresh else None,
            "cos": cur[1] if refresh and cur[1] is not None else None,
            "sin": cur[2] if refresh and cur[2] is not None else None,
        }
        fresh = st.m == 0 or st.pos.shape[0] != pos.shape[0]
        for name, value in parts.items():
            old, d = getattr(st, name), _FIELDS[name]
            if fresh:
                new = value
            elif value is None or old is None:
                new = None  # optional fields (refresh inputs) must cover every window token
            else:
                new = torch.cat([old, value], dim=d)
            if new is not None and new.shape[d] > keep:
                new = new.narrow(d, new.shape[d] - keep, keep)
            setattr(st, name, new)
