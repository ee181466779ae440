"""Forward time and memory of one lab mixer layer vs sequence length, with ratios to softmax from the
same run (interleaved repeats, medians). The linear-time claims (RACE, LaCT, L2A, linear, Mamba) show
as ratios that fall with length.

    python bench/lab_mixers.py --lengths 256 1024 4096 16384 --repeats 3 --out bench/results/lab_mixers.json

One layer (D = 64, H = 4, B = 1, float32, no grad) built from the sweep's specs (ultramem: attention
plus its parallel memory layer; no MLP anywhere). ``l2a@R`` routes exactly the top fraction R of the tokens
to global attention (``l2a`` alone: a random router, about half). Memory: the peak of
the profiler's CPU allocation timeline during one forward (``torch.profiler``, ``profile_memory``),
i.e. the largest live set of tensors the layer allocates. A mixer whose forward exceeds ``--budget-s``
is not run at longer lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from longlab.lab.mixers import mixer_config
from longlab.lab.positions import Positions

SPECS = {
    "softmax": "softmax", "ssmax": "ssmax", "asentmax": "asentmax", "lssa": "lssa", "lssar": "lssar",
    "race": "race", "l2a": "l2a:window=16", "lact": "lact:chunk=16,window=16", "ultramem": "ultramem",
    "linear": "linear", "mamba": "mamba:expand=1,d_state=8",
}


class WithMemory(torch.nn.Module):
    """A mixer plus its parallel memory (UltraMemV2), so the row counts the memory's cost too."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.mod = mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mod(x) + self.mod.parallel_ffn(x)


class FixedRate(torch.nn.Module):
    """L2A whose router sends the top ``rate`` fraction of each sequence's tokens to global attention
    (random router weights, threshold at the (1 − rate) quantile of this input's gate logits)."""

    def __init__(self, mod: torch.nn.Module, rate: float) -> None:
        super().__init__()
        self.mod, self.rate = mod, rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.mod.router(x)[..., 0]
        k = max(1, round(self.rate * x.shape[1]))
        cut = logits.topk(k, dim=-1).values[..., -1:]  # [B, 1]: the k-th largest logit
        self.mod.gate = lambda h: torch.where(logits >= cut, 0.75, 0.25).to(h.dtype)  # 1[g > τ] on top k
        return self.mod(x)


def build(name: str, dim: int, heads: int) -> torch.nn.Module:
    base, _, rate = name.partition("@")
    cfg = mixer_config(SPECS[base])
    pos = Positions(cfg.default_positions, heads, dim // heads)
    mod = cfg.build(dim, heads, pos).eval()
    router = getattr(mod, "router", None)
    if router is not None:  # L2A with random router weights: routes ~50% of tokens to global attention
        torch.nn.init.normal_(router.weight, std=1.0)
    if rate:  # "l2a@0.1": exactly that fraction of tokens routed (the trained router's rate)
        return FixedRate(mod, float(rate))
    return WithMemory(mod) if getattr(mod, "parallel_ffn", None) is not None else mod


def peak_mb(mod: torch.nn.Module, x: torch.Tensor) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.no_grad():
        mod(x)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixers", nargs="+", default=list(SPECS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=20.0)
    ap.add_argument("--out", default="bench/results/lab_mixers.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    header = (f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}, load at start {os.getloadavg()[0]:.2f}")
    print("#", header, flush=True)
    mods = {m: build(m, args.dim, args.heads) for m in args.mixers}
    alive = set(args.mixers)
    with torch.no_grad():  # warm-up
        for mod in mods.values():
            mod(torch.randn(1, 64, args.dim))
    results = []
    for length in args.lengths:
        x = torch.randn(1, length, args.dim)
        times: dict[str, list[float]] = {m: [] for m in args.mixers if m in alive}
        for r in range(args.repeats):
            order = [m for m in args.mixers if m in times]
            order = order[r % len(order):] + order[: r % len(order)]  # rotate: interleaved repeats
            for m in order:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    mods[m](x)
                    times[m].append(time.perf_counter() - t0)
        base = statistics.median(times["softmax"]) if "softmax" in times else None
        for m, ts in times.items():
            med = statistics.median(ts)
            mem = peak_mb(mods[m], x)
            row = {"mixer": m, "spec": SPECS[m.partition("@")[0]], "length": length, "median_ms": med * 1e3,
                   "ratio_to_softmax": (med / base) if base else None, "peak_mb": mem,
                   "repeats": len(ts), "load": os.getloadavg()[0]}
            results.append(row)
            ratio = f"{med / base:6.2f}×" if base else "   -  "
            print(f"{m:>9} T={length:>6}: {med * 1e3:9.1f} ms  {ratio}  peak {mem:8.1f} MB", flush=True)
            rate = getattr(getattr(mods[m], "mod", mods[m]), "last_rate", None)
            if rate is not None:
                row["global_rate"] = rate
            if med > args.budget_s:
                alive.discard(m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "rows": results}, indent=1) + "\n")
    print(f"# wrote {out}; load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
