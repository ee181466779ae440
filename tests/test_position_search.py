"""LongRoPE's evolutionary factor search (longlab.position.search): the search space's constraints, that it
improves on its starting points, determinism, and the factors file round trip through ``longrope:factors``."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from longlab.models import build_tiny_model
from longlab.position import apply_position, use_position
from longlab.position.rope import with_rescale
from longlab.position.search import crossover, longrope_search, mutate, starting_points
from longlab.recipe import LonglabError


def _ok(lam, high):
    return all(1.0 <= v <= high + 1e-9 for v in lam) and all(a <= b for a, b in zip(lam, lam[1:]))


def test_mutation_and_crossover_stay_in_the_search_space():
    rng = random.Random(0)
    starts = starting_points(2.0, 64, 8192, 1e5)
    assert starts["pi"] == [2.0] * 32 and starts["ntk"][0] == 1.0 and starts["ntk"][-1] == 2.0
    assert starts["yarn"][:5] == [1.0] * 5 and starts["yarn"][-1] == 2.0  # fast pairs kept, slow ones / s
    for _ in range(200):
        a = mutate(starts["yarn"], rng, 0.5, 2.5)
        b = crossover(a, starts["pi"], rng, 2.5)
        assert _ok(a, 2.5) and _ok(b, 2.5)
        assert all(abs(v * 100 - round(v * 100)) < 1e-6 for v in a + b)  # the 0.01 grid


def test_search_finds_a_planted_optimum_better_than_its_starts():
    """Objective: squared distance to a monotone target none of the starts equals; the search must beat every
    start, never evaluate a candidate twice, and be deterministic for a seed."""
    target = [1.0] * 8 + [1.3, 1.5, 1.8, 2.0, 2.2, 2.4, 2.5, 2.5]
    calls = []

    def objective(lam):
        calls.append(tuple(lam))
        return sum((a - b) ** 2 for a, b in zip(lam, target))

    starts = starting_points(2.0, 32, 1024, 1e4)
    res = longrope_search(objective, starts, 2.0, population=10, parents=3, generations=8, seed=3)
    assert res.score < min(res.start_scores.values())
    assert len(calls) == len(set(calls)) == res.evaluations
    assert [h["best"] for h in res.history] == sorted((h["best"] for h in res.history), reverse=True)
    assert _ok(res.rescale, 2.5)
    again = longrope_search(objective, starts, 2.0, population=10, parents=3, generations=8, seed=3)
    assert again.rescale == res.rescale
    capped = longrope_search(objective, starts, 2.0, population=10, generations=8, budget=7)
    assert capped.evaluations == 7  # scoring stops once the budget is spent


def test_search_on_a_tiny_model_and_factors_file_round_trip(tmp_path):
    """End to end on a tiny Llama (L = 64, text of 192 tokens): the objective is the model's NLL under
    ``longrope`` with the candidate factors; the best factors written to a file and loaded back as
    ``longrope:factor=2,factors=FILE`` reproduce the reported objective exactly."""
    torch.manual_seed(0)
    ids = torch.randint(0, 250, (1, 192))
    model = build_tiny_model("tiny-llama", max_position_embeddings=64)

    def nll(method) -> float:
        with use_position(model, method), torch.no_grad():
            logits = model(ids).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()

    starts = starting_points(2.0, 16, 64, 1e4)
    res = longrope_search(lambda lam: nll(with_rescale(2.0, lam)), starts, 2.0, population=6, generations=3)
    assert res.score <= min(res.start_scores.values()) and math.isfinite(res.score)
    path = tmp_path / "factors.json"
    path.write_text(json.dumps(res.to_dict()))
    assert nll(f"longrope:factor=2,factors={path}") == res.score
    loaded = build_tiny_model("tiny-llama", max_position_embeddings=64)
    apply_position(loaded, f"longrope:factor=2,factors={path}")
    want = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16) * torch.tensor(res.rescale))
    assert torch.allclose(loaded.model.rotary_emb.inv_freq, want, rtol=1e-5)


@pytest.mark.parametrize(
    "content,words",
    [
        (None, "cannot read"),
        ("[1, 2]", "'rescale' list"),
        ('{"rescale": [1.0, 0.5]}', "every factor must be a finite number >= 1"),
        ('{"rescale": [1.0, 1.0]}', "needs D/2 = 8"),
    ],
)
def test_bad_factors_file(tmp_path, content, words):
    path = tmp_path / "f.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LonglabError, match=words):
        apply_position(build_tiny_model("tiny-llama"), f"longrope:factor=2,factors={path}")


def test_bad_search_settings():
    starts = starting_points(2.0, 16, 64, 1e4)
    with pytest.raises(LonglabError, match="parents"):
        longrope_search(lambda lam: 0.0, starts, 2.0, population=4, parents=4)
    with pytest.raises(LonglabError, match="starting point"):
        longrope_search(lambda lam: 0.0, {}, 2.0)
