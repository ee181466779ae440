"""Slice masks (LongCA-bench / MagiAttention format): every converter against a brute-force definition."""

from __future__ import annotations

import pytest
import torch

from longlab.ops.masks import MASKS, SliceMask, make_mask, mask_from_dense, sample_document_lengths
from longlab.recipe import LonglabError

T = 203  # not a multiple of any block size
DOCS = [37, 5, 60, 1, 70, 30]
W = 17
BLOCK = 32


def _grid(n: int):
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    return q, k


def _doc_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _doc_starts(lengths):
    starts = torch.cumsum(torch.tensor([0] + list(lengths[:-1])), 0)
    return torch.repeat_interleave(starts, torch.tensor(lengths))


def brute(name: str, n: int) -> torch.Tensor:
    """The mask's definition, pair by pair. -> [n, n] bool"""
    q, k = _grid(n)
    causal = k <= q
    if name == "FULL":
        return torch.ones(n, n, dtype=torch.bool)
    if name == "CAUSAL":
        return causal
    if name in ("FULL_DOCUMENT", "CAUSAL_DOCUMENT", "PREFIX_LM_DOCUMENT", "BLOCK_CAUSAL_DOCUMENT"):
        d = _doc_ids(DOCS)
        same = d[:, None] == d[None, :]
        if name == "FULL_DOCUMENT":
            return same
        if name == "CAUSAL_DOCUMENT":
            return same & causal
        s = _doc_starts(DOCS)
        lens = torch.tensor(DOCS)[d]
        if name == "PREFIX_LM_DOCUMENT":
            p = torch.clamp((lens * 0.5).long(), min=1)
            return same & ((k - s[None, :] < p[None, :]) | causal)
        return same & ((k - s[None, :]) // 16 <= (q - s[:, None]) // 16)
    if name == "SLIDING_WINDOW":
        return (q - k).abs() < W
    if name == "SLIDING_WINDOW_CAUSAL":
        return causal & (q - k < W)
    if name == "SHARE_QUESTION":
        seg = _doc_ids([50, 40, 13, 100])
        qs, ks = seg[:, None], seg[None, :]
        return ((ks == 0) & ((qs != 0) | causal)) | ((qs == ks) & causal)
    if name == "CAUSAL_BLOCKWISE":
        b = torch.arange(n) // 48
        last = int(b[-1])
        return ((b[:, None] == b[None, :]) & causal) | ((b[:, None] == last) & (b[None, :] < last))
    if name == "PREFIX_LM_CAUSAL":
        return (k < 70) | causal
    if name == "GLOBAL_SLIDING_WINDOW":
        return (q < 9) | (k < 9) | ((q - k).abs() < W)
    if name.startswith("RANDOM_BLOCK_"):
        s = float(name.rsplit("_", 1)[1])
        nb = -(-n // BLOCK)
        keep = torch.rand(nb, nb, generator=torch.Generator().manual_seed(3)) >= s
        keep[:, 0] = True
        keep = torch.tril(keep, -1) | torch.eye(nb, dtype=torch.bool)
        return causal & keep[q // BLOCK, k // BLOCK]
    raise AssertionError(name)


KWARGS = {
    "FULL_DOCUMENT": {"lengths": DOCS},
    "CAUSAL_DOCUMENT": {"lengths": DOCS},
    "PREFIX_LM_DOCUMENT": {"lengths": DOCS},
    "BLOCK_CAUSAL_DOCUMENT": {"lengths": DOCS, "block": 16},
    "SLIDING_WINDOW": {"window": W},
    "SLIDING_WINDOW_CAUSAL": {"window": W},
    "SHARE_QUESTION": {"question": 50, "answers": [40, 13, 100]},
    "CAUSAL_BLOCKWISE": {"block": 48},
    "PREFIX_LM_CAUSAL": {"prefix": 70},
    "GLOBAL_SLIDING_WINDOW": {"n_global": 9, "window": W},
    "RANDOM_BLOCK_0.2": {"block": BLOCK, "seed": 3},
    "RANDOM_BLOCK_0.5": {"block": BLOCK, "seed": 3},
    "RANDOM_BLOCK_0.8": {"block": BLOCK, "seed": 3},
}


def _mask(name: str, n: int = T) -> SliceMask:
    return make_mask(name, n, **KWARGS.get(name, {}))


def flex_pairs(bm, n_q: int, n_k: int, ref: torch.Tensor) -> torch.Tensor:
    """Visible pairs of a flex BlockMask: full blocks all, partial blocks by its mask_mod. -> [n_q, n_k]"""
    bq, bk = bm.BLOCK_SIZE
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    qi = torch.arange(n_q)[:, None]
    ki = torch.arange(n_k)[None, :]
    elem = bm.mask_mod(torch.tensor(0), torch.tensor(0), qi, ki).expand(n_q, n_k)
    assert torch.equal(elem, ref), "the mask_mod alone (as eager flex evaluates it) is the whole mask"
    for i in range(-(-n_q // bq)):
        rs = slice(i * bq, min((i + 1) * bq, n_q))
        for j in bm.full_kv_indices[0, 0, i, : int(bm.full_kv_num_blocks[0, 0, i])].tolist():
            out[rs, j * bk: (j + 1) * bk] = True
        for j in bm.kv_indices[0, 0, i, : int(bm.kv_num_blocks[0, 0, i])].tolist():
            cs = slice(j * bk, min((j + 1) * bk, n_k))
            out[rs, cs] = elem[rs, cs]
    return out


@pytest.mark.parametrize("name", list(MASKS))
def test_sdpa_mask_and_area_equal_brute_force(name):
    m = _mask(name)
    ref = brute(name, T)
    assert torch.equal(m.to_sdpa_mask(), ref)
    assert m.area() == int(ref.sum())  # slices do not overlap
    assert bool(ref.any(-1).all())  # every row sees a key


@pytest.mark.parametrize("blocks", [(32, 32), (16, 64), (64, 16)], ids=lambda b: f"bq{b[0]}-bk{b[1]}")
@pytest.mark.parametrize("name", list(MASKS))
def test_block_layout_and_flex_block_mask_equal_brute_force(name, blocks):
    bq, bk = blocks
    m = _mask(name)
    ref = brute(name, T)
    lay = m.to_block_layout(bq, bk)
    ar = torch.arange(T)
    assert torch.equal(lay.element_mask(ar, ar), ref)
    # counts per block = brute-force sums; full / partial classification follows
    pad = torch.nn.functional.pad(ref, (0, -T % bk, 0, -T % bq)).long()
    sums = pad.view(pad.shape[0] // bq, bq, pad.shape[1] // bk, bk).sum((1, 3))
    assert torch.equal(lay.counts, sums)
    assert torch.equal(lay.row_any, ref.any(-1))
    assert torch.equal(flex_pairs(m.to_flex_block_mask(bq, bk), T, T, ref), ref)


@pytest.mark.parametrize("name", ["CAUSAL", "RANDOM_BLOCK_0.2", "RANDOM_BLOCK_0.5", "RANDOM_BLOCK_0.8"])
def test_block_sparse_layout_equals_brute_force(name):
    m = _mask(name)
    bs = m.to_block_sparse(BLOCK, BLOCK, B=2, H=3)
    assert bs.mask.shape == (2, 3, -(-T // BLOCK), -(-T // BLOCK))
    assert torch.equal(bs.to_element_mask()[1, 2], brute(name, T))


@pytest.mark.parametrize("name", ["FULL", "CAUSAL_DOCUMENT", "SLIDING_WINDOW_CAUSAL", "PREFIX_LM_CAUSAL"])
def test_block_sparse_layout_refuses_masks_it_cannot_hold(name):
    with pytest.raises(LonglabError, match="to_block_sparse"):
        _mask(name).to_block_sparse(BLOCK, BLOCK)


def test_slice_types_by_hand():
    # a 3x5 rectangle at (q 1..4, k 2..7) of each type; L_k - L_q = 2
    rows = {"full": [[2, 7]] * 3, "causal": [[2, 5], [2, 6], [2, 7]], "inv-causal": [[2, 7], [3, 7], [4, 7]],
            "bi-causal": [[2, 5], [3, 6], [4, 7]]}
    for kind, want in rows.items():
        m = SliceMask([[1, 4]], [[2, 7]], [kind], 6, 8)
        d = m.to_sdpa_mask()
        for r, (lo, hi) in enumerate(want, start=1):
            assert d[r].nonzero().flatten().tolist() == list(range(lo, hi)), kind
        assert not d[0].any() and not d[4:].any()


def test_mask_from_dense_round_trip():
    ref = torch.rand(40, 50, generator=torch.Generator().manual_seed(0)) < 0.4
    assert torch.equal(mask_from_dense(ref).to_sdpa_mask(), ref)


def test_sampled_document_lengths():
    for dist in ("short", "long", "uniform", [100, 7]):
        lens = sample_document_lengths(5000, dist, seed=1)
        assert sum(lens) == 5000 and min(lens) > 0
    assert sample_document_lengths(5000, "short", seed=1) == sample_document_lengths(5000, "short", seed=1)
    m = make_mask("CAUSAL_DOCUMENT", 4096, distribution="short", seed=2)
    assert len(m) > 1 and m.area() < 4096 * 4097 // 2


def test_bad_input_names_the_argument():
    with pytest.raises(LonglabError, match="mask must be one of"):
        make_mask("NOPE", 10)
    with pytest.raises(LonglabError, match="T must be"):
        make_mask("FULL", 0)
    with pytest.raises(LonglabError, match="slice type"):
        SliceMask([[0, 1]], [[0, 1]], ["diagonal"], 2, 2)
    with pytest.raises(LonglabError, match="k_ranges"):
        SliceMask([[0, 1]], [[0, 3]], ["full"], 2, 2)
    with pytest.raises(LonglabError, match="sparsity"):
        make_mask("RANDOM_BLOCK_0.5", 10, sparsity=0.3)
    with pytest.raises(LonglabError, match="document lengths"):
        make_mask("CAUSAL_DOCUMENT", 10, lengths=[3, 3])
