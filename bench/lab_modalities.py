"""Issue 33: the four long-context mechanisms from other modalities in the layers lab, each claim measured
at small scale on one CPU thread, ≥ 3 training seeds per cell. Every model is trained by the lab's CLI
(``longlab lab train``, called in-process; the exact command is stored with each row); checkpoints go to
``runs/modalities/`` (not committed), compact JSON rows to ``bench/results/lab_modalities/``;
``longlab report --docs --page results/modalities`` (:mod:`longlab.eval.pages.modalities`) writes the tables
and verdicts of ``docs/results/modalities.md`` from those rows.

    bench/heavy.sh python bench/lab_modalities.py emformer --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py conv-time
    bench/heavy.sh python bench/lab_modalities.py meg --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py vlta --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py ts --task xor --seeds 0 1 2
    bench/heavy.sh python bench/lab_modalities.py ts --task blobs --seeds 0 1 2
    longlab report --docs --page results/modalities

Claims (remaining-seeds §35–38): EMFormer — rollout (accumulative-context) fine-tuning improves long
leads (20, 40) without hurting lead 1, and the merged conv is faster than three convs; MEG-XL —
block-masked pretraining at a long context beats a short one (equal tokens) on a 1 %-label linear
probe; TAPTRv3 — VLTA keeps accuracy after long occlusions where an EMA memory drifts; TS neuron — LIF
accuracy declines with the number of timesteps T, TS does not.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch
from common import ROOT, hardware, interleaved, write_json

from longlab.cli import main as cli_main
from longlab.lab.train import load_checkpoint

RESULTS = ROOT / "bench" / "results" / "lab_modalities"  # --results overrides (smoke runs)
RUNS = ROOT / "runs" / "modalities"  # --runs overrides


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
    a = ap.parse_args(argv)
    RESULTS, RUNS = a.results, a.runs
    torch.set_num_threads(1)
    {
        "emformer": run_emformer,
        "conv-time": run_conv_time,
        "meg": run_meg,
        "vlta": run_vlta,
        "ts": run_ts,
    }[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
