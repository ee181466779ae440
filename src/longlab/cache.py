"""``LonglabCache``: a ``transformers.Cache`` whose evictions really free memory.

Layout (chosen for vectorised attention over batches and GQA): each layer holds
``keys, values: [B, H_kv, T, D]`` plus ``index: [B, H_kv, T]`` (int32), the true *position* of the
token in each slot (its RoPE position: the number of real tokens of its row before it), or ``-1``
for an empty slot (padding or evicted). Positions increase along the stream, so causality and
sliding windows are comparisons of positions, whatever was evicted or padded. When heads keep
different numbers of tokens (AdaKV), ``T`` is the largest per-head count and
shorter heads carry empty slots: a padded-per-layer layout with a validity mask. ``nbytes()``
reports the bytes of the held slots, padding included.

Appends: a decode step adds one slot to every layer. Re-allocating the layer (``torch.cat``, as
transformers' ``DynamicCache`` does) would copy the whole cache once per token, so a short append
(at most ``SHORT_APPEND`` tokens) that overflows a layer grows its slot buffers with ``DECODE_RESERVE``
spare slots, and the next appends write into them: one copy per ``DECODE_RESERVE`` decode steps.
``keys``/``values``/``index`` read as the held slots (a view of the buffer); assigning them replaces the
buffer. Prefill chunks allocate exactly. ``spare_nbytes()`` reports the rest of the buffers: the spare
capacity (at most ``DECODE_RESERVE`` slots per layer) and the slots a sliding window moved past without a
copy (KIVI's value residual, :meth:`LonglabLayer._drop_front`; freed at the next re-allocation, so the two
together stay within one buffer's ``DECODE_RESERVE`` + 1 slots).

Positions: ``get_seq_length()`` returns the number of tokens *seen* (``n_seen``), not the number
held, so transformers gives the next token the RoPE position it would have had without eviction.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .recipe import LonglabError, Recipe, parse_recipe

__all__ = ["LonglabCache", "LonglabLayer", "CACHE_KWARG", "left_pad"]

# transformers' attention layers call ``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then pass the
# same ``kwargs`` to the attention function: the cache adds itself there, so the hook receives
# ``longlab_cache=(cache, layer_idx)`` directly, without a global or thread-local lookup.
CACHE_KWARG = "longlab_cache"

DECODE_RESERVE = 256  # spare slots a short append allocates when it overflows a layer's buffers
SHORT_APPEND = 16  # appends of at most this many tokens (decode steps, speculative drafts) get spare slots


class _Slots:
    """A layer tensor whose dim 2 is the slot axis (``keys``/``values`` ``[B, H_kv, T, D]``, ``index``
    ``[B, H_kv, T]``), held in a buffer that may have spare slots past ``T``.

    Reading gives the ``T`` held slots (the buffer itself when it has no spare slots, else a view of its
    first ``T``). Assigning a tensor makes it the buffer, without spare slots, so ``layer.keys = t`` works
    as for a plain attribute and ``t`` is never written past its end. Only :meth:`LonglabLayer._append`
    writes into spare slots, and only into a buffer this very layer allocated: a ``copy.copy`` or
    ``deepcopy`` of the layer re-allocates before its first append, so twins never share spare slots."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_slots_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        buf, n, _ = obj.__dict__.get(self.key, (None, 0, None))
        return buf if buf is None or buf.shape[2] == n else buf.narrow(2, 0, n)

    def __set__(self, obj: Any, value: torch.Tensor | None) -> None:
        # (buffer, slots held, id of the layer that allocated the buffer: None = assigned from outside)
        obj.__dict__[self.key] = (value, 0 if value is None else value.shape[2], None)
        if self.key == "_slots_index":
            obj.__dict__["_valid_all"] = obj.__dict__["_heads_shared"] = None  # recomputed when asked
            obj.__dict__["lead_pad"] = None  # a new layout: no known leading empty slots
            obj.__dict__["row_valid"] = None


class LonglabLayer(CacheLayerMixin):
    """One layer's storage: keys/values ``[B, H_kv, T, D]``, stream index ``[B, H_kv, T]``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    # Capability: the layer is keys/values/index/n_real (+ per-slot extras) only, so the harness may
    # stack several streams' layers as batch rows, padding with empty slots. Storage with more state
    # (quantized) sets False.
    batchable: ClassVar[bool] = True
    keys = _Slots()  # [B, H_kv, T, D]
    values = _Slots()  # [B, H_kv, T, D]
    index = _Slots()  # [B, H_kv, T] int32; -1 = empty slot

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.index: torch.Tensor | None = None  # [B, H_kv, T] int32; -1 = empty slot
        self.extras: dict[str, torch.Tensor] = {}  # per-slot method state, each [B, H_kv, T]
        self.state: dict[str, torch.Tensor] = {}  # per-layer method state, each [B, ...] (e.g. a memory)
        self.n_seen = 0  # tokens written so far, padding included (the stream length)
        self.n_real: torch.Tensor | None = None  # [B] non-padding tokens seen per row
        self.sliding_window: int | None = None  # set by the hook for sliding-window layers
        # [B] leading empty slots of each row (rows of unequal length stacked as one batch), or None:
        # attention may then skip them per row (longlab.attention._ragged_rows)
        self.lead_pad: torch.Tensor | None = None
        # with ``lead_pad``: per row, whether every slot after its leading empty ones holds a real token
        # (kept across appends; forgotten with the layout), so attention per row needs no pass over T
        self.row_valid: list[bool] | None = None

    # --- transformers' layer protocol -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H_kv, _, D = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty(B, H_kv, 0, D)
        self.values = value_states.new_empty(B, H_kv, 0, value_states.shape[-1])
        self.index = torch.empty(B, H_kv, 0, dtype=torch.int32, device=self.device)
        self.n_real = torch.zeros(B, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H_kv, T_new, D] -> returns the whole layer: [B, H_kv, T, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H_kv, T_new, _ = key_states.shape
        steps = torch.arange(T_new, dtype=torch.int32, device=self.device)
        new_index = (self.n_real[:, None].to(torch.int32) + steps)[
            :, None, :
        ]  # [B, 1, T_new]; mark_padding fixes pads
        self._append("keys", key_states)
        self._append("values", value_states)
        self._append("index", new_index.expand(B, H_kv, T_new))  # new slots: valid, shared by all heads
        for name, state in self.extras.items():
            self.extras[name] = torch.cat([state, state.new_zeros(B, H_kv, T_new)], dim=-1)
        self.n_seen += T_new
        self.n_real += T_new
        return self.keys, self.values

    def _append(self, name: str, new: torch.Tensor) -> None:
        """Write ``new [B, H_kv, T_new, ...]`` after the held slots of ``keys``, ``values`` or ``index``."""
        slots = "_slots_" + name
        buf, n, owner = self.__dict__[slots]
        T_new, dtype = new.shape[2], torch.promote_types(buf.dtype, new.dtype)  # as torch.cat would
        if owner != id(self) or buf.shape[2] < n + T_new or dtype != buf.dtype:
            spare = DECODE_RESERVE if T_new <= SHORT_APPEND else 0
            shape = (*new.shape[:2], n + T_new + spare, *new.shape[3:])
            fresh = torch.empty(shape, dtype=dtype, device=buf.device)
            fresh[:, :, :n] = buf[:, :, :n]
            buf, owner = fresh, id(self)
        buf[:, :, n : n + T_new] = new
        self.__dict__[slots] = (buf, n + T_new, owner)

    def _drop_front(self, name: str, n: int) -> None:
        """Forget the first ``n`` held slots of ``keys``, ``values`` or ``index`` without copying them
        away: the buffer is re-pointed past them and keeps its spare slots, so a sliding window (KIVI's
        value residual) moves by one slot a decode step with no copy. A buffer this layer did not allocate
        is narrowed the same way and still never written (the next append re-allocates). The forgotten
        slots stay allocated until that next re-allocation and count in :meth:`spare_nbytes`."""
        slots = "_slots_" + name
        buf, held, owner = self.__dict__[slots]
        n = min(n, held)
        self.__dict__[slots] = (buf.narrow(2, n, buf.shape[2] - n), held - n, owner)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.index = self.n_real = None
        self.extras = {}
        self.state = {}
        self.n_seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("LonglabCache cannot be cropped: evicted entries are gone")

    def _select_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        lead, row_valid = self.lead_pad, self.row_valid  # assigning index forgets them
        # select whole buffers, spare slots included, so the next append (the decode step that follows
        # a dropped row) writes in place instead of copying the layer a second time
        slots = {name: self.__dict__["_slots_" + name] for name in ("keys", "values", "index")}
        self.index = None  # resets the layout flags; the selected buffers are set below
        for name, (buf, n, _) in slots.items():
            new = fn(buf)
            self.__dict__["_slots_" + name] = (new, n, id(self) if new.data_ptr() != buf.data_ptr() else None)
        self.n_real = fn(self.n_real)
        self.extras = {k: fn(v) for k, v in self.extras.items()}
        self.state = {k: fn(v) for k, v in self.state.items()}
        if lead is not None:
            self.lead_pad = fn(lead)
            if row_valid is not None:
                self.row_valid = fn(torch.tensor(row_valid, device=lead.device)).tolist()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(lambda t: t[indices])

    # --- longlab operations -------------------------------------------------------------------------
    @property
    def valid(self) -> torch.Tensor:
        """``[B, H_kv, T]`` bool: slot holds a real (non-padding, non-evicted) token."""
        return self.index >= 0

    def lengths(self) -> torch.Tensor:
        """``[B, H_kv]`` number of real entries held per head."""
        return self.valid.sum(-1)

    @property
    def all_valid(self) -> bool:
        """Every slot holds a real token (no padding, no empty slot), so a decode query sees every held
        key and attention needs no mask. Kept across appends; one pass over ``index`` after it is
        replaced. Code that writes into ``index`` in place calls :meth:`index_changed`."""
        if self.__dict__.get("_valid_all") is None:
            self._valid_all = bool((self.index >= 0).all())
        return self._valid_all

    @property
    def heads_share_slots(self) -> bool:
        """Every KV head of a row holds the same position in each slot (one mask serves all heads).
        Tracked like :attr:`all_valid`."""
        if self.__dict__.get("_heads_shared") is None:
            idx = self.index
            self._heads_shared = idx.shape[1] == 1 or bool((idx == idx[:, :1]).all())
        return self._heads_shared

    def index_changed(self) -> None:
        """Forget what :attr:`all_valid`, :attr:`heads_share_slots` and ``row_valid`` know (after an
        in-place edit of ``index``)."""
        self._valid_all = self._heads_shared = None
        self.row_valid = None

    def mark_padding(self, new_valid: torch.Tensor) -> None:
        """The last ``T_new`` slots were written with ``new_valid`` ``[B, T_new]``: padding slots become
        empty and real tokens get their true positions."""
        T_new = new_valid.shape[-1]
        new_valid = new_valid.to(torch.bool)
        n_pad = (~new_valid).sum(-1)  # [B]
        if not bool(n_pad.any()):
            return
        start = self.n_real - T_new  # real tokens before this segment
        pos = (start[:, None] + new_valid.long().cumsum(-1) - 1).to(torch.int32)
        pos = pos.masked_fill(~new_valid, -1)
        self.index[..., -T_new:] = pos[:, None, :].expand(-1, self.index.shape[1], -1)
        self._valid_all = False  # heads still share slots exactly when they did
        self.row_valid = None
        self.n_real -= n_pad

    def keep(self, mask: torch.Tensor) -> None:
        """Physically keep the slots where ``mask`` ``[B, H_kv, T]`` is True; order is preserved.

        The layer is repacked to the largest per-head count; shorter heads get empty slots.
        """
        mask = mask & self.valid
        B, H_kv, T = mask.shape
        counts = mask.sum(-1)  # [B, H_kv]
        new_T = int(counts.max()) if counts.numel() else 0
        if new_T == T and bool(mask.all()):
            return
        arange = torch.arange(T, device=mask.device)
        order_key = (~mask).long() * T + arange  # kept slots first, each group in stream order
        order = order_key.argsort(dim=-1)[..., :new_T]  # [B, H_kv, new_T]
        slot_ok = torch.arange(new_T, device=mask.device) < counts[..., None]  # [B, H_kv, new_T]

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 4:
                return t.gather(2, order[..., None].expand(-1, -1, -1, t.shape[-1]))
            return t.gather(2, order)

        self.keys, self.values = take(self.keys), take(self.values)
        self.index = torch.where(slot_ok, take(self.index), torch.full_like(order, -1, dtype=torch.int32))
        self.extras = {k: take(v) for k, v in self.extras.items()}

    def trim_to_window(self, window: int, slack: int = 64) -> None:
        """Sliding-window layers: drop entries no future query can see (``q - k >= window``).

        Trims only once ``slack`` dead entries accumulate, so decoding does not repack every step.
        """
        if self.keys.shape[-2] <= window + slack:
            return
        newest = self.index.amax(dim=(1, 2), keepdim=True)  # [B, 1, 1] position of the latest token
        self.keep(self.index > newest - window)

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.index, *self.extras.values(), *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def stacked(cls, rows: list[LonglabLayer], reserve: int = 0) -> LonglabLayer:
        """One layer whose batch rows are the rows of ``rows`` (layers of any batch size, plain storage),
        each after leading empty slots up to the longest (position -1, never attended; ``lead_pad``), so a
        row's slots stay contiguous as it appends. ``reserve``: spare slots allocated now for the appends
        to come (the question and the answer), so they never re-allocate the batch."""
        first = rows[0]
        if any(type(x) is not type(first) or x.keys.shape[1] != first.keys.shape[1] for x in rows):
            raise LonglabError("stacked: every row must be a layer of the same kind and head count")
        layer = copy.copy(first)
        T = max(x.keys.shape[2] for x in rows)
        B, (_, H_kv, _, D) = sum(x.keys.shape[0] for x in rows), first.keys.shape
        keys = first.keys.new_empty(B, H_kv, T + reserve, D)  # [B, H_kv, T + reserve, D]
        values = first.values.new_empty(B, H_kv, T + reserve, first.values.shape[-1])
        index = torch.full((B, H_kv, T + reserve), -1, dtype=first.index.dtype, device=keys.device)
        lead: list[int] = []
        row_valid: list[bool] = []
        b = 0
        for x in rows:
            s = T - x.keys.shape[2]
            n = x.keys.shape[0]
            keys[b : b + n, :, :s] = values[b : b + n, :, :s] = 0.0  # empty slots hold finite values
            keys[b : b + n, :, s:T], values[b : b + n, :, s:T] = x.keys, x.values
            index[b : b + n, :, s:T] = x.index
            old_lead = x.lead_pad.tolist() if x.lead_pad is not None else [0] * n
            for r in range(n):
                lead.append(s + int(old_lead[r]))
                if n == 1 and x.lead_pad is None:
                    row_valid.append(bool(x.all_valid))  # one pass per row, here, not per step
                elif x.row_valid is not None:
                    row_valid.append(bool(x.row_valid[r]))
                else:
                    row_valid.append(bool((x.index[r, :, int(old_lead[r]) :] >= 0).all()))
            b += n
        layer.index = index[:, :, :T]  # resets the layout flags; the owned buffers are set below
        for name, buf in (("keys", keys), ("values", values), ("index", index)):
            layer.__dict__["_slots_" + name] = (buf, T, id(layer))
        layer.lead_pad = torch.tensor(lead, device=keys.device)  # [B]
        layer.row_valid = row_valid
        layer.n_real = torch.cat([x.n_real for x in rows])  # [B]
        layer.extras, layer.state = {}, {}
        return layer

    def share(self) -> LonglabLayer:
        """A copy that reads this layer's key/value/index buffers without copying them (copy on write).

        The twin's first append re-allocates (it owns no buffer), eviction (:meth:`keep`) gathers into
        new tensors, and its per-slot extras, per-layer state and ``n_real`` are its own; so neither
        layer ever sees the other's later writes. Only for methods that never write into held slots in
        place (``batchable`` recipes; RetroAttention's decode-time corrections do write in place)."""
        twin = copy.copy(self)
        for name in ("keys", "values", "index"):
            key = "_slots_" + name
            if key in self.__dict__:
                buf, n, _ = self.__dict__[key]
                twin.__dict__[key] = (buf, n, None)  # owner None: never written past n in place
        if self.n_real is not None:
            twin.n_real = self.n_real.clone()
        twin.extras = {k: v.clone() for k, v in self.extras.items()}
        twin.state = {k: v.clone() for k, v in self.state.items()}
        return twin

    def spare_nbytes(self) -> int:
        """Bytes allocated beside the held slots (not counted by :meth:`nbytes`): spare slots past them
        (decode headroom, at most ``DECODE_RESERVE``) and slots a sliding window left before them
        (:meth:`_drop_front`), i.e. the rest of each buffer this layer allocated."""
        total = 0
        for name in ("keys", "values", "index"):
            buf, n, owner = self.__dict__.get("_slots_" + name, (None, 0, None))
            if buf is None:
                continue
            row = buf[:, :, :1].numel() * buf.element_size()
            if owner == id(self):
                total += buf.untyped_storage().nbytes() - n * row
            elif buf.shape[2] > n:
                total += (buf.shape[2] - n) * row
        return total


class LonglabCache(Cache):
    """A KV cache driven by a recipe: ``model.generate(ids, past_key_values=LonglabCache("snapkv@0.5"))``.

    Multi-token forwards (prefill chunks) are compressed by the recipe's KV policies while
    ``compressing`` is True; the pipeline switches it off for the question in query-agnostic mode.
    Requires the model to run with ``attn_implementation="longlab"`` (see :func:`longlab.load_model`).
    """

    def __init__(self, recipe: str | Recipe | None = None, *, compressing: bool = True) -> None:
        super().__init__(layer_class_to_replicate=LonglabLayer)
        self.recipe = parse_recipe(recipe)
        self.compressing = compressing
        self.stats: dict[str, float] = {"compress_s": 0.0, "compress_calls": 0}
        self.model_ref: Any = None  # weakref.ref to the model (set by pipeline.Stream; RetroAttention)
        self.hook_calls = 0  # forwards of layer 0 that reached the longlab attention hook
        self._updates_of_layer0 = 0
        # What methods attach *outside* the cache (RetroAttention's forward pre-hooks on the model), by
        # name; each has ``release()``. ``copy.deepcopy`` (Stream.fork) copies each one with its own
        # ``__deepcopy__`` (a fork takes its own share); see :meth:`close`.
        self.resources: dict[str, Any] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H_kv, T_new, D] -> the whole layer [B, H_kv, T, D]
        if layer_idx == 0:
            self._check_hook()
            self._updates_of_layer0 += 1
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        forwarded = kwargs.get("kwargs")  # the dict transformers passes on to the attention function
        if isinstance(forwarded, dict):
            forwarded[CACHE_KWARG] = (self, layer_idx)
        return keys, values

    def reset_hook_check(self) -> None:
        """Forget the layer-0 updates counted so far: for code that fills the cache with ``update`` directly
        (no model forward, e.g. a benchmark's random K/V), so that the next real forwards are the ones the
        hook check (:meth:`_check_hook`) counts."""
        self._updates_of_layer0 = 0

    def _check_hook(self) -> None:
        """A recipe acts only through the longlab attention hook: refuse to silently do nothing when the
        model runs another attention implementation (checked at the second forward of layer 0)."""
        if self._updates_of_layer0 and not self.hook_calls and not self.recipe.is_empty:
            raise LonglabError(
                f"LonglabCache({self.recipe.name!r}) was used by a model whose attention is not 'longlab', "
                "so the recipe would compress nothing. Load the model with longlab.load_model(...), or wrap "
                "your own model: `with longlab.use_longlab_attention(model): ...`"
            )

    def close(self) -> None:
        """Release what methods attached outside the cache (e.g. RetroAttention's pre-hooks on the model).

        Idempotent. It also happens when the cache is garbage-collected (resources hold a
        ``weakref.finalize``) and on leaving ``with LonglabCache(recipe) as cache: ...``."""
        resources, self.resources = self.resources, {}
        for resource in resources.values():
            resource.release()

    def __enter__(self) -> LonglabCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def share(self, recipe: str | Recipe | None = None) -> LonglabCache:
        """A copy under ``recipe`` (default: this one's) whose layers read this cache's buffers
        without copying them (:meth:`LonglabLayer.share`); a layer of another kind is deep-copied. For
        recipes that never write into held slots in place, where a fork would copy the whole
        uncompressed cache only to evict half of it. Refused while methods hold outside resources."""
        if self.resources:
            raise LonglabError(f"cannot share a cache holding resources {sorted(self.resources)}; fork it")
        twin = copy.copy(self)
        twin.recipe = self.recipe if recipe is None else parse_recipe(recipe)
        twin.stats = dict(self.stats)
        twin.resources = {}
        twin.layers = [
            layer.share() if type(layer) is LonglabLayer else copy.deepcopy(layer) for layer in self.layers
        ]
        return twin

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (keys, values, indices, method state)."""
        return sum(layer.nbytes() for layer in self.layers)

    def spare_nbytes(self) -> int:
        """Bytes of spare slots the layers allocated ahead for decoding (see the module docstring)."""
        return sum(layer.spare_nbytes() for layer in self.layers if hasattr(layer, "spare_nbytes"))

    def full_nbytes(self) -> int:
        """Bytes an uncompressed cache would hold for the same tokens (keys and values only); a
        sliding-window layer holds at most its window, as transformers' own sliding cache does."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H_kv, _, D = layer.keys.shape
                H_kv //= getattr(layer, "kv_repeat", 1)  # KV heads repeated per query head (repeat_kv_heads)
                elem = getattr(layer, "full_element_size", layer.keys.element_size())  # quantized layers
                held = layer.n_seen if not layer.sliding_window else min(layer.n_seen, layer.sliding_window)
                total += 2 * B * H_kv * held * D * elem
        return total

    def lengths(self) -> list[torch.Tensor]:
        """Per layer, ``[B, H_kv]`` entries held per head."""
        return [layer.lengths() for layer in self.layers if layer.is_initialized]

    def __repr__(self) -> str:
        return f"LonglabCache(recipe={self.recipe.name!r}, layers={len(self.layers)}, nbytes={self.nbytes()})"


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> ``(ids [B, T], valid [B, T])``, left-padded with ``pad_id`` to the longest row:
    the batch layout the cache's rows share (padding slots are empty, never attended). Used by
    ``Stream.feed`` and by the speculative drafts' appends (longlab.spec)."""
    T = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            ids[b, T - len(r) :] = torch.tensor(r, dtype=torch.long)
            valid[b, T - len(r) :] = True
    return ids, valid
