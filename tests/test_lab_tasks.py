"""Layers-lab tasks: exact answers, seeding, lengths, the MTD Bayes/mirror-descent maths, group tables."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.lab.tasks import (
    GROUPS,
    LAB_TASKS,
    MTDTask,
    cayley_table,
    mirror_descent,
    task_config,
)
from longlab.recipe import LonglabError


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# next-token tasks only: lcube (continuous) is in test_lab_lcube.py; the continuous, masked and
# classification tasks of other modalities (lorenz96, meg, track, xor, blobs) in test_lab_modalities.py
OTHER = {"lcube", "lorenz96", "meg", "track", "xor", "blobs"}


@pytest.mark.parametrize("name", sorted(set(LAB_TASKS) - OTHER))
@pytest.mark.parametrize("length", [64, 257])
def test_exact_length_vocab_and_seeding(name, length):
    task = task_config("pcfg:max_length=300" if name == "pcfg" else name)
    exact = name != "pcfg"  # the PCFG oracle is cubic in the length: checked in test_lab_pcfg.py
    a = task.sample(3, length, _gen(5), exact=exact)
    b = task.sample(3, length, _gen(5), exact=exact)
    c = task.sample(3, length, _gen(6), exact=exact)
    assert a.tokens.shape == (3, length)
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < task.vocab_size
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert a.answer.any(dim=1).all()
    # targets are the next tokens exactly where scored
    t, i = torch.nonzero(a.answer, as_tuple=True)
    assert torch.equal(a.targets[t, i], a.tokens[t, i + 1])


def test_copy_answers_are_the_first_half():
    task = task_config("copy")
    b = task.sample(2, 40, _gen())
    n = 19
    assert torch.equal(b.tokens[:, 1 : 1 + n], b.tokens[:, -n:])
    assert int(b.answer.sum(-1)[0]) == n


def test_mqar_answers_are_the_queried_keys_values():
    task = task_config("mqar:key_len=2,value_len=2,queries=4")
    b = task.sample(4, 128, _gen(1))
    per = 4
    for row in b.tokens:
        sep = int((row == task.alphabet + 1).nonzero()[0])
        ctx = row[sep - task.n_pairs(128) * per : sep].view(-1, per)
        table = {tuple(r[:2].tolist()): tuple(r[2:].tolist()) for r in ctx}
        assert len(table) == ctx.shape[0]  # distinct keys
        for q in row[sep + 1 :].view(-1, per):
            assert table[tuple(q[:2].tolist())] == tuple(q[2:].tolist())
    assert int(b.answer.sum(-1)[0]) == 4 * 2


def test_mqar_fixed_pairs_gap_of_filler():
    task = task_config("mqar:key_len=1,pairs=6,queries=6,alphabet=16,filler=4")
    assert task.vocab_size == 16 + 2 + 4
    for length in (32, 256):
        b = task.sample(3, length, _gen(5))
        assert b.tokens.shape == (3, length)
        for row, tgt in zip(b.tokens, b.targets):
            sep = int((row == 17).nonzero()[0])
            ctx = row[1:13].view(6, 2)
            assert (ctx < 16).all() and len(set(ctx[:, 0].tolist())) == 6  # distinct keys, no filler
            gap = row[13:sep]
            assert gap.numel() == length - 2 - 24 and bool(((gap >= 18) & (gap < 22)).all())
            table = dict(ctx.tolist())
            for k, v in row[sep + 1 :].view(-1, 2).tolist():
                assert table[k] == v
            assert int((tgt != -100).sum()) == 6
    with pytest.raises(LonglabError, match="length"):
        task.sample(1, 20, _gen(0))


def test_passkey_digits_are_repeated_after_query():
    task = task_config("passkey")
    b = task.sample(4, 300, _gen(2))
    key = 11 + task.filler
    for row in b.tokens:
        at = int((row == key).nonzero()[0])
        assert torch.equal(row[at + 1 : at + 1 + task.digits], row[-task.digits :])


def test_flipflop_reads_return_the_last_write():
    task = task_config("flipflop:p_write=0.2,p_read=0.3")
    b = task.sample(8, 101, _gen(3))
    for row, ans in zip(b.tokens, b.answer):
        last = None
        off = len(row) % 2
        for j in range(off, len(row) - 1, 2):
            instr, bit = int(row[j]), int(row[j + 1])
            if instr == 2:
                last = bit
            elif instr == 3:
                assert bit == last and bool(ans[j])


def test_algebra_tables_are_groups_and_facts_are_consistent():
    for g in GROUPS:
        tab = cayley_table(g)
        n = tab.shape[0]
        e = torch.arange(n)
        assert torch.equal(tab[0], e) and torch.equal(tab[:, 0], e)  # identity
        assert all(sorted(r.tolist()) == list(range(n)) for r in tab)  # Latin square: inverses exist
        assoc = tab[tab[e[:, None, None], e[None, :, None]], e[None, None, :]]
        assert torch.equal(assoc, tab[e[:, None, None], tab[e[None, :, None], e[None, None, :]]])
    assert not torch.equal(cayley_table("D4"), cayley_table("D4").T)  # dihedral: not commutative
    task = task_config("algebra")
    b = task.sample(6, 250, _gen(4))
    for row in b.tokens:
        facts = {}
        eqs = (row == task.symbols).nonzero()[:, 0]
        for p in eqs.tolist():
            if p >= 2 and p + 1 < len(row):
                key = (int(row[p - 2]), int(row[p - 1]))
                assert facts.setdefault(key, int(row[p + 1])) == int(row[p + 1])  # a function of (a, b)
        assert len(facts) > 5


def _facts(row, task):
    """Complete facts ``(a, b, c)`` of an algebra sequence, in order."""
    eqs = (row == task.symbols).nonzero()[:, 0].tolist()
    return [(int(row[p - 2]), int(row[p - 1]), int(row[p + 1])) for p in eqs if p >= 3 and p + 1 < len(row)]


@pytest.mark.parametrize("query", ["commuted", "absent", "identity", "elimination"])
def test_algebra_mechanism_sets(query):
    for groups, mix in (('["D3"]', 0), ('["C5","D3","C4"]', 0.7)):
        task = task_config(f"algebra:query={query},groups={groups},mix={mix}")
        b = task.sample(12, 80, _gen(7))
        assert bool((b.answer.sum(-1) == 1).all()) and bool(b.answer[:, -2].all())  # only the query
        for row, tgt in zip(b.tokens, b.targets):
            facts = _facts(row, task)
            *ctx, (a, q, c) = facts
            assert int(tgt[-2]) == c
            table = {}
            for x, y, z in facts:
                assert table.setdefault((x, y), z) == z  # every fact true to one table
            keys = {(x, y) for x, y, _ in ctx}
            assert (a, q) not in keys
            if query == "commuted":
                assert (q, a, c) in ctx and a != q and c not in (a, q)
            elif query == "absent":
                assert (q, a) not in keys and a != q
            elif query == "identity":
                e, other = (a, q) if c == q else (q, a)
                assert c == other and (q, a) not in keys
                assert any((x == e and z == y) or (y == e and z == x) for x, y, z in ctx if (x, y) != (a, q))
            else:
                assert (q, a) not in keys
                row_answers = {z for x, y, z in ctx if x == a and y != q}
                if groups == '["D3"]':  # the row's other 5 answers plus c are the group's 6 elements
                    assert len(row_answers) == 5 and c not in row_answers
                    assert row_answers | {c} == {v for f in ctx for v in f}
    with pytest.raises(LonglabError, match="query"):
        task_config("algebra:query=copy")


def test_algebra_holdout_zero():
    task = task_config("algebra:groups=[\"C5\"],mix=0")
    for s in range(20):
        row = task.sample(1, 200, _gen(s)).tokens[0]
        eqs = (row == task.symbols).nonzero()[:, 0].tolist()
        for p in eqs:
            if p >= 2 and p + 1 < len(row) and row[p - 2] == row[p + 1]:  # a·b = a: b is the identity
                assert int(row[p - 1]) != 0


def test_mtd_bayes_is_a_distribution_and_uniform_before_evidence():
    task = MTDTask(draws=2000)
    b = task.sample(3, 40, _gen(7))
    assert b.probs is not None
    torch.testing.assert_close(b.probs.sum(-1), torch.ones(3, 40))
    k = task.lags
    # no evidence yet at t = k-1: the prior mean λ = 1/K (up to the Monte Carlo error of 2000 draws)
    rows = task.lag_rows(b.tokens)
    torch.testing.assert_close(b.probs[:, k - 1], rows[:, k - 1].mean(-2), rtol=0, atol=0.02)


def test_mtd_bayes_concentrates_on_the_true_lag():
    task = MTDTask(draws=4000, concentration=0.2)
    g = _gen(8)
    x = torch.randint(0, task.states, (1, 300), generator=g)
    for t in range(task.lags, 300):  # lag 2 only
        x[0, t] = torch.multinomial(task.Q[x[0, t - 2]], 1, generator=g)[0]
    probs = task.bayes(x, _gen(9))
    rows = task.lag_rows(x)
    torch.testing.assert_close(probs[0, -1], rows[0, -1, 1], rtol=0.05, atol=0.05)


def test_mirror_descent_eta_zero_stays_uniform_and_g_is_the_gradient():
    task = MTDTask()
    x = task.sample(2, 60, _gen(10)).tokens
    lam = mirror_descent(task, x, steps=3, eta=0.0)
    torch.testing.assert_close(lam, torch.full((2, task.lags), 1 / task.lags))
    # g = ∂/∂λ mean_t log Σ_k λ_k Q(x_{t−k}, x_t), by autograd
    k = task.lags
    rows = task.lag_rows(x)
    lik = rows[:, :-1].gather(-1, x[:, 1:, None, None].expand(-1, -1, k, 1))[..., 0][:, k - 1 :]
    l0 = torch.tensor([[0.2, 0.3, 0.5]] * 2, requires_grad=True)
    torch.log(lik @ l0[..., None]).mean().backward()
    g = (lik / (lik @ l0.detach()[..., None])).mean(1)
    torch.testing.assert_close(l0.grad * 2, g)  # the mean runs over both sequences too
    one = mirror_descent(task, x, steps=1, eta=0.5)
    u = torch.full((2, k), 1 / k)
    gu = (lik / (lik @ u[..., None])).mean(1)
    expected = u * torch.exp(0.5 * gu)
    torch.testing.assert_close(one, expected / expected.sum(-1, keepdim=True))


def test_mtd_generator_lag_frequencies_match_lambda():
    task = MTDTask(states=16, concentration=0.05)  # near-deterministic rows: the lag is identifiable
    g = _gen(11)
    lam = torch.tensor([0.6, 0.3, 0.1])
    x = torch.randint(0, 16, (3000,), generator=g)
    for t in range(3, 3000):
        lag = int(torch.multinomial(lam, 1, generator=g)[0]) + 1
        x[t] = torch.multinomial(task.Q[x[t - lag]], 1, generator=g)[0]
    lik = torch.stack([task.Q[x[3 - k : 3000 - k], x[3:]] for k in (1, 2, 3)], dim=1)  # [T, K]
    post = lik * lam / (lik * lam).sum(-1, keepdim=True)  # responsibility of each lag
    hits = post.mean(0)
    assert math.isclose(float(hits[0]), 0.6, abs_tol=0.06) and math.isclose(float(hits[2]), 0.1, abs_tol=0.06)


@pytest.mark.parametrize(
    "spec, length, match",
    [
        ("nosuch", 64, "unknown task"),
        ("copy:bogus=1", 64, "no parameter"),
        ("copy", 3, "length must be"),
        ("mqar:alphabet=4,key_len=1", 256, "distinct keys"),
        ("flipflop:p_write=0", 64, "p_write"),
        ("algebra:groups=[\"Q8\"]", 64, "groups"),
        ("pcfg:max_length=32", 64, "max_length"),
        ("pcfg:alpha=0", 16, "alpha"),
    ],
)
def test_bad_task_input(spec, length, match):
    with pytest.raises(LonglabError, match=match):
        task_config(spec).sample(1, length, _gen())
