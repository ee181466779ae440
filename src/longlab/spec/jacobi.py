"""Jacobi (parallel fixed-point) block decoding over a cached prefix, with a pluggable block attention.

Santilli et al. 2023, "Accelerating Transformer Inference for Translation via Parallel Decoding",
arXiv:2305.10427; Song et al. 2021 (Jacobi iteration for autoregressive decoding). A block of ``n`` tokens
``z = [x, g_1 .. g_{n-1}]`` (``x`` final, ``g`` guesses) runs in one forward against the frozen prefix
cache; the guesses become ``g_i <- argmax p(. | z_{<=i})`` and the block is run again, up to ``max_steps``
times or until nothing changes. Then the longest prefix that greedy decoding confirms is committed
(``z_{i+1} = argmax p_i``, the speculative rule with the last guesses as the draft), plus the next token.
With dense attention the output is plain greedy decoding's.

This is the setting of LoSA (:class:`longlab.decode.losa.LoSA`): the same queries are refined step by step
against the same prefix. ``attention="dense"`` (exact), ``"quest"`` (per-query Quest: LoSA with
``rho=1``) or ``"losa"``; ``budget``/``page_size``/``rho`` configure the sparse ones. With
``compare_dense`` every step also runs dense attention on the same block and records the logit L-inf
distance and the greedy-token agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention import LayerContext, layer_attention
from ..decode.losa import LoSA
from ..recipe import LonglabError, Recipe, check_choice, check_range
from .base import forward_tokens
from .rollback import CacheSnapshot, check_target_recipe, commit

__all__ = ["jacobi_decode", "JacobiStats"]


@dataclass
class JacobiStats:
    forwards: int = 0
    tokens: int = 0
    rounds: int = 0
    pages: list[float] = field(
        default_factory=list
    )  # union of prefix pages loaded per layer-step (mean over heads)
    active_fraction: list[float] = field(default_factory=list)
    logit_linf: list[float] = field(default_factory=list)  # vs dense on the same block
    token_agreement: list[float] = field(default_factory=list)  # greedy tokens equal to dense's, per step

    def as_dict(self) -> dict[str, float]:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "forwards": self.forwards,
            "tokens": self.tokens,
            "tokens_per_forward": self.tokens / self.forwards if self.forwards else 0.0,
            "pages_per_layer_step": mean(self.pages),
            "active_fraction": mean(self.active_fraction),
            "logit_linf": mean(self.logit_linf),
            "logit_linf_max": max(self.logit_linf, default=0.0),
            "token_agreement": mean(self.token_agreement),
        }


class _Dense:
    """Dense attention standing in as the block's prefill and decode policy (the reference)."""

    def attend(self, ctx: LayerContext) -> torch.Tensor:
        return layer_attention(ctx, None)

    def reset(self) -> None:
        pass

    def decode_records(self) -> list[dict[str, Any]]:
        return []


@torch.inference_mode()
def jacobi_decode(
    model: Any,
    stream: Any,
    logits: torch.Tensor,
    max_new_tokens: int,
    *,
    block: int = 16,
    max_steps: int = 8,
    attention: str = "dense",
    budget: int = 512,
    page_size: int = 16,
    rho: float = 0.25,
    compare_dense: bool = False,
) -> tuple[list[list[int]], JacobiStats]:
    """Greedy Jacobi decoding of ``max_new_tokens`` per row (batch rows in lockstep; each row commits its
    own count). ``logits [B, V]``: the stream's last next-token logits."""
    check_range("block", block, 2, integer=True)
    check_range("max_steps", max_steps, 1, integer=True)
    check_range("max_new_tokens", max_new_tokens, 1, integer=True)
    check_choice("attention", attention, ("dense", "quest", "losa"))
    cache = stream.cache
    check_target_recipe(cache.recipe)
    if any(p.kind == "quant" for p in cache.recipe.kv):
        raise LonglabError("jacobi_decode reads full-precision caches only (no quantization policy)")
    policy: Any = _Dense()
    if attention != "dense":
        policy = LoSA(budget=budget, page_size=page_size, rho=1.0 if attention == "quest" else rho)
    dense_recipe = Recipe(prefill=_Dense(), decode=_Dense())  # type: ignore[arg-type]
    recipe = Recipe(prefill=policy, decode=policy)  # type: ignore[arg-type]
    stats = JacobiStats()
    B = stream.batch_size
    x = logits.float().cpu().argmax(-1)  # [B]
    out = [[int(x[b])] for b in range(B)]
    device = stream.device
    while min(len(o) for o in out) < max_new_tokens:
        n = block
        z = x[:, None].repeat(1, n)  # [B, n] guesses start as copies of x
        policy.reset()
        snapshot = CacheSnapshot(cache)
        for step in range(max_steps):
            mark = len(policy.decode_records())
            lg = forward_tokens(model, cache, z.to(device), stream.seen_mask, stream.next_pos, recipe).cpu()
            stats.forwards += 1
            trace = policy.decode_records()[mark:]
            if trace:
                stats.pages += [t["pages"] for t in trace]
                stats.active_fraction += [t["active"] / t["queries"] for t in trace]
            if compare_dense:
                snapshot.restore()
                ref = forward_tokens(
                    model, cache, z.to(device), stream.seen_mask, stream.next_pos, dense_recipe
                ).cpu()
                stats.logit_linf.append(float((lg - ref).abs().max()))
                stats.token_agreement.append(float((lg.argmax(-1) == ref.argmax(-1)).float().mean()))
            pred = lg.argmax(-1)  # [B, n]
            new_z = torch.cat([z[:, :1], pred[:, :-1]], dim=1)
            last = step == max_steps - 1 or torch.equal(new_z, z)
            if last:
                break
            snapshot.restore()
            z = new_z
        # commit the confirmed prefix of z (the cache holds this forward's block)
        ok = (z[:, 1:] == pred[:, :-1]).long().cumprod(-1).sum(-1)  # [B] confirmed guesses
        keep = ok + 1
        commit(cache, snapshot, n, keep.to(device))
        m = int(keep.max())
        stream.seen_mask = torch.cat(
            [stream.seen_mask, (torch.arange(m)[None] < keep[:, None]).to(device)], 1
        )
        stream.next_pos = stream.next_pos + keep.to(device)
        nxt = pred.gather(1, ok[:, None])[:, 0]
        for b in range(B):
            out[b] += z[b, 1 : 1 + int(ok[b])].tolist() + [int(nxt[b])]
        stats.tokens += int((ok + 1).sum())
        stats.rounds += 1
        x = nxt
    return [o[:max_new_tokens] for o in out], stats
