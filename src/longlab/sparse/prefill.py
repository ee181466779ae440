"""Sparse prefill as recipe prefill policies (``ashape``, ``vslash``, ``prism+snapkv@0.5``, ...).

:class:`SparsePrefill` is the base of every block selector (:class:`~longlab.sparse.base.BlockSelector`):
each selector is registered once, with its paper, by ``@register("name")`` in its own file, so the recipe
registry (``longlab methods``) is the one list of them. At every prefill chunk the hook calls
:meth:`SparsePrefill.attend`: the selector picks blocks from the chunk's post-RoPE ``q`` and the held
keys, and the block-sparse executor computes attention on those blocks only. Layers whose cache is no
longer the contiguous stream (after eviction, with padding, or sliding-window layers) fall back to
dense attention, since block masks are defined over contiguous positions.

Quality on demand: inside ``with collect_prefill_metrics(PrefillMetrics()) as m:`` every chunk a policy
handles adds its density, attention recall and relative output error vs dense (on a few sampled query
rows, :func:`~longlab.sparse.executor.quality_metrics`) per layer and head to ``m``, and every chunk that
falls back to dense counts as such; ``m.items()`` are the rows of the results store's ``metrics`` table.
Outside such a block nothing is measured and attention costs what it always does.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import layer_attention
from ..recipe import Method
from .executor import block_sparse_attention, quality_metrics

__all__ = ["SparsePrefill", "PrefillMetrics", "collect_prefill_metrics", "BACKENDS"]

BACKENDS = ("auto", "flash", "grouped", "flex", "gather", "dense")


QUALITY = ("density", "recall", "rel_error")


@dataclass
class PrefillMetrics:
    """Row-weighted quality of the sparse prefill chunks of one run, per layer and head.

    Every chunk of ``T_q`` query rows adds, per (layer, head), its density (fraction of the causally
    allowed blocks computed), recall (true softmax mass inside the mask) and relative output error
    (``||O_sparse - O_dense|| / ||O_dense||``), the last two on ``n_sample_rows`` sampled rows, each
    weighted by ``T_q``. Chunks that fall back to dense attention (sliding-window layers, a cache that is
    no longer the contiguous stream) count ``T_q`` dense rows for their layer. ``seconds`` is the time
    spent measuring, which callers subtract from the prefill time.
    """

    n_sample_rows: int = 32
    seconds: float = 0.0
    sums: dict[tuple[int, int, str], float] = field(default_factory=dict)  # (layer, head, name) -> sum
    rows: dict[tuple[int, int], float] = field(default_factory=dict)  # (layer, head) -> weight
    sparse_rows: dict[int, float] = field(default_factory=dict)  # layer -> rows attended sparsely
    dense_rows: dict[int, float] = field(default_factory=dict)  # layer -> rows that fell back

    def copy(self) -> PrefillMetrics:
        """An independent copy (a branch continues from a shared prefix's metrics)."""
        return copy.deepcopy(self)

    def add_dense(self, layer: int, n_rows: int) -> None:
        self.dense_rows[layer] = self.dense_rows.get(layer, 0.0) + n_rows

    def add_chunk(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scaling: float,
        out: torch.Tensor,
    ) -> None:
        """q: [B, H, T_q, D], k, v: [B, H_kv, T, D], mask [B, H, n_qb, n_kb], out [B, H, T_q, D]."""
        t0 = time.perf_counter()
        T_q = q.shape[2]
        m = quality_metrics(q, k, v, mask, scaling, self.n_sample_rows, out=out)
        for name in QUALITY:
            for head, value in enumerate(m[f"{name}_per_head"]):  # [H]
                key = (layer, head, name)
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * T_q
        for head in range(q.shape[1]):
            self.rows[(layer, head)] = self.rows.get((layer, head), 0.0) + T_q
        self.sparse_rows[layer] = self.sparse_rows.get(layer, 0.0) + T_q
        self.seconds += time.perf_counter() - t0

    def items(self) -> list[dict[str, Any]]:
        """Rows for the ``metrics`` table: ``{layer, head, name, value}``.

        Per (layer, head): density, recall, rel_error. Per layer (``head=-1``): their mean over heads and
        ``fallback`` (fraction of the layer's rows attended densely). Overall (``layer=head=-1``): the
        row-weighted means over the sparse chunks of every layer, ``fallback`` (fraction of all layer
        rows attended densely) and ``layers_sparse`` (layers with at least one sparse chunk).
        """
        out: list[dict[str, Any]] = []
        total = {name: 0.0 for name in QUALITY}
        weight = 0.0
        for layer in sorted(set(self.sparse_rows) | set(self.dense_rows)):
            heads = sorted(h for (lay, h) in self.rows if lay == layer)
            for name in QUALITY:
                per_head = [self.sums[(layer, h, name)] / self.rows[(layer, h)] for h in heads]
                for h, value in zip(heads, per_head):
                    out.append({"layer": layer, "head": h, "name": name, "value": value})
                if per_head:
                    mean = sum(per_head) / len(heads)
                    out.append({"layer": layer, "head": -1, "name": name, "value": mean})
                    total[name] += sum(self.sums[(layer, h, name)] for h in heads) / len(heads)
            sparse, dense = self.sparse_rows.get(layer, 0.0), self.dense_rows.get(layer, 0.0)
            out.append({"layer": layer, "head": -1, "name": "fallback", "value": dense / (sparse + dense)})
            weight += sparse
        if weight > 0:
            out += [{"layer": -1, "head": -1, "name": n, "value": total[n] / weight} for n in QUALITY]
        n_dense, n_sparse = sum(self.dense_rows.values()), sum(self.sparse_rows.values())
        if n_dense + n_sparse > 0:
            out.append({"layer": -1, "head": -1, "name": "fallback", "value": n_dense / (n_dense + n_sparse)})
            out.append({"layer": -1, "head": -1, "name": "layers_sparse", "value": len(self.sparse_rows)})
        return out


_COLLECTOR: contextvars.ContextVar[PrefillMetrics | None] = contextvars.ContextVar(
    "longlab_prefill_metrics", default=None
)


@contextlib.contextmanager
def collect_prefill_metrics(metrics: PrefillMetrics | None) -> Iterator[PrefillMetrics | None]:
    """Record the quality of every sparse prefill chunk run inside the block into ``metrics``
    (``None``: record nothing)."""
    token = _COLLECTOR.set(metrics)
    try:
        yield metrics
    finally:
        _COLLECTOR.reset(token)


@dataclass
class SparsePrefill(Method):
    """Base of the sparse prefill policies: :meth:`select` a block mask for a chunk, attend on it.

    ``backend``: the executor's backend (``auto``, ``flash``, ``grouped``, ``flex``, ``gather`` or
    ``dense``; see :func:`~longlab.sparse.executor.block_sparse_attention`). Each registered policy declares
    it as its *last* field, ``backend: str = "auto"``, so recipe names keep it last
    (``ashape:n_local=128,backend=gather``); the plain class attribute here is the value for a subclass
    that does not. Subclasses implement :meth:`select`.
    """

    kind: ClassVar[str] = "prefill"
    reports_prefill_metrics: ClassVar[bool] = True  # PrefillMetrics measures its chunks
    batch_select_safe: ClassVar[bool] = True  # acts at prefill only: nothing to select at decode
    backend = "auto"  # not a field here: see above (each field declares ``choices=BACKENDS``)

    def select(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> Any:
        """q: [B, H, T_q, D], k: [B, H_kv, T_k, D] -> BlockSparseMask [B, H, n_qb, n_kb]."""
        raise NotImplementedError

    def attend(self, ctx) -> torch.Tensor:
        """ctx.q: [B, H, T_q, D]; held k, v: [B, H_kv, T, D] -> out [B, H, T_q, D]."""
        collector = _COLLECTOR.get()
        idx = ctx.key_index
        contiguous = (
            ctx.sliding_window is None
            and bool((idx >= 0).all())
            and idx.shape[-1] == ctx.n_seen
            and int(idx[0, 0, 0]) == 0
        )
        if not contiguous:
            if collector is not None:
                collector.add_dense(ctx.layer_idx, ctx.q.shape[2])
            return layer_attention(ctx, None)
        mask = self.select(ctx.q, ctx.k, ctx.scaling)  # [B, H, n_qb, n_kb]
        out = block_sparse_attention(ctx.q, ctx.k, ctx.v, mask, ctx.scaling, backend=self.backend)
        if collector is not None:
            collector.add_chunk(ctx.layer_idx, ctx.q, ctx.k, ctx.v, mask, ctx.scaling, out)
        return out  # [B, H, T_q, D]
