"""On-demand sparse-prefill quality metrics: collected by the prefill policy, stored by the runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.eval.config import EvalConfig
from longlab.eval.driver import run_eval
from longlab.eval.report import load_metrics, load_rows, prefill_table
from longlab.eval.runner import SampleRunner
from longlab.eval.store import ResultStore
from longlab.sparse.prefill import PrefillMetrics, collect_prefill_metrics

FULL_DENSITY = "ashape:bq=64,bk=64,n_sink=64,n_local=100000,backend=gather"
SPARSE = "ashape:bq=64,bk=64,n_sink=64,n_local=128,backend=gather"
QUALITY = ("density", "recall", "rel_error")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


def _ids(n: int) -> list[list[int]]:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0)).tolist()


def _overall(items: list[dict]) -> dict[str, float]:
    return {m["name"]: m["value"] for m in items if m["layer"] == -1 and m["head"] == -1}


def test_full_density_selector_is_exact(tiny_models):
    model, _ = tiny_models["tiny-llama"]
    metrics = PrefillMetrics(n_sample_rows=16)
    with torch.no_grad(), collect_prefill_metrics(metrics):
        Stream(model, LonglabCache(FULL_DENSITY), 1).feed(_ids(320), chunk_size=128)
    items = metrics.items()
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    per_head = [m for m in items if m["layer"] >= 0 and m["head"] >= 0]
    assert len(per_head) == n_layers * n_heads * len(QUALITY)
    for m in per_head:
        if m["name"] == "rel_error":
            assert m["value"] <= 1e-5
        else:
            assert m["value"] == pytest.approx(1.0, abs=1e-5), m
    overall = _overall(items)
    assert overall["density"] == pytest.approx(1.0) and overall["recall"] == pytest.approx(1.0, abs=1e-5)
    assert overall["rel_error"] <= 1e-5 and overall["fallback"] == 0.0
    assert overall["layers_sparse"] == n_layers
    assert metrics.seconds > 0


def test_no_collector_records_nothing_and_sparse_is_measured(tiny_models):
    model, _ = tiny_models["tiny-llama"]
    metrics = PrefillMetrics(n_sample_rows=16)
    with torch.no_grad():
        Stream(model, LonglabCache(SPARSE), 1).feed(_ids(512), chunk_size=512)  # outside: nothing
        assert metrics.items() == []
        with collect_prefill_metrics(metrics):
            Stream(model, LonglabCache(SPARSE), 1).feed(_ids(512), chunk_size=512)
    overall = _overall(metrics.items())
    assert 0.0 < overall["density"] < 1.0 and 0.0 < overall["recall"] <= 1.0 and overall["rel_error"] > 0


def test_sliding_window_layers_count_as_dense_fallback(tiny_models):
    model, _ = tiny_models["tiny-gemma3"]
    metrics = PrefillMetrics(n_sample_rows=8)
    with torch.no_grad(), collect_prefill_metrics(metrics):
        Stream(model, LonglabCache(SPARSE), 1).feed(_ids(256), chunk_size=256)
    items = metrics.items()
    per_layer = {m["layer"]: m["value"] for m in items if m["name"] == "fallback" and m["layer"] >= 0}
    window = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert window and all(per_layer[i] == 1.0 for i in window)
    assert all(per_layer[i] == 0.0 for i in per_layer if i not in window)
    overall = _overall(items)
    assert overall["fallback"] == pytest.approx(len(window) / model.config.num_hidden_layers)
    assert overall["layers_sparse"] == model.config.num_hidden_layers - len(window)


def test_runner_stores_metrics_for_sparse_rows_only_and_resumes(tmp_path: Path):
    recipes = ["full", SPARSE, f"{SPARSE}+snapkv@0.5", "snapkv@0.5"]
    base = dict(out=str(tmp_path), model="tiny-llama", recipes=recipes, tasks=["niah_single_1"],
                lengths=[512], samples=2, max_new_tokens=4, progress=False, prefill_metrics=True,
                metric_rows=8)
    first = run_eval(EvalConfig(**base))
    assert first.written == 2 * len(recipes)
    with ResultStore(tmp_path) as store:
        rows = store.rows()
        n_metrics = len(store.metrics())
        by_recipe: dict[str, list[list[dict]]] = {}
        for row in rows:
            by_recipe.setdefault(row["recipe"], []).append(store.metrics(run_key=row["run_key"]))
    assert all(not m for r in ("full", "snapkv@0.5") for m in by_recipe[r])
    for recipe in (SPARSE, f"{SPARSE}+snapkv@0.5"):
        for items in by_recipe[recipe]:
            assert items and all(0.0 <= m["value"] <= 1.0 for m in items if m["name"] != "layers_sparse")
            assert {"density", "recall", "rel_error", "fallback"} <= set(_overall(items))
            assert {m["head"] for m in items} >= {-1, 0}
    # the composed recipe asks its question after eviction: that chunk falls back to dense
    assert _overall(by_recipe[f"{SPARSE}+snapkv@0.5"][0])["fallback"] > 0
    assert _overall(by_recipe[SPARSE][0])["fallback"] == 0
    # resume: nothing new, no duplicated metric rows
    again = run_eval(EvalConfig(**{**base, "report": False}))
    assert (again.written, again.skipped) == (0, 2 * len(recipes))
    with ResultStore(tmp_path) as store:
        assert len(store.metrics()) == n_metrics
    md = (tmp_path / "report.md").read_text()
    assert "## Sparse prefill" in md
    table = prefill_table(load_rows(tmp_path), load_metrics(tmp_path))
    assert SPARSE.replace("|", "\\|") in table and "| full |" in table


def test_metrics_are_off_by_default(tmp_path: Path):
    run_eval(EvalConfig(out=str(tmp_path), model="tiny-llama", recipes=[SPARSE], tasks=["niah_single_1"],
                        lengths=[512], samples=1, max_new_tokens=2, progress=False, report=False))
    with ResultStore(tmp_path) as store:
        assert len(store.rows()) == 1 and store.metrics() == []


def test_two_selectors_never_share_a_prefill(tiny_models, tokenizer):
    from longlab.tasks import generate_samples

    model = tiny_models["tiny-llama"][0]
    sample = generate_samples("niah_single_1", tokenizer, 512, 1, 0)[0]
    other = "ashape:bq=64,bk=64,n_sink=64,n_local=64,backend=gather"
    recipes = ["full", SPARSE, f"{SPARSE}+snapkv@0.5", other, "snapkv@0.5"]
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, max_new_tokens=2,
                        prefill_metrics=True, metric_rows=8)
    rows = {r["recipe"]: r for r in SampleRunner(model, tokenizer, config, "t").run(sample, recipes)}
    shared = {name: r["extra"]["shared_by"] for name, r in rows.items()}
    assert shared == {"full": 2, "snapkv@0.5": 2, SPARSE: 2, f"{SPARSE}+snapkv@0.5": 2, other: 1}
    density = {name: _overall(r["metrics"])["density"] for name, r in rows.items() if "metrics" in r}
    assert set(density) == {SPARSE, f"{SPARSE}+snapkv@0.5", other}
    assert density[other] < density[SPARSE]
    assert all(r["prefill_s"] > 0 for r in rows.values())
