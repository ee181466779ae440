"""Synthetic tasks of the layers lab: seeded generators with exact answers (or exact next-token
distributions), any length.

A task makes a :class:`Batch` of ``tokens: [B, T]`` (the model input), ``targets: [B, T]`` (the next
token to predict where the loss counts, else ``-100``) and ``answer: [B, T]`` (the positions that are
scored). ``score`` is the fraction of answer positions whose argmax is right, per sample; tasks with
an exact next-token distribution (``mtd``) also give ``probs: [B, T, V]`` and score
``exp(−mean KL(p_true ‖ p_model))``.

Registered (``TASKS``):

- ``copy``: ``BOS x_1..x_n SEP x_1..x_n`` over ``alphabet`` symbols; answers: the second copy.
- ``mqar``: multi-query (multi-token) associative recall, the MQMTAR form of Vasylenko et al. (ASEntmax,
  arXiv 2506.16640) after Arora et al. (Zoology, arXiv 2312.04927): ``n`` pairs of a ``key_len``-token key
  and a ``value_len``-token value (distinct keys), ``SEP``, then ``queries`` keys whose values are the
  answers. ``n`` grows with the length; the number of queries does not. With ``pairs = n > 0`` the
  number of pairs is fixed and a gap of random ``filler`` tokens between the pairs and the queries grows
  with the length instead (Zoology's few-pairs setting; the test length then tests recall distance).
- ``passkey``: random filler with ``KEY d_1..d_k`` at a random depth, ending in ``QUERY``: the answers are
  the digits (Mohtashami & Jaggi 2023, arXiv 2305.16300).
- ``flipflop``: flip-flop language modelling (Liu et al. 2023, arXiv 2306.00946): pairs
  (instruction, bit) with instructions w/r/i drawn with probabilities (p_w, p_r, p_i), the first a write;
  the bit after ``r`` is the last written bit (answers).
- ``mtd``: mixture of transition distributions (D'Angelo & Flammarion, arXiv 2604.10848): a fixed
  transition matrix Q (from the task seed), per-sequence lag weights ``λ ~ Dir(1_K)``, ``x_t ~ Σ_k λ_k
  Q(x_{t−k}, ·)``. ``probs`` is the Bayes-optimal predictor ``E_{λ|x_{<t}}[Σ_k λ_k Q(x_{t−k}, ·)]`` by
  self-normalised importance sampling over ``draws`` prior draws; :func:`mirror_descent` gives the
  MD-n estimator.
- ``pcfg``: strings of a random binary PCFG with the exact next-token distribution by the inside
  algorithm (:mod:`longlab.lab.pcfg`; "How Transformers Represent Hierarchies", ICML 2026) [recon];
  lengths up to ``max_length`` (the oracle is cubic).
- ``algebra``: in-context group arithmetic (Todd et al., "In-Context Algebra", arXiv 2512.16902): per
  sequence one or more groups from cyclic C3..C10 and dihedral D3..D5, elements mapped injectively
  to random variable symbols, facts ``, a b = c`` drawn from the Cayley tables; every token after ``=``
  is an answer (holdout_zero: the identity is never symbol 0). ``query=commuted|absent|identity|
  elimination`` gives the mechanism test sets (one held-out query fact per sequence; see
  :class:`AlgebraTask`).
- ``lcube``: L-CUBE hierarchical Gaussian sequences (:mod:`longlab.lab.lcube`) [recon]: continuous
  tokens ``x_t ∈ R^D``, the exact conditional ``p(x_t | x_{<t})``; the model has a linear input and a
  diagonal-Gaussian head; score = the utilisation ``U`` (1: the exact conditional, 0: the marginal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..recipe import LonglabError

__all__ = [
    "TASKS",
    "Batch",
    "Task",
    "cayley_table",
    "mirror_descent",
    "register_task",
    "task_config",
]

TASKS: dict[str, type[Task]] = {}
IGNORE = -100


def register_task(name: str):
    def wrap(cls: type[Task]) -> type[Task]:
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T] long, IGNORE where no loss
    answer: torch.Tensor  # [B, T] bool, scored positions
    probs: torch.Tensor | None = None  # [B, T, V] exact next-token distribution (where known)
    # continuous tasks (lcube): tokens are [B, T, D] floats; the next value, its exact conditional
    values: torch.Tensor | None = None  # [B, T, D] x_{t+1} (the target at t)
    cond_mean: torch.Tensor | None = None  # [B, T, D] E[x_{t+1} | x_{≤t}]
    cond_var: torch.Tensor | None = None  # [T, D] Var[x_{t+1} | x_{≤t}] (data-independent)
    info: torch.Tensor | None = None  # [T] available information I* of x_{t+1} (nats)


@dataclass
class Task:
    """Base: subclasses set ``vocab_size`` and implement :meth:`_sample` for one sequence."""

    name: ClassVar[str] = "?"
    seed: int = 0  # task-level randomness (mtd's Q); sequences come from the generator given to sample

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def input_dim(self) -> int:
        """0 for token tasks; the value dimension ``D`` of continuous tasks (``lcube``)."""
        return 0

    def loss(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Training loss: cross-entropy on the answer tokens (``out``: logits ``[B, T, V]``)."""
        return F.cross_entropy(out.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)

    def metrics(self, out: torch.Tensor, batch: Batch) -> dict[str, float]:
        """Extra per-sample numbers for the results row (``batch`` of one sequence)."""
        return {"kl": float(kl_per_position(out, batch)[0])} if batch.probs is not None else {}

    def min_length(self) -> int:
        return 8

    def check_length(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < self.min_length():
            raise LonglabError(
                f"task {self.name}: length must be an integer >= {self.min_length()}, got {length!r}"
            )

    def sample(self, batch: int, length: int, gen: torch.Generator, exact: bool = True) -> Batch:
        """``batch`` sequences of exactly ``length`` tokens, drawn from ``gen``; ``exact=False`` skips the
        exact next-token distributions (training needs only the tokens)."""
        self.check_length(length)
        rows = [self._sample(length, gen) for _ in range(batch)]
        tokens = torch.stack([r[0] for r in rows])
        answer = torch.stack([r[1] for r in rows])  # [B, T] bool: the token at t+1 is an answer
        targets = torch.full_like(tokens, IGNORE)
        targets[:, :-1] = torch.where(answer[:, :-1], tokens[:, 1:], IGNORE)
        return Batch(tokens, targets, answer & (targets != IGNORE))

    def _sample(self, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence ``[T]`` and the mask ``[T]`` of positions whose *next* token is an answer."""
        raise NotImplementedError

    def score(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per-sample score ``[B]`` in [0, 1] (see the module docstring)."""
        if batch.probs is not None:
            kl = kl_per_position(logits, batch)
            return torch.exp(-kl)
        right = (logits.argmax(-1) == batch.targets) & batch.answer
        return right.sum(-1).float() / batch.answer.sum(-1).clamp_min(1).float()


def kl_per_position(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean over answer positions of ``KL(p_true ‖ p_model)`` in nats, per sample ``[B]``."""
    assert batch.probs is not None
    logq = torch.log_softmax(logits.float(), -1)
    p = batch.probs.float()
    kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)  # [B, T]
    m = batch.answer.float()
    return (kl * m).sum(-1) / m.sum(-1).clamp_min(1)


def _randint(n: int, gen: torch.Generator, size: int = 1) -> torch.Tensor:
    return torch.randint(0, n, (size,), generator=gen)


def _check(name: str, field_: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise LonglabError(f"task {name}: {field_} must be an integer >= {lo}, got {value!r}")


def _check_p(name: str, field_: str, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    if not ok:
        raise LonglabError(f"task {name}: {field_} must be a probability in [0, 1], got {value!r}")


@register_task("copy")
@dataclass
class CopyTask(Task):
    alphabet: int = 16

    def __post_init__(self) -> None:
        _check(self.name, "alphabet", self.alphabet, 2)

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 2  # + BOS, SEP

    def _sample(self, length, gen):
        bos, sep = self.alphabet, self.alphabet + 1
        n = (length - 2) // 2
        x = _randint(self.alphabet, gen, n)
        pad = torch.full((length - 2 - 2 * n,), bos)
        seq = torch.cat([pad, torch.tensor([bos]), x, torch.tensor([sep]), x])
        ans = torch.zeros(length, dtype=torch.bool)
        ans[length - n - 1 : length - 1] = True  # SEP predicts x_1, ..., x_{n-1} predicts x_n
        return seq, ans


@register_task("mqar")
@dataclass
class MQARTask(Task):
    alphabet: int = 32
    key_len: int = 2
    value_len: int = 1
    queries: int = 8
    pairs: int = 0  # 0: as many pairs as fit the length; > 0: that many, then a gap of filler tokens
    filler: int = 8  # filler symbols of the gap (only when pairs > 0)

    def __post_init__(self) -> None:
        _check(self.name, "alphabet", self.alphabet, 2)
        for f in ("key_len", "value_len", "queries", "filler"):
            _check(self.name, f, getattr(self, f), 1)
        _check(self.name, "pairs", self.pairs, 0)

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 2 + (self.filler if self.pairs else 0)

    def min_length(self) -> int:
        per = self.key_len + self.value_len
        return 2 + ((self.pairs or self.queries) + self.queries) * per

    def n_pairs(self, length: int) -> int:
        """Key-value pairs in a sequence of ``length`` tokens (fixed when ``pairs > 0``)."""
        if self.pairs:
            return self.pairs
        per = self.key_len + self.value_len
        return (length - 2 - self.queries * per) // per

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if self.n_pairs(length) > self.alphabet**self.key_len:
            raise LonglabError(
                f"task mqar: length {length} needs {self.n_pairs(length)} distinct keys but "
                f"alphabet^key_len = "
                f"{self.alphabet ** self.key_len}; raise key_len or alphabet"
            )

    def _sample(self, length, gen):
        bos, sep = self.alphabet, self.alphabet + 1
        a, kl, vl = self.alphabet, self.key_len, self.value_len
        n = self.n_pairs(length)
        ids = torch.randperm(a**kl, generator=gen)[:n]
        keys = torch.stack([(ids // a**i) % a for i in range(kl)], dim=1)  # [n, key_len] distinct
        values = torch.randint(0, a, (n, vl), generator=gen)
        q = torch.randint(0, n, (self.queries,), generator=gen)
        ctx = torch.cat([keys, values], dim=1).flatten()
        qs = torch.cat([keys[q], values[q]], dim=1).flatten()
        used = 2 + ctx.numel() + qs.numel()
        if self.pairs:  # BOS, the pairs, a gap of random filler (grows with the length), SEP, the queries
            gap = a + 2 + _randint(self.filler, gen, length - used)
            seq = torch.cat([torch.tensor([bos]), ctx, gap, torch.tensor([sep]), qs])
        else:
            seq = torch.cat([torch.full((length - used + 1,), bos), ctx, torch.tensor([sep]), qs])
        ans = torch.zeros(length, dtype=torch.bool)
        start = length - qs.numel()
        for j in range(self.queries):  # the tokens before each value token predict it
            v0 = start + j * (kl + vl) + kl
            ans[v0 - 1 : v0 - 1 + vl] = True
        return seq, ans


@register_task("passkey")
@dataclass
class PasskeyTask(Task):
    digits: int = 5
    filler: int = 8

    def __post_init__(self) -> None:
        _check(self.name, "digits", self.digits, 1)
        _check(self.name, "filler", self.filler, 1)

    @property
    def vocab_size(self) -> int:
        return 10 + self.filler + 3  # digits, filler, BOS, KEY, QUERY

    def min_length(self) -> int:
        return 2 * self.digits + 4

    def _sample(self, length, gen):
        bos, key, query = 10 + self.filler, 11 + self.filler, 12 + self.filler
        d = _randint(10, gen, self.digits)
        n_fill = length - 3 - 2 * self.digits
        fill = 10 + _randint(self.filler, gen, n_fill)
        at = int(_randint(n_fill + 1, gen)[0])
        t = torch.tensor
        seq = torch.cat([t([bos]), fill[:at], t([key]), d, fill[at:], t([query]), d])
        ans = torch.zeros(length, dtype=torch.bool)
        ans[length - self.digits - 1 : length - 1] = True
        return seq, ans


@register_task("flipflop")
@dataclass
class FlipFlopTask(Task):
    p_write: float = 0.1
    p_read: float = 0.1

    def __post_init__(self) -> None:
        _check_p(self.name, "p_write", self.p_write)
        _check_p(self.name, "p_read", self.p_read)
        if self.p_write + self.p_read > 1 or self.p_write <= 0:
            raise LonglabError("task flipflop: need p_write > 0 and p_write + p_read <= 1")

    @property
    def vocab_size(self) -> int:
        return 5  # 0, 1, w, r, i

    def min_length(self) -> int:
        return 4

    def _sample(self, length, gen):
        w, r, i = 2, 3, 4
        n = length // 2
        u = torch.rand(n, generator=gen)
        instr = torch.where(u < self.p_write, w, torch.where(u < self.p_write + self.p_read, r, i))
        instr[0] = w
        bits = _randint(2, gen, n)
        last = 0
        for j in range(n):
            if instr[j] == w:
                last = int(bits[j])
            elif instr[j] == r:
                bits[j] = last
        seq = torch.stack([instr, bits], dim=1).flatten()
        if seq.numel() < length:
            seq = torch.cat([torch.tensor([i]), seq])
        off = length - 2 * n
        ans = torch.zeros(length, dtype=torch.bool)
        ans[off : off + 2 * n : 2] = instr == r  # the instruction r predicts the bit
        return seq, ans


@register_task("mtd")
@dataclass
class MTDTask(Task):
    states: int = 8
    lags: int = 3
    draws: int = 4096
    concentration: float = 0.5  # Dirichlet prior of each row of Q

    def __post_init__(self) -> None:
        _check(self.name, "states", self.states, 2)
        _check(self.name, "lags", self.lags, 1)
        _check(self.name, "draws", self.draws, 1)
        g = torch.Generator().manual_seed(10_000 + int(self.seed))
        conc = torch.full((self.states, self.states), float(self.concentration))
        self.Q = _dirichlet(conc, g)  # [S, S], rows sum to 1

    @property
    def vocab_size(self) -> int:
        return self.states

    def min_length(self) -> int:
        return self.lags + 2

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        s, k = self.states, self.lags
        lam = _dirichlet(torch.ones(batch, k), gen)  # [B, K]
        x = torch.randint(0, s, (batch, length), generator=gen)
        for t in range(k, length):
            lag = torch.multinomial(lam, 1, generator=gen)[:, 0] + 1  # [B]
            prev = x[torch.arange(batch), t - lag]
            x[:, t] = torch.multinomial(self.Q[prev], 1, generator=gen)[:, 0]
        probs = self.bayes(x, gen) if exact else None
        targets = torch.full_like(x, IGNORE)
        targets[:, k - 1 : -1] = x[:, k:]
        answer = targets != IGNORE
        return Batch(x, targets, answer, probs)

    def _lag_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``Q(x_{t+1−k}, ·)`` for the prediction at position t: ``[B, T, K, S]`` (zeros before lag k)."""
        b, t = x.shape
        out = torch.zeros(b, t, self.lags, self.states)
        for k in range(1, self.lags + 1):
            out[:, k - 1 :, k - 1] = self.Q[x[:, : t - k + 1]]
        return out

    def bayes(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Bayes predictor at every position ``[B, T, S]`` (prediction of x_{t+1} from x_{≤t})."""
        b, t = x.shape
        k = self.lags
        lam = _dirichlet(torch.ones(self.draws, k), gen)  # [N, K] prior draws
        rows = self._lag_rows(x)  # [B, T, K, S]
        # likelihood of x_{t+1} under each lag, for t = k-1 .. T-2: Q(x_{t+1-k}, x_{t+1})
        lik = torch.zeros(b, t, k)
        lik[:, :-1] = rows[:, :-1].gather(-1, x[:, 1:, None, None].expand(-1, -1, k, 1))[..., 0]
        ll = torch.log((lik[:, k - 1 : -1] @ lam.T).clamp_min(1e-30))  # [B, T-k, N]
        cum = torch.cat([torch.zeros(b, 1, self.draws), ll.cumsum(1)], dim=1)  # evidence before each step
        w = torch.softmax(cum, dim=-1)  # [B, T-k+1, N] posterior weights at t = k-1 .. T-1
        post_lam = w @ lam  # [B, T-k+1, K] posterior mean of λ
        probs = torch.full((b, t, self.states), 1.0 / self.states)
        probs[:, k - 1 :] = (post_lam[..., None] * rows[:, k - 1 :]).sum(-2)
        return probs


def _dirichlet(conc: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Dirichlet draws (one per row of ``conc``) from ``gen``: normalised Gamma(conc, 1) variates."""
    g = torch._standard_gamma(conc, generator=gen)
    return g / g.sum(-1, keepdim=True).clamp_min(1e-30)


def mirror_descent(task: MTDTask, x: torch.Tensor, steps: int, eta: float) -> torch.Tensor:
    """MD-n estimate of λ from the whole sequence ``x: [B, T]`` (entropic mirror descent from uniform):
    ``λ^{n+1} ∝ λ^n · exp(η g)``, ``g_k = (1/T') Σ_t Q(x_{t−k}, x_t) / Σ_j λ_j Q(x_{t−j}, x_t)``
    (the gradient of the mean log-likelihood). Returns ``[B, K]``."""
    b, t = x.shape
    k = task.lags
    rows = task._lag_rows(x)
    lik = rows[:, :-1].gather(-1, x[:, 1:, None, None].expand(-1, -1, k, 1))[..., 0][:, k - 1 :]  # [B, T', K]
    lam = torch.full((b, k), 1.0 / k)
    log_lam = torch.log(lam)
    for _ in range(steps):
        g = (lik / (lik @ lam[..., None]).clamp_min(1e-30)).mean(1)
        log_lam = log_lam + eta * g  # the same update in log space: no overflow of exp(η g) for large g
        lam = torch.softmax(log_lam, dim=-1)
    return lam


# -- in-context algebra -------------------------------------------------------------------------

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


# exact PCFG next-token distributions by (grammar fields, task seed, length, tokens): the evaluation draws
# the same test strings for every mixer, and the inside-algorithm oracle is O(L⁴·N³) per string
_PCFG_ORACLE: dict[tuple, torch.Tensor] = {}
_PCFG_ORACLE_MAX = 4096
_PCFG_ORACLES = ("prefix", "string")


@dataclass
class PCFGBatch(Batch):
    """A PCFG batch scored by the string oracle: ``log_oracle: [B]`` float64, ``log p(x_{1:} | x_0, |x| = L)``
    (:func:`longlab.lab.pcfg.string_log_prob`), in place of the per-prefix ``probs``."""

    log_oracle: torch.Tensor | None = None


@register_task("pcfg")
@dataclass
class PCFGTask(Task):
    """Strings of a random binary PCFG (grammar from the task seed) with the exact next-token
    distribution (:mod:`longlab.lab.pcfg`); every position's prediction is scored.

    ``oracle="prefix"`` (default): per string ``exp(−mean_t KL(p*_t ‖ q_t))`` from the per-prefix oracle,
    ``O(L⁴ N³)``. ``oracle="string"`` (long lengths): per string ``exp(−e)`` with the excess NLL per scored
    token ``e = (log p*(x_{1:} | x_0, L) − Σ_t log q(x_t | x_{<t})) / (L − 1)``, ``O(L³ N³)``. By the chain
    rule ``log p*(x_{1:} | x_0, L) = Σ_t log p*(x_t | x_{<t})``, so ``E[e] = E[mean_t KL(p*_t ‖ q_t)]``
    over strings: an unbiased estimate of the same per-token KL, noisier per string (``e`` can be < 0 and
    the per-string score > 1 on one string). Aggregate it as ``exp(−mean e)`` over strings
    (``bench/lab_pcfg_long.py``); the metric ``excess_nll`` holds ``e``."""

    nonterminals: int = 16
    terminals: int = 32
    alpha: float = 0.3
    max_length: int = 128
    oracle: str = "prefix"

    def __post_init__(self) -> None:
        from .pcfg import length_inside, random_grammar

        _check(self.name, "nonterminals", self.nonterminals, 1)
        _check(self.name, "terminals", self.terminals, 1)
        _check(self.name, "max_length", self.max_length, 2)
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LonglabError(f"task pcfg: alpha must be a number > 0, got {self.alpha!r}")
        if self.oracle not in _PCFG_ORACLES:
            raise LonglabError(f"task pcfg: oracle must be one of {list(_PCFG_ORACLES)}, got {self.oracle!r}")
        if self.max_length > 1024:
            raise LonglabError(f"task pcfg: max_length must be <= 1024, got {self.max_length}")
        g = torch.Generator().manual_seed(20_000 + int(self.seed))
        self.grammar = random_grammar(self.nonterminals, self.terminals, float(self.alpha), g)
        self.beta = length_inside(self.grammar, self.max_length)

    @property
    def vocab_size(self) -> int:
        return self.terminals

    def min_length(self) -> int:
        return 2

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length > self.max_length:
            raise LonglabError(
                f"task pcfg: length {length} > max_length {self.max_length} (the exact oracle costs O(L³·N³) "
                "per prefix, or per string with oracle=string); raise max_length or test shorter"
            )
        if not float(self.beta[length, 0]) > 0:
            raise LonglabError(f"task pcfg: the grammar derives no string of length {length}")

    def sample(self, batch, length, gen, exact=True):
        from .pcfg import next_token_probs, sample_string, string_log_prob

        self.check_length(length)
        x = torch.stack([sample_string(self.grammar, length, self.beta, gen) for _ in range(batch)])
        targets = torch.full_like(x, IGNORE)
        targets[:, :-1] = x[:, 1:]
        probs = None
        key = (self.nonterminals, self.terminals, float(self.alpha), int(self.seed), length,
               x.numpy().tobytes())
        if exact and self.oracle == "string":
            skey = ("string", *key)
            lp = _PCFG_ORACLE.get(skey)
            if lp is None:
                lp = string_log_prob(self.grammar, x)
                if len(_PCFG_ORACLE) >= _PCFG_ORACLE_MAX:
                    _PCFG_ORACLE.pop(next(iter(_PCFG_ORACLE)))
                _PCFG_ORACLE[skey] = lp
            if not bool(torch.isfinite(lp).all()):
                raise LonglabError(f"task pcfg: the string oracle is not finite at length {length}")
            return PCFGBatch(x, targets, targets != IGNORE, log_oracle=lp.clone())
        if exact:  # the oracle is a function of (grammar, x): cached, so the mixers of one sweep share it
            probs = _PCFG_ORACLE.get(key)
            if probs is None:
                probs = next_token_probs(self.grammar, x).float()
                if len(_PCFG_ORACLE) >= _PCFG_ORACLE_MAX:
                    _PCFG_ORACLE.pop(next(iter(_PCFG_ORACLE)))
                _PCFG_ORACLE[key] = probs
            probs = probs.clone()
        return Batch(x, targets, targets != IGNORE, probs)

    def excess_nll(self, logits: torch.Tensor, batch: PCFGBatch) -> torch.Tensor:
        """``[B]`` float64: ``(log p*(x_{1:} | x_0, L) − Σ_t log q(x_t | x_{<t})) / (L − 1)`` (logits
        ``[B, L, V]``; the scored positions are all but the last)."""
        assert batch.log_oracle is not None
        logq = torch.log_softmax(logits.double(), -1)  # [B, L, V]
        m = batch.answer
        got = logq.gather(-1, batch.targets.clamp_min(0)[..., None])[..., 0]  # [B, L]
        return (batch.log_oracle - (got * m).sum(-1)) / m.sum(-1).clamp_min(1)

    def score(self, logits, batch):
        if isinstance(batch, PCFGBatch) and batch.log_oracle is not None:
            return torch.exp(-self.excess_nll(logits, batch)).float()
        return super().score(logits, batch)

    def metrics(self, out, batch):
        if isinstance(batch, PCFGBatch) and batch.log_oracle is not None:
            return {"excess_nll": float(self.excess_nll(out, batch)[0])}
        return super().metrics(out, batch)


@register_task("lcube")
@dataclass
class LCubeTask(Task):
    """L-CUBE (see :mod:`longlab.lab.lcube`): defaults β = 0.75, c = 1, ρ = 0.9, D = 8, σ_n = 0.1."""

    dim: int = 8
    beta: float = 0.75
    c: float = 1.0
    rho: float = 0.9
    sigma: float = 0.1
    min_logvar: float = -9.0  # clamp of the model's log-variance (keeps the Gaussian NLL finite)

    def __post_init__(self) -> None:
        _check(self.name, "dim", self.dim, 1)
        ranges = {"beta": "(0, 1)", "c": "(0, inf)", "rho": "(0, 1)", "sigma": "[0, inf)"}
        for f, allowed in ranges.items():
            v = getattr(self, f)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            ok = ok and (v >= 0 if f == "sigma" else v > 0) and (v < 1 if allowed.endswith("1)") else True)
            if not ok:
                raise LonglabError(f"task lcube: {f} must be a number in {allowed}, got {v!r}")
        self._cond: dict[int, object] = {}

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def input_dim(self) -> int:
        return self.dim

    def min_length(self) -> int:
        return 2

    def conditional(self, length: int):
        from .lcube import Conditional

        if length not in self._cond:
            self._cond[length] = Conditional(length, self.dim, self.c, self.beta, self.rho, self.sigma)
        return self._cond[length]

    def sample(self, batch, length, gen, exact=True):
        from .lcube import lcube_sample

        self.check_length(length)
        x = lcube_sample(batch, length, self.dim, self.c, self.beta, self.rho, self.sigma, gen)  # [B, T, D]
        values = torch.zeros_like(x)
        values[:, :-1] = x[:, 1:]
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, :-1] = True
        out = Batch(x.float(), torch.full((batch, length), IGNORE), answer, values=values.float())
        if exact:
            cond = self.conditional(length)
            mean = cond.mean(x)  # [B, T, D] E[x_t | x_<t]
            out.cond_mean = torch.zeros_like(x)
            out.cond_mean[:, :-1] = mean[:, 1:]
            out.cond_var = torch.ones(length, self.dim, dtype=torch.float64)
            out.cond_var[:-1] = cond.var[1:]
            out.info = torch.zeros(length, dtype=torch.float64)
            out.info[:-1] = cond.info()[1:]
        return out

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Model output ``[B, T, 2D]`` -> mean ``[B, T, D]`` and variance ``[B, T, D]``."""
        mean, logvar = out[..., : self.dim], out[..., self.dim :]
        return mean, torch.exp(logvar.clamp(self.min_logvar, 9.0))

    def loss(self, out, batch):
        """Gaussian negative log-likelihood of ``x_{t+1}`` per coordinate (up to ``½ log 2π``)."""
        mean, var = self.split(out.float())
        nll = 0.5 * (torch.log(var) + (batch.values - mean) ** 2 / var)  # [B, T, D]
        m = batch.answer.float()[..., None]
        return (nll * m).sum() / (m.sum() * self.dim)

    def _kl(self, out, batch) -> torch.Tensor:
        from .lcube import gaussian_kl

        assert batch.cond_mean is not None and batch.cond_var is not None
        mean, var = self.split(out.double())
        return gaussian_kl(batch.cond_mean, batch.cond_var[None], mean, var)  # [B, T]

    def score(self, logits, batch):
        """Utilisation ``U = Σ_t (I*_t − KL_t) / Σ_t I*_t`` per sample ``[B]``."""
        m = batch.answer.double()
        kl = self._kl(logits, batch)
        info = batch.info[None].double()
        return (((info - kl) * m).sum(-1) / (info * m).sum(-1).clamp_min(1e-12)).float()

    def metrics(self, out, batch):
        m = batch.answer.double()
        kl = (self._kl(out, batch) * m).sum(-1) / m.sum(-1)
        info = (batch.info[None].double() * m).sum(-1) / m.sum(-1)
        return {"kl": float(kl[0]), "info": float(info[0])}


def _split_top(text: str) -> list[str]:
    """Split ``k=v,k=[a,b]`` at the commas outside brackets (list values keep their commas)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth <= 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def task_config(spec: str | Task, seed: int = 0) -> Task:
    """A task from ``"name"`` or ``"name:k=v,..."`` (values as JSON scalars, never evaluated)."""
    import json

    if isinstance(spec, Task):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise LonglabError(f"--task: expected a task name, got {spec!r}; choose one of {', '.join(TASKS)}")
    name, _, rest = spec.strip().partition(":")
    if name not in TASKS:
        raise LonglabError(f"--task: unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    fields = {f for f in cls.__dataclass_fields__}
    kwargs: dict = {"seed": seed}
    for item in filter(None, (p.strip() for p in _split_top(rest))):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            raise LonglabError(
                f"--task: {name} has no parameter {key!r}; parameters: {', '.join(sorted(fields))}"
            )
        try:
            kwargs[key] = json.loads(raw)
        except ValueError:
            kwargs[key] = raw
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise LonglabError(f"--task: {name}: {err}") from None

