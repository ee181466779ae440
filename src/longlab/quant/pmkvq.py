"""PM-KVQ: progressive mixed-precision KV-cache quantization for long chain-of-thought decoding.

PM-KVQ (ICLR 2026; official code ``thu-nics/PM-KVQ``). Per transformer block ``l`` a memory budget
``B_l``. The cache has three regions: **sink** (the first ``n_s = 1`` entry) and **window** (up to
``n_w = 128`` most recent entries) at 16 bits (``fp_dtype="16bit"``: float16 for an fp32 model, the
model's dtype for a 16-bit one; ``"model"`` keeps them at the model's precision) and **main**,
per-token asymmetric integers in groups of 128 channels (capped at ``head_dim``) at the block's
current width ``b_l``, which starts at 16.

After every append (each prefill chunk while compressing, each decode step):

1. when the window holds ``n_w`` entries or more, the oldest whole multiples of ``n_w`` are quantized
   at 16 bits, lowered to ``b_l`` with the equivalent right shift and appended to main;
2. if the layer's code words then exceed ``B_l``, main is re-quantized once, ``b -> b / 2``
   (16 -> 8 -> 4 -> 2), with the integer-only equivalent right shift
   ``q' = ((q (2^(2b') - 2^b' + 1) + 2^(3b'-1) - 2^(2b'-1) + 2^(b'-1)) >> 3b') & (2^b' - 1)``,
   ``s' = s (2^b' + 1)``, offset unchanged (:func:`~longlab.quant.quantizer.equivalent_right_shift`).
   Over budget at 2 bits, the policy raises (the code raises ``MemoryError`` there too).

What the budget counts is what the official cache counts (``ProgressiveQuantizedCache``: ``numel`` of the
code tensors of main, sink and window, times 2 bytes): the **code words** of K and V, i.e. the packed
main codes at ``b_l`` bits plus the sink and window entries at their 16 bits (their storage size here:
``fp_dtype="model"`` on an fp32 model stores 32 bits), compared with ``B_l * batch``
(:meth:`QuantizedLayer.code_nbytes`, :func:`code_bytes`). The **overheads** are not in the budget and
are reported separately (:meth:`QuantizedLayer.overhead_nbytes`, :func:`memory_report`): scales and
offsets (``scale_dtype``; the code stores them as bf16, ``scale_dtype=bfloat16``; default float16), the
int32 position index, the smoothing vector and any other method state. ``nbytes()`` stays the honest
total of both. As in the code, a layer shrinks at most once per update, so after a long prefill chunk
its code words can exceed ``B_l`` for a few updates until successive halvings bring them under.

Budgets: ``budget_mb`` (MiB per sequence for the whole cache, split evenly over the layers) or
``allocation``, a JSON file written by ``longlab calibrate pmkvq`` (block-wise budgets from gradient
sensitivity and an integer program, plus optional key-smoothing factors); see
:mod:`longlab.quant.calibrate`. **Key smoothing**: with factors ``lambda [H_kv, D]`` the cache quantizes
``k / lambda`` and reads back ``lambda * dequant(q)``: the same as the paper's reparameterisation
``W_k / lambda``, ``W_q * lambda`` (``q . k`` unchanged) without touching the weights.
"""

from __future__ import annotations

import json
import math
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, register, shorten
from ..registry import MAX_BLOCK, MAX_TOKENS, param
from .base import FP_DTYPES, QuantPolicy
from .storage import QuantizedLayer, TokenGroupStore

__all__ = ["PMKVQ", "ALLOCATION_FORMAT", "layer_bytes", "code_bytes", "memory_report", "load_allocation"]

ALLOCATION_FORMAT = "longlab.pmkvq.allocation"
MIB = 2**20


def layer_bytes(
    tokens: int,
    bits: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    sink: int = 1,
    window: int = 128,
    group_size: int = 128,
    fp_bytes: int = 2,
    scale_bytes: int = 2,
    smooth: bool = False,
    window_tokens: int | None = None,
) -> int:
    """Bytes one PM-KVQ layer holds for one sequence of ``tokens`` entries with main at ``bits``.

    ``window_tokens`` defaults to the worst case after a flush, ``min(window - 1, tokens - sink)``.
    Matches :meth:`QuantizedLayer.nbytes` exactly (tested)."""
    H, D = num_kv_heads, head_dim
    main = tokens - _full_precision_tokens(tokens, sink, window, window_tokens)
    codes = code_bytes(
        tokens, bits, H, D, sink=sink, window=window, fp_bytes=fp_bytes, window_tokens=window_tokens
    )
    scales_offsets = main * 2 * H * 2 * (D // min(group_size, D)) * scale_bytes  # K and V, per group
    return codes + scales_offsets + tokens * H * 4 + (H * D * 4 if smooth else 0)  # + index, smoothing


def _full_precision_tokens(tokens: int, sink: int, window: int, window_tokens: int | None) -> int:
    """Entries held at full precision: the sink plus the recent window (worst case after a flush,
    ``min(window - 1, tokens - sink)``, unless ``window_tokens`` is given)."""
    s = min(sink, tokens)
    return s + (min(window - 1, tokens - s) if window_tokens is None else window_tokens)


def code_bytes(
    tokens: int,
    bits: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    sink: int = 1,
    window: int = 128,
    fp_bytes: int = 2,
    window_tokens: int | None = None,
) -> int:
    """The part of :func:`layer_bytes` PM-KVQ's budget counts: K and V code words only (main packed at
    ``bits``, sink and window at ``fp_bytes`` each). Matches :meth:`QuantizedLayer.code_nbytes` (tested)."""
    held_fp = _full_precision_tokens(tokens, sink, window, window_tokens)
    per_token = head_dim * bits // 8  # one head's packed code words for one entry
    return 2 * num_kv_heads * (held_fp * head_dim * fp_bytes + (tokens - held_fp) * per_token)


def memory_report(cache) -> list[dict[str, int]]:
    """Per quantized layer of ``cache``: ``bits`` (main width), ``code_bytes`` (what a PM-KVQ budget
    counts), ``overhead_bytes`` (scales, offsets, index, smoothing, method state) and ``total_bytes``
    (``nbytes()``). Layers that are not quantized are listed with ``bits=None``."""
    out = []
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        total = layer.nbytes()
        if isinstance(layer, QuantizedLayer):
            codes = layer.code_nbytes()
            out.append({"bits": layer.key_store.bits, "code_bytes": codes, "overhead_bytes": total - codes,
                        "total_bytes": total})
        else:
            out.append({"bits": None, "code_bytes": total, "overhead_bytes": 0, "total_bytes": total})
    return out


ALLOCATION_BYTES = 64 * MIB  # an allocation is a few KB per layer; a larger file is not one
_SETTING_RANGES = {"sink": 0, "window": 1, "group_size": 1}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _positive(value: Any) -> bool:
    """A positive finite number below 2^62 (a JSON integer of 1,000 digits is not a budget)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (not isinstance(value, float) or math.isfinite(value)) and 0 < value < 2**62


def load_allocation(path: str | Path) -> dict[str, Any]:
    """Read and check an allocation file (strict JSON, never pickle) before it is used: a regular file
    of at most 64 MiB; ``format`` :data:`ALLOCATION_FORMAT`; one entry per layer (``num_layers`` of them
    when the file says) with a positive finite ``budget_bytes``, ``bits`` (when given) one of 16/8/4/2 and
    ``smooth_scale`` null or a ``[num_kv_heads][head_dim]`` table of positive finite factors; ``settings``
    of the right types. Anything else is a :class:`LonglabError` naming the file and the entry."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise LonglabError(f"pmkvq: allocation file not found: {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise LonglabError(f"pmkvq: allocation {path} is not a regular file")
    if st.st_size > ALLOCATION_BYTES:
        raise LonglabError(f"pmkvq: allocation {path} is {st.st_size:,} bytes (over 64 MiB): not one")
    try:
        data = json.loads(p.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except OSError as exc:
        raise LonglabError(f"pmkvq: cannot read allocation file {path} ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # JSON syntax, NaN/Infinity, bad UTF-8, deep nesting
        raise LonglabError(f"pmkvq: allocation file {path} is not JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict) or data.get("format") != ALLOCATION_FORMAT:
        raise LonglabError(f"pmkvq: {path} is not a PM-KVQ allocation (format {ALLOCATION_FORMAT!r})")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise LonglabError(f"pmkvq: {path} has no layers")
    n = data.get("num_layers")
    if n is not None and n != len(layers):
        raise LonglabError(f"pmkvq: {path} says num_layers={shorten(n)} but lists {len(layers)} layers")
    dims = [data.get(k) for k in ("num_kv_heads", "head_dim")]
    dims_known = all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
    for i, entry in enumerate(layers):
        budget = entry.get("budget_bytes") if isinstance(entry, dict) else None
        if not _positive(budget):
            raise LonglabError(
                f"pmkvq: {path} layer {i}: budget_bytes must be a positive number, got {shorten(budget)}"
            )
        if entry.get("bits") is not None and entry["bits"] not in (16, 8, 4, 2):
            raise LonglabError(
                f"pmkvq: {path} layer {i}: bits must be 16, 8, 4 or 2, got {shorten(entry['bits'])}"
            )
        lam = entry.get("smooth_scale")
        if lam is None:
            continue
        rows_ok = isinstance(lam, list) and lam and all(isinstance(r, list) and r for r in lam)
        if not rows_ok or len({len(r) for r in lam}) != 1 or not all(_positive(x) for r in lam for x in r):
            raise LonglabError(
                f"pmkvq: {path} layer {i}: smooth_scale must be null or a table [KV heads][head_dim] of "
                "positive finite factors"
            )
        if dims_known and [len(lam), len(lam[0])] != dims:
            raise LonglabError(
                f"pmkvq: {path} layer {i}: smooth_scale is [{len(lam)}][{len(lam[0])}], the file's model has "
                f"[{dims[0]}][{dims[1]}] (num_kv_heads, head_dim)"
            )
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise LonglabError(f"pmkvq: {path}: settings must be an object")
    for key, low in _SETTING_RANGES.items():
        value = settings.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LonglabError(
                f"pmkvq: {path}: settings.{key} must be an integer >= {low}, got {shorten(value)}"
            )
    for key in ("scale_dtype", "fp_dtype"):
        if not isinstance(settings.get(key, ""), str):
            raise LonglabError(f"pmkvq: {path}: settings.{key} must be a string")
    return data


@register("pmkvq")
@dataclass
class PMKVQ(QuantPolicy):
    """PM-KVQ (ICLR 2026): per-block budgets, progressive 16 -> 8 -> 4 -> 2 bits, 16-bit sink and window.

    Set ``budget_mb`` (MiB of K/V code words per sequence, whole cache, split evenly over layers; scales,
    offsets and the index are overheads outside it) or ``allocation`` (path of a ``longlab calibrate
    pmkvq`` JSON file). ``smooth`` applies the file's key-smoothing factors; ``scale_dtype=bfloat16``
    stores scales and offsets as the official code does."""

    paper: ClassVar[str] = "PM-KVQ, ICLR 2026 (thu-nics/PM-KVQ)"

    # MiB per sequence (whole cache): a budget beyond 1 TiB (2^20 MiB) is no budget
    budget_mb: float | None = param(None, low=0, high=2**20, low_open=True)
    allocation: str | None = None
    sink: int = param(1, low=0, high=MAX_TOKENS, integer=True)
    window: int = param(128, low=1, high=MAX_TOKENS, integer=True)
    group_size: int = param(128, low=1, high=MAX_BLOCK, integer=True)  # channels (capped at head_dim)
    init_bits: int = param(16, choices=(16, 8, 4, 2))
    smooth: bool = param(True, choices=(True, False))
    fp_dtype: str = param("16bit", choices=tuple(FP_DTYPES))
    chunk_tokens: int = param(4096, low=16, high=MAX_TOKENS, integer=True)
    _alloc: dict | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if (self.budget_mb is None) == (self.allocation is None):
            raise LonglabError(
                "pmkvq: set exactly one of budget_mb (MiB per sequence) or allocation (a JSON file)"
            )
        if self.allocation is not None:
            self._alloc = load_allocation(self.allocation)
            settings = self._alloc.get("settings") or {}
            differ = [
                f"{key}={settings[key]}"
                for key in ("sink", "window", "group_size", "scale_dtype", "fp_dtype")
                if key in settings and settings[key] != getattr(self, key)
            ]
            if differ:
                raise LonglabError(
                    f"pmkvq: {self.allocation} was calibrated with {', '.join(differ)}; "
                    "add them to the recipe (its budgets assume those settings)"
                )

    # --- budgets ---------------------------------------------------------------------------------
    def _entry(self, ctx) -> dict | None:
        if self._alloc is None:
            return None
        layers = self._alloc["layers"]
        if len(layers) != ctx.num_layers:
            raise LonglabError(
                f"pmkvq: allocation {self.allocation} has {len(layers)} layers, "
                f"the model has {ctx.num_layers}"
            )
        return layers[ctx.layer_idx]

    def layer_budget(self, ctx) -> float:
        """``B_l`` in bytes for one sequence."""
        entry = self._entry(ctx)
        if entry is not None:
            return float(entry["budget_bytes"])
        return self.budget_mb * MIB / ctx.num_layers

    def _smoothing(self, ctx, H_kv: int, D: int) -> torch.Tensor | None:
        entry = self._entry(ctx)
        if not self.smooth or entry is None or entry.get("smooth_scale") is None:
            return None
        lam = torch.tensor(entry["smooth_scale"], dtype=torch.float32, device=ctx.layer.index.device)
        if lam.shape != (H_kv, D) or not bool((lam > 0).all()):
            raise LonglabError(f"pmkvq: smooth_scale of layer {ctx.layer_idx} must be positive [{H_kv}, {D}]")
        return lam[None, :, None, :]  # [1, H_kv, 1, D]

    # --- policy ----------------------------------------------------------------------------------
    def make_layer(self, ctx) -> QuantizedLayer | None:
        if ctx.layer.index.shape[-1] <= self.sink:
            return None
        _, H_kv, _, D = ctx.layer.keys.shape
        group = self.token_group(ctx, self.group_size)
        keys = TokenGroupStore(self.init_bits, group, self.scale_dtype, 16, self._smoothing(ctx, H_kv, D))
        values = TokenGroupStore(self.init_bits, group, self.scale_dtype, 16)
        return self.layer_from(ctx, keys, values)

    def step(self, ctx, layer: QuantizedLayer) -> bool:
        W = self.window
        n_flush = layer.keys.shape[-2] // W * W  # whole windows move into main (16 bits, then shifted)
        layer.quantize_keys(n_flush)
        layer.quantize_values(n_flush)
        budget = self.layer_budget(ctx) * layer.index.shape[0]
        used = layer.code_nbytes()  # code words only, as the official cache counts (overheads apart)
        if used <= budget:
            return bool(n_flush)
        if layer.key_store.bits <= 2:
            raise LonglabError(
                f"pmkvq: layer {ctx.layer_idx} needs {used} B of code words for "
                f"{int(layer.lengths().max())} entries at 2 bits, over its budget of {int(budget)} B; "
                "raise budget_mb (or shorten the context)"
            )
        layer.key_store.shrink()  # once per update, as the official cache does
        layer.value_store.shrink()
        return True
