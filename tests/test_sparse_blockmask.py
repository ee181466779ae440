"""Block-mask geometry: required blocks, causal clearing, density."""

from __future__ import annotations

import pytest
import torch

from longlab.sparse.blockmask import (
    BlockSparseMask,
    causal_allowed,
    density,
    density_per_head,
    diagonal_blocks,
    enforce_required,
    full_mask,
)

GEOMS = [(256, 256, 64, 64), (200, 256, 64, 32), (100, 300, 32, 64), (256, 1000, 128, 128), (1, 77, 16, 16)]


def _ids(g: tuple[int, int, int, int]) -> str:
    return "Tq{}-Tk{}-bq{}-bk{}".format(*g)


def _brute_allowed(q_len: int, k_len: int, bq: int, bk: int) -> torch.Tensor:
    n_qb, n_kb = -(-q_len // bq), -(-k_len // bk)
    out = torch.zeros(n_qb, n_kb, dtype=torch.bool)
    diag = torch.zeros_like(out)
    for r in range(q_len):
        p = k_len - q_len + r
        out[r // bq, : p // bk + 1] = True
        diag[r // bq, p // bk] = True
    return out, diag


@pytest.mark.parametrize("geom", GEOMS, ids=_ids)
def test_geometry_matches_brute_force(geom):
    allowed, own = _brute_allowed(*geom)
    assert torch.equal(causal_allowed(*geom), allowed)
    diag = diagonal_blocks(*geom)
    assert torch.equal(diag & own, own)  # every row's own key block is a diagonal block
    assert not (diag & ~allowed).any()


@pytest.mark.parametrize("geom", GEOMS, ids=_ids)
def test_enforce_required_adds_sink_diagonal_and_clears_future(geom):
    q_len, k_len, bq, bk = geom
    n_qb, n_kb = -(-q_len // bq), -(-k_len // bk)
    empty = BlockSparseMask(torch.zeros(2, 3, n_qb, n_kb, dtype=torch.bool), bq, bk, q_len, k_len)
    m = enforce_required(empty).mask
    allowed, own = _brute_allowed(*geom)
    assert m[..., 0].all()
    assert (m | ~own).all()
    ones = enforce_required(empty.with_mask(torch.ones_like(empty.mask))).mask
    assert torch.equal(ones, allowed.expand_as(ones))


def test_density_counts_only_allowed_blocks():
    m = full_mask(2, 3, 256, 256, 64, 64)
    assert density(m) == 1.0
    raw = BlockSparseMask(torch.ones(2, 3, 4, 4, dtype=torch.bool), 64, 64, 256, 256)
    assert density(raw) == 1.0  # blocks above the diagonal are not counted
    req = enforce_required(raw.with_mask(torch.zeros_like(raw.mask)))
    # 4 q-blocks: diagonal (4) + sink for rows 1..3 (3) = 7 of 10 allowed
    assert density(req) == pytest.approx(0.7)
    assert density_per_head(req).shape == (3,)


def test_element_mask_is_causal():
    m = full_mask(1, 1, 100, 300, 32, 64)
    elem = m.to_element_mask()[0, 0]
    pos = torch.arange(100) + 200
    assert torch.equal(elem, torch.arange(300)[None, :] <= pos[:, None])


def test_invalid_mask_raises():
    with pytest.raises(ValueError, match="do not match"):
        BlockSparseMask(torch.ones(1, 1, 3, 3, dtype=torch.bool), 64, 64, 256, 256)
    with pytest.raises(ValueError, match="q_len <= k_len"):
        BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), 64, 64, 64, 32)
