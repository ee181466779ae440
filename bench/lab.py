"""The layers lab's analyses and timings beside ``longlab lab train/eval``: train-short/test-long sweeps,
FLOPs, L-CUBE ceilings, mechanism sets, mixer speed, MTD, PCFG baselines and long PCFG, seed differences.

Subcommands (``python bench/lab.py SUB --help`` for each one's options):

- ``extrapolation``: Layers lab, train short / test long: train every mixer on one task with equal
  parameters and equal training tokens, then test at many lengths into one results store (resumable:
  finished trainings and stored rows are skipped, so a sweep can be run in pieces of a few mixers).
- ``flops``: Forward FLOPs per token of the trained layers-lab models (matmul FLOPs, 2 per multiply-add),
  counted by ``torch.utils.flop_counter.FlopCounterMode`` on the real forward, next to the analytic per-
  layer counts of softmax attention, LaCT and UltraMemV2, so "recall per FLOP" can be judged.
- ``lcube``: L-CUBE reference curves: the utilisation ceiling ``U_w(L)`` of the best predictor that sees
  only the last ``w`` tokens (exact Gaussian conditioning on the window, :meth:`Conditional.window_info`),
  and for every trained lab model in a results store its utilisation ``U(L)`` and *effective context*: the
  smallest window ``w`` whose ceiling reaches the model's U (the spec's "utilised length", read off the
  ceiling curves).
- ``mechanisms``: The in-context algebra mechanism sets (and unseen-group sets) per mixer, from a lab
  results store: accuracy on the held-out query of each set, with the Wilson interval over test sequences,
  and the gap ``commuted − absent`` (copying; the two sets are different sequences, so unpaired) with
  Newcombe's interval from the two Wilson intervals.
- ``mixers``: Forward time and memory of one lab mixer layer vs sequence length, with ratios to softmax from
  the same run (interleaved repeats, medians).
- ``mtd``: Mixture of transition distributions (D'Angelo & Flammarion, arXiv 2604.10848): how close is a
  trained lab model's next-token distribution to the Bayes-optimal predictor, and to the MD-n estimator (n
  steps of entropic mirror descent on the in-context likelihood of the lag weights λ), which the paper says
  transformers approximate?.
- ``pcfg-baselines``: How much of a PCFG task's next token a parse-free predictor gets: the unigram and the
  bigram predictors fitted on the exact oracle at the training length, scored like ``longlab lab eval`` on
  the same test strings.
- ``pcfg-long``: PCFG to 16x the training length with the string oracle (``oracle=string``): evaluate the
  trained PCFG models at long lengths, then tabulate ``exp(−excess NLL per token)``.
- ``seeds``: Mixer-vs-mixer differences over training seeds, from a lab results store: for each pair and
  length, the difference of the seed-mean scores with a Welch t-interval over the per-seed means (each
  seed's mean over the same test sequences), and the paired test-sequence bootstrap of the seed-averaged
  scores; a difference is called significant only when both 95% intervals exclude 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import interleaved, run_subcommand
from scipy import stats
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from longlab.eval.stats import paired_difference, score_estimate
from longlab.lab.evaluate import eval_generator, evaluate
from longlab.lab.mixers import mixer_config
from longlab.lab.plot import cell_estimate, lab_rows
from longlab.lab.positions import Positions
from longlab.lab.tasks import mirror_descent, task_config
from longlab.lab.train import TrainConfig, load_checkpoint, train

# ---- extrapolation (was bench/lab.py extrapolation) ----------------------------------------

DOC_EXTRAPOLATION = """
Layers lab, train short / test long: train every mixer on one task with equal parameters and equal
training tokens, then test at many lengths into one results store (resumable: finished trainings and
stored rows are skipped, so a sweep can be run in pieces of a few mixers).

    python bench/lab.py extrapolation --task mqar --mixers softmax ssmax --seeds 0 \\
        --train-len 64 --steps 600 --lengths 64 128 256 512 1024 --root runs/lab

A mixer name ``NAME+POS`` trains ``NAME``'s spec with positions ``POS`` (``softmax+nape``: the NAPE control).
Writes ``ROOT/ckpt/<task>[/<tag>]/<mixer>/seed<s>/`` and ``ROOT/results/results.sqlite``; prints one line per
model (parameters, training seconds, final loss) and per length (mean score). ``--tag`` keeps runs of other
settings of one task (``mqar:alphabet=16``, other step counts) in their own checkpoint directories.
``--variants`` also tests each model on variants of its task (the algebra mechanism sets, an unseen group).
""".lstrip("\n")

EXTRAPOLATION_SPECS = {
    "softmax": "softmax",
    "ssmax": "ssmax",
    "asentmax": "asentmax",
    "lssa": "lssa",
    "lssar": "lssar",
    "race": "race",
    "l2a": "l2a:window=16",
    "l2a-hard": "l2a:window=16,hard_rate=true",  # the rate term on the STE gate (the routed fraction)
    "lact": "lact:chunk=16,window=16",
    "ultramem": "ultramem",
    "linear": "linear",
    "mamba": "mamba:expand=1,d_state=8",
}


def extrapolation_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_EXTRAPOLATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True)
    ap.add_argument("--mixers", nargs="+", default=list(EXTRAPOLATION_SPECS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--train-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--params", type=int, default=110_000)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--root", default="runs/lab")
    ap.add_argument("--tag", default="", help="checkpoint subdirectory for these settings")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="also test every model on these variants of the task (algebra:query=commuted, ...)")
    ap.add_argument("--variant-lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--variant-samples", type=int, default=64)
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="start no new model after this many minutes (0: no limit); re-run to continue")
    args = ap.parse_args()
    start = time.perf_counter()
    last = 0.0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}", flush=True)
    root = Path(args.root)
    for seed in args.seeds:
        for name in args.mixers:
            base, _, positions = name.partition("+")
            spec = EXTRAPOLATION_SPECS.get(base, base)
            cfg = TrainConfig(mixer=spec, task=args.task, train_len=args.train_len, steps=args.steps,
                              batch=args.batch, lr=args.lr, seed=seed, params=args.params, ckpt_every=100,
                              positions=positions)
            ck = root / "ckpt" / args.task.split(":")[0] / args.tag / name / f"seed{seed}"
            spent = time.perf_counter() - start
            if args.max_minutes and spent + 1.3 * last > 60 * args.max_minutes:
                print(f"# time cap: stopping before {name} seed {seed} ({spent:.0f} s); re-run to continue")
                return
            t0 = time.perf_counter()
            man = train(cfg, ck, progress=False, log=None)
            t1 = time.perf_counter()
            print(f"{name:>9} seed {seed}: {man['params']} params, {man['train_tokens']} tokens, "
                  f"train {man['elapsed_s']:.0f} s, loss {man['history'][-1]['loss']:.3f}", flush=True)
            evaluate(ck, args.lengths, out=root / "results", samples=args.samples, batch=8,
                     log=lambda s: print("   " + s, flush=True))
            for variant in args.variants:
                evaluate(ck, args.variant_lengths, out=root / "results", samples=args.variant_samples,
                         batch=8, task=variant, log=lambda s: print("   " + s, flush=True))
            secs = time.perf_counter() - t1
            last = time.perf_counter() - t0
            print(f"          eval {secs:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)


def _run_extrapolation() -> object:
    extrapolation_main()


# ---- flops (was bench/lab.py flops) ----------------------------------------

DOC_FLOPS = """
Forward FLOPs per token of the trained layers-lab models (matmul FLOPs, 2 per multiply-add), counted by
``torch.utils.flop_counter.FlopCounterMode`` on the real forward, next to the analytic per-layer counts of
softmax attention, LaCT and UltraMemV2, so "recall per FLOP" can be judged.

    python bench/lab.py flops --root runs/lab --task passkey --lengths 64 256 1024 \\
        --out bench/results/lab_results/flops.json

Counted: matmuls, einsums and SDPA (FlopCounterMode has no formula for the CPU flash kernel
``_scaled_dot_product_flash_attention_for_cpu``; it is given torch's own SDPA formula, ``4·B·H·Tq·Tk·d``),
as implemented: attention in row chunks of 256 computes the whole masked chunk, so at T ≤ 256 it counts
T² score entries, twice the causal T(T+1)/2; sliding windows count their key slice.
Not counted: elementwise work (exponentials, gathers, the entmax sort, LSSA's elementwise passes).
"mixer" FLOPs include UltraMemV2's memory (called beside the MLP).
L2A's count is the trained router's actual routing at each length (eval path: a real gather).

Analytic per-layer counts per token at context position t (D = model dim, w = window, d_h = fast-weight
hidden, f = fast heads, C = chunk, h = key sets, r = Tucker rank, k = key dim, n = grid, d_v = value dim):

- softmax layer: ``8D² + 4D(t+1)`` (q, k, v, o projections; causal QKᵀ and AV);
- LaCT layer: ``8D² + 2D² + 6fD + 4D·min(t+1, w) + 6 d_h D + 12 d_h D`` (projections, output gate,
  learning rates, sliding window, the fast-weight apply and its chunk update, amortised per token);
- UltraMemV2 memory (beside the MLP): ``4D·hrk + 4hrnk + 4h²rn + 2h²(pre·r² + pre²·r) + 2h²d_vD``
  (row/column queries, key scores, rank-1 pre-selection, candidate grid scores, output projection).
""".lstrip("\n")

def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def analytic_layer(spec: str, dim: int, t: int) -> float | None:
    """Analytic matmul FLOPs of one mixer layer for the token at position t (None: not modelled)."""
    from longlab.lab.mixers import mixer_config

    cfg = mixer_config(spec)
    proj = 8 * dim * dim
    if cfg.name == "softmax":
        return proj + 4 * dim * (t + 1)
    if cfg.name == "lact":
        dh = cfg.inter_multi * dim // cfg.fast_heads
        return (proj + 2 * dim * dim + 6 * cfg.fast_heads * dim + 4 * dim * min(t + 1, cfg.window)
                + 18 * dh * dim)
    if cfg.name == "ultramem":
        h, r, k, n, pre = cfg.sets, cfg.rank, cfg.key_dim, cfg.grid, cfg.pre
        mem = (4 * dim * h * r * k + 4 * h * r * n * k + 4 * h * h * r * n
               + 2 * h * h * (pre * r * r + pre * pre * r) + 2 * h * h * cfg.d_v * dim)
        return proj + 4 * dim * (t + 1) + mem
    return None


def flops_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_FLOPS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/lab")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--mixers", nargs="+", default=["softmax", "lact", "ultramem", "l2a", "race", "linear",
                                                     "ssmax", "asentmax", "lssa", "lssar", "mamba"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--out", default="bench/results/lab_results/flops.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for name in args.mixers:
        ck = Path(args.root) / "ckpt" / args.task / name / "seed0"
        model, cfg, man = load_checkpoint(ck)
        task = task_config(cfg.task, cfg.seed)
        for length in args.lengths:
            b = task.sample(1, length, eval_generator(0, length, 0))
            with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as fc, torch.no_grad():
                model(b.tokens)
            total = fc.get_total_flops()
            by_mod = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
            mixer = sum(v for k, v in by_mod.items()
                        if re.fullmatch(r"LabLM\.blocks\.\d+\.mixer(\.parallel_ffn)?", k))
            ana = [analytic_layer(cfg.mixer, model.cfg.dim, t) for t in range(length)]
            row = {"mixer": name, "spec": cfg.mixer, "length": length, "params": man["params"],
                   "flops_per_token": total / length, "mixer_flops_per_token": mixer / length,
                   "analytic_mixer_per_token": (model.cfg.n_layers * sum(ana) / length) if ana[0] else None,
                   "mlp_hidden": model.cfg.hidden}
            rate = [getattr(blk.mixer, "last_rate", None) for blk in model.blocks]
            if rate[0] is not None:
                row["global_rate"] = sum(rate) / len(rate)
            rows.append(row)
            an = row["analytic_mixer_per_token"]
            an_k = an / 1e3 if an else float("nan")
            print(f"{name:>9} T={length:>5}: {total / length / 1e3:8.1f} kFLOP/token (mixers "
                  f"{mixer / length / 1e3:7.1f}k, analytic {an_k:7.1f}k)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"# wrote {out}")


def _run_flops() -> object:
    flops_main()


# ---- lcube (was bench/lab.py lcube) ----------------------------------------

DOC_LCUBE = """
L-CUBE reference curves: the utilisation ceiling ``U_w(L)`` of the best predictor that sees only the last
``w`` tokens (exact Gaussian conditioning on the window, :meth:`Conditional.window_info`), and for every
trained lab model in a results store its utilisation ``U(L)`` and *effective context*: the smallest window
``w`` whose ceiling reaches the model's U (the spec's "utilised length", read off the ceiling curves).

    python bench/lab.py lcube runs/lab/results --lengths 64 128 256 512 1024 \\
        --windows 1 2 4 8 16 32 64 128 256 512 1024 --out bench/results/lab_results/lcube_ceiling.json
""".lstrip("\n")

def lcube_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_LCUBE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--task", default="lcube")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--out", default="bench/results/lab_results/lcube_ceiling.json")
    args = ap.parse_args()
    task = task_config(args.task)
    ceiling: dict[int, dict[int, float]] = {}
    for n in args.lengths:
        cond = task.conditional(n)
        full = cond.info()[1:].sum()  # predictions of x_1 .. x_{n-1}
        ceiling[n] = {w: float(cond.window_info(w)[1:].sum() / full) for w in args.windows if w <= n}
        ceiling[n][n] = 1.0
        print(f"L={n:>5}: I* per token {float(full) / (n - 1):.4f} nats; ceiling U_w: "
              + " ".join(f"w{w}={u:.3f}" for w, u in sorted(ceiling[n].items())), flush=True)
    scores: dict = defaultdict(lambda: defaultdict(list))
    for r in lab_rows(args.dir):
        if str(r["task"]).split(":")[0] == args.task:
            scores[r["recipe"]][int(r["length"])].append(float(r["score"]))
    models = {}
    for recipe, by_len in sorted(scores.items()):
        models[recipe] = {}
        for n in sorted(by_len):
            u = sum(by_len[n]) / len(by_len[n])
            reach = [w for w, c in sorted(ceiling.get(n, {}).items()) if c >= u]
            models[recipe][n] = {"U": u, "effective_context": reach[0] if reach else None}
            eff = reach[0] if reach else "-"
            print(f"{recipe:>10} L={n:>5}: U {u:.3f}, effective context ≈ {eff} tokens", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ceiling": ceiling, "models": models}, indent=1) + "\n")
    print(f"# wrote {out}")


def _run_lcube() -> object:
    lcube_main()


# ---- mechanisms (was bench/lab.py mechanisms) ----------------------------------------

DOC_MECHANISMS = """
The in-context algebra mechanism sets (and unseen-group sets) per mixer, from a lab results store:
accuracy on the held-out query of each set, with the Wilson interval over test sequences, and the
gap ``commuted − absent`` (copying; the two sets are different sequences, so unpaired) with Newcombe's
interval from the two Wilson intervals.

    python bench/lab.py mechanisms runs/lab15/results --lengths 64 256 \
        --out bench/results/lab_results/round3/algebra_mechanisms.json

A row's set is read from its task spec (``query=...``, ``groups=[...]``); the trained task (no query, the
training groups) is the ``all facts`` column.
""".lstrip("\n")

def set_name(task: str) -> str:
    q = re.search(r"query=(\w+)", task)
    if q:
        return q.group(1)
    g = re.search(r"groups=\[([^\]]*)\]", task)
    groups = [x.strip().strip('"') for x in g.group(1).split(",")] if g else []
    return "all facts" if len(groups) != 1 else f"only {groups[0]}"


def mechanisms_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_MECHANISMS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out")
    args = ap.parse_args()
    cells: dict = defaultdict(list)
    for r in lab_rows(args.dir):
        if not str(r["task"]).startswith("algebra") or r.get("score") is None:
            continue
        if int(r["length"]) in args.lengths:
            cells[(r["recipe"], set_name(str(r["task"])), int(r["length"]))].append(float(r["score"]))
    sets = ["all facts", "commuted", "absent", "identity", "elimination"]
    sets += sorted({s for _, s, _ in cells if s not in sets})
    recipes = sorted({r for r, _, _ in cells})
    out = {}
    for n in args.lengths:
        print(f"\n**length {n}** (accuracy [95% Wilson / bootstrap CI], n test sequences)\n")
        print("| mixer | " + " | ".join(sets) + " | commuted − absent |")
        print("|---|" + "---|" * (len(sets) + 1))
        for rec in recipes:
            row, est = [rec], {}
            for s in sets:
                vals = cells.get((rec, s, n))
                if not vals:
                    row.append("–")
                    continue
                e = score_estimate(vals)
                est[s] = e
                row.append(f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}] n={e.n}")
                out.setdefault(rec, {}).setdefault(str(n), {})[s] = {"mean": e.mean, "low": e.low,
                                                                      "high": e.high, "n": e.n}
            if "commuted" in est and "absent" in est:
                a, b = est["commuted"], est["absent"]
                d = a.mean - b.mean  # Newcombe's hybrid score interval for a difference of proportions
                lo = d - math.sqrt((a.mean - a.low) ** 2 + (b.high - b.mean) ** 2)
                hi = d + math.sqrt((a.high - a.mean) ** 2 + (b.mean - b.low) ** 2)
                row.append(f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]")
                out[rec][str(n)]["commuted-absent"] = {"diff": d, "low": lo, "high": hi}
            else:
                row.append("–")
            print("| " + " | ".join(row) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def _run_mechanisms() -> object:
    mechanisms_main()


# ---- mixers (was bench/lab.py mixers) ----------------------------------------

DOC_MIXERS = """
Forward time and memory of one lab mixer layer vs sequence length, with ratios to softmax from the
same run (interleaved repeats, medians). The linear-time claims (RACE, LaCT, L2A, linear, Mamba) show
as ratios that fall with length.

    python bench/lab.py mixers --lengths 256 1024 4096 16384 --repeats 3 --out bench/results/lab_mixers.json

One layer (D = 64, H = 4, B = 1, float32, no grad) built from the sweep's specs (ultramem: attention
plus its parallel memory layer; no MLP anywhere). ``l2a@R`` routes exactly the top fraction R of the tokens
to global attention (``l2a`` alone: a random router, about half). Memory: the peak of
the profiler's CPU allocation timeline during one forward (``torch.profiler``, ``profile_memory``),
i.e. the largest live set of tensors the layer allocates. A mixer whose forward exceeds ``--budget-s``
is not run at longer lengths.
""".lstrip("\n")

MIXERS_SPECS = {
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
    cfg = mixer_config(MIXERS_SPECS[base])
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


def mixers_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_MIXERS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixers", nargs="+", default=list(MIXERS_SPECS))
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
        def forward(mod, x=x):
            return lambda: mod(x)

        with torch.no_grad():  # the shared runner: interleaved repeats, order rotated per round
            variants = {m: forward(mods[m]) for m in args.mixers if m in alive}
            timing = interleaved(variants, args.repeats, warmup=0)
        times = {m: v["wall_s"] for m, v in timing["variants"].items()}
        base = statistics.median(times["softmax"]) if "softmax" in times else None
        for m, ts in times.items():
            med = statistics.median(ts)
            mem = peak_mb(mods[m], x)
            row = {"mixer": m, "spec": MIXERS_SPECS[m.partition("@")[0]], "length": length,
                   "median_ms": med * 1e3,
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


def _run_mixers() -> object:
    mixers_main()


# ---- mtd (was bench/lab.py mtd) ----------------------------------------

DOC_MTD = """
Mixture of transition distributions (D'Angelo & Flammarion, arXiv 2604.10848): how close is a trained
lab model's next-token distribution to the Bayes-optimal predictor, and to the MD-n estimator (n steps of
entropic mirror descent on the in-context likelihood of the lag weights λ), which the paper says
transformers approximate?

    python bench/lab.py mtd runs/lab/ckpt/mtd/softmax/seed0 --lengths 64 256 --samples 24 \\
        --steps 1 2 5 20 --etas 0.5 1 2 4 --out bench/results/lab_results/mtd_md.json

Per length: mean over samples and scored positions of ``KL(p_Bayes ‖ q_model)``, ``KL(p_MD ‖ q_model)``
for each (n, η), and ``KL(p_Bayes ‖ p_MD)``, with 95% bootstrap intervals over the samples. The MD-n
prediction at position t uses λ estimated from ``x_{≤t}`` only (causal), then ``Σ_k λ_k Q(x_{t+1−k}, ·)``.
""".lstrip("\n")

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


def mtd_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_MTD, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _run_mtd() -> object:
    mtd_main()


# ---- pcfg-baselines (was bench/lab.py pcfg-baselines) ----------------------------------------

DOC_PCFG_BASELINES = """
How much of a PCFG task's next token a parse-free predictor gets: the unigram and the bigram predictors
fitted on the exact oracle at the training length, scored like ``longlab lab eval`` on the same test strings.

    python bench/lab.py pcfg-baselines --task pcfg:max_length=64,nonterminals=8,terminals=32,alpha=0.02 \\
        --train-len 16 --lengths 16 32 64 --samples 24 --fit 256 \\
        --out bench/results/lab_results/round4/pcfg_baselines.json

``unigram``: ``q(a) = mean over fitting strings and positions of p(x_{t+1} = a | x_{≤t})`` (the best
context-free predictor under the KL score); ``bigram``: ``q(a | x_t = b)`` = the same mean over the
positions whose current token is b (the best predictor that sees only the current token), with add-ε
smoothing towards the unigram. Fitting strings: ``--fit`` fresh strings of the training length (task seed 0,
generator seed 1), i.e. what a context-free model trained there could at best learn. Test strings: the
evaluation's (``longlab.lab.evaluate.eval_generator``, eval seed 0, indices 0..samples−1), so the scores are
paired with the mixers' rows. Score per string ``exp(−mean_t KL(p_t ‖ q_t))`` (the task's score); interval:
bootstrap over the test strings (:func:`longlab.eval.stats.score_estimate`). No training; the oracle is
O(L⁴·N³) per string (about 1 s per string at 64 tokens with N = 8 on a loaded core).

``--compare DIR --from JSON``: no oracle; read the per-string reference scores from a written JSON and print,
per mixer and length, the mixer − bigram difference over the same test strings (training seed 0, whose task
seed drew this grammar) with the paired bootstrap interval (:func:`longlab.eval.stats.paired_difference`).
""".lstrip("\n")

def fit(task, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ``(unigram [T], bigram [T, T])`` (row b: the next-token distribution after token b)."""
    b = task.sample(n, length, torch.Generator().manual_seed(1))
    p = b.probs[:, :-1].double().reshape(-1, task.terminals)  # [n·(L−1), T]
    x = b.tokens[:, :-1].reshape(-1)
    uni = p.mean(0)
    big = torch.zeros(task.terminals, task.terminals, dtype=torch.float64)
    cnt = torch.zeros(task.terminals, dtype=torch.float64)
    big.index_add_(0, x, p)
    cnt.index_add_(0, x, torch.ones_like(x, dtype=torch.float64))
    eps = 1e-3
    return uni, (big + eps * uni) / (cnt[:, None] + eps)


def compare(results: str, src: str, task: str) -> None:
    ref = json.load(open(src))
    rows = [r for r in lab_rows(results) if r["task"] == task and int(r["seed"]) == 0]
    by: dict = {}
    for r in rows:
        cell = by.setdefault(r["recipe"], {}).setdefault(int(r["length"]), {})
        cell[int(r["sample_id"])] = float(r["score"])
    print("| mixer (seed 0) | " + " | ".join(f"{n}: mixer − bigram" for n in ref["lengths"]) + " |")
    print("|---|" + "---|" * len(ref["lengths"]))
    for recipe in sorted(by):
        cells = []
        for n, res in ref["lengths"].items():
            mine = by[recipe].get(int(n), {})
            ids = [i for i in range(len(res["bigram"]["scores"])) if i in mine]
            if not ids:
                cells.append("–")
                continue
            d = paired_difference([mine[i] for i in ids], [res["bigram"]["scores"][i] for i in ids])
            cells.append(f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]")
        print(f"| {recipe} | " + " | ".join(cells) + " |")


def pcfg_baselines_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_PCFG_BASELINES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True)
    ap.add_argument("--train-len", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--fit", type=int, default=256)
    ap.add_argument("--out")
    ap.add_argument("--compare", help="results directory: print mixer − bigram (seed 0) from --from")
    ap.add_argument("--from", dest="src", help="a JSON written by --out (with --compare)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.src, args.task)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    task = task_config(args.task, 0)
    t0 = time.perf_counter()
    uni, big = fit(task, args.train_len, args.fit)
    out: dict = {"task": args.task, "train_len": args.train_len, "fit_strings": args.fit, "lengths": {},
                 "load_start": os.getloadavg()[0]}
    print(f"# fit {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    for length in args.lengths:
        parts = [task.sample(1, length, eval_generator(0, length, i)) for i in range(args.samples)]
        res: dict = {}
        ent = []
        for name in ("unigram", "bigram"):
            scores = []
            for part in parts:
                q = uni.expand(length, -1) if name == "unigram" else big[part.tokens[0]]  # [L, T]
                logits = torch.log(q.clamp_min(1e-30)).float()[None]
                scores.append(float(task.score(logits, part)[0]))
            e = score_estimate(scores)
            res[name] = {"score": e.mean, "low": e.low, "high": e.high, "n": e.n, "scores": scores,
                         "kl": float(-torch.log(torch.tensor(scores)).mean())}
        for part in parts:
            p = part.probs[0, :-1].double()
            ent.append(float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean()))
        res["oracle_entropy"] = sum(ent) / len(ent)
        out["lengths"][str(length)] = res
        u, b = res["unigram"], res["bigram"]
        print(f"length {length:>4}: unigram {u['score']:.3f} [{u['low']:.3f}, {u['high']:.3f}]  bigram "
              f"{b['score']:.3f} [{b['low']:.3f}, {b['high']:.3f}]  H "
              f"{res['oracle_entropy']:.3f} nats ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["load_end"] = os.getloadavg()[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"# wrote {args.out}")


def _run_pcfg_baselines() -> object:
    pcfg_baselines_main()


# ---- pcfg-long (was bench/lab.py pcfg-long) ----------------------------------------

DOC_PCFG_LONG = """
PCFG to 16x the training length with the string oracle (``oracle=string``): evaluate the trained PCFG
models at long lengths, then tabulate ``exp(−excess NLL per token)``.

    python bench/lab.py pcfg-long run --root runs/lab15 --tag n8a002 --seeds 0 1 2 --lengths 16 32 64 128 256
    python bench/lab.py pcfg-long reference --out bench/results/lab_results/round4/pcfg_long_reference.json
    python bench/lab.py pcfg-long report runs/lab15/results \\
        --reference bench/results/lab_results/round4/pcfg_long_reference.json \\
        --md runs/lab15/pcfg_long.md

``run``: for each mixer and training seed, :func:`longlab.lab.evaluate.evaluate` (what ``longlab lab eval
CKPT --task SPEC --lengths ... --samples 24 --batch 8 --out ROOT/results`` runs) on the variant
``SPEC = pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string`` of the trained task, in
one process so that the string oracle (cached per grammar and string) is computed once for all mixers. The
test strings are the evaluation's, the same as the per-prefix rows' at 16/32/64 (sampling does not depend
on ``max_length``).

``reference``: the unigram and bigram predictors of ``bench/lab.py pcfg-baselines`` (fitted on the per-prefix
oracle at 16 tokens, 256 strings, generator seed 1), per task seed, scored with the string oracle on the
evaluation's test strings (eval seed 0, indices 0..samples−1) at every length; per-string ``e`` to ``--out``.

``report``: per mixer and length, the excess NLL per scored token ``e`` (the rows' ``excess_nll``) is
aggregated like ``longlab lab plot --table`` aggregates scores (:func:`longlab.lab.plot.cell_estimate`: the
hull of the t-interval over the per-seed means and the test-string bootstrap) and shown as ``exp(−mean e)``
with the interval mapped through ``exp(−·)``. Since ``E[e] = E[mean_t KL]`` (chain rule), ``exp(−mean e)``
estimates ``exp(−mean KL)``, while the prefix rows average ``exp(−KL)`` per string (lower by Jensen; both
columns are printed at the lengths where the prefix rows exist: mean KL and mean e on the same strings).
""".lstrip("\n")

MIXERS = ["softmax", "ssmax", "asentmax", "lssa", "lssar", "race", "l2a", "lact", "ultramem", "linear",
          "mamba"]


PREFIX = "pcfg:max_length=64,nonterminals=8,terminals=32,alpha=0.02"


SPEC = "pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string"


def cell(by_seed: dict) -> tuple[float, float, float, str]:
    """``(mean e, low, high, what)``: :func:`longlab.lab.plot.cell_estimate` (t over seed means, bootstrap
    over the seed-averaged per-string values; one seed: the bootstrap) on the excess scale, unclipped
    (``e`` lives on [−∞, ∞))."""
    return cell_estimate(by_seed, clip=False)


def run(args: argparse.Namespace) -> None:
    for seed in args.seeds:
        for m in args.mixers:
            t0 = time.time()
            ckpt = f"{args.root}/ckpt/pcfg/{args.tag}/{m}/seed{seed}"
            evaluate(ckpt, args.lengths, out=f"{args.root}/results", samples=args.samples, batch=8, task=SPEC)
            print(f"{m} seed {seed}: {time.time() - t0:.1f} s", flush=True)


def reference(args: argparse.Namespace) -> None:
    import json
    import os

    import torch

    from longlab.lab.evaluate import eval_generator
    from longlab.lab.tasks import task_config

    out: dict = {"spec": SPEC, "fit": PREFIX, "fit_len": 16, "fit_strings": 256, "samples": args.samples,
                 "load_start": os.getloadavg()[0], "seeds": {}}
    t0 = time.time()
    for seed in args.seeds:
        uni, big = fit(task_config(PREFIX, seed), 16, 256)
        tk = task_config(SPEC, seed)
        per: dict = {}
        for n in args.lengths:
            parts = [tk.sample(1, n, eval_generator(0, n, i)) for i in range(args.samples)]
            per[str(n)] = {
                "unigram": [float(tk.excess_nll(torch.log(uni).expand(1, n, -1), p)[0]) for p in parts],
                "bigram": [float(tk.excess_nll(torch.log(big)[p.tokens], p)[0]) for p in parts],
            }
            print(f"seed {seed} length {n}: {time.time() - t0:.0f} s", flush=True)
        out["seeds"][str(seed)] = per
    out["load_end"] = os.getloadavg()[0]
    out["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def report(args: argparse.Namespace) -> None:
    rows = lab_rows(args.results)
    e: dict = defaultdict(lambda: defaultdict(dict))  # (recipe, length) -> seed -> sample -> value
    kl: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        x = r.get("extra") or {}
        key = (str(r["recipe"]), int(r["length"]))
        if r["task"] == SPEC and "excess_nll" in x:
            e[key][int(r["seed"])][str(r["sample_id"])] = float(x["excess_nll"])
        elif r["task"] == PREFIX and "kl" in x:
            kl[key][int(r["seed"])][str(r["sample_id"])] = float(x["kl"])
    if args.reference:
        import json

        ref = json.load(open(args.reference))
        for seed, per in ref["seeds"].items():
            for n, cols in per.items():
                for name, vals in cols.items():
                    e[f"({name})", int(n)][int(seed)] = {str(i): v for i, v in enumerate(vals)}
    lengths = sorted({n for _, n in e})
    order = [*MIXERS, "(unigram)", "(bigram)"]  # recipes by mixer name (mamba's carries its config)
    names = {m for m, _ in e if m.split(":")[0] in order}
    recipes = sorted(names, key=lambda m: order.index(m.split(":")[0]))
    out = ["| mixer | " + " | ".join(f"{n} ({n // 16}×)" for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for m in recipes:
        cells = []
        for n in lengths:
            if (m, n) not in e:
                cells.append("–")
                continue
            mean, lo, hi, what = cell(e[m, n])  # the score's interval: exp(−·), clipped at 1 (KL ≥ 0)
            cells.append(f"{math.exp(-mean):.3f} [{math.exp(-hi):.3f}, {min(1.0, math.exp(-lo)):.3f}] {what}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "Same strings, per-prefix vs string oracle (mean over seeds and strings, nats per token):",
            "", "| mixer | length | mean KL (prefix) | mean e (string) | e − KL ± 2 se | per seed |",
            "|---|---|---|---|---|---|"]
    for m in recipes:
        for n in lengths:
            if (m, n) not in kl or (m, n) not in e:
                continue
            diffs = []
            a_all: list[float] = []
            b_all: list[float] = []
            for s in sorted(set(kl[m, n]) & set(e[m, n])):
                ids = sorted(set(kl[m, n][s]) & set(e[m, n][s]))
                a = [kl[m, n][s][i] for i in ids]
                b = [e[m, n][s][i] for i in ids]
                a_all += a
                b_all += b
                diffs.append(sum(b) / len(b) - sum(a) / len(a))
            if diffs:
                ma, mb = sum(a_all) / len(a_all), sum(b_all) / len(b_all)
                d = [y - x for x, y in zip(a_all, b_all)]
                se = math.sqrt(sum((v - (mb - ma)) ** 2 for v in d) / (len(d) - 1) / len(d))
                per = " / ".join(f"{v:+.4f}" for v in diffs)
                out.append(f"| {m} | {n} | {ma:.4f} | {mb:.4f} | {mb - ma:+.4f} ± {2 * se:.4f} | {per} |")
    if ("(bigram)", lengths[0]) in e:
        from longlab.eval.stats import paired_difference

        out += ["", "Seed 0, mixer − bigram in exp(−e) per string (paired bootstrap over the test strings):",
                "", "| mixer (seed 0) | " + " | ".join(str(n) for n in lengths) + " |",
                "|---|" + "---|" * len(lengths)]
        for m in recipes:
            if m.startswith("("):
                continue
            cells = []
            for n in lengths:
                mine, ref0 = e.get((m, n), {}).get(0, {}), e["(bigram)", n].get(0, {})
                ids = sorted(set(mine) & set(ref0))
                if not ids:
                    cells.append("–")
                    continue
                d = paired_difference([math.exp(-mine[i]) for i in ids], [math.exp(-ref0[i]) for i in ids])
                cells.append(f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


def pcfg_long_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_PCFG_LONG.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default="runs/lab15")
    r.add_argument("--tag", default="n8a002")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--mixers", nargs="+", default=MIXERS)
    r.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    r.add_argument("--samples", type=int, default=24)
    f = sub.add_parser("reference")
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    f.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    f.add_argument("--samples", type=int, default=24)
    f.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("results")
    p.add_argument("--reference", default=None)
    p.add_argument("--md", default=None)
    args = ap.parse_args()
    {"run": run, "reference": reference, "report": report}[args.cmd](args)


def _run_pcfg_long() -> object:
    pcfg_long_main()


# ---- seeds (was bench/lab.py seeds) ----------------------------------------

DOC_SEEDS = """
Mixer-vs-mixer differences over training seeds, from a lab results store: for each pair and length,
the difference of the seed-mean scores with a Welch t-interval over the per-seed means (each seed's mean
over the same test sequences), and the paired test-sequence bootstrap of the seed-averaged scores; a
difference is called significant only when both 95% intervals exclude 0.

    python bench/lab.py seeds runs/lab/results --task passkey \\
        --pairs asentmax:softmax softmax+nape:softmax asentmax:softmax+nape l2a:softmax ssmax:softmax
""".lstrip("\n")

def seeds_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_SEEDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--task", required=True)
    ap.add_argument("--pairs", nargs="+", required=True, help="A:B (A minus B)")
    args = ap.parse_args()
    cell: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in lab_rows(args.dir):
        if r["task"] == args.task:
            cell[r["recipe"]][int(r["length"])][int(r["seed"])][str(r["sample_id"])] = float(r["score"])
    print("| A − B | length | seeds A/B | Δ mean | 95% CI (seeds, Welch) | 95% CI (test sequences, paired) | "
          "verdict |")
    print("|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        a, b = pair.split(":")
        for n in sorted(set(cell[a]) & set(cell[b])):
            ma = [sum(v.values()) / len(v) for v in cell[a][n].values()]
            mb = [sum(v.values()) / len(v) for v in cell[b][n].values()]
            d = sum(ma) / len(ma) - sum(mb) / len(mb)
            va = statistics.variance(ma) / len(ma) if len(ma) > 1 else 0.0
            vb = statistics.variance(mb) / len(mb) if len(mb) > 1 else 0.0
            se = math.sqrt(va + vb)
            if se > 0:
                parts = [v * v / (len(m) - 1) for v, m in ((va, ma), (vb, mb)) if len(m) > 1 and v > 0]
                dfs = (va + vb) ** 2 / sum(parts)  # Welch–Satterthwaite
                half = float(stats.t.ppf(0.975, dfs)) * se
                seed_ci = (d - half, d + half)
            else:
                seed_ci = None
            runs = list(cell[a][n].values()) + list(cell[b][n].values())
            ids = sorted(set.intersection(*[set(v) for v in runs]))
            sa = [sum(v[i] for v in cell[a][n].values()) / len(ma) for i in ids]
            sb = [sum(v[i] for v in cell[b][n].values()) / len(mb) for i in ids]
            pdiff = paired_difference(sa, sb)
            sig = (pdiff.low > 0 or pdiff.high < 0) and (seed_ci is None or seed_ci[0] > 0 or seed_ci[1] < 0)
            enough = len(ma) > 1 and len(mb) > 1
            verdict = ("significant" if sig else "not significant") if enough else (
                "one seed on a side: test sequences only" + (", significant" if sig else ", not significant"))
            sci = f"[{seed_ci[0]:+.2f}, {seed_ci[1]:+.2f}]" if seed_ci else "–"
            print(f"| {a} − {b} | {n} | {len(ma)}/{len(mb)} | {d:+.2f} | {sci} | "
                  f"[{pdiff.low:+.2f}, {pdiff.high:+.2f}] | {verdict} |")


def _run_seeds() -> object:
    seeds_main()


SUBCOMMANDS = {
    "extrapolation": _run_extrapolation,
    "flops": _run_flops,
    "lcube": _run_lcube,
    "mechanisms": _run_mechanisms,
    "mixers": _run_mixers,
    "mtd": _run_mtd,
    "pcfg-baselines": _run_pcfg_baselines,
    "pcfg-long": _run_pcfg_long,
    "seeds": _run_seeds,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/lab.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
