"""What the speculation loop and its parts share: the forward helper, the per-run context and the
registries of drafts and verifiers (``lookup``, ``self:KVRECIPE``, ``model:NAME``; ``full``, ``dustin``).

Names: a draft is ``lookup``, ``lookup:max_ngram=2,num_pred_tokens=8``, ``self:<method spec>`` (any KV
eviction or decode policy as the view, e.g. ``self:streaming:budget=256``, ``self:snapkv@0.9``,
``self:quest:budget=1024``) or ``model:<model name>``; a verifier is ``full`` or ``dustin:budget=1024,...``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, Recipe, shorten
from ..registry import REGISTRY, Registered

__all__ = [
    "SpecContext",
    "SpecStats",
    "Proposal",
    "Draft",
    "Verifier",
    "DRAFTS",
    "VERIFIERS",
    "register_draft",
    "register_verifier",
    "parse_draft",
    "parse_verifier",
    "forward_tokens",
]


@dataclass
class SpecStats:
    """Counters of one speculative run (sums over batch rows)."""

    steps: int = 0  # verification forwards of the target
    row_steps: int = 0  # verification forwards x rows still running
    drafted: int = 0  # draft tokens proposed to the target (rows still running)
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens produced by verification (accepted + one per row-step)
    draft_forwards: int = 0  # forwards of the draft (0 for lookup)
    target_kv_bytes: float = 0.0  # K/V bytes the target's attention read while verifying
    draft_kv_bytes: float = 0.0  # K/V bytes the draft's attention read (the target's cache or its own)
    refreshes: int = 0  # sparse-verification selections computed (Dustin)
    accept_trace: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens produced per target forward per row (1.0 = plain decoding)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "accept_trace"}
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_forward=self.tokens_per_forward)
        return out


@dataclass
class Proposal:
    """Draft tokens ``[B, L]`` (rows with fewer carry filler after ``lengths[b]``), ``lengths [B]``, the
    draft's sampling distributions ``probs [B, L, V]`` (None: deterministic proposals, e.g. lookup) and
    its lookahead attention over context positions ``lookahead [B, n_pos]`` (None when not collected)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    lookahead: torch.Tensor | None = None


@dataclass
class SpecContext:
    """The state the loop hands to drafts and verifiers: the target, its stream (``cache``,
    ``seen_mask [B, n_seen]``, ``next_pos [B]``), every row's tokens so far (prompt + emitted, the pending
    token included) and the run's counters."""

    model: Any
    tokenizer: Any
    stream: Any
    history: list[list[int]]
    stats: SpecStats
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    collect_lookahead: bool = False  # the verifier reads the draft's lookahead attention (Dustin)

    @property
    def cache(self) -> Any:
        return self.stream.cache


def forward_tokens(
    model: Any,
    cache: Any,
    tokens: torch.Tensor,
    seen_mask: torch.Tensor,
    next_pos: torch.Tensor,
    recipe: Recipe | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``tokens [B, T]`` through ``model`` on ``cache`` after a stream with padding mask ``seen_mask
    [B, n]`` whose rows' next positions are ``next_pos [B]``; ``valid [B, T]`` marks padding in the new
    segment (default: all real). While it runs the cache reads with ``recipe`` (its attention policies;
    None: the cache's own) and compresses nothing. Returns logits ``[B, T, V]`` (fp32)."""
    B, T = tokens.shape
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=tokens.device)
    mask = torch.cat([seen_mask, valid], dim=1)
    pos = (next_pos[:, None] + valid.long().cumsum(-1) - 1).clamp(min=0)
    saved_recipe, saved_compress = cache.recipe, cache.compressing
    if recipe is not None:
        cache.recipe = recipe
    cache.compressing = False
    try:
        out = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=0,
        )
    finally:
        cache.recipe, cache.compressing = saved_recipe, saved_compress
    return out.logits.float()


@dataclass
class Draft(Registered):
    """A proposer of draft tokens (family ``draft``). Subclasses set ``paper``; :func:`register_draft`
    sets ``name``."""

    family: ClassVar[str] = "draft"
    default_gamma: ClassVar[int] = 4

    observe_queries: ClassVar[Any] = None  # or a method (layer_idx, q, qidx): sees the verification queries
    spec_name: ClassVar[str | None] = None  # how results name it (None: from its name and fields)

    def start(self, sc: SpecContext) -> None:
        """Called once before the first step (a draft model prefills its own cache here)."""

    def propose(self, sc: SpecContext, pend: list[list[int]], gamma: int) -> Proposal:
        """Up to ``gamma`` tokens per row following ``sc.history[b]``, whose last ``len(pend[b])`` tokens
        (``pend``) are final but not yet in the target's cache."""
        raise NotImplementedError

    def accepted(self, sc: SpecContext, committed: list[list[int]]) -> None:
        """The tokens the target committed this step, per row (the pending token and the accepted drafts)."""

    def close(self) -> None:
        """Release what :meth:`start` built."""


@dataclass
class Verifier(Registered):
    """How the target reads its cache while verifying (family ``verify``). ``attend(ctx)`` is called for
    every layer of the verification forward (``ctx.q [B, H, L+1, D]``)."""

    family: ClassVar[str] = "verify"
    needs_lookahead: ClassVar[bool] = False

    def start(self, sc: SpecContext) -> None:
        pass

    def begin(self, sc: SpecContext, snapshot: Any, proposal: Proposal) -> None:
        """Before a verification forward; ``snapshot`` is the cache before it."""

    def end(self, sc: SpecContext, keep: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """After acceptance: ``keep [B]`` block tokens committed per row, ``drafted [B]`` proposed,
        ``accepted [B]`` of those accepted."""

    def attend(self, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


#: The draft and verifier families of the one registry (live views ``name -> class``).
DRAFTS = REGISTRY.view("draft")
VERIFIERS = REGISTRY.view("verify")


def register_draft(name: str):
    return REGISTRY.register(name, "draft")


def register_verifier(name: str):
    return REGISTRY.register(name, "verify")


def parse_draft(spec: str | Draft) -> Draft:
    """``"lookup"`` / ``"self:streaming:budget=256"`` / ``"model:tiny-llama"`` -> a :class:`Draft`."""
    if isinstance(spec, str) and not spec.strip() or spec is None:
        raise LonglabError(
            f"speculative must be a draft name ({', '.join(sorted(DRAFTS))}), e.g. 'lookup', "
            f"'self:streaming:budget=256' or 'model:NAME', got {shorten(spec)}"
        )
    return REGISTRY.parse("draft", spec)


def parse_verifier(spec: str | Verifier | None) -> Verifier:
    """``"full"`` (default) or ``"dustin:budget=1024,alpha=0.5"`` -> a :class:`Verifier`."""
    if spec is None:
        spec = "full"
    if isinstance(spec, str) and not spec.strip():
        raise LonglabError(f"verify must be one of {', '.join(sorted(VERIFIERS))}, got {shorten(spec)}")
    return REGISTRY.parse("verify", spec)
