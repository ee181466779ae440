"""``longlab lab train|eval|plot|list``: the layers-lab command line (argparse only; torch is imported
when a command runs)."""

from __future__ import annotations

import argparse
from typing import Any

from ..recipe import LonglabError

__all__ = ["add_lab_arguments", "lab_main"]


def add_lab_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", required=True)
    t = sub.add_parser("train", help="train a small LM with one token mixer on one synthetic task (CPU)")
    t.add_argument("--mixer", required=True,
                   help="softmax, ssmax, asentmax, lssa, lssar:p=15, race, emformer, crisscross, vlta, ema, "
                        "lif, ts, ... (longlab lab list)")
    t.add_argument("--task", required=True,
                   help="copy, mqar, passkey, flipflop, mtd, algebra, pcfg, lcube, lorenz96, meg, track, "
                        "xor, blobs (name:k=v,...)")
    t.add_argument("--train-len", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--out", required=True, help="checkpoint directory (re-run the same command to resume)")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=0, help="warm-up steps (default: 5%% of --steps)")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dim", type=int, default=64)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--positions", default="",
                   help="rope, nope, alibi, nape, ropeid (default: the mixer's; another one gets its own "
                        "recipe line, e.g. softmax+nape)")
    t.add_argument("--params", type=int, default=0, help="match the parameter count by the MLP width")
    t.add_argument("--ckpt-every", type=int, default=200)
    t.add_argument("--rollout", type=int, default=0,
                   help="autoregressive rollout training: that many steps per batch, one update each "
                        "(forecasting tasks: lorenz96; EMFormer's accumulative-context fine-tuning)")
    t.add_argument("--init", default="", help="start from the weights of this lab checkpoint (fine-tuning)")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--threads", type=int, default=0)

    e = sub.add_parser("eval", help="test a trained lab model at several lengths into a results store")
    e.add_argument("dir", metavar="DIR", help="checkpoint directory written by `longlab lab train`")
    e.add_argument("--lengths", type=int, nargs="+", required=True)
    e.add_argument("--out", help="results directory (default: DIR); use one for every mixer to compare them")
    e.add_argument("--samples", type=int, default=32)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--seed", type=int, default=0, help="evaluation seed (the samples)")
    e.add_argument("--task", help="test on a variant of the trained task (e.g. algebra:query=commuted)")
    e.add_argument("--threads", type=int, default=0)

    p = sub.add_parser("plot", help="score vs length, one line per mixer, from a results directory")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--table", help="also write the extrapolation table (Markdown) here")
    p.add_argument("--skip", nargs="*", default=[], help="drop rows whose task spec contains one of these")

    pr = sub.add_parser("probe", help="PCFG parsing probes: ridge R² from each layer to log inside probs")
    pr.add_argument("dir", metavar="DIR", help="checkpoint of a model trained on the pcfg task")
    pr.add_argument("--length", type=int, default=0, help="string length (default: the training length)")
    pr.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8, 16])
    pr.add_argument("--train", type=int, default=256, help="strings the probes are fitted on")
    pr.add_argument("--test", type=int, default=128, help="held-out strings the R² is measured on")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--ridge", type=float, default=1e-3)
    pr.add_argument("--out", help="write the JSON here")
    pr.add_argument("--threads", type=int, default=0)

    ls = sub.add_parser("list", help="registered mixers, positions and tasks")
    ls.set_defaults(lab_command="list")
    parser.set_defaults(func=lab_main)


def lab_main(args: Any) -> int:
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    if args.lab_command == "train":
        from ..lab.train import TrainConfig, train

        cfg = TrainConfig(
            mixer=args.mixer, task=args.task, train_len=args.train_len, steps=args.steps, batch=args.batch,
            lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, seed=args.seed, dim=args.dim,
            n_layers=args.layers, n_heads=args.heads, positions=args.positions, params=args.params,
            ckpt_every=args.ckpt_every, rollout=args.rollout, init=args.init,
        )
        manifest = train(cfg, args.out, progress=not args.no_progress)
        last = manifest["history"][-1]["loss"] if manifest["history"] else float("nan")
        print(
            f"longlab lab train: {args.out}: {manifest['step']} steps, {manifest['params']} parameters, "
            f"{manifest['train_tokens']} training tokens, loss {last:.4f}"
        )
        return 0
    if args.lab_command == "eval":
        from ..lab.evaluate import evaluate

        evaluate(args.dir, args.lengths, out=args.out, samples=args.samples, batch=args.batch, seed=args.seed,
                 task=args.task)
        return 0
    if args.lab_command == "plot":
        from ..lab.plot import plot_results

        path = plot_results(args.dir, args.out, args.skip)
        if path is None:
            print(f"longlab lab plot: no lab rows in {args.dir}")
            return 1
        print(f"longlab lab plot: {path}")
        if args.table:
            from pathlib import Path

            from ..lab.plot import extrapolation_table, lab_rows

            Path(args.table).write_text(extrapolation_table(lab_rows(args.dir, args.skip)) + "\n")
            print(f"longlab lab plot: {args.table}")
        return 0
    if args.lab_command == "probe":
        import json

        from ..lab.probes import probe_checkpoint

        res = probe_checkpoint(args.dir, args.length, args.widths, args.train, args.test, args.seed,
                               args.ridge)
        for part in ("trained", "untrained"):
            r2 = res[part]["r2"]
            print(f"{part}: R² by layer (rows) and width (columns {', '.join(map(str, args.widths))})")
            for layer, row in r2.items():
                print(f"  layer {layer}: " + "  ".join(f"{row[w]:+.3f}" for w in args.widths))
        print("best layer by width (trained): " + ", ".join(f"w={w}: {v}" for w, v in
                                                             res["trained"]["best_layer"].items()))
        if args.out:
            from pathlib import Path

            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
            print(f"longlab lab probe: {args.out}")
        return 0
    if args.lab_command == "list":
        from ..lab.mixers import MIXERS
        from ..lab.positions import LAB_POSITIONS
        from ..lab.tasks import LAB_TASKS

        for name, cls in MIXERS.items():
            print(f"mixer {name:<10} positions {'/'.join(cls.positions_allowed):<22} {cls.paper}")
        print("positions " + ", ".join(LAB_POSITIONS))
        print("tasks     " + ", ".join(LAB_TASKS))
        return 0
    raise LonglabError(f"longlab lab: unknown command {args.lab_command!r}")
