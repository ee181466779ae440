"""Issue 33: the four long-context mechanisms from other modalities in the layers lab, each claim measured
at small scale on one CPU thread, ≥ 3 training seeds per cell. Every model is trained by the lab's CLI
(``longlab lab train``, called in-process; the exact command is stored with each row); checkpoints go to
``runs/modalities/`` (not committed), compact JSON rows to ``bench/results/lab_modalities/``, and
``page`` regenerates the tables of ``docs/results/modalities.md`` from those rows.

    bench/heavy.sh python bench/lab_modalities.py emformer --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py conv-time
    bench/heavy.sh python bench/lab_modalities.py meg --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py vlta --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py ts --task xor --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py ts --task blobs --seeds 0 1 2
    python bench/lab_modalities.py page

Claims (remaining-seeds §35–38): EMFormer — rollout (accumulative-context) fine-tuning improves long
leads (20, 40) without hurting lead 1, and the merged conv is faster than three convs; MEG-XL —
block-masked pretraining at a long context beats a short one (equal tokens) on a 1 %-label linear
probe; TAPTRv3 — VLTA keeps accuracy after long occlusions where an EMA memory drifts; TS neuron — LIF
accuracy declines with the number of timesteps T, TS does not.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import re
import statistics
import sys
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch
from common import ROOT, hardware, interleaved, write_json

from longlab.cli import main as cli_main
from longlab.lab.train import load_checkpoint

RESULTS = ROOT / "bench" / "results" / "lab_modalities"  # --results overrides (smoke runs)
RUNS = ROOT / "runs" / "modalities"  # --runs overrides
PAGE = ROOT / "docs" / "results" / "modalities.md"


def lab_train(args: list[str]) -> str:
    """Run ``longlab lab train ARGS`` in-process (resumes or skips a finished run); returns the command."""
    argv = ["lab", "train", *args, "--no-progress", "--threads", "1"]
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(argv)
    if rc:
        raise SystemExit(f"longlab {' '.join(argv)} failed ({rc}): {buf.getvalue()}")
    print(buf.getvalue().strip().splitlines()[-1], flush=True)
    return "longlab " + " ".join(argv)


def _settings(a: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(a).items() if k not in ("results", "runs")}


def rnd(values, nd: int = 4) -> list[float]:
    return [round(float(v), nd) for v in values]


# -- EMFormer: rollout fine-tuning on Lorenz-96 ---------------------------------------------------------


def run_emformer(a: argparse.Namespace) -> None:
    """Pretrain one-step, then from the same weights either continue one-step or fine-tune by rollout, at
    each fine-tuning learning rate, with equal optimizer updates; RMSE at the leads on fixed test
    trajectories."""
    from longlab.lab.tasks import task_config

    common = ["--mixer", "emformer", "--task", a.task, "--batch", str(a.batch), "--dim", "64"]
    common += ["--layers", "2", "--heads", "4", "--ckpt-every", "500"]
    for seed in a.seeds:
        # the task instance training used (`longlab lab train` seeds the task with --seed: here the
        # attractor pool and the climatology that normalises the states), as `longlab lab eval` does
        task = task_config(a.task, seed)
        test = task.sample(a.test, task.window + max(a.leads), torch.Generator().manual_seed(777))
        one_step = ["--train-len", str(task.window + 1)]
        out = RESULTS / f"emformer_seed{seed}.json"
        rows, cmds = [], {}
        pre = RUNS / "l96" / f"pre-s{seed}"
        pre_args = [*common, *one_step, "--steps", str(a.pretrain), "--lr", str(a.lr), "--seed", str(seed)]
        cmds["pretrain"] = lab_train([*pre_args, "--out", str(pre)])
        arms: dict[str, tuple[Path, list[str] | None]] = {"pretrained": (pre, None)}
        for lr in a.ft_lr:
            # equal optimizer updates: one-step runs rollout× as many steps (rollout: one update per step)
            arms[f"one-step@{lr:g}"] = (
                RUNS / "l96" / f"one-step-lr{lr:g}-s{seed}",
                [*one_step, "--steps", str(a.finetune * a.rollout), "--lr", str(lr)],
            )
            arms[f"rollout@{lr:g}"] = (
                RUNS / "l96" / f"rollout-lr{lr:g}-s{seed}",
                [
                    "--train-len",
                    str(task.window + a.rollout),
                    "--steps",
                    str(a.finetune),
                    "--rollout",
                    str(a.rollout),
                    "--lr",
                    str(lr),
                ],
            )
        for arm, (ck, extra) in arms.items():
            if extra is not None:
                t0 = time.perf_counter()
                cmds[arm] = lab_train(
                    [
                        *common,
                        *extra,
                        "--warmup",
                        "1",
                        "--seed",
                        str(seed),
                        "--init",
                        str(pre),
                        "--out",
                        str(ck),
                    ]
                )
                print(f"  {arm} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
            model, _, manifest = load_checkpoint(ck)
            with torch.no_grad():
                pred = task.predict(model, test.tokens)
            rmse = task.rmse(pred, test)  # [N, leads]
            updates = manifest["step"] * (a.rollout if arm.startswith("rollout") else 1)
            rows.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "theta": round(float(model.loss_params.detach()[0]), 7),
                    "elapsed_s": manifest["elapsed_s"],
                    "updates": updates,
                    "rmse": {str(k): rnd(rmse[:, k - 1]) for k in a.leads},
                }
            )
            print(
                f"  {arm:>14} seed {seed}: "
                + " ".join(f"lead {k} {float(rmse[:, k - 1].mean()):.3f}" for k in a.leads),
                flush=True,
            )
        write_json(
            out,
            {
                "experiment": "emformer",
                "hardware": hardware(),
                "settings": _settings(a) | {"seeds": [seed]},
                "commands": cmds,
                "rows": rows,
            },
        )
        print(f"# wrote {out}", flush=True)


def _conv_cases(conv, mixer, x: torch.Tensor, xm: torch.Tensor) -> dict:
    """The timed pairs (merged, three convs): the conv alone (forward, forward+backward) and the mixer."""

    def fwd(separate: bool):
        return lambda: conv.forward_separate(x) if separate else conv(x)

    def fwd_bwd(separate: bool):
        def run():
            xg = x.detach().requires_grad_()
            (conv.forward_separate(xg) if separate else conv(xg)).sum().backward()

        return run

    def mix(separate: bool):
        def run():
            mixer.merged = not separate
            with torch.no_grad():
                mixer(xm)

        return run

    return {
        "conv forward": (fwd(False), fwd(True)),
        "conv forward+backward": (fwd_bwd(False), fwd_bwd(True)),
        "mixer forward": (mix(False), mix(True)),
    }


def run_conv_time(a: argparse.Namespace) -> None:
    """Merged vs three separate convolutions, side by side (interleaved repeats, medians)."""
    from longlab.lab import Positions, mixer_config
    from longlab.lab.mixers.emformer import MultiScaleConv

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = []
    for b, t, d in a.shapes:
        conv = MultiScaleConv(3 * d)
        mixer = mixer_config("emformer").build(d, 4, Positions("rope", 4, d // 4))
        x = torch.randn(b, t, 3 * d)
        xm = torch.randn(b, t, d)
        for name, fns in _conv_cases(conv, mixer, x, xm).items():
            # a warm-up call each, then interleaved repeats, the order rotated per round (common.interleaved)
            timing = interleaved(dict(zip(("merged", "separate"), fns)), repeats=a.repeats, warmup=1)
            times = {label: timing["variants"][label]["wall_s"] for label in ("merged", "separate")}
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios = [s / m for m, s in zip(times["merged"], times["separate"])]
            rows.append(
                {
                    "case": name,
                    "B": b,
                    "T": t,
                    "channels": 3 * d,
                    "repeats": a.repeats,
                    "merged_ms": round(med["merged"] * 1e3, 4),
                    "separate_ms": round(med["separate"] * 1e3, 4),
                    "speedup_median": round(statistics.median(ratios), 3),
                    "speedup_q25_q75": rnd(statistics.quantiles(ratios, n=4)[::2], 3),
                    "ratios": rnd(ratios),  # per repeat, three convs / merged: the verdict's samples
                }
            )
            print(
                f"{name:>22} B{b}-T{t}-C{3 * d}: merged {med['merged'] * 1e3:.3f} ms, three convs "
                f"{med['separate'] * 1e3:.3f} ms, speed-up {statistics.median(ratios):.2f}x",
                flush=True,
            )
    out = write_json(
        RESULTS / "conv_time.json",
        {"experiment": "conv-time", "hardware": hardware(), "settings": _settings(a), "rows": rows},
    )
    print(f"# wrote {out}")


# -- MEG-XL: long- vs short-context block-masked pretraining, linear probe --------------------------------


def run_meg(a: argparse.Namespace) -> None:
    from longlab.lab import LabLM
    from longlab.lab.tasks import task_config
    from longlab.lab.tasks.meg import event_probe

    for seed in a.seeds:
        task = task_config(a.task, seed)  # training's task instance: its state patterns and event codes
        c = task.channels
        out = RESULTS / f"meg_seed{seed}.json"
        rows, cmds = [], {}
        for steps_ctx in a.contexts:
            n = steps_ctx * c
            batch = a.tokens // n  # equal tokens per optimizer step
            ck = RUNS / "meg" / f"ctx{steps_ctx}-s{seed}"
            args = [
                "--mixer",
                "crisscross",
                "--task",
                a.task,
                "--train-len",
                str(n),
                "--steps",
                str(a.steps),
                "--batch",
                str(batch),
                "--lr",
                str(a.lr),
                "--dim",
                "64",
                "--layers",
                "2",
                "--heads",
                "4",
                "--seed",
                str(seed),
                "--ckpt-every",
                "200",
                "--out",
                str(ck),
            ]
            t0 = time.perf_counter()
            cmds[f"ctx{steps_ctx}"] = lab_train(args)
            train_s = time.perf_counter() - t0
            model, cfg, manifest = load_checkpoint(ck)
            torch.manual_seed(seed)
            untrained = LabLM(cfg.model_config()).eval()  # a fresh random encoder (seeded): the control
            for which, m in (("pretrained", model), ("untrained", untrained)):
                t0 = time.perf_counter()
                res = event_probe(m, task, steps_ctx, a.labels, a.test, seed=a.probe_seed)
                acc = sum(res["correct"]) / len(res["correct"])
                rows.append(
                    {
                        "context": steps_ctx,
                        "seed": seed,
                        "encoder": which,
                        "labels": a.labels,
                        "correct": "".join(str(int(v)) for v in res["correct"]),
                        "train_tokens": manifest["train_tokens"],
                        "final_loss": manifest["history"][-1]["loss"],
                        "train_s": round(train_s, 1),
                    }
                )
                print(
                    f"  context {steps_ctx} seed {seed} {which}: probe accuracy {acc:.3f} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
        write_json(
            out,
            {
                "experiment": "meg",
                "hardware": hardware(),
                "settings": _settings(a) | {"seeds": [seed]},
                "commands": cmds,
                "rows": rows,
            },
        )
        print(f"# wrote {out}", flush=True)


# -- TAPTRv3 VLTA: reacquisition after occlusions ---------------------------------------------------------


def run_vlta(a: argparse.Namespace) -> None:
    from longlab.lab.tasks import task_config

    for seed in a.seeds:
        out = RESULTS / f"vlta_seed{seed}.json"
        rows, cmds = [], {}
        for mixer in a.mixers:
            ck = RUNS / "track" / f"{mixer.replace(':', '_')}-s{seed}"
            args = [
                "--mixer",
                mixer,
                "--task",
                a.task,
                "--train-len",
                str(a.train_len),
                "--steps",
                str(a.steps),
                "--batch",
                str(a.batch),
                "--lr",
                str(a.lr),
                "--dim",
                "64",
                "--layers",
                "2",
                "--heads",
                "4",
                "--seed",
                str(seed),
                "--ckpt-every",
                "200",
                "--out",
                str(ck),
            ]
            cmds[mixer] = lab_train(args)
            model, _, manifest = load_checkpoint(ck)
            for variant in a.variants:
                spec = (a.task + ("," if ":" in a.task else ":") + variant) if variant else a.task
                tk = task_config(spec)
                for length in a.lengths:
                    if length < tk.min_length():
                        continue
                    b = tk.sample(a.videos, length, torch.Generator().manual_seed(900 + length))
                    with torch.no_grad():  # 8 videos at a time: bounded attention memory at 2000 frames
                        out_ = torch.cat([model(b.tokens[i : i + 8]) for i in range(0, a.videos, 8)])
                    right = tk.correct(out_, b)  # [N, T − 1]
                    sel = b.answer[:, :-1]
                    occ = b.occ_len[:, 1:][sel]
                    rows.append(
                        {
                            "mixer": mixer,
                            "seed": seed,
                            "variant": variant,
                            "length": length,
                            "occ_len": occ.tolist(),
                            "correct": "".join(str(int(v)) for v in right[sel]),
                            "visible_acc": round(float(right[b.visible[:, 1:]].float().mean()), 4),
                        }
                    )
                    print(
                        f"  {mixer:>8} seed {seed} {variant or 'default':>28} {length:>5} frames: reacquired "
                        f"{float(right[sel].float().mean()):.3f} of {int(sel.sum())}, visible "
                        f"{rows[-1]['visible_acc']:.3f}",
                        flush=True,
                    )
        write_json(
            out,
            {
                "experiment": "vlta",
                "hardware": hardware(),
                "settings": _settings(a) | {"seeds": [seed]},
                "commands": cmds,
                "rows": rows,
            },
        )
        print(f"# wrote {out}", flush=True)


# -- TS neuron: accuracy and gradient ratio against T ---------------------------------------------------


def grad_ratio(model, task, batch) -> float:
    """``‖∂L/∂u_1‖ / ‖∂L/∂u_T‖`` of the first spiking layer on ``batch`` (train-mode forward)."""
    layer = model.blocks[0].mixer
    layer.record = True
    try:
        model.zero_grad(set_to_none=True)
        loss = task.loss(model(batch.tokens), batch)
        loss.backward()
        g1, gt = layer.potentials[0].grad, layer.potentials[-1].grad
        return float(g1.norm() / gt.norm().clamp_min(1e-30))
    finally:
        layer.record = False
        layer.potentials, layer.traces = [], []
        model.zero_grad(set_to_none=True)


def run_ts(a: argparse.Namespace) -> None:
    from longlab.lab import LabLM
    from longlab.lab.tasks import task_config

    for seed in a.seeds:
        task = task_config(a.task, seed)  # training's task instance (blobs: its centres)
        out = RESULTS / f"ts_{a.task}_seed{seed}.json"
        rows, cmds = [], {}
        for t in a.timesteps:
            test = task.sample(a.test, t, torch.Generator().manual_seed(4242 + t))
            probe = task.sample(256, t, torch.Generator().manual_seed(5151 + t))
            for neuron in a.neurons:
                ck = RUNS / "ts" / f"{a.task}-{neuron}-T{t}-s{seed}"
                args = [
                    "--mixer",
                    neuron,
                    "--task",
                    a.task,
                    "--train-len",
                    str(t),
                    "--steps",
                    str(a.steps),
                    "--batch",
                    str(a.batch),
                    "--lr",
                    str(a.lr),
                    "--dim",
                    str(a.dim),
                    "--layers",
                    "2",
                    "--seed",
                    str(seed),
                    "--ckpt-every",
                    "500",
                    "--out",
                    str(ck),
                ]
                cmds[f"{neuron}-T{t}"] = lab_train(args)
                model, cfg, manifest = load_checkpoint(ck)
                with torch.no_grad():
                    correct = task.score(model(test.tokens), test)
                trained_ratio = grad_ratio(model.train(), task, probe)
                torch.manual_seed(seed)
                init_ratio = grad_ratio(LabLM(cfg.model_config()).train(), task, probe)
                rows.append(
                    {
                        "neuron": neuron,
                        "T": t,
                        "seed": seed,
                        "correct": "".join(str(int(v)) for v in correct),
                        "grad_ratio": trained_ratio,
                        "grad_ratio_init": init_ratio,
                        "final_loss": manifest["history"][-1]["loss"],
                        "elapsed_s": manifest["elapsed_s"],
                    }
                )
                print(
                    f"  {a.task} {neuron:>3} T={t:>2} seed {seed}: accuracy {float(correct.mean()):.3f}, "
                    f"‖∂L/∂u_1‖/‖∂L/∂u_T‖ {trained_ratio:.3g} (init {init_ratio:.3g}), "
                    f"{manifest['elapsed_s']:.0f} s",
                    flush=True,
                )
        write_json(
            out,
            {
                "experiment": f"ts-{a.task}",
                "hardware": hardware(),
                "settings": _settings(a) | {"seeds": [seed]},
                "commands": cmds,
                "rows": rows,
            },
        )
        print(f"# wrote {out}", flush=True)


# -- the results page ------------------------------------------------------------------------------------


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95 % Student-t interval over ``values`` (the seeds)."""
    from scipy import stats

    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return m, m - half, m + half


def fmt_ci(m: float, lo: float, hi: float, nd: int = 3, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{nd}f}}"
    if math.isnan(lo):
        return f.format(m)
    return f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]"


def verdict(lo: float, hi: float) -> str:
    if math.isnan(lo):
        return "one seed"
    return "significant" if lo > 0 or hi < 0 else "not significant"


def load(pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob(pattern))]


def table_emformer() -> str:
    from longlab.eval.stats import paired_difference

    docs = load("emformer_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    leads = sorted({int(k) for r in rows for k in r["rmse"]})
    seeds = sorted({r["seed"] for r in rows})
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["arm"], r["seed"]): r for r in rows}

    def mean_rmse(arm: str, s: int, k: int) -> float:
        return statistics.mean(by[(arm, s)]["rmse"][str(k)])

    lines = [
        "| arm | " + " | ".join(f"RMSE lead {k}" for k in leads) + " | θ at the end |",
        "|---|" + "---|" * (len(leads) + 1),
    ]
    for arm in arms:
        if all((arm, s) in by for s in seeds):
            cells = [fmt_ci(*t_interval([mean_rmse(arm, s, k) for s in seeds])) for k in leads]
            thetas = [by[(arm, s)]["theta"] for s in seeds]
            cells.append(f"{min(thetas):.7f} … {max(thetas):.7f}")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| rollout − one-step (same fine-tuning lr) | lead | Δ RMSE (t-interval over 3 seeds) | verdict | "
        "Δ pooled over seeds × test trajectories (paired bootstrap) |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        if not arm.startswith("rollout"):
            continue
        base = "one-step" + arm[len("rollout") :]
        ok = [s for s in seeds if (arm, s) in by and (base, s) in by]
        for k in leads if ok else []:
            m, lo, hi = t_interval([mean_rmse(arm, s, k) - mean_rmse(base, s, k) for s in ok])
            pd = paired_difference(
                [v for s in ok for v in by[(arm, s)]["rmse"][str(k)]],
                [v for s in ok for v in by[(base, s)]["rmse"][str(k)]],
            )
            lines.append(
                f"| {arm} − {base} | {k} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
                f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} |"
            )
    return "\n".join(lines)


def table_conv_time() -> str:
    docs = load("conv_time.json")
    if not docs:
        return "_no rows yet_"
    d = docs[0]
    hw = d["hardware"]
    lines = [
        f"{hw['cpu']}, {hw['threads']} thread, torch {hw['torch']}, load average {hw['load_avg_1m']:.2f} "
        f"at the end, {d['settings']['repeats']} interleaved repeats, commit {hw['git_commit']}",
        "",
        "| case | shape | merged (ms, median) | three convs (ms, median) | speed-up (median [q25, q75] "
        "of per-repeat ratios) |",
        "|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        q = r["speedup_q25_q75"]
        lines.append(
            f"| {r['case']} | B{r['B']}-T{r['T']}-C{r['channels']} | {r['merged_ms']:.3f} | "
            f"{r['separate_ms']:.3f} | {r['speedup_median']:.2f}× [{q[0]:.2f}, {q[1]:.2f}] |"
        )
    return "\n".join(lines)


def table_meg() -> str:
    from longlab.eval.stats import paired_difference

    docs = load("meg_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    ctxs = sorted({r["context"] for r in rows})
    by = {(r["context"], r["encoder"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    labels = rows[0]["labels"]
    n_test = len(rows[0]["correct"])
    lines = [
        f"Probe: {labels} labelled events, {n_test} test events per cell (chance 1/8 = 0.125; knowing the "
        "response but not the state: 0.25).",
        "",
        "| pretraining context (steps × 16 channels) | encoder | probe accuracy (t-interval over seeds) | "
        "final masked-token loss |",
        "|---|---|---|---|",
    ]
    for c in ctxs:
        for enc in ("pretrained", "untrained"):
            accs = [statistics.mean(by[(c, enc, s)]) for s in seeds if (c, enc, s) in by]
            losses = [r["final_loss"] for r in rows if r["context"] == c and r["encoder"] == enc]
            loss = f"{statistics.mean(losses):.3f}" if enc == "pretrained" else "–"
            lines.append(f"| {c} | {enc} | {fmt_ci(*t_interval(accs))} | {loss} |")
    if len(ctxs) == 2:
        lo_c, hi_c = ctxs
        lines += [
            "",
            f"| {hi_c} − {lo_c} (pretrained) | seeds | Δ accuracy (t-interval over seeds) | verdict | "
            "Δ pooled (paired bootstrap over seeds × test events) |",
            "|---|---|---|---|---|",
        ]
        ok = [s for s in seeds if (hi_c, "pretrained", s) in by and (lo_c, "pretrained", s) in by]
        diffs = [
            statistics.mean(by[(hi_c, "pretrained", s)]) - statistics.mean(by[(lo_c, "pretrained", s)])
            for s in ok
        ]
        m, lo, hi = t_interval(diffs)
        a = [v for s in ok for v in by[(hi_c, "pretrained", s)]]
        b = [v for s in ok for v in by[(lo_c, "pretrained", s)]]
        pd = paired_difference(a, b)
        lines.append(
            f"| probe accuracy | {len(ok)} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
            f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} |"
        )
    return "\n".join(lines)


def _bucket(n: int) -> str:
    return "5–19" if n < 20 else "20–40" if n <= 40 else "100–200" if n >= 100 else "41–99"


def table_vlta() -> str:
    from longlab.eval.stats import paired_difference

    docs = load("vlta_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    cells: dict = {}
    for r in rows:
        for occ, c in zip(r["occ_len"], r["correct"]):
            key = (r["variant"] or "default", r["length"], _bucket(occ))
            cells.setdefault(key, {}).setdefault((r["mixer"], r["seed"]), []).append(int(c))
    lines = [
        "| occlusions | video frames | occlusion length | reacquisitions per seed | "
        + " | ".join(mixers)
        + " | vlta − ema (t over seeds; paired bootstrap) |",
        "|---|---|---|---|" + "---|" * len(mixers) + "---|",
    ]
    for key in sorted(cells, key=lambda k: (k[0] != "default", k[1], k[2])):
        cell = cells[key]
        n = len(cell.get((mixers[0], seeds[0]), []))
        parts = []
        for m in mixers:
            accs = [statistics.mean(cell[(m, s)]) for s in seeds if cell.get((m, s))]
            parts.append(fmt_ci(*t_interval(accs)) if accs else "–")
        diff = "–"
        if "vlta" in mixers and "ema" in mixers:
            ok = [s for s in seeds if cell.get(("vlta", s)) and cell.get(("ema", s))]
            d = [statistics.mean(cell[("vlta", s)]) - statistics.mean(cell[("ema", s)]) for s in ok]
            m_, lo, hi = t_interval(d)
            pd = paired_difference(
                [v for s in ok for v in cell[("vlta", s)]], [v for s in ok for v in cell[("ema", s)]]
            )
            diff = f"{fmt_ci(m_, lo, hi, sign=True)}, {verdict(lo, hi)}; [{pd.low:+.3f}, {pd.high:+.3f}]"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {n} | " + " | ".join(parts) + f" | {diff} |")
    return "\n".join(lines)


def table_ts(task: str) -> str:
    from longlab.eval.stats import paired_difference

    docs = load(f"ts_{task}_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    ts_ = sorted({r["T"] for r in rows})
    by = {(r["neuron"], r["T"], r["seed"]): r for r in rows}
    acc = {k: statistics.mean(int(c) for c in r["correct"]) for k, r in by.items()}
    lines = [
        "| T | LIF accuracy | TS accuracy | TS − LIF (t over seeds) | verdict | TS − LIF pooled (paired "
        "bootstrap) | ‖∂L/∂u_1‖/‖∂L/∂u_T‖ LIF (trained; init) | TS (trained; init) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in ts_:
        ok = [s for s in seeds if ("lif", t, s) in by and ("ts", t, s) in by]
        if not ok:
            continue
        la = [acc[("lif", t, s)] for s in ok]
        ta = [acc[("ts", t, s)] for s in ok]
        m, lo, hi = t_interval([b - a for a, b in zip(la, ta)])
        pd = paired_difference(
            [int(c) for s in ok for c in by[("ts", t, s)]["correct"]],
            [int(c) for s in ok for c in by[("lif", t, s)]["correct"]],
        )

        ratio = {}
        for neuron in ("lif", "ts"):
            g = statistics.median(by[(neuron, t, s)]["grad_ratio"] for s in ok)
            g0 = statistics.median(by[(neuron, t, s)]["grad_ratio_init"] for s in ok)
            ratio[neuron] = f"{fmt_ratio(g)}; {fmt_ratio(g0)}"
        lines.append(
            f"| {t} | {fmt_ci(*t_interval(la))} | {fmt_ci(*t_interval(ta))} | "
            f"{fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
            f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} | {ratio['lif']} | {ratio['ts']} |"
        )
    # the decline: accuracy at the largest T minus the smallest, per neuron
    lines += [
        "",
        f"| neuron | accuracy(T={ts_[-1]}) − accuracy(T={ts_[0]}) (t over seeds) | verdict |",
        "|---|---|---|",
    ]
    for neuron in ("lif", "ts"):
        ok = [s for s in seeds if (neuron, ts_[0], s) in by and (neuron, ts_[-1], s) in by]
        if ok:
            m, lo, hi = t_interval([acc[(neuron, ts_[-1], s)] - acc[(neuron, ts_[0], s)] for s in ok])
            lines.append(f"| {neuron} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} |")
    return "\n".join(lines)


def commands_block() -> str:
    """The exact training commands of seed 0 of every experiment (other seeds differ in --seed/--out)."""
    out = []
    for pattern in (
        "emformer_seed0.json",
        "meg_seed0.json",
        "vlta_seed0.json",
        "ts_xor_seed0.json",
        "ts_blobs_seed0.json",
    ):
        for d in load(pattern):
            out.append(f"# {d['experiment']} (seed 0)")
            out += [re.sub(r"\S*?(runs/modalities/)", r"\1", c) for c in d["commands"].values()]
    return "```bash\n" + "\n".join(out) + "\n```" if out else "_no rows yet_"


# -- verdicts: written from the stored rows by the rules below, never by hand ------------------------------

REPRODUCES, FAILS, NOT_SIG = "reproduces", "does not reproduce", "not significant"
COMMANDS = {
    "emformer": "bench/heavy.sh python bench/lab_modalities.py emformer --seeds 0 1 2",
    "conv-time": "bench/heavy.sh python bench/lab_modalities.py conv-time",
    "meg": "bench/heavy.sh python bench/lab_modalities.py meg --seeds 0 1 2",
    "vlta": "bench/heavy.sh python bench/lab_modalities.py vlta --seeds 0 1 2",
    "ts-xor": "bench/heavy.sh python bench/lab_modalities.py ts --task xor --seeds 0 1 2",
    "ts-blobs": "bench/heavy.sh python bench/lab_modalities.py ts --task blobs --seeds 0 1 2",
}


@dataclass
class Paired:
    """A per-seed paired difference: mean, 95 % t-interval and paired t-test p over ``n`` seeds, and
    (when the samples pair) the paired-bootstrap interval over seeds × test samples pooled."""

    mean: float
    low: float
    high: float
    p: float
    n: int
    boot: tuple[float, float] | None = None

    @property
    def sign(self) -> int:
        """+1 / −1 when the t-interval lies above / below 0, else 0 (also with fewer than 2 seeds)."""
        if math.isnan(self.low):
            return 0
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def brief(self, nd: int = 3) -> str:
        return f"{fmt_ci(self.mean, self.low, self.high, nd, sign=True)}, p = {self.p:.2g}"

    def text(self, nd: int = 3) -> str:
        s = f"{fmt_ci(self.mean, self.low, self.high, nd, sign=True)} (paired t over {self.n} seeds, p = "
        s += f"{self.p:.2g}" + (", not significant" if self.sign == 0 else "")
        if self.boot is not None:
            s += f"; pooled paired bootstrap [{self.boot[0]:+.{nd}f}, {self.boot[1]:+.{nd}f}]"
        return s + ")"


def paired_seeds(diffs: list[float], a: list[float] | None = None, b: list[float] | None = None) -> Paired:
    """``diffs``: one difference per seed; ``a``, ``b``: the pooled per-sample scores that pair."""
    from scipy import stats

    from longlab.eval.stats import paired_difference

    m, lo, hi = t_interval(diffs)
    if len(diffs) < 2:
        p = float("nan")
    elif statistics.stdev(diffs) == 0:
        p = 1.0 if m == 0 else 0.0
    else:
        p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
    boot = None
    if a is not None and b is not None:
        pd = paired_difference(a, b)
        boot = (pd.low, pd.high)
    return Paired(m, lo, hi, p, len(diffs), boot)


@dataclass
class Claim:
    section: str  # the page region it belongs to (verdict-<section>)
    name: str
    verdict: str  # REPRODUCES, FAILS, NOT_SIG, or "not measured yet"
    figures: str  # the numbers it rests on
    command: str
    short: str = ""  # the deciding numbers alone, for the summary table


def claims_emformer() -> list[Claim]:
    """Rollout − one-step RMSE, per fine-tuning lr. Reproduces when leads 20 and 40 are significantly lower
    and lead 1 is not significantly higher; does not reproduce when any of them goes significantly the
    wrong way (a long lead higher, lead 1 higher); otherwise not significant."""
    docs = load("emformer_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        if not arm.startswith("rollout"):
            continue
        base = "one-step" + arm[len("rollout") :]
        ok = [s for s in seeds if (arm, s) in by and (base, s) in by]
        cmp = {}
        for k in (1, 20, 40):
            ra = [by[(arm, s)]["rmse"][str(k)] for s in ok]
            rb = [by[(base, s)]["rmse"][str(k)] for s in ok]
            cmp[k] = paired_seeds(
                [statistics.mean(x) - statistics.mean(y) for x, y in zip(ra, rb)],
                [v for x in ra for v in x],
                [v for y in rb for v in y],
            )
        if cmp[20].sign > 0 or cmp[40].sign > 0 or cmp[1].sign > 0:
            v = FAILS
        elif cmp[20].sign < 0 and cmp[40].sign < 0:
            v = REPRODUCES
        else:
            v = NOT_SIG
        lr = arm.split("@", 1)[1] if "@" in arm else "?"
        figs = "; ".join(f"lead {k} {cmp[k].text()}" for k in (20, 40, 1))
        out.append(
            Claim(
                "emformer",
                f"EMFormer: rollout fine-tuning improves leads 20 and 40 without hurting lead 1 "
                f"(fine-tuning lr {lr}, {len(ok)} seeds)",
                v if len(ok) >= 2 else "not measured yet",
                "rollout − one-step RMSE: " + figs,
                COMMANDS["emformer"],
                "Δ RMSE " + ", ".join(f"lead {k} {cmp[k].brief()}" for k in (20, 40, 1)),
            )
        )
    return out or [
        Claim("emformer", "EMFormer: rollout fine-tuning", "not measured yet", "", COMMANDS["emformer"])
    ]


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95 % interval (binomial order statistics, coverage ≥ 95 %)."""
    from scipy import stats

    x = sorted(values)
    n = len(x)
    j = int(stats.binom.ppf(0.025, n, 0.5))  # x_(j) ≤ median ≤ x_(n−j+1) with probability ≥ 0.95
    if j < 1:
        return statistics.median(x), float("nan"), float("nan")
    return statistics.median(x), x[j - 1], x[n - j]


def claims_conv() -> list[Claim]:
    """Merged vs three convolutions, per timed case: the median per-repeat speed-up (three convs / merged,
    interleaved repeats) with its 95 % interval and a paired Wilcoxon signed-rank test of the log ratios.
    Reproduces when every conv case (forward; forward+backward; every shape) has its interval above 1; does
    not reproduce when one lies below 1; otherwise not significant. The mixer case is reported, not judged
    (attention dominates it)."""
    from scipy import stats

    docs = load("conv_time.json")
    rows = [r for r in docs[0]["rows"] if "ratios" in r] if docs else []
    if not rows:
        return [
            Claim(
                "conv",
                "EMFormer: the merged conv is faster than three convs",
                "not measured yet",
                "",
                COMMANDS["conv-time"],
            )
        ]
    parts, signs, conv = [], [], []
    for r in rows:
        m, lo, hi = median_interval(r["ratios"])
        p = float(stats.wilcoxon([math.log(v) for v in r["ratios"]]).pvalue)
        sign = 0 if math.isnan(lo) else 1 if lo > 1 else -1 if hi < 1 else 0
        if r["case"].startswith("conv"):
            signs.append(sign)
            conv.append((m, lo, hi, p))
        parts.append(
            f"{r['case']} B{r['B']}-T{r['T']}-C{r['channels']} {m:.2f}× [{lo:.2f}, {hi:.2f}] "
            f"(Wilcoxon p = {p:.2g}, {len(r['ratios'])} paired repeats)"
        )
    v = FAILS if -1 in signs else REPRODUCES if signs and all(s > 0 for s in signs) else NOT_SIG
    return [
        Claim(
            "conv",
            "EMFormer: the merged conv is faster than the three convs (one CPU thread)",
            v,
            "speed-up (three convs / merged, per repeat), median with its 95 % interval: " + "; ".join(parts),
            COMMANDS["conv-time"],
            f"{len(conv)} conv cases: median speed-up {min(c[0] for c in conv):.2f}×–"
            f"{max(c[0] for c in conv):.2f}×, 95 % intervals from {min(c[1] for c in conv):.2f}× to "
            f"{max(c[2] for c in conv):.2f}×, Wilcoxon p ≤ {max(c[3] for c in conv):.2g}"
            if conv
            else "",
        )
    ]


def claims_meg() -> list[Claim]:
    """Probe accuracy, long − short pretraining context (pretrained encoders). Reproduces when the
    t-interval over seeds lies above 0, does not reproduce when below, otherwise not significant."""
    docs = load("meg_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    name = "MEG-XL: block-masked pretraining at the long context beats the short one on the 1 %-label probe"
    ctxs = sorted({r["context"] for r in rows})
    if len(ctxs) != 2:
        return [Claim("meg", name, "not measured yet", "", COMMANDS["meg"])]
    by = {(r["context"], r["encoder"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    seeds = sorted({r["seed"] for r in rows})

    def cmp(a_key, b_key) -> Paired:
        ok = [s for s in seeds if (*a_key, s) in by and (*b_key, s) in by]
        return paired_seeds(
            [statistics.mean(by[(*a_key, s)]) - statistics.mean(by[(*b_key, s)]) for s in ok],
            [v for s in ok for v in by[(*a_key, s)]],
            [v for s in ok for v in by[(*b_key, s)]],
        )

    lo_c, hi_c = ctxs
    main = cmp((hi_c, "pretrained"), (lo_c, "pretrained"))
    v = REPRODUCES if main.sign > 0 else FAILS if main.sign < 0 else NOT_SIG
    ctrl = "; ".join(
        f"context {c}: pretrained − untrained {cmp((c, 'pretrained'), (c, 'untrained')).text()}" for c in ctxs
    )
    figs = f"probe accuracy, context {hi_c} − {lo_c} steps: {main.text()}. Control, {ctrl}"
    short = f"Δ accuracy {main.brief()}"
    return [Claim("meg", name, v if main.n >= 2 else "not measured yet", figs, COMMANDS["meg"], short)]


def claims_vlta() -> list[Claim]:
    """Reacquisition accuracy after the long occlusions (100–200 frames, never seen in training), VLTA −
    EMA, at each video length. Reproduces when every length's t-interval lies above 0; does not reproduce
    when one lies below 0; otherwise not significant."""
    docs = load("vlta_seed*.json")
    rows = [r for d in docs for r in d["rows"] if r["variant"]]
    name = "TAPTRv3: VLTA keeps reacquisition accuracy after long occlusions where the EMA memory drifts"
    by = {(r["mixer"], r["length"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    if not lengths or len(seeds) < 2:
        return [Claim("vlta", name, "not measured yet", "", COMMANDS["vlta"])]

    def cmp(a: str, b: str, n: int) -> Paired:
        ok = [s for s in seeds if (a, n, s) in by and (b, n, s) in by]
        return paired_seeds(
            [statistics.mean(by[(a, n, s)]) - statistics.mean(by[(b, n, s)]) for s in ok],
            [v for s in ok for v in by[(a, n, s)]],
            [v for s in ok for v in by[(b, n, s)]],
        )

    main = {n: cmp("vlta", "ema", n) for n in lengths}
    signs = [c.sign for c in main.values()]
    v = FAILS if -1 in signs else REPRODUCES if all(s > 0 for s in signs) else NOT_SIG
    accs = []
    for n in lengths:
        cell = []
        for m in ("vlta", "ema", "softmax"):
            vals = [statistics.mean(by[(m, n, s)]) for s in seeds if (m, n, s) in by]
            if vals:
                cell.append(f"{m} {fmt_ci(*t_interval(vals))}")
        accs.append(f"{n} frames: " + ", ".join(cell))
    figs = "VLTA − EMA reacquisition accuracy after 100–200-frame occlusions: " + "; ".join(
        f"{n} frames {c.text()}" for n, c in main.items()
    )
    figs += ". Accuracies (t over seeds): " + "; ".join(accs)
    if all(("softmax", n, s) in by for n in lengths for s in seeds):
        figs += ". VLTA − causal softmax: " + "; ".join(
            f"{n} frames {cmp('vlta', 'softmax', n).text()}" for n in lengths
        )
    short = "Δ accuracy " + ", ".join(f"{n} frames {c.brief()}" for n, c in main.items())
    return [Claim("vlta", name, v, figs, COMMANDS["vlta"], short)]


def fmt_ratio(g: float) -> str:
    """A gradient ratio; ``∞`` when ‖∂L/∂u_T‖ was 0 (the stored value divides by the 1e-30 floor)."""
    return "∞" if g >= 1e15 else f"{g:.2g}"


def claims_ts(task: str) -> list[Claim]:
    """Accuracy at the largest T minus the smallest, per neuron (paired by seed). Reproduces when LIF's
    change lies significantly below 0 and TS's does not; does not reproduce when LIF's lies above 0 or TS
    declines significantly as well; otherwise (LIF's decline not significant) not significant."""
    docs = load(f"ts_{task}_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    name = f"TS neuron ({task}): LIF accuracy declines with T, TS accuracy does not"
    seeds = sorted({r["seed"] for r in rows})
    ts_ = sorted({r["T"] for r in rows})
    if len(ts_) < 2 or len(seeds) < 2:
        return [Claim("ts", name, "not measured yet", "", COMMANDS[f"ts-{task}"])]
    by = {(r["neuron"], r["T"], r["seed"]): r for r in rows}
    acc = {k: statistics.mean(int(c) for c in r["correct"]) for k, r in by.items()}
    t0, t1 = ts_[0], ts_[-1]
    change = {}
    for neuron in ("lif", "ts"):
        ok = [s for s in seeds if (neuron, t0, s) in by and (neuron, t1, s) in by]
        change[neuron] = paired_seeds([acc[(neuron, t1, s)] - acc[(neuron, t0, s)] for s in ok])
    ok = [s for s in seeds if ("lif", t1, s) in by and ("ts", t1, s) in by]
    gap = paired_seeds(
        [acc[("ts", t1, s)] - acc[("lif", t1, s)] for s in ok],
        [int(c) for s in ok for c in by[("ts", t1, s)]["correct"]],
        [int(c) for s in ok for c in by[("lif", t1, s)]["correct"]],
    )
    lif, ts = change["lif"].sign, change["ts"].sign
    v = FAILS if lif > 0 or ts < 0 else REPRODUCES if lif < 0 else NOT_SIG
    ratios = "; ".join(
        f"{n.upper() if n == 'lif' else 'TS'} "
        + fmt_ratio(statistics.median(by[(n, t1, s)]["grad_ratio"] for s in ok))
        + " (init "
        + fmt_ratio(statistics.median(by[(n, t1, s)]["grad_ratio_init"] for s in ok))
        + ")"
        for n in ("lif", "ts")
    )
    figs = (
        f"accuracy(T={t1}) − accuracy(T={t0}): LIF {change['lif'].text()}, TS {change['ts'].text()}; "
        f"TS − LIF at T={t1}: {gap.text()}; ‖∂L/∂u_1‖/‖∂L/∂u_T‖ at T={t1}, median over seeds: {ratios}"
    )
    short = f"Δ accuracy T={t1} − T={t0}: LIF {change['lif'].brief()}, TS {change['ts'].brief()}"
    return [Claim("ts", name, v, figs, COMMANDS[f"ts-{task}"], short)]


@functools.cache
def all_claims() -> list[Claim]:
    return [
        *claims_emformer(),
        *claims_conv(),
        *claims_meg(),
        *claims_vlta(),
        *claims_ts("xor"),
        *claims_ts("blobs"),
    ]


def verdicts_summary() -> str:
    lines = [
        "| claim | verdict | deciding differences (mean [95 % t-interval over seeds], paired t-test p) | "
        "reproduce with |",
        "|---|---|---|---|",
    ]
    for c in all_claims():
        lines.append(f"| {c.name} | **{c.verdict}** | {c.short or c.figures or '–'} | `{c.command}` |")
    return "\n".join(lines)


def verdicts_section(section: str, rule_of) -> str:
    rule = " ".join((rule_of.__doc__ or "").split())
    out = [f"_Rule (applied by `bench/lab_modalities.py page`)_: {rule}", ""]
    for c in all_claims():
        if c.section == section:
            out.append(f"**Verdict — {c.name}: {c.verdict}.** {c.figures}. Reproduce: `{c.command}`.")
            out.append("")
    return "\n".join(out).rstrip()


TABLES = {
    "emformer": table_emformer,
    "conv-time": table_conv_time,
    "meg": table_meg,
    "vlta": table_vlta,
    "ts-xor": lambda: table_ts("xor"),
    "ts-blobs": lambda: table_ts("blobs"),
    "commands": commands_block,
    "verdicts": verdicts_summary,
    "verdict-emformer": lambda: verdicts_section("emformer", claims_emformer),
    "verdict-conv": lambda: verdicts_section("conv", claims_conv),
    "verdict-meg": lambda: verdicts_section("meg", claims_meg),
    "verdict-vlta": lambda: verdicts_section("vlta", claims_vlta),
    "verdict-ts": lambda: verdicts_section("ts", claims_ts),
}


def run_page(a: argparse.Namespace) -> None:
    """Replace every ``<!-- generated: NAME -->`` … ``<!-- /generated -->`` region of the page (tables,
    verdicts, commands), all computed from the stored rows."""
    page = a.page
    text = page.read_text()

    def fill(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise SystemExit(f"{page}: unknown generated region {name!r}")
        return f"<!-- generated: {name} -->\n{TABLES[name]()}\n<!-- /generated -->"

    new = re.sub(r"<!-- generated: ([\w-]+) -->\n.*?<!-- /generated -->", fill, text, flags=re.S)
    page.write_text(new)
    print(f"# wrote {page}")


def main(argv: list[str] | None = None) -> None:
    global RESULTS, RUNS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSON rows go")
    ap.add_argument("--runs", type=Path, default=RUNS, help="where the checkpoints go")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("emformer")
    e.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    e.add_argument("--task", default="lorenz96")
    e.add_argument("--pretrain", type=int, default=3000)
    e.add_argument("--finetune", type=int, default=300, help="rollout steps (5 updates each)")
    e.add_argument("--rollout", type=int, default=5)
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--lr", type=float, default=3e-3)
    e.add_argument("--ft-lr", type=float, nargs="+", default=[1e-4, 3e-4], help="fine-tuning learning rates")
    e.add_argument("--test", type=int, default=256)
    e.add_argument("--leads", type=int, nargs="+", default=[1, 5, 20, 40])
    c = sub.add_parser("conv-time")
    c.add_argument(
        "--shapes",
        type=lambda s: tuple(int(v) for v in s.split("x")),
        nargs="+",
        default=[(32, 8, 64), (8, 512, 64), (1, 8192, 64)],
        help="BxTxD",
    )
    c.add_argument("--repeats", type=int, default=51)
    m = sub.add_parser("meg")
    m.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    m.add_argument("--task", default="meg")
    m.add_argument("--contexts", type=int, nargs="+", default=[50, 500], help="time steps")
    m.add_argument(
        "--tokens", type=int, default=8000, help="tokens per optimizer step (equal for every context)"
    )
    m.add_argument("--steps", type=int, default=600)
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--labels", type=int, default=80)
    m.add_argument("--test", type=int, default=300)
    m.add_argument("--probe-seed", type=int, default=0)
    v = sub.add_parser("vlta")
    v.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    v.add_argument("--task", default="track")
    v.add_argument("--mixers", nargs="+", default=["vlta", "ema", "softmax"])
    v.add_argument("--train-len", type=int, default=100)
    v.add_argument("--steps", type=int, default=600)
    v.add_argument("--batch", type=int, default=16)
    v.add_argument("--lr", type=float, default=3e-3)
    v.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 2000])
    v.add_argument("--variants", nargs="+", default=["", "occ_min=100,occ_max=200"])
    v.add_argument("--videos", type=int, default=32)
    t = sub.add_parser("ts")
    t.add_argument("--task", default="xor", choices=["xor", "blobs"])
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    t.add_argument("--neurons", nargs="+", default=["lif", "ts"])
    t.add_argument("--timesteps", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--dim", type=int, default=64)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--test", type=int, default=512)
    pg = sub.add_parser("page")
    pg.add_argument("--page", type=Path, default=PAGE, help="the page whose generated regions are rewritten")
    a = ap.parse_args(argv)
    RESULTS, RUNS = a.results, a.runs
    torch.set_num_threads(1)
    {
        "emformer": run_emformer,
        "conv-time": run_conv_time,
        "meg": run_meg,
        "vlta": run_vlta,
        "ts": run_ts,
        "page": run_page,
    }[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
