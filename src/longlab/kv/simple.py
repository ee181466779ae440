"""Score-free and norm-based baselines: Full, Random, Knorm, StreamingLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipe import register
from ..registry import MAX_SEED, MAX_TOKENS, param
from .base import KVPolicy, ScorerPolicy


@register("full")
@dataclass
class Full(KVPolicy):
    """Keep everything (the reference every method is compared with)."""

    paper = "—"

    def validate(self) -> None:
        super().validate()
        if self.compression_ratio or self.budget:
            from ..recipe import LonglabError

            raise LonglabError("full: takes no compression_ratio or budget (it keeps every entry)")


@register("random")
@dataclass
class RandomPolicy(ScorerPolicy):
    """Uniformly random eviction (a floor for every scorer). Score: ``u_j ~ U(0, 1)``, seeded per layer."""

    paper = "baseline"
    seed: int = param(0, low=0, high=MAX_SEED, integer=True)

    def score(self, ctx) -> torch.Tensor:
        # modulo 2^63: a seed below 2^32 gives the stream it always gave; a larger one stays a valid seed
        gen = torch.Generator(device="cpu").manual_seed(
            (self.seed * 1_000_003 + ctx.layer_idx * 7919 + ctx.n_seen) % 2**63
        )
        return torch.rand(ctx.key_index.shape, generator=gen).to(ctx.k.device)


@register("knorm")
@dataclass
class Knorm(ScorerPolicy):
    """Keep keys with the smallest L2 norm. Devoto et al. 2024, "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression", arXiv:2406.11430. Score: ``s_j = -||k_j||_2``."""

    paper = "arXiv:2406.11430"

    def score(self, ctx) -> torch.Tensor:
        return -ctx.k.float().norm(dim=-1)  # [B, H_kv, T]


@register("streaming")
@dataclass
class StreamingLLM(ScorerPolicy):
    """Attention sinks + recent window. Xiao et al. 2024, "Efficient Streaming Language Models with
    Attention Sinks", arXiv:2309.17453. Keep the first ``sink_size`` tokens and the most recent
    ``target - sink_size``; score: ``s_j = stream index of j`` (recency)."""

    paper = "arXiv:2309.17453"
    sink_size: int = param(4, low=0, high=MAX_TOKENS, integer=True)

    def score(self, ctx) -> torch.Tensor:
        return ctx.key_index.float()
