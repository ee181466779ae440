"""Random binary PCFGs with the exact next-token oracle (for the ``pcfg`` task).

"How Transformers Represent Hierarchies: A Local-to-Global Mechanism" (ICML 2026; arXiv id and code
not found) [abs + recon]: a random grammar in Chomsky normal form, ``nonterminals`` symbols (root 0),
``terminals`` symbols, each nonterminal's rule probabilities over its ``N² + T`` right-hand sides from
Dirichlet(``alpha``). Strings have a fixed length L, sampled top-down from the length-inside
probabilities ``β(A, n) = P(A ⇒* some string of length n)``:

    β(A, 1) = Σ_a P(A → a),   β(A, n) = Σ_{B,C} P(A → B C) Σ_{k=1}^{n−1} β(B, k) β(C, n − k)

(choose ``A → B C`` and the split k with probability ∝ ``P(A → B C) β(B, k) β(C, n − k)``).

Next-token oracle: ``p(x_{t+1} = a | x_{1:t}, |x| = L) ∝ Σ_A out_{t+1}(A) P(A → a)``, where the chart
fixes the emissions of positions ≤ t, leaves positions > t+1 as wildcards (emission ``β(A, 1)``) and
``out_{t+1}(A)`` is the outside probability of the leaf at t+1: the derivative of the root's inside
probability with respect to that leaf's emission (the inside probability is linear in it), taken by
autograd. Cost ``O(L³ N³)`` per prefix, vectorised over all prefixes of a batch; float64 (no underflow
for L ≤ 128).

String oracle (:func:`string_log_prob`, the long-length score): by the chain rule the oracle's next-token
probabilities of one string telescope, ``Π_{t≥1} p(x_t | x_{<t}, |x| = L) = I(x) / I(x_0, ∗, …, ∗)``, where
``I`` is the root's inside probability with the given emissions (∗ = wildcard ``β(A, 1)``), so
``log p(x_{1:L−1} | x_0, |x| = L)`` -- the sum of the log-probabilities the per-prefix oracle gives to the
observed tokens -- costs two inside passes, ``O(L³ N³)``, instead of ``O(L⁴ N³)``. The full-string pass
multiplies every emission by ``e²`` (and subtracts ``2L``) so that strings of 256 tokens stay far from
float64's underflow.

Probe targets (:func:`span_log_inside`, used by :mod:`longlab.lab.probes`): ``log β(A, t − w + 1, t)``, the
inside probability of each nonterminal over the observed span of width w ending at t.
"""

from __future__ import annotations

import bisect

import torch

__all__ = [
    "Grammar", "inside_chart", "inside_spans", "length_inside", "next_token_probs", "random_grammar",
    "sample_string", "span_log_inside", "string_log_prob",
]


class Grammar:
    """``binary: [N, N, N]`` = P(A → B C), ``unary: [N, T]`` = P(A → a); rows sum to 1 over both."""

    def __init__(self, binary: torch.Tensor, unary: torch.Tensor) -> None:
        self.binary = binary.double()
        self.unary = unary.double()
        self.n, self.t = unary.shape


def random_grammar(nonterminals: int, terminals: int, alpha: float, gen: torch.Generator) -> Grammar:
    shape = (nonterminals, nonterminals * nonterminals + terminals)
    conc = torch.full(shape, float(alpha), dtype=torch.float64)
    g = torch._standard_gamma(conc, generator=gen)
    p = g / g.sum(-1, keepdim=True)
    n = nonterminals
    return Grammar(p[:, : n * n].reshape(n, n, n), p[:, n * n :])


def length_inside(g: Grammar, max_len: int) -> torch.Tensor:
    """``β(A, n)`` for n = 1..max_len: ``[max_len + 1, N]`` (row 0 unused)."""
    beta = torch.zeros(max_len + 1, g.n, dtype=torch.float64)
    beta[1] = g.unary.sum(-1)
    for n in range(2, max_len + 1):
        acc = torch.zeros(g.n, dtype=torch.float64)
        for k in range(1, n):
            acc = acc + torch.einsum("abc,b,c->a", g.binary, beta[k], beta[n - k])
        beta[n] = acc
    return beta


def _split_cdf(g: Grammar, a: int, n: int, beta: torch.Tensor) -> list[float]:
    """Cumulative distribution of ``(k, B, C)`` for expanding ``A`` over ``n`` terminals (``n = 1``: the
    terminal distribution); cached on ``g`` for spans of up to 32 terminals (training lengths)."""
    cache = g.__dict__.setdefault("_cdf", {})
    key = (a, n, id(beta))
    if key in cache:
        return cache[key]
    if n == 1:
        w = g.unary[a]
    else:
        ks = torch.arange(1, n)
        w = (g.binary[a][None] * beta[ks][:, :, None] * beta[n - ks][:, None, :]).flatten()  # [(n−1)·N·N]
    cdf = w.cumsum(0)
    cdf = (cdf / cdf[-1]).tolist()
    if n <= 32:
        cache[key] = cdf
    return cdf


def sample_string(
    g: Grammar, length: int, beta: torch.Tensor, gen: torch.Generator, root: int = 0
) -> torch.Tensor:
    """One string of exactly ``length`` terminals derived from ``root`` (top-down, conditioned on length:
    ``A → B C`` with split k drawn with probability ∝ ``P(A → B C) β(B, k) β(C, n − k)``, by inverse-CDF
    sampling with one uniform per node from ``gen``)."""
    out: list[int] = []
    stack = [(root, length)]
    u = torch.rand(2 * length, generator=gen, dtype=torch.float64).tolist()  # 2L − 1 nodes
    while stack:
        a, n = stack.pop()
        cdf = _split_cdf(g, a, n, beta)
        idx = min(bisect.bisect_right(cdf, u.pop()), len(cdf) - 1)
        if n == 1:
            out.append(idx)
            continue
        k, rest = divmod(idx, g.n * g.n)
        b, c = divmod(rest, g.n)
        stack.append((c, n - (k + 1)))  # right child popped after the left one
        stack.append((b, k + 1))
    return torch.tensor(out)


def inside_spans(g: Grammar, emit: torch.Tensor, max_width: int | None = None) -> list[torch.Tensor]:
    """Inside probabilities of every span up to ``max_width`` (default: all): entry ``m`` is
    ``[R, L − m + 1, N]``, the inside ``β(A, i, i + m − 1)`` by start ``i`` (entry 0 is empty)."""
    r, length, n = emit.shape
    top = length if max_width is None else min(length, max_width)
    spans = [emit[:, :0], emit]  # spans[m]: [R, L − m + 1, N], the inside of spans of length m by start
    rules = g.binary.reshape(n, n * n).T  # [N·N, N]
    for m in range(2, top + 1):
        width = length - m + 1
        left = torch.stack([spans[k][:, :width] for k in range(1, m)], dim=1)  # [R, m−1, W, N]
        right = torch.stack([spans[m - k][:, k : k + width] for k in range(1, m)], dim=1)
        pairs = left.permute(0, 2, 3, 1) @ right.permute(0, 2, 1, 3)  # Σ_k β(B) β(C): [R, W, N, N]
        spans.append(pairs.reshape(r, width, n * n) @ rules)
    return spans


def span_log_inside(g: Grammar, x: torch.Tensor, widths: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The PCFG probe targets: ``log β(A, t − w + 1, t)`` (the inside probability that nonterminal A
    derives the observed span of width w ending at t) for ``x: [B, L]`` -> ``[B, L, len(widths), N]``;
    NaN where the span would start before the string (t < w − 1). Clamped at log 1e-300."""
    b, length = x.shape
    spans = inside_spans(g, g.unary.T[x], max(widths))
    out = torch.full((b, length, len(widths), g.n), float("nan"), dtype=torch.float64)
    for j, w in enumerate(widths):
        if w <= length:
            out[:, w - 1 :, j] = torch.log(spans[w].clamp_min(1e-300))  # start i = t − w + 1
    return out


def inside_chart(g: Grammar, emit: torch.Tensor) -> torch.Tensor:
    """Inside probability of the whole span for each row: ``emit: [R, L, N]`` (P(A → x_i), or β(A, 1)
    for a wildcard) -> ``[R, N]``."""
    return inside_spans(g, emit)[emit.shape[1]][:, 0]


def next_token_probs(g: Grammar, x: torch.Tensor, root: int = 0) -> torch.Tensor:
    """``x: [B, L]`` -> ``[B, L, T]``: row t is ``p(x_{t+1} | x_{1..t}, |x| = L)`` for t = 0..L−2 (0-based:
    the distribution of ``x[:, t + 1]`` given ``x[:, :t + 1]``); the last row is zeros."""
    b, length = x.shape
    wild = g.unary.sum(-1)  # β(A, 1)
    out = torch.zeros(b, length, g.t, dtype=torch.float64)
    fixed = g.unary.T[x]  # [B, L, N] emission of the observed tokens
    rows = []
    for t in range(length - 1):  # predict position t + 1
        e = fixed.clone()
        e[:, t + 1 :] = wild
        rows.append(e)
    emit = torch.stack(rows, dim=1).reshape(b * (length - 1), length, g.n)
    leaf = torch.ones(b * (length - 1), g.n, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(length - 1).repeat(b) + 1  # the leaf of each row
    onehot = torch.nn.functional.one_hot(pos, length).to(torch.float64)[..., None]  # [R, L, 1]
    with torch.enable_grad():  # also under torch.no_grad() (evaluation): the outside pass is a gradient
        emit = emit * (1 - onehot) + onehot * leaf[:, None, :]
        z = inside_chart(g, emit)[:, root].sum()
        outside = torch.autograd.grad(z, leaf)[0]  # [R, N]
    num = outside @ g.unary  # [R, T]
    out[:, :-1] = (num / num.sum(-1, keepdim=True)).reshape(b, length - 1, g.t)
    return out


def string_log_prob(g: Grammar, x: torch.Tensor, root: int = 0) -> torch.Tensor:
    """``x: [B, L]`` -> ``[B]`` float64: ``log p(x_{1:L−1} | x_0, |x| = L) = Σ_{t=1}^{L−1} log p(x_t | x_{<t},
    |x| = L)``, the log-probability the next-token oracle (:func:`next_token_probs`) gives to the observed
    continuation, from two inside passes (module docstring): ``log I(x) − log I(x_0, ∗, …, ∗)``. ``−inf``
    where the grammar cannot derive ``x``."""
    b, length = x.shape
    scale = 2.0  # log of the per-emission factor: the scaled inside of a span of m tokens is e^{2m} I
    fixed = g.unary.T[x] * torch.exp(torch.tensor(scale, dtype=torch.float64))  # [B, L, N]
    log_full = torch.log(inside_chart(g, fixed)[:, root]) - scale * length  # [B] log I(x)
    cache = g.__dict__.setdefault("_first", {})  # independent of x: once per (root, length)
    log_first = cache.get((root, length))
    if log_first is None:
        first = g.unary.sum(-1).expand(g.t, length, g.n).clone()  # [T, L, N]: x_0 = a, the rest wildcards
        first[:, 0] = g.unary.T
        log_first = cache[root, length] = torch.log(inside_chart(g, first)[:, root])  # [T] log I(a, ∗…∗)
    return log_full - log_first[x[:, 0]]
