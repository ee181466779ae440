"""A :class:`Stream`: a batch of token streams flowing into one :class:`~longlab.cache.LonglabCache`.

The engine's primitive: ``feed`` appends a segment per row (left-padded, in prefill chunks; KV policies
may compress after every chunk, once at the end, or not at all), ``fork`` branches the stream under
another recipe, ``decode`` samples tokens. Each row's next RoPE position is the number of real tokens
it has seen, so eviction never shifts positions; padding slots are never attended to.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from ..cache import LonglabCache, left_pad
from ..recipe import LonglabError, Recipe, parse_recipe

__all__ = ["Stream", "chunk_slices", "MIN_LAST_CHUNK", "eos_token_ids", "blocked_linear"]

MIN_LAST_CHUNK = 64  # the last chunk must cover observation windows (SnapKV's W = 32)


def chunk_slices(length: int, chunk_size: int) -> list[slice]:
    """Prefill chunks of ``chunk_size`` tokens over ``length``; a tail shorter than ``MIN_LAST_CHUNK``
    joins the chunk before it (so the last chunk, where query-aware scores come from, is never tiny)."""
    bounds = list(range(0, length, chunk_size)) + [length]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < MIN_LAST_CHUNK:
        bounds.pop(-2)  # merge a short tail into the previous chunk
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class Stream:
    """A batch of token streams flowing into one :class:`LonglabCache`.

    Tracks the padding mask of everything written (``[B, n_seen]``) and each row's next RoPE
    position (real tokens seen), so eviction never shifts positions."""

    def __init__(self, model: Any, cache: LonglabCache, batch_size: int) -> None:
        self.model = model
        self.cache = cache
        cache.model_ref = weakref.ref(model)  # for decode policies that re-run layers (RetroAttention)
        self.device = next(model.parameters()).device
        self.seen_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.pad_id = 0

    @property
    def batch_size(self) -> int:
        return self.seen_mask.shape[0]

    def fork(self, recipe: str | Recipe | None = None, *, share: bool = False) -> Stream:
        """An independent copy (cache tensors included), optionally with another recipe.

        ``share``: the copy reads the cache's key/value buffers instead of copying them
        (:meth:`LonglabCache.share`, copy on write), for recipes that never write into held slots in
        place; the harness uses it for branches it batches."""
        if share:
            twin = copy.copy(self)
            twin.cache = self.cache.share(recipe)
            twin.next_pos = self.next_pos.clone()  # feed() adds to it in place
            return twin
        model, self.model = self.model, None
        try:
            twin = copy.deepcopy(self)
        finally:
            self.model = model
        twin.model = model
        if recipe is not None:
            twin.cache.recipe = parse_recipe(recipe)
        return twin

    @torch.inference_mode()
    def feed(self, rows: list[list[int]], chunk_size: int = 1024, compress: str = "chunk", *,
             every_position: bool = False) -> torch.Tensor:
        """Append one segment per row (left-padded to a common length); return last logits [B, V]
        (``every_position``: the logits after every token of the segment, ``[B, T, V]``).

        compress: ``"chunk"`` (policies act after every chunk), ``"end"`` (after the last chunk only)
        or ``"none"``."""
        if len(rows) != self.batch_size:
            raise LonglabError(f"expected {self.batch_size} rows, got {len(rows)}")
        if any(len(r) == 0 for r in rows):
            raise LonglabError("every row must contribute at least one token to a segment")
        ids, valid = left_pad(rows, self.pad_id)
        T = ids.shape[1]
        ids, valid = ids.to(self.device), valid.to(self.device)
        chunks = chunk_slices(T, chunk_size)
        saved = self.cache.compressing
        logits = None
        every: list[torch.Tensor] = []
        try:
            for i, sl in enumerate(chunks):
                self.cache.compressing = compress == "chunk" or (compress == "end" and i == len(chunks) - 1)
                v = valid[:, sl]
                self.seen_mask = torch.cat([self.seen_mask, v], dim=1)
                pos = (self.next_pos[:, None] + v.long().cumsum(-1) - 1).clamp(min=0)
                inputs = {"input_ids": ids[:, sl], "attention_mask": self.seen_mask, "position_ids": pos,
                          "cache": self.cache, "use_cache": True}
                head = _row_blocked_head(self.model, ids.shape[0])
                if every_position:
                    every.append(self.model(**inputs, logits_to_keep=0).logits)  # [B, T_chunk, V]
                elif head is None:
                    logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
                else:  # the same logits, bitwise, with the LM head in row blocks (faster at a few rows)
                    logits = head(self.model.model(**inputs).last_hidden_state[:, -1].contiguous())
                self.next_pos += v.sum(-1)
        finally:
            self.cache.compressing = saved
        return torch.cat(every, dim=1) if every_position else logits

    @torch.inference_mode()
    def decode(
        self,
        logits: torch.Tensor,
        max_new_tokens: int,
        eos_ids: set[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        *,
        drop_finished: bool = False,
    ) -> list[list[int]]:
        """Greedy (temperature 0) or temperature/top-p sampling; stops per row at an EOS id.

        ``logits``: ``[B, V]`` next-token logits of the stream's rows; returns each row's tokens. Every
        row samples from its own generator seeded with ``seed`` (:class:`~longlab.engine.decode.Sampler`),
        so a row's tokens are those it gets alone. ``drop_finished``: a row that emitted EOS leaves the
        batch (``Cache.batch_select_indices``), so every later step costs only the rows still running;
        rows are dropped only when every method of the recipe declares ``batch_select_safe``, and the
        stream then ends holding only the rows that ran to the last step. (The loop is
        :class:`~longlab.engine.decode.StreamLane`, the engine's.)"""
        from .decode import Row, Sampler, StreamLane

        rows = [
            Row(b, logits[b].to(device="cpu", dtype=torch.float32, copy=True), max_new_tokens, eos_ids,
                Sampler(temperature, top_p, seed))
            for b in range(self.batch_size)
        ]
        lane = StreamLane(self, rows, drop=drop_finished)
        while lane.rows:
            lane.step()
        return [r.tokens for r in rows]

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only the batch rows ``keep`` (indices into the current rows), cache included."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(idx)
        self.seen_mask = self.seen_mask[idx]  # [B', n_seen]
        self.next_pos = self.next_pos[idx]  # [B']


HEAD_BLOCK = 2048  # LM head rows per block (vocabulary entries)
HEAD_MIN_ROWS = 2  # batch rows from which the blocked LM head is used (measured: slower at 1 row)
_HEAD_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM")  # forward = lm_head(last hidden states), no scaling


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, block: int = HEAD_BLOCK) -> torch.Tensor:
    """``x @ weight.T`` computed over blocks of ``block`` output rows. x: [B, D]; weight: [V, D] -> [B, V].

    Each output entry is the same dot product over D as in ``F.linear``; only the output columns are
    split, which at a few rows (decode steps) streams a large LM head faster on CPU. No gradient.
    Bit-equality with ``F.linear`` depends on the BLAS: at one row some CPUs' gemv path differs in the
    last bit, so the pipeline blocks only from ``HEAD_MIN_ROWS`` rows and checks equality at run time."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    with torch.no_grad():
        for i in range(0, weight.shape[0], block):
            torch.mm(x, weight[i : i + block].t(), out=out[:, i : i + block])
    return out


def _row_blocked_head(model: Any, rows: int) -> Any:
    """A function ``hidden [B, D] -> logits [B, V]`` equal bit for bit to the model's own head at ``rows``
    rows, or None where that is not known: fewer rows than :data:`HEAD_MIN_ROWS`, another model class,
    a head with a bias, not fp32 on CPU, a vocabulary within one block, or forward hooks that the direct
    call would skip. The first call at each row count checks bitwise equality with ``F.linear`` on its
    input and remembers the answer on the head module itself, so it lives and dies with that model
    (BLAS builds may order the sums differently)."""
    if rows < HEAD_MIN_ROWS or type(model).__name__ not in _HEAD_CLASSES or "forward" in vars(model):
        return None
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or not hasattr(model, "model"):
        return None
    w = head.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[0] <= HEAD_BLOCK:
        return None
    if (model._forward_hooks or model._forward_pre_hooks or head._forward_hooks or head._forward_pre_hooks
            or torch.nn.modules.module._global_forward_hooks
            or torch.nn.modules.module._global_forward_pre_hooks):
        return None
    block = HEAD_BLOCK
    exact: dict[tuple, bool] = head.__dict__.setdefault("_longlab_blocked_exact", {})
    key = (*w.shape, rows, block)  # (V, D, rows, block) -> blocked == F.linear, bitwise, for this head

    def apply(x: torch.Tensor) -> torch.Tensor:  # x: [B, D] -> [B, V]
        known = exact.get(key)
        if known is False:
            return torch.nn.functional.linear(x, w)
        out = blocked_linear(x, w, block)
        if known is None:
            exact[key] = torch.equal(out, torch.nn.functional.linear(x, w))
        return out if exact[key] else torch.nn.functional.linear(x, w)

    return apply


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


