"""HiCo's video-level hierarchical token dropping, as a KV policy: ``hico-drop@r``.

VideoChat-Flash (Li et al., arXiv 2501.00574, ICLR 2026) drops visual tokens inside the LLM at layers
[8, 16, 24] with cumulative keep ratios [1, 0.5, 0.25, 0.125], scored by that layer's attention (with RoPE,
averaged over heads) from the last prompt token, keeping the top tokens in their order. Here, on the KV
cache: ``stages`` layer fractions (default 1/3 and 2/3 of the depth: layers 10 and 20 of SmolLM2's 30)
split the layers into ``S + 1`` stages; stage ``s`` keeps ``(1 - r)^(s / S)`` of the context tokens, so the
last stage keeps ``1 - r``. At the first layer of a stage the last query of the compressed chunk (the last
prompt token) scores every held token (head-averaged attention); the best tokens *among those the previous
stage kept* stay, the same tokens for every head and for every later layer of the stage (cumulative:
a dropped token never comes back). The layers before the first boundary keep everything, so the cache is
larger than a uniform ``1 - r`` (``kv_bytes_after`` says by how much).

Difference from the paper: the kept tokens' own hidden states at later layers were computed while the
dropped ones were still visible (the prefill ran before the cache was compressed); in HiCo they are not.
What the question and the answer see — the KV entries left — is the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..kv.base import KVPolicy, group_mean
from ..recipe import LonglabError, register

if TYPE_CHECKING:
    from ..attention import LayerContext

__all__ = ["HiCoDrop", "stage_of"]

_KEY = "hico_drop_keep"  # layer.state of a stage's first layer: [B, n_seen] bool, kept by position


def stage_of(layer_idx: int, num_layers: int, stages: tuple[float, ...]) -> tuple[int, int]:
    """(stage index, first layer of that stage) of ``layer_idx``; stage 0 = before every boundary."""
    bounds = [round(f * num_layers) for f in stages]
    s = sum(1 for b in bounds if layer_idx >= b)
    return s, (bounds[s - 1] if s else 0)


@register("hico-drop")
@dataclass
class HiCoDrop(KVPolicy):
    """HiCo hierarchical token dropping on the KV cache (Li et al., "VideoChat-Flash", arXiv 2501.00574):
    see the module docstring."""

    paper: ClassVar[str] = "VideoChat-Flash (HiCo video level), Li et al., arXiv 2501.00574, ICLR 2026"

    stages: tuple[float, ...] = (1 / 3, 2 / 3)

    def validate(self) -> None:
        super().validate()
        fracs = list(self.stages)
        if not fracs or any(not 0 < f < 1 for f in fracs) or fracs != sorted(set(fracs)):
            raise LonglabError(f"hico-drop: stages must be increasing layer fractions in (0, 1), got {fracs}")

    def select(self, ctx: LayerContext) -> torch.Tensor | None:
        s, first = stage_of(ctx.layer_idx, ctx.num_layers, tuple(self.stages))
        if s == 0 or self.compression_ratio == 0:
            return None
        idx = ctx.key_index  # [B, H_kv, T] positions (-1 empty)
        valid = ctx.layer.valid  # [B, H_kv, T]
        B = idx.shape[0]
        n_pos = int(idx.max()) + 1
        if ctx.layer_idx == first:
            probs = ctx.attention_probs(slice(-1, None))[:, :, 0]  # [B, H, T], the last prompt token
            score = group_mean(probs, ctx.groups).mean(1)  # [B, T], heads averaged
            pos = idx[:, 0]  # [B, T] (every head holds the same positions before this policy drops)
            prev = None  # the previous stage's kept positions (cumulative dropping)
            if s > 1:
                before = stage_of(first - 1, ctx.num_layers, tuple(self.stages))[1]
                prev = ctx.cache.layers[before].state.get(_KEY)
            keep_pos = torch.zeros(B, n_pos, dtype=torch.bool, device=idx.device)
            frac = (1 - self.compression_ratio) ** (s / len(self.stages))
            for b in range(B):
                ok = (pos[b] >= 0) & valid[b, 0]
                if prev is not None:
                    ok &= prev[b][pos[b].clamp(min=0)]
                n = int(((pos[b] >= 0) & valid[b, 0]).sum())
                k = max(1, math.ceil(frac * n - 1e-9))
                sc = score[b].masked_fill(~ok, float("-inf"))
                top = sc.topk(min(k, int(ok.sum()))).indices
                keep_pos[b, pos[b][top]] = True
            ctx.layer.state[_KEY] = keep_pos
        else:
            keep_pos = ctx.cache.layers[first].state[_KEY]
        keep = keep_pos.gather(1, idx.clamp(min=0).reshape(B, -1)).reshape(idx.shape)  # [B, H_kv, T]
        return keep & valid & (idx >= 0)
