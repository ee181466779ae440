"""Mixture of transition distributions (D'Angelo & Flammarion, arXiv 2604.10848): how close is a trained
lab model's next-token distribution to the Bayes-optimal predictor, and to the MD-n estimator (n steps of
entropic mirror descent on the in-context likelihood of the lag weights λ), which the paper says
transformers approximate?

    python bench/lab_mtd.py runs/lab/ckpt/mtd/softmax/seed0 --lengths 64 256 --samples 24 \\
        --steps 1 2 5 20 --etas 0.5 1 2 4 --out bench/results/lab_results/mtd_md.json

Per length: mean over samples and scored positions of ``KL(p_Bayes ‖ q_model)``, ``KL(p_MD ‖ q_model)``
for each (n, η), and ``KL(p_Bayes ‖ p_MD)``, with 95% bootstrap intervals over the samples. The MD-n
prediction at position t uses λ estimated from ``x_{≤t}`` only (causal), then ``Σ_k λ_k Q(x_{t+1−k}, ·)``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from longlab.eval.stats import score_estimate
from longlab.lab.evaluate import eval_generator
from longlab.lab.tasks import mirror_descent, task_config
from longlab.lab.train import load_checkpoint


def md_predictions(task, x: torch.Tensor, steps: int, eta: float) -> torch.Tensor:
    """Causal MD-n predictions ``[B, T, S]`` (uniform before lag K is reachable)."""
    b, t = x.shape
    k = task.lags
    rows = task.lag_rows(x)  # [B, T, K, S]
    out = torch.full((b, t, task.states), 1.0 / task.states)
    for i in range(k, t):  # λ from x_{≤i}: needs at least one transition x_{k} given lags
        lam = mirror_descent(task, x[:, : i + 1], steps, eta)  # [B, K]
        out[:, i] = (lam[..., None] * rows[:, i]).sum(-2)
    return out


def kl(p: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of ``KL(p ‖ q)`` per sample ``[B]``."""
    v = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
    return (v * mask).sum(-1) / mask.sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5, 20])
    ap.add_argument("--etas", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--out", default="bench/results/lab_results/mtd_md.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, cfg, man = load_checkpoint(args.ckpt)
    task = task_config(cfg.task, cfg.seed)
    report = {"ckpt": args.ckpt, "task": cfg.task, "mixer": cfg.mixer, "train_len": cfg.train_len,
              "load": os.getloadavg()[0], "lengths": {}}
    for length in args.lengths:
        parts = [task.sample(1, length, eval_generator(0, length, i)) for i in range(args.samples)]
        x = torch.cat([p.tokens for p in parts])
        bayes = torch.cat([p.probs for p in parts])
        mask = torch.cat([p.answer for p in parts]).float()
        with torch.no_grad():
            logq = torch.log_softmax(model(x).float(), -1)
        res = {"kl_bayes_model": kl(bayes, logq, mask).tolist(), "md": {}}
        for n in args.steps:
            for eta in args.etas:
                md = md_predictions(task, x, n, eta)
                res["md"][f"n={n},eta={eta:g}"] = {
                    "kl_md_model": kl(md, logq, mask).tolist(),
                    "kl_bayes_md": kl(bayes, torch.log(md.clamp_min(1e-30)), mask).tolist(),
                }
        report["lengths"][str(length)] = res
        e = score_estimate(res["kl_bayes_model"])
        print(f"T={length}: KL(Bayes‖model) {e.mean:.4f} [{e.low:.4f}, {e.high:.4f}] nats", flush=True)
        best = sorted(res["md"].items(), key=lambda kv: sum(kv[1]["kl_md_model"]))
        for name, v in best[:4]:
            a, b = score_estimate(v["kl_md_model"]), score_estimate(v["kl_bayes_md"])
            print(f"   MD {name:>14}: KL(MD‖model) {a.mean:.4f} [{a.low:.4f}, {a.high:.4f}]  "
                  f"KL(Bayes‖MD) {b.mean:.4f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report) + "\n")
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
