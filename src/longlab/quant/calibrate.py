"""``longlab calibrate pmkvq``: PM-KVQ's offline block-wise bit allocation and key smoothing.

PM-KVQ (ICLR 2026; official code ``thu-nics/PM-KVQ``), three offline steps on calibration text:

1. **Positional interpolation.** Short samples of ``T`` tokens are run with strided positions
   ``position_ids = arange(0, E, E // T)`` (``E`` = the long context to prepare for), so the slow RoPE
   channels already see long-context angles; used for every statistic below.
2. **Key smoothing** (optional; SmoothAttention-like). Per layer and KV head, ``m_c = max_t |K_{t,c}|``
   pooled over the RoPE pair ``(c, c + D/2)``; ``lambda = m^alpha``; keys are quantized as ``K / lambda``
   and read back times ``lambda`` (the same as ``W_k / lambda``, ``W_q * lambda``). ``alpha`` is grid-searched
   per layer over {1, 0.95, ..., 0.05} and 0 (no smoothing) to minimise the MSE of the attention block's
   output (``o_proj`` applied) with RTN-quantized 4-bit keys and values against full precision.
3. **Sensitivity and integer program.** ``s^K_l(b) = E[mean |(Q_b(K_l) - K_l) * dL/dK_l|]`` (post-RoPE keys,
   LM cross-entropy ``L``, weights frozen; the same for V) for ``b`` in {16, 8, 4, 2, 1}; then::

       min  sum_{l,b} x_{l,b} (s^K_l(b) + s^V_l(b))
       s.t. sum_b x_{l,b} = 1,   x in {0, 1},   sum_{l,b} x_{l,b} M_l(b) <= M_total

   solved with :func:`scipy.optimize.milp`. ``M_l(b)`` is the bytes a layer holds at ``T_max`` tokens with
   main at ``b`` bits as the paper counts them, code words only, exactly as the runtime budget counts
   (:meth:`QuantizedLayer.code_nbytes`, :func:`~longlab.quant.pmkvq.code_bytes`: packed main entries plus
   the full-precision sink and window; scales, offsets and the index are overheads reported apart).
   Each layer's budget is ``B_l = M_l(b*_l)``.

Deviations, for the CPU budget of this project: samples of 1024 tokens (paper: 512 x 2048 from RedPajama),
text from longlab's own essay haystack, smoothing searched on activations of the full-precision model
(not sequentially through already-quantized layers), every layer treated as global causal attention.

The allocation is written as JSON (never pickle) and loaded by the recipe ``pmkvq:allocation=PATH``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..capture import AttentionCapture, capture_attention
from ..recipe import LonglabError, check_range
from ..registry import MAX_TOKENS
from .base import resolve_fp_dtype
from .pmkvq import ALLOCATION_FORMAT, MIB, PMKVQ, code_bytes
from .quantizer import SCALE_DTYPES, dequantize_tokens, quantize_tokens

__all__ = [
    "is_allocation_file",
    "calibrate_pmkvq",
    "calibration_samples",
    "solve_allocation",
    "fake_quant",
    "SENSITIVITY_BITS",
]

SENSITIVITY_BITS = (16, 8, 4, 2, 1)
ALPHA_GRID = tuple(round(1 - 0.05 * i, 2) for i in range(20)) + (0.0,)  # 1, 0.95, ..., 0.05 and 0 (off)


# --------------------------------------------------------------------------------------------------
# pieces


def fake_quant(
    x: torch.Tensor,
    bits: int,
    group: int,
    scale_dtype: torch.dtype = torch.float16,
    lam: torch.Tensor | None = None,
) -> torch.Tensor:
    """PM-KVQ's quantizer round trip (per token, groups of ``group`` channels), optionally smoothed:
    ``lambda * dequant(quant(x / lambda))``. x: [B, H, T, D]; lam: [1, H, 1, D]."""
    y = x.float() / lam if lam is not None else x.float()
    codes, scale, offset = quantize_tokens(y, bits, group, scale_dtype)
    y_hat = dequantize_tokens(codes, scale, offset)
    return y_hat * lam if lam is not None else y_hat


def solve_allocation(cost: np.ndarray, memory: np.ndarray, total: float) -> np.ndarray:
    """Choose one option per layer minimising ``sum cost`` with ``sum memory <= total`` (a 0/1 program).

    cost, memory: [L, n_options]. Returns the chosen option per layer, ``[L]`` ints. Raises
    :class:`LonglabError` when even the smallest options do not fit."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    L, n = cost.shape
    smallest = float(memory.min(1).sum())
    if smallest > total:
        raise LonglabError(
            f"pmkvq: the budget ({total / MIB:.3f} MiB) is below the smallest allocation "
            f"({smallest / MIB:.3f} MiB with every layer at its lowest width); "
            "raise --budget-mb or lower --max-tokens"
        )
    one_per_layer = np.kron(np.eye(L), np.ones((1, n)))  # [L, L*n]
    constraints = [
        LinearConstraint(one_per_layer, 1, 1),
        LinearConstraint(memory.reshape(1, -1), -np.inf, total),
    ]
    scale = max(float(np.abs(cost).max()), 1e-30)  # a well-conditioned objective
    result = milp(
        (cost / scale).reshape(-1), constraints=constraints, integrality=np.ones(L * n), bounds=Bounds(0, 1)
    )
    if result.x is None:
        raise LonglabError(f"pmkvq: the integer program failed: {result.message}")
    return np.round(result.x).reshape(L, n).argmax(1)


def calibration_samples(
    tokenizer: Any, num_samples: int, sample_tokens: int, seed: int = 0
) -> tuple[str, list]:
    """``(source label, token-id lists)``: shuffled essay-haystack sentences, ``sample_tokens`` each."""
    from ..tasks import essay_sentences

    label, sentences = essay_sentences()
    samples = []
    for i in range(num_samples):
        rng = random.Random(seed * 1_000_003 + i)
        ids: list[int] = []
        while len(ids) < sample_tokens:
            order = list(sentences)
            rng.shuffle(order)
            ids += tokenizer(" ".join(order), add_special_tokens=False)["input_ids"]
        samples.append(ids[:sample_tokens])
    return label, samples


def _attention_block(module, q, k, v, scaling) -> torch.Tensor:
    """``o_proj(softmax(q k^T) v)``; q: [1, H, T, D], k, v: [1, H_kv, T, D] -> [1, T, hidden]."""
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
    return module.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


# --------------------------------------------------------------------------------------------------
# calibration


@torch.no_grad()
def _smoothing(
    model,
    capture: AttentionCapture,
    samples: list,
    positions: torch.Tensor,
    group: int,
    scale_dtype,
    smooth_samples: int,
    log,
) -> list[tuple[float, torch.Tensor | None]]:
    """Per layer ``(alpha, lambda [1, H_kv, 1, D] or None)``."""
    num_layers = model.config.num_hidden_layers
    kmax: list[torch.Tensor | None] = [None] * num_layers
    kept: list[list] = [[] for _ in range(num_layers)]
    for i, ids in enumerate(samples):
        capture.records.clear()
        model(input_ids=torch.tensor([ids]), position_ids=positions[None], use_cache=False, logits_to_keep=1)
        for layer, (module, q, k, v, scaling) in capture.records.items():
            m = k.abs().amax(dim=(0, 2))  # [H_kv, D]
            kmax[layer] = m if kmax[layer] is None else torch.maximum(kmax[layer], m)
            if i < smooth_samples:
                kept[layer].append((module, q, k, v, scaling))
    result = []
    for layer in range(num_layers):
        m = kmax[layer]
        D = m.shape[-1]
        pooled = torch.maximum(m[:, : D // 2], m[:, D // 2 :]).repeat(1, 2)  # RoPE pairs (c, c + D/2)
        refs = [_attention_block(module, q, k, v, scaling) for module, q, k, v, scaling in kept[layer]]
        v_hats = [fake_quant(v, 4, group, scale_dtype) for _, _, _, v, _ in kept[layer]]
        best = (float("inf"), 0.0, None)
        for alpha in ALPHA_GRID:
            lam = pooled.clamp_min(1e-5).pow(alpha)[None, :, None, :] if alpha > 0 else None
            err = 0.0
            for (module, q, k, _, scaling), ref, v_hat in zip(kept[layer], refs, v_hats):
                k_hat = fake_quant(k, 4, group, scale_dtype, lam)
                err += float((_attention_block(module, q, k_hat, v_hat, scaling) - ref).pow(2).mean())
            if err < best[0]:
                best = (err, alpha, lam)
        result.append((best[1], best[2]))
        log(f"  layer {layer:2d}: smoothing alpha={best[1]:.2f} (4-bit attention-output MSE {best[0]:.3e})")
    return result


def _sensitivities(
    model,
    capture: AttentionCapture,
    samples: list,
    positions: torch.Tensor,
    group: int,
    scale_dtype,
    lams: list,
    log,
) -> tuple[np.ndarray, np.ndarray]:
    """``s^K, s^V``: [L, len(SENSITIVITY_BITS)], averaged over samples."""
    num_layers = model.config.num_hidden_layers
    sk = np.zeros((num_layers, len(SENSITIVITY_BITS)))
    sv = np.zeros_like(sk)
    embed = model.get_input_embeddings()
    capture.keep_grad = True
    try:
        for i, ids in enumerate(samples):
            start = time.perf_counter()
            capture.records.clear()
            ids_t = torch.tensor([ids])
            with torch.enable_grad():
                x = embed(ids_t).detach().requires_grad_(True)  # the graph reaches K, V through x only
                out = model(inputs_embeds=x, position_ids=positions[None], labels=ids_t, use_cache=False)
                out.loss.backward()
            with torch.no_grad():
                for layer, (_, _, k, v, _) in capture.records.items():
                    for j, bits in enumerate(SENSITIVITY_BITS):
                        dk = fake_quant(k.detach(), bits, group, scale_dtype, lams[layer]) - k.detach()
                        dv = fake_quant(v.detach(), bits, group, scale_dtype) - v.detach()
                        sk[layer, j] += float((dk * k.grad).abs().mean()) / len(samples)
                        sv[layer, j] += float((dv * v.grad).abs().mean()) / len(samples)
            log(
                f"  sample {i + 1}/{len(samples)}: loss {float(out.loss.detach()):.3f} "
                f"({time.perf_counter() - start:.1f}s)"
            )
            del out, x
    finally:
        capture.keep_grad = False
    return sk, sv


# The CLI's names for calibrate_pmkvq's arguments (errors name what the user typed).
CLI_FLAGS = {
    "budget_mb": "--budget-mb",
    "bits_choices": "--bits",
    "max_tokens": "--max-tokens",
    "num_samples": "--samples",
    "sample_tokens": "--sample-tokens",
    "target_tokens": "--target-tokens",
    "smooth_samples": "smooth_samples",
    "sink": "--sink",
    "window": "--window",
    "group_size": "group_size",
    "scale_dtype": "scale_dtype",
    "fp_dtype": "--fp-dtype",
    "seed": "--seed",
}


def check_settings(
    *,
    budget_mb: float,
    bits_choices: Sequence[int],
    max_tokens: int,
    num_samples: int,
    sample_tokens: int,
    target_tokens: int | None,
    smooth_samples: int,
    sink: int,
    window: int,
    group_size: int,
    scale_dtype: str,
    fp_dtype: str,
    seed: int,
    flags: dict[str, str] | None = None,
) -> None:
    """Refuse, before any work, settings the calibration cannot use or that the recipe reading its file
    (``pmkvq:allocation=FILE``, whose settings must match) would refuse: the budget, sink, window, group
    size and dtypes go through :class:`~longlab.quant.pmkvq.PMKVQ`'s own ``validate()``, so both accept
    the same ranges. ``flags`` names the arguments in errors (the CLI passes :data:`CLI_FLAGS`)."""

    def label(name: str) -> str:
        return flags[name] if flags else f"pmkvq: {name}"

    sizes = (("max_tokens", max_tokens, MAX_TOKENS), ("num_samples", num_samples, 4096),
             ("sample_tokens", sample_tokens, MAX_TOKENS), ("smooth_samples", smooth_samples, 4096))
    for name, value, high in sizes:
        check_range(label(name), value, 1, high, integer=True)
    if target_tokens is not None:
        check_range(label("target_tokens"), target_tokens, 1, MAX_TOKENS, integer=True)
    check_range(label("seed"), seed, 0, 2**32 - 1, integer=True)
    if not bits_choices or any(isinstance(b, bool) or b not in (16, 8, 4, 2) for b in bits_choices):
        raise LonglabError(f"{label('bits_choices')} must be among 16, 8, 4, 2, got {list(bits_choices)}")
    recipe = {"budget_mb": budget_mb, "sink": sink, "window": window, "group_size": group_size,
              "scale_dtype": scale_dtype, "fp_dtype": fp_dtype}
    for name, value in recipe.items():  # one at a time, so the error names the argument
        try:
            PMKVQ(**{**{"budget_mb": 1.0}, name: value})
        except LonglabError as exc:
            if not flags:
                raise
            raise LonglabError(f"{label(name)}: {exc}") from None
    PMKVQ(**recipe)


def calibrate_pmkvq(
    model: Any,
    tokenizer: Any,
    budget_mb: float,
    *,
    bits_choices: Sequence[int] = (16, 8, 4, 2),
    max_tokens: int = 4096,
    num_samples: int = 4,
    sample_tokens: int = 1024,
    target_tokens: int | None = None,
    smooth: bool = True,
    smooth_samples: int = 2,
    sink: int = 1,
    window: int = 128,
    group_size: int = 128,
    scale_dtype: str = "float16",
    fp_dtype: str = "16bit",
    seed: int = 0,
    model_name: str = "",
    log=print,
) -> dict[str, Any]:
    """Run the three steps of the module docstring; return the allocation (a JSON-ready dict).

    ``budget_mb``: MiB per sequence for the whole cache at ``max_tokens`` tokens; ``target_tokens``
    (``E``) defaults to ``max_tokens``: samples of ``sample_tokens`` get positions strided by ``E // T``."""
    check_settings(
        budget_mb=budget_mb, bits_choices=bits_choices, max_tokens=max_tokens, num_samples=num_samples,
        sample_tokens=sample_tokens, target_tokens=target_tokens, smooth_samples=smooth_samples, sink=sink,
        window=window, group_size=group_size, scale_dtype=scale_dtype, fp_dtype=fp_dtype, seed=seed,
    )
    E = target_tokens or max_tokens
    stride = max(1, E // sample_tokens)
    positions = torch.arange(0, stride * sample_tokens, stride)
    config = model.config
    num_layers = config.num_hidden_layers
    H_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = min(group_size, D)
    sdtype = SCALE_DTYPES[scale_dtype]
    model_dtype = next(model.parameters()).dtype
    fp_bytes = (resolve_fp_dtype(fp_dtype, model_dtype) or model_dtype).itemsize
    start = time.perf_counter()
    label, samples = calibration_samples(tokenizer, num_samples, sample_tokens, seed)
    log(
        f"pmkvq calibration: {num_samples} samples x {sample_tokens} tokens from {label}, "
        f"positions stride {stride} (E = {stride * sample_tokens}); {num_layers} layers, {H_kv} KV heads, "
        f"head_dim {D}"
    )

    grads = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        with capture_attention(model) as capture:
            if smooth:
                log("key smoothing: grid search per layer")
                smoothing = _smoothing(model, capture, samples, positions, group, sdtype, smooth_samples, log)
            else:
                smoothing = [(0.0, None)] * num_layers
            lams = [lam for _, lam in smoothing]
            log("gradient sensitivity")
            sk, sv = _sensitivities(model, capture, samples, positions, group, sdtype, lams, log)
    finally:
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)

    choices = sorted(set(bits_choices), reverse=True)
    cols = [SENSITIVITY_BITS.index(b) for b in choices]
    cost = (sk + sv)[:, cols]
    memory = np.array(
        [
            [
                code_bytes(max_tokens, b, H_kv, D, sink=sink, window=window, fp_bytes=fp_bytes)
                for b in choices
            ]
            for layer in range(num_layers)
        ],
        dtype=np.float64,
    )
    total = budget_mb * MIB
    pick = solve_allocation(cost, memory, total)
    layers = []
    for layer in range(num_layers):
        alpha, lam = smoothing[layer]
        layers.append(
            {
                "layer": layer,
                "bits": choices[pick[layer]],
                "budget_bytes": int(memory[layer, pick[layer]]),
                "sensitivity_k": {str(b): float(sk[layer, j]) for j, b in enumerate(SENSITIVITY_BITS)},
                "sensitivity_v": {str(b): float(sv[layer, j]) for j, b in enumerate(SENSITIVITY_BITS)},
                "smooth_alpha": alpha,
                "smooth_scale": None if lam is None else lam[0, :, 0, :].tolist(),
            }
        )
    used = sum(entry["budget_bytes"] for entry in layers)
    bits_hist = {str(b): sum(1 for e in layers if e["bits"] == b) for b in choices}
    log(
        f"allocation: {bits_hist} layers per width; "
        f"{used / MIB:.3f} of {budget_mb:g} MiB at {max_tokens} tokens"
    )
    return {
        "format": ALLOCATION_FORMAT,
        "version": 1,
        "method": "pmkvq",
        "paper": "PM-KVQ, ICLR 2026 (thu-nics/PM-KVQ)",
        "model": model_name,
        "num_layers": num_layers,
        "num_kv_heads": H_kv,
        "head_dim": D,
        "budget_mb": budget_mb,
        "used_mb": used / MIB,
        "max_tokens": max_tokens,
        "bits_choices": choices,
        "settings": {
            "sink": sink,
            "window": window,
            "group_size": group_size,
            "scale_dtype": scale_dtype,
            "fp_dtype": fp_dtype,
            "fp_bytes": fp_bytes,
        },
        "calibration": {
            "text": label,
            "samples": num_samples,
            "sample_tokens": sample_tokens,
            "position_stride": stride,
            "target_tokens": stride * sample_tokens,
            "seed": seed,
            "smooth": smooth,
            "smooth_samples": smooth_samples,
            "seconds": round(time.perf_counter() - start, 1),
        },
        "layers": layers,
    }


def is_allocation_file(path: Path) -> bool:
    """An allocation file ``longlab calibrate`` wrote (the only kind of file ``--out`` may replace)."""
    from ..safeio import json_format_is

    return json_format_is(path, ALLOCATION_FORMAT)
