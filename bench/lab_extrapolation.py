"""Layers lab, train short / test long: train every mixer on one task with equal parameters and equal
training tokens, then test at many lengths into one results store (resumable: finished trainings and
stored rows are skipped, so a sweep can be run in pieces of a few mixers).

    python bench/lab_extrapolation.py --task mqar --mixers softmax ssmax --seeds 0 \\
        --train-len 64 --steps 600 --lengths 64 128 256 512 1024 --root runs/lab

A mixer name ``NAME+POS`` trains ``NAME``'s spec with positions ``POS`` (``softmax+nape``: the NAPE control).
Writes ``ROOT/ckpt/<task>[/<tag>]/<mixer>/seed<s>/`` and ``ROOT/results/results.sqlite``; prints one line per
model (parameters, training seconds, final loss) and per length (mean score). ``--tag`` keeps runs of other
settings of one task (``mqar:alphabet=16``, other step counts) in their own checkpoint directories.
``--variants`` also tests each model on variants of its task (the algebra mechanism sets, an unseen group).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from longlab.lab.evaluate import evaluate
from longlab.lab.train import TrainConfig, train

# mixer specs used in the lab sweep (lab-scale windows/chunks: the train length is 64)
SPECS = {
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True)
    ap.add_argument("--mixers", nargs="+", default=list(SPECS))
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
            spec = SPECS.get(base, base)
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


if __name__ == "__main__":
    main()
