"""The memory pages' generated blocks (longlab.eval.pages.memory) on hand-made stores: the verdicts follow
the paired differences (and flip when the scores are swapped), a missing store says so."""

from __future__ import annotations

from pathlib import Path

from longlab.eval.pages import GENERATORS
from longlab.eval.pages import memory as M
from longlab.eval.store import ResultStore


def _hgmem_rows(root: Path, hg: list[int], rag: list[int], full: list[int]) -> None:
    with ResultStore(root / M.HGMEM_DIR) as st:
        for system, scores in (("hgmem", hg), ("rag:k=4", rag), ("context:full", full)):
            for i, s in enumerate(scores):
                st.add(
                    {
                        "model": "m",
                        "recipe": system,
                        "method": system.split(":")[0],
                        "task": "longdoc_multihop",
                        "length": 1024,
                        "sample_id": f"q{i}",
                        "score": float(s),
                        "extra": {"wall_per_question_s": 1.0, "generated_per_question": 16},
                    }
                )


def test_hgmem_verdict_follows_the_paired_difference(tmp_path: Path) -> None:
    _hgmem_rows(tmp_path / "a", [1] * 12, [0] * 12, [0] * 12)
    blocks = M.render_hgmem(tmp_path / "a", False)
    assert "reproduces (significant)" in blocks["memory-hgmem-verdict"]
    assert "small model is the limit" in blocks["memory-hgmem-verdict"]  # the whole document: 0 of 12
    assert "| hgmem | 1.000" in blocks["memory-hgmem"] and "| 12 |" in blocks["memory-hgmem"]
    _hgmem_rows(tmp_path / "b", [0] * 12, [1] * 12, [1] * 12)
    verdict = M.render_hgmem(tmp_path / "b", False)["memory-hgmem-verdict"]
    assert "opposite holds" in verdict and "small model is the limit" not in verdict
    _hgmem_rows(tmp_path / "c", [1, 0] * 6, [0, 1] * 6, [1] * 12)
    assert "not significant: not reproduced" in M.render_hgmem(tmp_path / "c", False)["memory-hgmem-verdict"]


def test_persist_verdict_pairs_with_and_without_memories(tmp_path: Path) -> None:
    with ResultStore(tmp_path / M.PERSIST_DIR) as st:
        for i in range(20):
            for recipe, leak in (("memories", 1.0), ("no-memories", 0.0)):
                st.add(
                    {
                        "model": "m",
                        "recipe": recipe,
                        "method": "memory_safety",
                        "task": "memory_safety/leakage",
                        "sample_id": f"l{i}",
                        "score": leak,
                    }
                )
            base = {"model": "m", "method": "memory_safety", "task": "memory_safety/sycophancy"}
            st.add({**base, "recipe": "no-memories", "sample_id": f"s{i}", "score": 0.0, "margin": 1.0})
            flip = {"margin": 0.5, "delta": -0.5, "flip": 0.0}
            st.add({**base, "recipe": "memories", "sample_id": f"s{i}", "score": 0.0, **flip})
    (line,) = M.persist_verdicts(tmp_path / M.PERSIST_DIR)
    assert "+100.0 pp [+100.0, +100.0] (paired, n = 20, significant)" in line
    assert "-100.0 pp" in line and "fails not significantly more than leakage" in line  # flips 0, leaks 1
    assert "Leakage" in M.render_persist(tmp_path, False)["memory-persistbench"]


def test_persist_verdict_over_hgmem_gives_rates_and_both_paired_differences(tmp_path: Path) -> None:
    """HGMem rows (recipe hgmem-memories) pair with the raw-memory and the no-memory rows of the same
    items: the HGMem rate with its Wilson interval, HGMem − raw and HGMem − none, each with its verdict."""
    with ResultStore(tmp_path / M.PERSIST_DIR) as st:
        for i in range(20):
            leak = {
                "model": "m",
                "method": "memory_safety",
                "task": "memory_safety/leakage",
                "sample_id": f"l{i}",
            }
            st.add({**leak, "recipe": "memories", "score": float(i < 10)})
            st.add({**leak, "recipe": "no-memories", "score": 0.0})
            hg = {"hgmem": {"points": 2}, "points_with_marker": int(i < 5)}
            st.add({**leak, "recipe": "hgmem-memories", "score": float(i == 0), **hg})
            syc = {
                "model": "m",
                "method": "memory_safety",
                "task": "memory_safety/sycophancy",
                "sample_id": f"s{i}",
            }
            st.add({**syc, "recipe": "no-memories", "score": 0.0, "margin": 1.0})
            st.add({**syc, "recipe": "memories", "score": 0.0, "margin": 0.5, "delta": -0.5, "flip": 0.0})
    base, via = M.persist_verdicts(tmp_path / M.PERSIST_DIR)
    assert "+50.0 pp" in base and "significant" in base
    assert "2.0 points per item" in via and "25% of items carry the marker" in via
    assert "leak rate 5.0% [0.9, 23.6] (n = 20) through HGMem vs 50.0% [29.9, 70.1] (n = 20)" in via
    assert "HGMem − raw memories = -45.0 pp" in via and "(paired, n = 20, significant)" in via
    assert "HGMem − no memories = +5.0 pp [+0.0, +15.0] (not significant)" in via
    # the leaks split by whether the marker reached a point (items 0-4 carry it, items 0-9 leak raw)
    assert ("(leaks on the 5 items whose points carry it, 1 through HGMem vs 5 with the raw memories; "
            "on the 15 items whose points do not, 0 through HGMem vs 5 with the raw memories)") in via


def test_persist_verdict_says_which_hgmem_instructions_built_the_rows() -> None:
    """Version-1 rows (no recorded version): how many points are the former sample values (any case and
    punctuation); version-2 rows: how many echoed descriptions were dropped."""
    v1 = [
        {"extra": {"hgmem_points": ["A fact.", "rewritten fact", "Tanlorfen is a sailboat"]}},
        {"extra": {"hgmem_points": ["the merged fact"]}},
    ]
    note = M._instructions_note(v1)
    assert note.startswith("HGMem's instructions: version 1, 3 of its 4 points are one of their sample"), note
    v2 = [
        {"extra": {"hgmem_prompts": 2, "hgmem": {"instruction_copies": 2}, "hgmem_points": ["a fact"]}},
        {"extra": {"hgmem_prompts": 2, "hgmem": {"instruction_copies": 1}, "hgmem_points": []}},
    ]
    note = M._instructions_note(v2)
    assert note == "HGMem's instructions: version 2, 3 echoed descriptions or sub-queries dropped", note


def test_missing_stores_say_so_and_pages_are_registered(tmp_path: Path) -> None:
    for render in (M.render_hgmem, M.render_cdic, M.render_persist):
        assert all("No committed results" in v for v in render(tmp_path, False).values())
    pages = {g.page for g in GENERATORS}
    assert {"docs/results/memory-hgmem.md", "docs/results/memory-cdic.md"} <= pages
    assert "docs/results/memory-persistbench.md" in pages
