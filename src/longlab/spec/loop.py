"""The speculation loop: draft ``L <= gamma`` tokens, verify ``L + 1`` in one target forward, accept, roll
the cache back exactly.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023,
arXiv:2211.17192; Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling",
arXiv:2302.01318.

One step, per row ``b`` (the pending token ``x`` is the last one produced, not yet in the cache):

1. the draft proposes ``d_1 .. d_L`` (``L = lengths[b]``) with distributions ``q_i`` (a point mass for
   deterministic drafts such as prompt lookup);
2. the target runs ``[x, d_1, .., d_L]`` in one forward: next-token distributions ``p_0 .. p_L``;
3. greedy (temperature 0): accept while ``d_i = argmax p_{i-1}``; the next token is ``argmax p_a``.
   Sampling: accept ``d_i`` with probability ``min(1, p_{i-1}(d_i) / q_i(d_i))``; at the first rejection
   draw from ``norm(max(0, p_{i-1} - q_i))``; when all ``L`` are accepted draw the bonus token from
   ``p_L``. The output is distributed as the target's (the theorem of both papers);
4. the cache keeps ``x, d_1 .. d_a`` (:func:`longlab.spec.rollback.commit`): bit-identical to a cache that
   never saw the rejected tokens. Batches: rows accept different counts. Over a full-precision cache each
   row keeps its own count (the shorter rows get empty slots, as left padding does). Over a quantized
   cache rows stay aligned: every row commits the smallest count and carries its other final tokens
   into the next block ahead of its drafts (a hole would shift the storage policy's slot windows).

``p`` is the target's softmax at the run's temperature with the same top-p filter as plain sampling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..recipe import LonglabError, Recipe
from .base import Proposal, SpecContext, SpecStats, forward_tokens
from .rollback import CacheSnapshot, check_target_recipe, commit

__all__ = ["speculative_decode", "speculative_steps", "filtered_probs", "accept_greedy", "accept_sampling"]


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution ``[..., V]`` of logits at ``temperature`` (> 0) with top-p filtering (the rule
    of plain sampling in :mod:`longlab.engine.decode`)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def accept_greedy(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, L+1, V] of the verified block; tokens [B, L] drafts; lengths [B].
    Returns (accepted [B], next token [B])."""
    target = logits.argmax(-1)  # [B, L+1]
    L = tokens.shape[1]
    ok = (tokens == target[:, :L]) & (torch.arange(L)[None, :] < lengths[:, None])
    accepted = ok.long().cumprod(-1).sum(-1) if L else torch.zeros(len(tokens), dtype=torch.long)
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def accept_sampling(
    p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection rule. p [B, L+1, V] target distributions; q [B, L, V] draft distributions (None: the
    drafts were deterministic, q is a point mass at each token); tokens [B, L]; lengths [B].
    Returns (accepted [B], next token [B])."""
    B, L1, V = p.shape
    accepted = torch.zeros(B, dtype=torch.long)
    nxt = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        a = 0
        residual = None
        for i in range(int(lengths[b])):
            d = int(tokens[b, i])
            qi = q[b, i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), V).float()
            ratio = float(p[b, i, d]) / max(float(qi[d]), 1e-30)
            if float(torch.rand((), generator=gen)) < min(1.0, ratio):
                a += 1
                continue
            residual = (p[b, i] - qi).clamp(min=0)
            break
        if residual is None:
            dist = p[b, a]
        else:
            total = residual.sum()
            dist = residual / total if float(total) > 0 else p[b, a]
        accepted[b] = a
        nxt[b] = torch.multinomial(dist, 1, generator=gen)[0]
    return accepted, nxt


def _first_token(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(filtered_probs(logits, temperature, top_p), 1, generator=gen)[:, 0]


def speculative_decode(*args: Any, **kwargs: Any) -> tuple[list[list[int]], SpecStats]:
    """Run :func:`speculative_steps` to the end; returns ``(tokens per row, stats)``."""
    steps = speculative_steps(*args, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def speculative_steps(
    model: Any,
    tokenizer: Any,
    stream: Any,
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    draft: Any,
    verifier: Any,
    gamma: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[None]:
    """Decode ``max_new_tokens`` per row with speculation; the stream (``cache``, ``seen_mask``,
    ``next_pos``) is the target's after the prompt, ``logits [B, V]`` its last next-token logits,
    ``prompt_ids`` each row's prompt tokens. Greedy output equals plain greedy decoding's.

    A generator: it yields after every verification step (the engine interleaves it with other
    requests) and returns ``(tokens per row, stats)``."""
    gamma = draft.default_gamma if gamma is None else gamma
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise LonglabError(f"gamma (draft tokens per step) must be an integer >= 1, got {gamma!r}")
    cache = stream.cache
    check_target_recipe(cache.recipe)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B = stream.batch_size
    stats = SpecStats()
    x = _first_token(logits.float().cpu(), temperature, top_p, gen)  # [B]
    out = [[int(x[b])] for b in range(B)]
    done = torch.tensor([int(x[b]) in eos_ids or max_new_tokens <= 1 for b in range(B)])
    sc = SpecContext(
        model,
        tokenizer,
        stream,
        [list(p) + [int(x[b])] for b, p in enumerate(prompt_ids)],
        stats,
        temperature,
        top_p,
        gen,
        collect_lookahead=verifier.needs_lookahead,
    )
    # Rows of a quantized cache stay aligned (no empty slots between decoded tokens): the storage
    # policy's windows count slots, so a hole would change what gets quantized when.
    aligned = B > 1 and any(p.kind == "quant" for p in cache.recipe.kv)
    pend = [[int(x[b])] for b in range(B)]  # per row: tokens produced but not yet in the target's cache
    draft.start(sc)
    verifier.start(sc)
    reader = _VerifyAttention(verifier, draft.observe_queries)
    verify_recipe = Recipe(prefill=reader, decode=reader)  # type: ignore[arg-type]
    device = stream.device
    try:
        while not bool(done.all()):
            yield
            left = max(max_new_tokens - len(out[b]) for b in range(B) if not done[b])
            g = max(0, min(gamma, left - 1))
            if g:
                prop = draft.propose(sc, pend, g)
            else:
                prop = Proposal(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long))
            u = torch.tensor([len(p) for p in pend])
            lengths = torch.minimum(prop.lengths, (g + 1 - u).clamp(min=0))  # block of at most g + 1
            L = prop.tokens.shape[1]
            T_blk = int((u + lengths).max())
            block = torch.full((B, T_blk), pend[0][-1], dtype=torch.long)
            for b in range(B):
                block[b, : u[b]] = torch.tensor(pend[b])
                block[b, u[b] : u[b] + lengths[b]] = prop.tokens[b, : lengths[b]]
            snapshot = CacheSnapshot(cache)
            verifier.begin(sc, snapshot, prop)
            vlogits = forward_tokens(
                model, cache, block.to(device), stream.seen_mask, stream.next_pos, verify_recipe
            ).cpu()  # [B, T_blk, V]
            where = ((u - 1)[:, None] + torch.arange(L + 1)[None, :]).clamp(max=T_blk - 1)  # [B, L+1]
            vl = vlogits.gather(1, where[..., None].expand(-1, -1, vlogits.shape[-1]))  # p_0 .. p_L per row
            if temperature == 0:
                acc, nxt = accept_greedy(vl, prop.tokens, lengths)
            else:
                p = filtered_probs(vl, temperature, top_p)
                acc, nxt = accept_sampling(p, prop.probs, prop.tokens, lengths, gen)
            known = u + acc  # leading tokens of each row's block that are final
            keep = known.min().expand(B).clone() if aligned else known
            commit(cache, snapshot, T_blk, keep.to(device), _module_getter(model))
            m = int(keep.max())
            valid = (torch.arange(m)[None, :] < keep[:, None]).to(device)
            stream.seen_mask = torch.cat([stream.seen_mask, valid], dim=1)
            stream.next_pos = stream.next_pos + keep.to(device)
            verifier.end(sc, keep, lengths, acc)
            draft.accepted(sc, [block[b, : int(keep[b])].tolist() for b in range(B)])
            live = ~done
            stats.steps += 1
            stats.row_steps += int(live.sum())
            stats.drafted += int(lengths[live].sum())
            stats.accepted += int(acc[live].sum())
            stats.emitted += int((acc[live] + 1).sum())
            stats.accept_trace.append((int(lengths[live].sum()), int(acc[live].sum())))
            for b in range(B):
                new = block[b, int(u[b]) : int(known[b])].tolist() + [int(nxt[b])]
                pend[b] = block[b, int(keep[b]) : int(known[b])].tolist() + [int(nxt[b])]
                sc.history[b].extend(new)
                if done[b]:
                    continue
                for tok in new:
                    out[b].append(tok)
                    if tok in eos_ids or len(out[b]) >= max_new_tokens:
                        done[b] = True
                        break
    finally:
        draft.close()
    return out, stats


class _VerifyAttention:
    """The attention of a verification forward: the verifier's, after showing the draft its queries."""

    def __init__(self, verifier: Any, observe: Any) -> None:
        self.verifier, self.observe = verifier, observe

    def attend(self, ctx: Any) -> torch.Tensor:
        if self.observe is not None:
            self.observe(ctx.layer_idx, ctx.q, ctx.query_index)
        return self.verifier.attend(ctx)


def _module_getter(model: Any):
    """layer index -> that layer's attention module (storage policies may read it)."""

    def get(idx: int) -> Any:
        inner = getattr(model, "model", model)
        layers = getattr(inner, "layers", None)
        return getattr(layers[idx], "self_attn", None) if layers is not None and idx < len(layers) else None

    return get
