"""Which pages Dustin's sparse verifier keeps and which heads it scores with, on hand-built signals
(issue 28: inverting a selection rule must fail a test).

Pinned elsewhere: prompt lookup's latest match (``test_spec_decode.py::test_lookup_proposal_by_hand``), a
self-draft's view equal to its policy's selection (``test_spec_decode.py::test_self_draft_view_is_the_policys_
selection``), head recall by hand (``test_spec_decode.py::test_head_recall_by_hand_and_head_file``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longlab.spec.dustin import Dustin, _pick

P, N_POS = 8, 64  # pages of 8 positions, 8 pages


def _signal(pages: dict[int, float], rows: int = 1) -> torch.Tensor:
    """[rows, N_POS] mass spread evenly over the positions of the given pages (a small floor elsewhere)."""
    x = torch.full((rows, N_POS), 1e-3)
    for p, mass in pages.items():
        x[:, p * P : (p + 1) * P] = mass / P
    return x


def _select(dustin: Dustin, lookahead: torch.Tensor | None, ema: torch.Tensor | None) -> torch.Tensor:
    """Run Dustin's page selection on given signals; returns the selected positions mask [B, N_POS]."""
    B = (lookahead if lookahead is not None else ema).shape[0]
    dustin._lookahead, dustin._ema, dustin._scoring, dustin._views = lookahead, ema, {}, {}
    sc = SimpleNamespace(stream=SimpleNamespace(next_pos=torch.full((B,), N_POS)),
                         stats=SimpleNamespace(refreshes=0))
    dustin._select(sc, SimpleNamespace(n_slots=[N_POS]))
    return dustin._sel


def _pages(sel: torch.Tensor) -> list[list[int]]:
    """Pages fully selected, per row."""
    per_page = sel.reshape(sel.shape[0], -1, P).all(-1)
    return [torch.nonzero(r).flatten().tolist() for r in per_page]


@pytest.mark.parametrize(
    "alpha, want",
    [(1.0, [3, 5]), (0.0, [4, 6]), (0.5, [3, 4])],
    ids=["lookahead-only", "history-only", "mixed"],
)
def test_dustin_keeps_the_top_scored_pages_plus_sink_and_recent(alpha, want):
    """Sink = page 0, recent = page 7, budget 16 = two more pages. Lookahead mass: page 3 0.6, page 5 0.3,
    page 4 0.05; history (EMA): page 4 0.5, page 6 0.4, page 3 0.05 (both ~0.99 in total with the floor).
    Score = alpha la/|la| + (1 - alpha) ema/|ema|: alpha 1 -> pages 3, 5; alpha 0 -> 4, 6; alpha 0.5 ->
    page 3 (0.33) and page 4 (0.28) over page 6 (0.20) and page 5 (0.15)."""
    dustin = Dustin(budget=2 * P, page_size=P, alpha=alpha, sink=P, recent=P)
    sel = _select(dustin, _signal({3: 0.6, 5: 0.3, 4: 0.05}), _signal({4: 0.5, 6: 0.4, 3: 0.05}))
    assert _pages(sel) == [[0, *want, 7]]
    assert int(sel[0].sum()) == 4 * P  # whole pages: nothing else is read


def test_dustin_page_choice_is_per_row():
    """Rows keep their own top pages (row 0: pages 2 and 5; row 1: pages 3 and 4)."""
    dustin = Dustin(budget=2 * P, page_size=P, alpha=1.0, sink=P, recent=P)
    la = torch.cat([_signal({2: 0.6, 5: 0.3}), _signal({3: 0.6, 4: 0.3})])
    sel = _select(dustin, la, None)
    assert _pages(sel) == [[0, 2, 5, 7], [0, 3, 4, 7]]


def test_dustin_scoring_heads_are_those_with_the_highest_recall():
    """Offline head choice: the n_heads best by selection recall, at most per_layer per layer."""
    recall = {(0, 0): 0.9, (0, 1): 0.8, (0, 2): 0.7, (1, 0): 0.1, (1, 1): 0.5, (2, 0): 0.2}
    assert _pick(recall, n_heads=3, per_layer=2) == [(0, 0), (0, 1), (1, 1)]
    assert _pick(recall, n_heads=4, per_layer=1) == [(0, 0), (1, 1), (2, 0)]  # 3 layers, one each
