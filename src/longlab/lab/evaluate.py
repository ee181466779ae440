"""``longlab lab eval``: test a trained lab model at many lengths and store one row per sample in the
results store (``results.sqlite``) that ``longlab eval`` writes, so ``longlab report`` shows score vs
length with one line (recipe) per mixer.

Row fields: ``model = "lab-<task name>-train<train_len>"``, ``recipe = <mixer spec>[+<positions>]`` (the
positions only when not the mixer's default), ``method = <mixer spec>``,
``task = <task spec>``, ``length``, ``sample_id``, ``seed = <training seed>`` (several training seeds of
one mixer are then several samples of one recipe), ``score`` (the task's per-sample score), and in
``extra``: params, training tokens and steps, positions, the checkpoint, and ``kl`` for tasks with
exact next-token distributions. Samples depend only on (eval seed, task, length, sample index), so
every mixer is tested on the same sequences.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..eval.identity import config_hash, make_run_key, peak_rss_mb
from ..eval.store import ResultStore, check_results_dir
from ..recipe import LonglabError
from .tasks import task_config
from .train import load_checkpoint

__all__ = ["evaluate", "eval_generator", "recipe_name"]


def recipe_name(mixer: str, positions: str) -> str:
    """The row's recipe: the mixer spec, plus ``+<positions>`` when they are not the mixer's default
    (``softmax+nape``), so position controls get their own line."""
    from .mixers import mixer_config

    default = mixer_config(mixer).default_positions
    return mixer if positions == default else f"{mixer}+{positions}"


def eval_generator(seed: int, length: int, index: int) -> torch.Generator:
    """The generator of test sequence ``index`` at ``length`` for evaluation seed ``seed`` (what
    ``longlab lab eval`` samples with, so a script can rebuild exactly the sequences a row was scored on)."""
    return torch.Generator().manual_seed(((seed * 7_919 + length) * 104_729 + index) % (2**63 - 1))


def evaluate(
    ckpt: str | os.PathLike[str],
    lengths: Sequence[int],
    *,
    out: str | os.PathLike[str] | None = None,
    samples: int = 32,
    batch: int = 8,
    seed: int = 0,
    task: str | None = None,
    log: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """Evaluate the checkpoint in ``ckpt`` at ``lengths``; write rows to ``out`` (default ``ckpt``).
    ``task``: test on another variant of the trained task (same task, same vocabulary; e.g. an algebra
    mechanism set ``algebra:query=commuted`` or an unseen group); the rows then carry that spec."""
    model, cfg, manifest = load_checkpoint(ckpt, "DIR")
    if not lengths:
        raise LonglabError("--lengths: give at least one test length")
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int)]
    if bad:
        raise LonglabError(f"--lengths: integers expected, got {bad}")
    short = [n for n in lengths if n < cfg.train_len]
    if short:
        raise LonglabError(
            f"--lengths: the training length ({cfg.train_len}) is larger than test length(s) {short}; "
            f"test at lengths >= {cfg.train_len}"
        )
    for name, value in (("--samples", samples), ("--batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LonglabError(f"{name}: must be an integer >= 1, got {value!r}")
    trained = task_config(cfg.task, cfg.seed)
    task_spec = cfg.task if task is None else task
    tk = task_config(task_spec, cfg.seed)
    shapes = {(t.name, t.vocab_size, t.input_dim) for t in (tk, trained)}
    if len(shapes) > 1:
        raise LonglabError(
            f"--task: {task_spec!r} is not a variant of the trained task {cfg.task!r} (same task name and "
            f"vocabulary needed: {tk.name}/{tk.vocab_size} vs {trained.name}/{trained.vocab_size})"
        )
    for n in lengths:
        tk.check_length(n)
    target = Path(out) if out is not None else Path(ckpt)
    check_results_dir(target, "--out")
    identity = {"train": manifest["train"], "step": manifest["step"], "eval_seed": seed}
    if task_spec != cfg.task:
        identity["eval_task"] = task_spec
    chash = config_hash(identity)
    model_name = f"lab-{tk.name}-train{cfg.train_len}"
    recipe = recipe_name(cfg.mixer, cfg.positions)
    rows: list[dict[str, Any]] = []
    with ResultStore(target, what="--out") as store, torch.no_grad():
        for length in lengths:
            keys = [
                make_run_key(model=model_name, recipe=recipe, task=task_spec, length=length, sample_id=i,
                             seed=cfg.seed, config_hash=chash)
                for i in range(samples)
            ]
            todo = [i for i, k in enumerate(keys) if not store.has(k)]
            for s in range(0, len(todo), batch):
                idx = todo[s : s + batch]
                parts = [tk.sample(1, length, eval_generator(seed, length, i)) for i in idx]
                tokens = torch.cat([p.tokens for p in parts])
                t0 = time.perf_counter()
                logits = tk.predict(model, tokens)  # one forward (forecasting tasks: a rollout)
                secs = (time.perf_counter() - t0) / len(idx)
                rates = [getattr(b.mixer, "last_rate", None) for b in model.blocks]
                rates = [r for r in rates if r is not None]
                for j, (i, part) in enumerate(zip(idx, parts)):
                    lj = logits[j : j + 1]
                    score = float(tk.score(lj, part)[0])
                    extra: dict[str, Any] = {
                        "params": manifest["params"], "train_tokens": manifest["train_tokens"],
                        "train_steps": manifest["step"], "train_len": cfg.train_len,
                        "positions": cfg.positions, "checkpoint": str(Path(ckpt)),
                        "answers_per_sample": int(part.answer.sum()),
                    }
                    if rates:  # L2A: fraction of tokens routed to global attention (batch mean, all layers)
                        extra["global_rate"] = sum(rates) / len(rates)
                    extra.update(tk.metrics(lj, part))
                    row = {
                        "run_key": keys[i], "model": model_name, "recipe": recipe, "method": cfg.mixer,
                        "task": task_spec, "length": length, "sample_id": str(i), "seed": cfg.seed,
                        "score": score, "prefill_s": secs, "context_tokens": length,
                        "config_hash": chash, "recipe_repr": repr(cfg.model_config()),
                        "peak_rss_mb": peak_rss_mb(), **extra,
                    }
                    store.add(row)
                    rows.append(row)
            if log:
                mine = store.rows(model=model_name, recipe=recipe, task=task_spec, length=length,
                                  seed=cfg.seed, config_hash=chash)
                mine = [r for r in mine if (r.get("extra") or {}).get("answers_per_sample") != 0]
                mean = sum(r["score"] for r in mine) / max(1, len(mine))
                log(f"{recipe:>12} {task_spec} length {length:>6}: score {mean:.3f} (n={len(mine)})")
    return rows
