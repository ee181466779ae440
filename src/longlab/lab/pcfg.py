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
"""

from __future__ import annotations

import torch

__all__ = ["Grammar", "inside_chart", "length_inside", "next_token_probs", "random_grammar", "sample_string"]


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


def sample_string(
    g: Grammar, length: int, beta: torch.Tensor, gen: torch.Generator, root: int = 0
) -> torch.Tensor:
    """One string of exactly ``length`` terminals derived from ``root`` (top-down, conditioned on length)."""
    out: list[int] = []
    stack = [(root, length)]
    while stack:
        a, n = stack.pop()
        if n == 1:
            out.append(int(torch.multinomial(g.unary[a], 1, generator=gen)[0]))
            continue
        ks = torch.arange(1, n)
        w = g.binary[a][None] * beta[ks][:, :, None] * beta[n - ks][:, None, :]  # [n-1, N, N]
        idx = int(torch.multinomial(w.flatten(), 1, generator=gen)[0])
        k, rest = divmod(idx, g.n * g.n)
        b, c = divmod(rest, g.n)
        stack.append((c, n - (k + 1)))  # right child popped after the left one
        stack.append((b, k + 1))
    return torch.tensor(out)


def inside_chart(g: Grammar, emit: torch.Tensor) -> torch.Tensor:
    """Inside probability of the whole span for each row: ``emit: [R, L, N]`` (P(A → x_i), or β(A, 1)
    for a wildcard) -> ``[R, N]``."""
    r, length, n = emit.shape
    spans = [None, emit]  # spans[m]: [R, L − m + 1, N], the inside of spans of length m by start
    rules = g.binary.reshape(n, n * n).T  # [N·N, N]
    for m in range(2, length + 1):
        width = length - m + 1
        left = torch.stack([spans[k][:, :width] for k in range(1, m)], dim=1)  # [R, m−1, W, N]
        right = torch.stack([spans[m - k][:, k : k + width] for k in range(1, m)], dim=1)
        pairs = left.permute(0, 2, 3, 1) @ right.permute(0, 2, 1, 3)  # Σ_k β(B) β(C): [R, W, N, N]
        spans.append(pairs.reshape(r, width, n * n) @ rules)
    return spans[length][:, 0]


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
    emit = emit * (1 - onehot) + onehot * leaf[:, None, :]
    with torch.enable_grad():
        z = inside_chart(g, emit)[:, root].sum()
        outside = torch.autograd.grad(z, leaf)[0]  # [R, N]
    num = outside @ g.unary  # [R, T]
    out[:, :-1] = (num / num.sum(-1, keepdim=True)).reshape(b, length - 1, g.t)
    return out
