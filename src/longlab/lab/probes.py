"""Linear probes of parsing information in a lab model trained on the ``pcfg`` task.

"How Transformers Represent Hierarchies: A Local-to-Global Mechanism" (ICML 2026; arXiv id and code not
found) [abs]: hidden states of a transformer trained on PCFG strings contain the quantities classical
parsers use; local patterns form in early layers, a compact global summary in later ones. The probe
[recon, spec §30]: a ridge-regression map from the residual stream at position t of layer ℓ
(``LabLM.hidden_states``: ℓ = 0 is the embedding) to the exact log inside probabilities
``log β(A, t − w + 1, t)`` of the span of width w ending at t, for every nonterminal A
(:func:`longlab.lab.pcfg.span_log_inside`, the inside algorithm). Fitted on ``n_train`` strings and scored
on ``n_test`` other strings by the pooled

    R² = 1 − Σ (y − ŷ)² / Σ (y − ȳ)²      (over positions t ≥ w − 1 and the N nonterminals; ȳ per output)

Local-to-global predicts that the best layer for width w rises with w. ``control=True`` also probes a
freshly initialised model of the same configuration (what the architecture gives without training).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..recipe import LonglabError
from .pcfg import span_log_inside

__all__ = ["pcfg_probes", "probe_checkpoint", "probe_r2", "ridge_fit"]


def ridge_fit(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression on standardised features: ``x: [M, D]``, ``y: [M, K]`` -> ``(W [D + 1, K],
    scale [2, D])`` so that ``ŷ = [(x − μ)/σ, 1] @ W`` (the intercept is not penalised)."""
    x, y = x.double(), y.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-8)
    z = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    reg = ridge * len(x) * torch.eye(z.shape[1], dtype=x.dtype)
    reg[-1, -1] = 0.0
    w = torch.linalg.solve(z.T @ z + reg, z.T @ y)
    return w, torch.stack([mu, sd])


def probe_r2(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
             ridge: float = 1e-3) -> float:
    """Held-out pooled R² of a ridge probe (see the module docstring); ``x: [M, D]``, ``y: [M, K]``."""
    w, (mu, sd) = ridge_fit(x_train, y_train, ridge)
    z = torch.cat([(x_test.double() - mu) / sd, torch.ones(len(x_test), 1, dtype=torch.float64)], dim=1)
    pred = z @ w
    yt = y_test.double()
    sst = ((yt - yt.mean(0)) ** 2).sum()
    return float(1 - ((yt - pred) ** 2).sum() / sst.clamp_min(1e-30))


def _pairs(states: torch.Tensor, targets: torch.Tensor, j: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (position t ≥ w − 1 of every string) for width index j: ``[M, D]``, ``[M, N]``."""
    return states[:, w - 1 :].flatten(0, 1), targets[:, w - 1 :, j].flatten(0, 1)


def pcfg_probes(
    states_fn: Callable[[torch.Tensor], torch.Tensor],
    grammar: Any,
    strings_train: torch.Tensor,
    strings_test: torch.Tensor,
    widths: Sequence[int] = (2, 4, 8, 16),
    ridge: float = 1e-3,
) -> dict[str, Any]:
    """Probe every layer for every width. ``states_fn(tokens [B, L]) -> [n_layers + 1, B, L, D]``
    (``LabLM.hidden_states``); ``strings_*: [B, L]`` PCFG strings of ``grammar``. Returns ``{"r2":
    {layer: {width: R²}}, "best_layer": {width: layer}, "n_train", "n_test", "length"}``."""
    widths = [int(w) for w in widths]
    length = strings_train.shape[1]
    if not widths or any(w < 1 or w > length for w in widths):
        raise LonglabError(f"--widths: each width must be in 1..{length} (the string length), got {widths}")
    if strings_test.shape[1] != length:
        raise LonglabError("pcfg probes: train and test strings must have one length")
    with torch.no_grad():
        h_tr, h_te = states_fn(strings_train), states_fn(strings_test)
    y_tr = span_log_inside(grammar, strings_train, widths)
    y_te = span_log_inside(grammar, strings_test, widths)
    r2: dict[int, dict[int, float]] = {}
    for layer in range(h_tr.shape[0]):
        r2[layer] = {}
        for j, w in enumerate(widths):
            xa, ya = _pairs(h_tr[layer], y_tr, j, w)
            xb, yb = _pairs(h_te[layer], y_te, j, w)
            r2[layer][w] = probe_r2(xa, ya, xb, yb, ridge)
    best = {w: max(r2, key=lambda layer: r2[layer][w]) for w in widths}
    return {"r2": r2, "best_layer": best, "n_train": len(strings_train), "n_test": len(strings_test),
            "length": length, "widths": widths}


def probe_checkpoint(
    ckpt: str, length: int = 0, widths: Sequence[int] = (2, 4, 8, 16), n_train: int = 256, n_test: int = 128,
    seed: int = 0, ridge: float = 1e-3, control: bool = True,
) -> dict[str, Any]:
    """:func:`pcfg_probes` of the ``pcfg`` model in ``ckpt`` on fresh strings of ``length`` (default: the
    training length) of its grammar; with ``control`` also of an untrained model of the same shape."""
    from .model import LabLM
    from .pcfg import sample_string
    from .tasks import PCFGTask, task_config
    from .train import load_checkpoint

    model, cfg, manifest = load_checkpoint(ckpt, "DIR")
    task = task_config(cfg.task, cfg.seed)
    if not isinstance(task, PCFGTask):
        raise LonglabError(f"DIR: the probes need a model trained on the pcfg task, not {cfg.task!r}")
    length = length or cfg.train_len
    for name, value in (("--train", n_train), ("--test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise LonglabError(f"{name}: must be an integer >= 2, got {value!r}")
    task.check_length(length)
    gen = torch.Generator().manual_seed(90_000 + seed)
    strings = torch.stack([sample_string(task.grammar, length, task.beta, gen)
                           for _ in range(n_train + n_test)])
    tr, te = strings[:n_train], strings[n_train:]
    out = {"checkpoint": str(ckpt), "mixer": cfg.mixer, "positions": cfg.positions, "task": cfg.task,
           "train_len": cfg.train_len, "train_steps": manifest["step"], "ridge": ridge,
           "trained": pcfg_probes(model.hidden_states, task.grammar, tr, te, widths, ridge)}
    if control:
        torch.manual_seed(cfg.seed)
        fresh = LabLM(model.cfg).eval()
        out["untrained"] = pcfg_probes(fresh.hidden_states, task.grammar, tr, te, widths, ridge)
    return out
