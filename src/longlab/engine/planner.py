"""The prefix-sharing planner: which recipes of a sample can branch from one shared prefill.

For one prompt every context token before the *tail* is fed once, uncompressed, into a stream whose
recipe holds each observing KV policy of its group (``needs_observe``, e.g. H2O's accumulated
attention), so their state covers the shared prefix. The tail is the last prefill chunk of the prompt
as a request alone would chunk it (:func:`longlab.engine.stream.chunk_slices`; at least 64 tokens and
at least every policy's ``observation_window``), so a branch equals the request run alone.

Recipes whose observers collide (two configurations of one observing method, e.g. two H2O settings
other than the ratio) or that differ in prefill policy or tail start get separate shared prefixes.
Everything here reads only the capabilities methods declare (:class:`longlab.recipe.Method`), never
their classes or fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..attention import StandIn
from ..recipe import LonglabError, Method, Recipe
from .stream import MIN_LAST_CHUNK, chunk_slices

__all__ = ["PrefixGroup", "Observer", "batchable", "compresses_every_chunk", "observation_need", "plan",
           "replayable", "tail_start", "transforms_prefill"]


class Observer(StandIn):
    """Stands in for an observing KV policy in the shared prefix: runs its ``observe`` and records
    which per-slot state (``layer.extras`` keys) it writes, so each fork keeps only its own."""

    needs_observe = True

    def __init__(self, policy: Method) -> None:
        self.policy = policy
        self.state_keys: set[str] = set()

    def observe(self, ctx: Any) -> None:
        before = dict(ctx.layer.extras)
        self.policy.observe(ctx)  # type: ignore[attr-defined]
        self.state_keys.update(k for k, v in ctx.layer.extras.items() if before.get(k) is not v)

    def select(self, ctx: Any) -> None:
        return None  # the shared prefix keeps every entry; each branch compresses for itself

    def select_decode(self, ctx: Any) -> None:
        return None


def observer_key(policy: Method) -> str:
    """Observers that observe alike share one stand-in. Assumption (true of H2O): what a policy
    observes does not depend on its budget, so ``h2o@0.5`` and ``h2o@0.75`` share an observer."""
    fields = {f.name for f in dataclasses.fields(policy)}
    changes = {k: v for k, v in (("compression_ratio", 0.0), ("budget", None)) if k in fields}
    try:
        return repr(dataclasses.replace(policy, **changes))
    except LonglabError:  # the policy requires its budget: key on the exact configuration
        return repr(policy)


def observers(recipe: Recipe) -> dict[str, Method]:
    """observer key -> policy, for the recipe's KV policies that observe every forward."""
    return {observer_key(p): p for p in recipe.kv if p.needs_observe}


def observation_need(recipe: Recipe) -> int:
    """Tokens the compressed (last) chunk must hold: 64, and every policy's observation window."""
    return max([MIN_LAST_CHUNK, *(int(p.observation_window) for p in recipe.kv)])


def tail_start(n_ctx: int, n_q: int, chunk_size: int, query_aware: bool, need: int) -> int:
    """Context tokens before the tail: the start of ``generate``'s last prefill chunk, moved earlier
    when that chunk would hold fewer than ``need`` tokens."""
    total = n_ctx + (n_q if query_aware and n_q else 0)
    start = chunk_slices(total, chunk_size)[-1].start
    # query-agnostic: the tail needs >= 1 context token; query-aware: the question can be the tail
    last_ok = n_ctx if query_aware and n_q else n_ctx - 1
    return max(0, min(start, total - need, last_ok))


def transforms_prefill(recipe: Recipe) -> bool:
    """Whether the recipe's context part acts inside the prefill forward (``hico-forward``): the recipe
    then prefills its whole prompt itself, in one forward (no shared prefix, no replayed tail)."""
    return recipe.context is not None and recipe.context.transforms_prefill


def compresses_every_chunk(recipe: Recipe, compress: str) -> bool:
    """Whether, under ``compress`` (``"end"`` or ``"chunk"``), the recipe's KV policies cut the cache
    after every prefill chunk (``longlab eval --compress chunk``, as ``generate``'s default): the recipe
    then prefills its whole prompt itself, compressing as it goes, so no prefix is shared or replayed.
    A recipe that evicts nothing (``full``) is the same under both."""
    return compress == "chunk" and any(m.name != "full" for m in recipe.kv)


def replayable(recipe: Recipe) -> bool:
    """Whether the recipe's tail can come from the shared stream, its compression replayed on a fork:
    true unless a KV policy computes attention itself while the tail is prefilled (``reads_attention``)
    or the prefill forward itself is transformed (:func:`transforms_prefill`)."""
    return not any(p.reads_attention for p in recipe.kv) and not transforms_prefill(recipe)


def batchable(recipe: Recipe) -> bool:
    """Whether decoding ``recipe`` is plain attention over its cache (no decode policy, no storage
    policy, nothing acting at decode steps), so its branch can decode in a batch under the empty
    recipe. A recipe with a prefill policy is not: the batched question would bypass it."""
    guided = recipe.context is not None and recipe.context.guides_decoding  # it decodes itself (Guidance)
    return recipe.decode is None and recipe.prefill is None and not guided and all(
        p.kind == "kv" and not p.acts_during_decode and not p.reads_attention for p in recipe.kv
    )


@dataclass
class PrefixGroup:
    """Recipes that branch from one shared prefix: same prefill policy and tail start, and observer
    state that each member would have computed alone.

    A member's fork keeps the state keys its own observers write; that state is right only if the
    group's writers of each such key are exactly the member's (H2O and a streaming H2O both write
    H2O's accumulator: sharing it would double-count). Which keys an observer writes is learnt when
    it first runs (``known``); before that, one configuration per observing method is allowed, and
    :meth:`unsafe` finds the members a collision spoilt, to be rerun from their own prefix."""

    prefill: Method | None
    start: int
    known: dict[str, frozenset[str]]  # observer key -> state keys it writes (shared, learnt)
    observers: dict[str, Observer] = field(default_factory=dict)
    recipes: list[tuple[str, Recipe]] = field(default_factory=list)

    def _writers(self, members: list[Recipe]) -> dict[str, set[str]]:
        """state key -> observer keys (of ``members``) writing it; needs every key known."""
        out: dict[str, set[str]] = {}
        for recipe in members:
            for key in observers(recipe):
                for state in self.known[key]:
                    out.setdefault(state, set()).add(key)
        return out

    def _consistent(self, members: list[Recipe]) -> bool:
        group = self._writers(members)
        for recipe in members:
            for state, own in self._writers([recipe]).items():
                if own != group[state]:
                    return False
        return True

    def accepts(self, recipe: Recipe, start: int) -> bool:
        if repr(recipe.prefill) != repr(self.prefill) or start != self.start:
            return False
        members = [r for _, r in self.recipes] + [recipe]
        keys = {k for r in members for k in observers(r)}
        if all(k in self.known for k in keys):
            return self._consistent(members)
        held = {o.policy.name: k for k, o in self.observers.items()}  # registered name -> observer key
        return all(held.get(p.name, k) == k for k, p in observers(recipe).items())

    def add(self, name: str, recipe: Recipe) -> None:
        for key, policy in observers(recipe).items():
            self.observers.setdefault(key, Observer(policy))
        self.recipes.append((name, recipe))

    def learn(self) -> None:
        """After the shared prefill: record which state keys each observer wrote."""
        for key, obs in self.observers.items():
            self.known[key] = frozenset(obs.state_keys) | self.known.get(key, frozenset())

    def unsafe(self) -> set[str]:
        """Members whose observer state the group's other observers changed (empty for one member)."""
        if len(self.recipes) == 1:
            return set()
        group = self._writers([r for _, r in self.recipes])
        return {
            name for name, recipe in self.recipes
            if any(own != group[state] for state, own in self._writers([recipe]).items())
        }

    def owned_state(self, recipe: Recipe) -> set[str]:
        return set().union(*(self.observers[k].state_keys for k in observers(recipe)))


def plan(
    recipes: list[tuple[str, Recipe]], n_ctx: int, n_q: int, chunk_size: int, query_aware: bool,
    known: dict[str, frozenset[str]], compress: str = "end",
) -> list[PrefixGroup]:
    """Group ``(name, recipe)`` pairs by shared prefix (first fit). ``known`` (observer key -> state
    keys it writes) is shared across calls and filled in as groups run. ``compress="chunk"``: recipes
    that compress after every chunk (:func:`compresses_every_chunk`) prefill from token 0."""
    groups: list[PrefixGroup] = []
    for name, recipe in recipes:
        start = tail_start(n_ctx, n_q, chunk_size, query_aware, observation_need(recipe))
        if transforms_prefill(recipe) or compresses_every_chunk(recipe, compress):
            start = 0  # its own prefill of the whole prompt (shares no prefix)
        group = next((g for g in groups if g.accepts(recipe, start)), None)
        if group is None:
            group = PrefixGroup(recipe.prefill, start, known)
            groups.append(group)
        group.add(name, recipe)
    return groups
