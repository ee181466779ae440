"""LongRoPE's evolutionary search over per-pair rescale factors (Ding et al. 2024, arXiv 2402.13753, §3.2
and Algorithm 1), at a scale this project can afford.

A candidate is ``λ = (λ_0, ..., λ_{D/2-1})`` with ``θ'_i = θ_i/λ_i``. Search space (the paper's): each
``λ_i`` on a 0.01 grid in ``[1, high]`` (``high = 1.25·s`` by default) with the monotone constraint
``λ_i <= λ_{i+1}`` (slower pairs are interpolated at least as much as faster ones). The population starts
from PI (``λ_i = s``), NTK-aware (``λ_i = s^{2i/(D-2)}``) and YaRN (``λ_i = θ_i/θ'_i``, the paper's ramp)
and mutations of them; each generation keeps the ``parents`` best (lowest objective, e.g. perplexity at
the target length), and refills the population with mutations (each ``λ_i`` with probability ``p``
redrawn uniformly between its neighbours, which keeps the order) and single-point crossovers of two
parents (projected back onto the monotone set by a running maximum). Not implemented: the paper's second
search dimension ``n̂`` (initial positions left unscaled) and its progressive (256k → 2048k) schedule.

``longrope_search(objective, starts, factor)`` is model-agnostic: ``objective(λ) -> float``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..recipe import LonglabError, check_range
from .rope import check_rescale, yarn_paper_inv_freq

__all__ = ["SearchResult", "starting_points", "longrope_search", "mutate", "crossover"]

GRID = 0.01


def _snap(x: float, high: float) -> float:
    return min(high, max(1.0, round(x / GRID) * GRID))


def _monotone(lam: list[float], high: float) -> list[float]:
    out, run = [], 1.0
    for v in lam:
        run = max(run, _snap(v, high))
        out.append(round(run, 2))
    return out


def starting_points(factor: float, head_dim: int, original: int, base: float) -> dict[str, list[float]]:
    """PI, NTK-aware and YaRN (paper ramp, α = 1, β = 32) as per-pair factors ``[D/2]``, on the grid."""
    half = head_dim // 2
    high = max(1.25 * factor, 1.0)
    theta = [base ** (-2 * i / head_dim) for i in range(half)]
    yarn = yarn_paper_inv_freq(base, head_dim, factor, original, 1.0, 32.0).tolist()
    raw = {
        "pi": [factor] * half,
        "ntk": [factor ** (2 * i / (head_dim - 2)) for i in range(half)],
        "yarn": [t / y for t, y in zip(theta, yarn)],
    }
    return {k: _monotone(v, high) for k, v in raw.items()}


def mutate(lam: list[float], rng: random.Random, p: float, high: float) -> list[float]:
    """Each ``λ_i`` with probability ``p``: a uniform draw between its neighbours (order kept), on grid."""
    out = list(lam)
    for i in range(len(out)):
        if rng.random() < p:
            lo = out[i - 1] if i > 0 else 1.0
            hi = out[i + 1] if i + 1 < len(out) else high
            out[i] = _snap(rng.uniform(lo, hi), high)
    return _monotone(out, high)


def crossover(a: list[float], b: list[float], rng: random.Random, high: float) -> list[float]:
    """``a`` up to a random cut, ``b`` after it, projected onto ``λ_i <= λ_{i+1}`` (running maximum)."""
    cut = rng.randrange(1, len(a)) if len(a) > 1 else 0
    return _monotone(a[:cut] + b[cut:], high)


@dataclass
class SearchResult:
    rescale: list[float]  # the best λ found [D/2]
    score: float  # its objective
    start_scores: dict[str, float]  # the objective of each starting point
    evaluations: int
    history: list[dict[str, Any]] = field(default_factory=list)  # per generation: best, evaluated so far
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def longrope_search(
    objective: Callable[[list[float]], float],
    starts: dict[str, list[float]],
    factor: float,
    *,
    population: int = 8,
    parents: int = 3,
    generations: int = 3,
    mutate_p: float = 0.3,
    high: float | None = None,
    seed: int = 0,
    budget: int | None = None,
    log: Callable[[str], None] | None = None,
) -> SearchResult:
    """Minimise ``objective(λ)`` over monotone ``λ`` (module docstring); ``budget`` caps evaluations.
    Deterministic for a given ``seed`` and objective."""
    check_range("longrope search: factor", factor, 1, None)
    check_range("longrope search: population", population, 2, None, integer=True)
    check_range("longrope search: parents", parents, 1, population - 1, integer=True)
    check_range("longrope search: generations", generations, 1, None, integer=True)
    check_range("longrope search: mutate_p", mutate_p, 0, 1, low_open=True)
    if not starts:
        raise LonglabError("longrope search: give at least one starting point")
    high = float(high if high is not None else 1.25 * factor)
    check_range("longrope search: high", high, 1, None)
    sizes = {len(v) for v in starts.values()}
    if len(sizes) != 1:
        raise LonglabError(f"longrope search: starting points differ in length: {sorted(sizes)}")
    rng = random.Random(seed)
    scores: dict[tuple[float, ...], float] = {}

    def score(lam: list[float]) -> float:
        key = tuple(lam)
        if key not in scores:
            value = float(objective(list(lam)))
            scores[key] = value if math.isfinite(value) else math.inf
        return scores[key]

    def out_of_budget() -> bool:
        return budget is not None and len(scores) >= budget

    start_scores = {}
    for name, lam in starts.items():
        lam = _monotone(check_rescale(f"longrope search: start {name}", lam), high)
        start_scores[name] = score(lam)
        if log:
            log(f"start {name}: {start_scores[name]:.4f}")
    pop = [_monotone(v, high) for v in starts.values()]
    while len(pop) < population:
        pop.append(mutate(rng.choice(pop[: len(starts)]), rng, mutate_p, high))
    history = []
    for gen in range(generations):
        for lam in pop:
            if out_of_budget() and tuple(lam) not in scores:
                continue
            score(lam)
        ranked = sorted({tuple(lam) for lam in pop if tuple(lam) in scores}, key=lambda k: scores[k])
        history.append({"generation": gen, "best": scores[ranked[0]], "evaluations": len(scores)})
        if log:
            log(f"generation {gen}: best {scores[ranked[0]]:.4f} after {len(scores)} evaluations")
        if gen == generations - 1 or out_of_budget():
            break
        keep = [list(k) for k in ranked[:parents]]
        children: list[list[float]] = []
        tries = 0
        while len(keep) + len(children) < population and tries < 50 * population:
            tries += 1
            if len(keep) > 1 and len(children) % 2:
                a, b = rng.sample(keep, 2)
                child = crossover(a, b, rng, high)
            else:
                child = mutate(rng.choice(keep), rng, mutate_p, high)
            if tuple(child) not in scores and child not in children:
                children.append(child)
        pop = keep + children
    best_key = min(scores, key=scores.get)
    return SearchResult(
        rescale=list(best_key),
        score=scores[best_key],
        start_scores=start_scores,
        evaluations=len(scores),
        history=history,
        settings={
            "factor": factor,
            "population": population,
            "parents": parents,
            "generations": generations,
            "mutate_p": mutate_p,
            "high": high,
            "seed": seed,
            "budget": budget,
        },
    )
