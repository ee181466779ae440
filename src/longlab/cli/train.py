"""``longlab train indexmem|drope|ropeid|repo``: train a learned method's weights.

The argparse of every training tool lives here; the work is the libraries' (:func:`longlab.kv.indexmem_train.
train_indexmem`, :func:`longlab.position.train.recalibrate` and :func:`~longlab.position.train.save_variant`).
An option of one method given to another is refused, naming the option and the methods it belongs to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_train_parser", "train_indexmem_main", "train_position_main"]

POSITION_METHODS = ("drope", "ropeid", "repo")  # longlab.position.train.TRAINABLE (checked by a test)
INDEXMEM_ONLY = {"inner_steps": "--inner-steps", "lr_memory": "--lr-memory", "max_steps": "--max-steps"}
POSITION_ONLY = {
    "steps": "--steps", "batch": "--batch", "params": "--params", "train": "--train",
    "heldout_windows": "--heldout-windows", "data": "--data",
}
INDEXMEM_LR, INDEXMEM_LR_MEMORY, INDEXMEM_INNER_STEPS = 1e-4, 2e-3, 4
POSITION_STEPS, POSITION_BATCH, POSITION_HELD_OUT = 50, 1, 2


def add_train_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train a learned method's weights (IndexMem; DroPE, RoPE-ID, RePo)")
    t.add_argument("method", choices=("indexmem", *POSITION_METHODS), help="method to train")
    t.add_argument("--model", default="smollm2-135m", help="model name or path (default: smollm2-135m)")
    t.add_argument("--minutes", type=float, default=15.0, help="wall-clock training budget (default 15)")
    t.add_argument("--seq-len", type=int, default=1024, help="tokens per training text (default 1024)")
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (indexmem: the indexer's, default {INDEXMEM_LR:g}; drope/ropeid/repo: "
        "drope 1e-4, ropeid 1e-4, repo 5e-3)",
    )
    t.add_argument("--seed", type=int, default=0, help="random seed, in [0, 2**32 - 1] (default 0)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    t.add_argument(
        "--out",
        default=None,
        help="indexmem: a weights file .safetensors; drope/ropeid/repo: a variant directory (default: the "
        "longlab cache); never one longlab did not write",
    )
    g = t.add_argument_group("indexmem only")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many texts (over --minutes)")
    g.add_argument(
        "--inner-steps", type=int, default=None, help=f"steps per forward (default {INDEXMEM_INNER_STEPS})"
    )
    g.add_argument(
        "--lr-memory", type=float, default=None, help=f"memory lr (default {INDEXMEM_LR_MEMORY:g})"
    )
    g = t.add_argument_group("drope / ropeid / repo only")
    g.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {POSITION_STEPS})")
    g.add_argument("--batch", type=int, default=None, help=f"windows per step (default {POSITION_BATCH})")
    g.add_argument("--params", default=None, help="the method's parameters, e.g. qk_norm=true or cycles=2")
    g.add_argument(
        "--train", default=None, choices=("attn", "all", "added"),
        help="tensors to train (default attn; added for repo)",
    )
    g.add_argument(
        "--heldout-windows", type=int, default=None,
        help=f"held-out windows scored before and after, each in the manifest (default {POSITION_HELD_OUT})",
    )
    g.add_argument(
        "--data", default=None, choices=("essay", "pydoc"),
        help="training text: essay (longlab's essay haystack, 1.8k tokens: short runs memorise it) or pydoc "
        "(CPython's documentation topics, ~85k tokens, disjoint from bench/position.py ppl's text); "
        "default essay",
    )
    t.set_defaults(func=_train_main)


def _train_main(args: argparse.Namespace) -> int:
    from ..recipe import LonglabError

    position = args.method in POSITION_METHODS
    other, owner = (INDEXMEM_ONLY, "indexmem") if position else (POSITION_ONLY, "drope, ropeid and repo")
    given = [flag for dest, flag in other.items() if getattr(args, dest) is not None]
    if given:
        raise LonglabError(f"{', '.join(given)}: an option of {owner}, not of train {args.method}")
    return train_position_main(args) if args.method in POSITION_METHODS else train_indexmem_main(args)


def _threads(args: argparse.Namespace) -> None:
    import torch

    from ..recipe import check_range

    if args.threads is not None:
        check_range("--threads", args.threads, 1, 1024, integer=True)
        torch.set_num_threads(args.threads)


def _check_model_positions(model: Any, seq_len: int) -> None:
    from ..recipe import LonglabError

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise LonglabError(
            f"--seq-len must be <= the model's max_position_embeddings ({limit}), got {seq_len}"
        )


def train_indexmem_main(args: argparse.Namespace) -> int:
    """``longlab train indexmem``: every setting checked before the model loads."""
    from ..kv.indexmem import manifest_path
    from ..kv.indexmem_train import CLI_FLAGS, check_settings, output_path, train_indexmem
    from ..models import load_model

    lr = INDEXMEM_LR if args.lr is None else args.lr
    lr_memory = INDEXMEM_LR_MEMORY if args.lr_memory is None else args.lr_memory
    inner = INDEXMEM_INNER_STEPS if args.inner_steps is None else args.inner_steps
    check_settings(
        minutes=args.minutes, max_steps=args.max_steps, seq_len=args.seq_len, inner_steps=inner,
        lr=lr, lr_memory=lr_memory, seed=args.seed, flags=CLI_FLAGS,
    )
    if args.out:  # --out checked before the model loads (the file name inside a directory needs the model)
        output_path(args.out, "model")
    _threads(args)
    model, tokenizer = load_model(args.model)
    _check_model_positions(model, args.seq_len)
    path = train_indexmem(
        model, tokenizer, model_name=args.model, minutes=args.minutes, max_steps=args.max_steps,
        seq_len=args.seq_len, inner_steps=inner, lr=lr, lr_memory=lr_memory, seed=args.seed, out=args.out,
    )
    man = json.loads(manifest_path(path).read_text(encoding="utf-8"))
    loss, training = man["loss"], man["training"]
    print(
        f"wrote {path} and {manifest_path(path).name}: {training['forwards']} texts, "
        f"{training['optimizer_steps']} steps in {training['seconds']:.0f}s; "
        f"indexer KL {loss['indexer_kl']['first_10pct']:.3f} -> {loss['indexer_kl']['last_10pct']:.3f}, "
        f"memory mse_ratio {loss['memory_mse_ratio']['first_10pct']:.3f} -> "
        f"{loss['memory_mse_ratio']['last_10pct']:.3f}"
    )
    print(f"use the recipe indexmem@0.9{':weights=' + str(path) if args.out else ''}")
    return 0


def train_position_main(args: argparse.Namespace) -> int:
    """``longlab train drope|ropeid|repo``: every setting and ``--out`` checked before the model loads."""
    import torch

    from ..models import load_model
    from ..paths import cache_dir
    from ..position import parse_position
    from ..position.train import DEFAULT_LR, PYDOC_HELD_OUT, _check_schedule, recalibrate, save_variant
    from ..position.variants import is_variant_dir
    from ..recipe import LonglabError, check_range
    from ..safeio import check_output_dir

    spec = args.method + (f":{args.params}" if args.params else "")
    method = parse_position(spec)
    if method.weights:
        raise LonglabError("--params: weights= is what training writes (use --out)")
    steps = POSITION_STEPS if args.steps is None else args.steps
    batch = POSITION_BATCH if args.batch is None else args.batch
    held = POSITION_HELD_OUT if args.heldout_windows is None else args.heldout_windows
    data = args.data or "essay"
    train = args.train or ("added" if args.method == "repo" else "attn")
    lr = DEFAULT_LR[args.method] if args.lr is None else args.lr
    _check_schedule(steps, args.seq_len, batch, lr, train, data, args.seed)
    check_range("--minutes", args.minutes, 0, 7 * 24 * 60, low_open=True)
    check_range("--heldout-windows", held, 1, 1024, integer=True)
    if data == "pydoc" and held * args.seq_len > PYDOC_HELD_OUT:
        raise LonglabError(
            f"--heldout-windows: --data pydoc holds out {PYDOC_HELD_OUT} tokens: at most "
            f"{PYDOC_HELD_OUT // args.seq_len} windows of --seq-len {args.seq_len}, got {held}"
        )
    key = Path(str(args.model)).name.replace(".gguf", "")
    out = Path(args.out) if args.out else cache_dir() / "variants" / f"{key}-{method.spec.replace(':', '-')}"
    check_output_dir(out, "--out", owned=is_variant_dir, what="trained variant")
    _threads(args)
    model, tokenizer = load_model(args.model, attn_implementation="sdpa", position=method)
    _check_model_positions(model, args.seq_len)
    print(
        f"longlab train {args.method}: {args.model} with {method.spec}; {steps} steps x {batch} x "
        f"{args.seq_len} tokens of {data}, lr {lr:g}, threads {torch.get_num_threads()}",
        flush=True,
    )
    stats = recalibrate(
        model, tokenizer, steps=steps, seq_len=args.seq_len, batch=batch, lr=lr, train=train, seed=args.seed,
        data=data, eval_windows=held, minutes=args.minutes,
        log=lambda m: print(m, flush=True),
    )
    save_variant(model, method, out, str(args.model), stats)
    print(
        f"held-out loss {stats['heldout_loss_before']:.3f} -> {stats['heldout_loss_after']:.3f} "
        f"({stats['tokens']} training tokens, {stats['seconds']:.0f}s); wrote {out}",
        flush=True,
    )
    if "repo_offset_abs_mean" in stats:
        moved = stats["repo_offset_abs_mean"]
        still = ": barely at all, the module has not learned (raise --lr or --steps)" if moved < 0.05 else ""
        print(
            f"RePo positions moved by |δ| = {moved:.3g} on average (max {stats['repo_offset_abs_max']:.3g})"
            f"{still}",
            flush=True,
        )
    print(f"load it: load_model({str(out)!r}) or --model {out}", flush=True)
    return 0
