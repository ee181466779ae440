"""``algebra``: in-context group arithmetic (Todd et al., "In-Context Algebra", arXiv 2512.16902): per
sequence one or more groups from cyclic C3..C10 and dihedral D3..D5, elements mapped injectively
to random variable symbols, facts ``, a b = c`` drawn from the Cayley tables; every token after ``=``
is an answer (holdout_zero: the identity is never symbol 0). ``query=commuted|absent|identity|
elimination`` gives the mechanism test sets (one held-out query fact per sequence; see
:class:`AlgebraTask`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...recipe import LonglabError
from .base import Task, _check, _check_p, _randint, register_task

__all__ = ["GROUPS", "QUERIES", "AlgebraTask", "cayley_table", "group_order"]

GROUPS = tuple([f"C{n}" for n in range(3, 11)] + [f"D{n}" for n in range(3, 6)])


def group_order(name: str) -> int:
    n = int(name[1:])
    return n if name[0] == "C" else 2 * n


def cayley_table(name: str) -> torch.Tensor:
    """Cayley table ``[n, n]`` of C_n (addition mod n) or D_n (order 2n: element (r, s) = rotation r,
    reflection s; ``(r1, s1)(r2, s2) = (r1 + (−1)^{s1} r2, s1 ⊕ s2)``); element 0 is the identity."""
    n = int(name[1:])
    if name[0] == "C":
        i = torch.arange(n)
        return (i[:, None] + i[None, :]) % n
    if name[0] != "D":
        raise LonglabError(f"task algebra: unknown group {name!r}; groups: {', '.join(GROUPS)}")
    elems = [(r, s) for s in (0, 1) for r in range(n)]
    index = {e: j for j, e in enumerate(elems)}
    tab = torch.zeros(2 * n, 2 * n, dtype=torch.long)
    for a, (r1, s1) in enumerate(elems):
        for b, (r2, s2) in enumerate(elems):
            tab[a, b] = index[((r1 + (-1) ** s1 * r2) % n, s1 ^ s2)]
    return tab


QUERIES = ("", "commuted", "absent", "identity", "elimination")


@register_task("algebra")
@dataclass
class AlgebraTask(Task):
    """``query = ""``: every token after ``=`` is scored (training). A mechanism test set (the paper's
    three mechanisms [paper]; the sets' construction is [recon]) instead ends every sequence in one held-out
    query fact ``, a b =`` whose answer is the only scored token; the query never appears in the context:

    - ``commuted``: a ≠ b commute, neither is the identity, and the commuted twin ``, b a = c`` is in the
      context (commutative copying answers it);
    - ``absent``: the same kind of query with its twin removed too (copying cannot answer it; the
      commuted − absent gap isolates copying);
    - ``identity``: one operand is the identity (``e b = b``); query and twin are removed, and some other
      fact with ``e`` as an operand is in the context (identity recognition);
    - ``elimination``: query and twin removed, and every other fact of the row ``a x = y`` (x ≠ b) is in
      the context, so the answer is the one element of a's group not yet used in a's row (closure-based
      cancellation).

    An unseen group: train with ``groups`` that leave one out and test with ``groups=["C7"]``."""

    symbols: int = 16
    max_order: int = 10
    mix: float = 0.7
    groups: tuple[str, ...] = field(default_factory=lambda: GROUPS)
    query: str = ""

    def __post_init__(self) -> None:
        _check(self.name, "symbols", self.symbols, 4)
        _check(self.name, "max_order", self.max_order, 2)
        _check_p(self.name, "mix", self.mix)
        self.groups = tuple(self.groups)
        bad = [g for g in self.groups if g not in GROUPS]
        if bad or not self.groups:
            raise LonglabError(f"task algebra: groups must be among {', '.join(GROUPS)}, got {bad or '()'}")
        if self.query not in QUERIES:
            raise LonglabError(
                f"task algebra: query must be one of {', '.join(map(repr, QUERIES))}, got {self.query!r}"
            )
        self._tables = {g: cayley_table(g) for g in self.groups}
        if not [g for g in self.groups if group_order(g) <= min(self.max_order, self.symbols)]:
            raise LonglabError(
                f"task algebra: no group of order <= max_order {self.max_order} and <= symbols {self.symbols}"
            )

    @property
    def vocab_size(self) -> int:
        return self.symbols + 2  # '=' and ','

    def min_length(self) -> int:
        if self.query == "elimination":  # the row's other facts, one possibly cut fact, the query
            return 5 * (min(self.max_order, self.symbols) + 1) + 1
        return 16 if self.query else 6

    def _groups(self, gen):
        """The sequence's groups, their offsets in the element list, and the element -> symbol map."""
        usable = [g for g in self.groups if group_order(g) <= min(self.max_order, self.symbols)]
        chosen = [usable[int(_randint(len(usable), gen)[0])]]
        total = group_order(chosen[0])
        while float(torch.rand(1, generator=gen)) < self.mix:
            fits = [g for g in usable if total + group_order(g) <= self.symbols]
            if not fits:
                break
            g = fits[int(_randint(len(fits), gen)[0])]
            chosen.append(g)
            total += group_order(g)
        # injective map of all elements to symbols; holdout_zero: no identity on symbol 0
        while True:
            perm = torch.randperm(self.symbols, generator=gen)[:total]
            starts = [0]
            for g in chosen[:-1]:
                starts.append(starts[-1] + group_order(g))
            if all(int(perm[s]) != 0 for s in starts):
                break
        return chosen, starts, perm

    def _fact(self, gi: int, a: int, b: int, chosen, starts, perm) -> list[int]:
        tab, off = self._tables[chosen[gi]], starts[gi]
        c = int(tab[a, b])
        return [self.symbols + 1, int(perm[off + a]), int(perm[off + b]), self.symbols, int(perm[off + c])]

    def _random_fact(self, gen, chosen, starts, perm) -> tuple[int, int, int]:
        gi = int(_randint(len(chosen), gen)[0])
        a, b = (int(v) for v in _randint(self._tables[chosen[gi]].shape[0], gen, 2))
        return gi, a, b

    def _sample(self, length, gen):
        chosen, starts, perm = self._groups(gen)
        n_facts = (length - 1) // 5 + 1
        if not self.query:
            facts = [self._fact(*self._random_fact(gen, chosen, starts, perm), chosen, starts, perm)
                     for _ in range(n_facts)]
            seq = torch.tensor(facts).flatten()[-length:]
            ans = torch.zeros(length, dtype=torch.bool)
            ans[:-1] = seq[:-1] == self.symbols  # '=' predicts c
            return seq, ans
        return self._query_sample(length, n_facts, gen, chosen, starts, perm)

    def _query_sample(self, length, n_facts, gen, chosen, starts, perm):
        gi = int(_randint(len(chosen), gen)[0])
        tab = self._tables[chosen[gi]]
        n = tab.shape[0]
        if self.query in ("commuted", "absent"):  # non-identity a ≠ b with ab = ba (rotations always do)
            cand = [(a, b) for a in range(1, n) for b in range(1, n) if a != b and tab[a, b] == tab[b, a]]
        elif self.query == "identity":
            cand = [(0, b) for b in range(1, n)] + [(a, 0) for a in range(1, n)]
        else:
            cand = [(a, b) for a in range(1, n) for b in range(1, n)]
        a, b = cand[int(_randint(len(cand), gen)[0])]
        banned = {(gi, a, b)} if self.query == "commuted" else {(gi, a, b), (gi, b, a)}
        required: list[tuple[int, int, int]] = []
        if self.query == "commuted":
            required = [(gi, b, a)]
        elif self.query == "identity":
            x = a or b  # the non-identity operand; another identity fact (e y or y e, y ≠ x)
            others = [(gi, 0, y) for y in range(n) if y != x] + [(gi, y, 0) for y in range(1, n) if y != x]
            required = [others[int(_randint(len(others), gen)[0])]]
        elif self.query == "elimination":
            required = [(gi, a, x) for x in range(n) if x != b]
        ctx = []
        while len(ctx) < n_facts - 1:
            f = self._random_fact(gen, chosen, starts, perm)
            if f not in banned:
                ctx.append(f)
        if len(required) > n_facts - 2:
            raise LonglabError(f"task algebra: query={self.query} needs a longer sequence than {length}")
        # positions 1 .. n_facts − 2: never the first fact (the cut one) nor the query
        slots = (torch.randperm(n_facts - 2, generator=gen)[: len(required)] + 1).tolist()
        for pos, f in zip(slots, required):
            ctx[pos] = f
        facts = [self._fact(*f, chosen, starts, perm) for f in ctx + [(gi, a, b)]]
        seq = torch.tensor(facts).flatten()[-length:]
        ans = torch.zeros(length, dtype=torch.bool)
        ans[length - 2] = True  # the query's '=' predicts its answer
        return seq, ans
