"""Which Mamba heads UPI rescales (against the ERF it measures) and which candidates LongRoPE's search breeds
from (issue 28: inverting a selection rule must fail a test). ``test_position_search.py`` checks that the
search beats its starts, which a search breeding from its worst candidates also does."""

from __future__ import annotations

import torch

from longlab.position import apply_position
from longlab.position.upi import UPI, HybridConfig, HybridLM, erf_mmd


def _scaled(model: HybridLM, layers: list[int]) -> list[bool]:
    return [bool(s != 1) for i in layers for s in model.mixers[i].dt_scale]


def test_upi_rescales_the_heads_with_the_largest_effective_receptive_field():
    """15 Mamba heads, top 20%: the 3 heads with the largest MMD (brute force: the ERF of each head on the
    same seeded calibration batch, computed before scaling) get dt_scale = factor, the others stay 1."""
    torch.manual_seed(0)
    model = HybridLM(HybridConfig(layers="MAMAM", n_heads=5))
    method = UPI(factor=4.0, top=0.2, calib=4, seed=3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.max_position_embeddings), generator=g)
    mmd = torch.cat([erf_mmd(model.mixers[i], x) for i, x in sorted(model.mamba_inputs(ids).items())])
    order = mmd.argsort(descending=True).tolist()
    assert float(mmd[order[2]] - mmd[order[3]]) > 1e-4  # no near tie at the cut
    returned = method.apply_hybrid(model)
    torch.testing.assert_close(torch.cat([returned[i] for i in sorted(returned)]), mmd)
    scaled = _scaled(model, [0, 2, 4])
    assert [i for i, s in enumerate(scaled) if s] == sorted(order[:3])
    assert all(float(s) in (1.0, 4.0) for i in (0, 2, 4) for s in model.mixers[i].dt_scale)


def test_upi_top_fraction_grows_from_the_largest_erf_down():
    """Raising ``top`` adds heads in decreasing ERF order: the chosen sets are nested prefixes of the
    ranking."""
    previous: set[int] = set()
    for top in (0.1, 0.3, 0.6):
        torch.manual_seed(1)
        model = HybridLM(HybridConfig(layers="MAMAM", n_heads=5))
        method = apply_position(model, f"upi:factor=2,top={top},yarn=false")
        ranking = torch.cat([erf for _, erf in sorted(_erf(model, method).items())])
        order = ranking.argsort(descending=True).tolist()
        chosen = {i for i, s in enumerate(_scaled(model, [0, 2, 4])) if s}
        assert chosen == set(order[: len(chosen)]) and len(chosen) == max(1, round(top * 15))
        assert previous <= chosen
        previous = chosen


def _erf(model: HybridLM, method) -> dict[int, torch.Tensor]:
    """The ERF the method measured (recomputed the same way it calibrates: ``calib`` seeded sequences)."""
    g = torch.Generator().manual_seed(method.seed)
    shape = (method.calib, model.cfg.max_position_embeddings)
    ids = torch.randint(0, model.cfg.vocab_size, shape, generator=g)
    saved = {i: model.mixers[i].dt_scale.clone() for i in (0, 2, 4)}
    for i in saved:  # ERF before scaling
        model.mixers[i].dt_scale.fill_(1.0)
    try:
        return {i: erf_mmd(model.mixers[i], x) for i, x in model.mamba_inputs(ids).items()}
    finally:
        for i, s in saved.items():
            model.mixers[i].dt_scale.copy_(s)


def test_longrope_search_keeps_the_best_candidates_as_parents():
    """LongRoPE's evolutionary search is elitist: each generation keeps its ``parents`` lowest-objective
    candidates, so the best of every generation is the best of everything evaluated so far (a search that
    bred from its worst candidates still beats its starts by chance, but loses this)."""
    from longlab.position.search import longrope_search, starting_points

    target = [1.0] * 8 + [1.3, 1.5, 1.8, 2.0, 2.2, 2.4, 2.5, 2.5]
    values: list[float] = []

    def objective(lam):
        values.append(sum((a - b) ** 2 for a, b in zip(lam, target)))
        return values[-1]

    starts = starting_points(2.0, 32, 1024, 1e4)
    res = longrope_search(objective, starts, 2.0, population=10, parents=3, generations=6, seed=3)
    assert len(res.history) == 6
    for h in res.history:
        assert h["best"] == min(values[: h["evaluations"]]), h
    assert res.history[-1]["best"] < res.history[0]["best"]  # it improved on the first generation
