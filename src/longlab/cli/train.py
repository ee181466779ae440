"""``longlab train indexmem|drope|ropeid|repo|comi|lora``: train a learned method's weights, or a LoRA
adapter.

The argparse of every training tool lives here; the work is the libraries' (:func:`longlab.kv.indexmem_train.
train_indexmem`, :func:`longlab.position.train.recalibrate` and :func:`~longlab.position.train.save_variant`,
:func:`longlab.compress.comi_train.train_comi`, :func:`longlab.adapter_train.train_lora` on an EntropyLong
dataset). An option of one method given to another
is refused, naming the option and the methods it belongs to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_train_parser", "train_indexmem_main", "train_position_main", "train_comi_main",
           "train_lora_main"]

POSITION_METHODS = ("drope", "ropeid", "repo")  # longlab.position.train.TRAINABLE (checked by a test)
INDEXMEM_ONLY = {"inner_steps": "--inner-steps", "lr_memory": "--lr-memory", "max_steps": "--max-steps"}
POSITION_ONLY = {
    "steps": "--steps", "batch": "--batch", "params": "--params", "train": "--train",
    "heldout_windows": "--heldout-windows", "data": "--data",
}
LORA_ONLY = {"rank": "--rank", "lora_alpha": "--lora-alpha", "targets": "--targets",
             "grad_checkpointing": "--grad-checkpointing", "restart": "--restart"}
COMI_ONLY = {"ratio": "--ratio", "task": "--task", "samples": "--samples"}
# dest -> (flag, the methods that take it)
OPTION_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{d: (f, ("indexmem",)) for d, f in INDEXMEM_ONLY.items()},
    **{d: (f, POSITION_METHODS) for d, f in POSITION_ONLY.items()},
    **{d: (f, ("lora",)) for d, f in LORA_ONLY.items()},
    **{d: (f, ("comi",)) for d, f in COMI_ONLY.items()},
    "minutes": ("--minutes", ("indexmem", *POSITION_METHODS, "lora")),
}
for _dest in ("heldout_windows", "data"):  # shared by the position methods and lora
    OPTION_METHODS[_dest] = (OPTION_METHODS[_dest][0], (*POSITION_METHODS, "lora"))
OPTION_METHODS["steps"] = ("--steps", (*POSITION_METHODS, "comi", "lora"))
INDEXMEM_LR, INDEXMEM_LR_MEMORY, INDEXMEM_INNER_STEPS = 1e-4, 2e-3, 4
POSITION_STEPS, POSITION_BATCH, POSITION_HELD_OUT = 50, 1, 2


def add_train_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train a learned method's weights (IndexMem; DroPE, RoPE-ID, RePo; "
                       "COMI's fusion layer) or a LoRA adapter on EntropyLong data (lora)")
    t.add_argument("method", choices=("indexmem", *POSITION_METHODS, "comi", "lora"), help="method to train")
    t.add_argument("--model", default="smollm2-135m", help="model name or path (default: smollm2-135m)")
    t.add_argument("--minutes", type=float, default=None,
                   help="wall-clock training budget (default 15; lora: none)")
    t.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per training text (comi: per generated sample; default 1024)")
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (indexmem: the indexer's, default {INDEXMEM_LR:g}; drope/ropeid/repo: "
        "drope 1e-4, ropeid 1e-4, repo 5e-3; lora 2e-4)",
    )
    t.add_argument("--seed", type=int, default=0, help="random seed, in [0, 2**32 - 1] (default 0)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    t.add_argument(
        "--out",
        default=None,
        help="indexmem, comi: a weights file .safetensors; drope/ropeid/repo: a variant directory; lora: an "
        "adapter directory (default: the longlab cache); never one longlab did not write",
    )
    g = t.add_argument_group("indexmem only")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many texts (over --minutes)")
    g.add_argument(
        "--inner-steps", type=int, default=None, help=f"steps per forward (default {INDEXMEM_INNER_STEPS})"
    )
    g.add_argument(
        "--lr-memory", type=float, default=None, help=f"memory lr (default {INDEXMEM_LR_MEMORY:g})"
    )
    g = t.add_argument_group(
        "drope / ropeid / repo (and lora: --steps, --heldout-windows, --data; comi: --steps)")
    g.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default {POSITION_STEPS}; lora 300; comi 160)")
    g.add_argument("--batch", type=int, default=None, help=f"windows per step (default {POSITION_BATCH})")
    g.add_argument("--params", default=None, help="the method's parameters, e.g. qk_norm=true or cycles=2")
    g.add_argument(
        "--train", default=None, choices=("attn", "all", "added"),
        help="tensors to train (default attn; added for repo)",
    )
    g.add_argument(
        "--heldout-windows", type=int, default=None,
        help=f"held-out windows scored before and after, each in the manifest (default {POSITION_HELD_OUT}; "
        "lora: held-out sequences, default 4)",
    )
    g.add_argument(
        "--data", default=None,
        help="training text: essay (longlab's essay haystack, 1.8k tokens: short runs memorise it) or pydoc "
        "(CPython's documentation topics, ~85k tokens, disjoint from bench/position.py ppl's text); "
        "default essay. lora: an EntropyLong dataset (`longlab data entropylong --out X.jsonl|.parquet`)",
    )
    g = t.add_argument_group("lora only (LoRA, arXiv 2106.09685, through peft: pip install 'longlab[train]')")
    g.add_argument("--rank", type=int, default=None, help="LoRA rank r (default 8)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha; the update is alpha/r B A "
                   "(default 16)")
    g.add_argument("--targets", default=None,
                   help="projections adapted: attn (q/k/v/o) or all (and the MLP's); default attn")
    g.add_argument("--grad-checkpointing", action="store_const", const=True, default=None,
                   help="recompute activations in the backward pass (less memory at long --seq-len, slower)")
    g.add_argument("--restart", action="store_const", const=True, default=None,
                   help="ignore OUT.checkpoint (saved every 25 steps; a rerun resumes from it), start over")
    g = t.add_argument_group(
        "comi only (COMI's soft variant, arXiv 2602.01719: a fusion layer, the model frozen)")
    g.add_argument("--ratio", type=float, default=None, help="COMI's compression ratio r, in (0, 1) "
                   "(default 0.875: 1/8 kept; evaluate with the recipe comi@r:fusion=OUT)")
    g.add_argument("--task", default=None, help="generated task the training samples come from (default "
                   "redundant_niah; seed 1000 + --seed, disjoint from longlab eval's samples)")
    g.add_argument("--samples", type=int, default=None, help="training samples (default 40)")
    t.set_defaults(func=_train_main)


def _train_main(args: argparse.Namespace) -> int:
    from ..recipe import LonglabError

    wrong: dict[tuple[str, ...], list[str]] = {}
    for dest, (flag, methods) in OPTION_METHODS.items():
        if getattr(args, dest) is not None and args.method not in methods:
            wrong.setdefault(methods, []).append(flag)
    if wrong:
        methods, flags = next(iter(wrong.items()))
        owner = methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} and {methods[-1]}"
        raise LonglabError(f"{', '.join(flags)}: an option of {owner}, not of train {args.method}")
    if args.method == "lora":
        return train_lora_main(args)
    if args.method == "comi":
        return train_comi_main(args)
    if args.minutes is None:
        args.minutes = 15.0
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


def train_comi_main(args: argparse.Namespace) -> int:
    """``longlab train comi``: settings and ``--out`` checked before the model loads."""
    from ..compress.comi_train import (
        COMI_DEFAULTS,
        check_comi_settings,
        fusion_output_path,
        manifest_path,
        train_comi,
        write_fusion,
    )
    from ..models import load_model
    from ..paths import cache_dir

    d = COMI_DEFAULTS
    ratio = d["ratio"] if args.ratio is None else args.ratio
    task = d["task"] if args.task is None else args.task
    samples = d["samples"] if args.samples is None else args.samples
    steps = d["steps"] if args.steps is None else args.steps
    lr = d["lr"] if args.lr is None else args.lr
    settings = dict(ratio=ratio, task=task, samples=samples, steps=steps, lr=lr, seq_len=args.seq_len,
                    seed=args.seed)
    check_comi_settings(**settings)
    key = Path(str(args.model)).name.replace(".gguf", "")
    out = Path(args.out) if args.out else cache_dir() / "comi" / f"{key}-comi-r{ratio:g}-{task}.safetensors"
    out = fusion_output_path(out)
    _threads(args)
    model, tokenizer = load_model(args.model)
    _check_model_positions(model, args.seq_len)
    import torch

    print(f"longlab train comi: {args.model}, comi@{ratio:g}, {samples} {task} samples of {args.seq_len} "
          f"tokens, {steps} steps, lr {lr:g}, threads {torch.get_num_threads()}", flush=True)
    fusion, record = train_comi(model, tokenizer, **settings, log=lambda m: print(m, flush=True))
    write_fusion(out, fusion, {"model": str(args.model), **settings, "training": record})
    log = record["loss_every_10_steps"]
    shown = f"training loss {log[0]:.3f} (first 10 steps) -> {log[-1]:.3f} (last 10); " if log else ""
    print(f"{shown}wrote {out} and {manifest_path(out).name}", flush=True)
    print(f"use the recipe comi@{ratio:g}:fusion={out}", flush=True)
    return 0


def train_lora_main(args: argparse.Namespace) -> int:
    """``longlab train lora``: settings, ``--data`` and ``--out`` checked before the model loads."""
    from ..adapter_train import (
        LORA_DEFAULTS,
        check_adapter_out,
        check_lora_settings,
        is_checkpoint_dir,
        load_sequences,
        remove_checkpoint_dir,
        save_adapter,
        train_lora,
    )
    from ..paths import cache_dir
    from ..recipe import LonglabError
    from ..safeio import check_output_dir, file_sha256

    if args.data is None:
        raise LonglabError("--data: train lora needs an EntropyLong dataset (`longlab data entropylong --out "
                           "X.jsonl|.parquet`)")
    d = LORA_DEFAULTS
    steps = d["steps"] if args.steps is None else args.steps
    lr = d["lr"] if args.lr is None else args.lr
    rank = d["rank"] if args.rank is None else args.rank
    alpha = d["alpha"] if args.lora_alpha is None else args.lora_alpha
    targets = d["targets"] if args.targets is None else args.targets
    held = d["heldout"] if args.heldout_windows is None else args.heldout_windows
    check_lora_settings(steps=steps, seq_len=args.seq_len, lr=lr, rank=rank, alpha=alpha, targets=targets,
                        seed=args.seed, heldout=held, minutes=args.minutes)
    try:
        import peft  # noqa: F401
    except ImportError:
        raise LonglabError("longlab train lora needs peft: pip install 'longlab[train]'") from None
    header, sequences, cut = load_sequences(args.data, args.seq_len, model_name=str(args.model))
    if len(sequences) <= held:
        raise LonglabError(f"--heldout-windows: {held} held-out sequences leave none of the {len(sequences)} "
                           f"in {args.data} to train on")
    key = Path(str(args.model)).name.replace(".gguf", "")
    out = Path(args.out) if args.out else cache_dir() / "adapters" / f"{key}-lora-{Path(args.data).stem}"
    check_adapter_out(out)
    checkpoint = out.with_name(out.name + ".checkpoint")
    check_output_dir(checkpoint, "--out", owned=is_checkpoint_dir, what="LoRA training checkpoint")
    _threads(args)
    from ..models import load_model

    model, _ = load_model(args.model, attn_implementation="sdpa")
    _check_model_positions(model, args.seq_len)
    vocab = model.get_input_embeddings().weight.shape[0]
    bad = next((i for i, s in enumerate(sequences) if int(s.max()) >= vocab), None)
    if bad is not None:
        raise LonglabError(f"--data: sequence {bad + 1} has token ids outside {args.model}'s vocabulary "
                           f"[0, {vocab})")
    import torch

    print(f"longlab train lora: {args.model} on {len(sequences)} sequences of {args.data} ({cut} cut to "
          f"their last {args.seq_len} tokens); {steps} steps, lr {lr:g}, rank {rank}, alpha {alpha:g}, "
          f"{targets}, threads {torch.get_num_threads()}", flush=True)
    tensors, stats = train_lora(
        model, sequences, steps=steps, lr=lr, rank=rank, alpha=alpha, targets=targets, seed=args.seed,
        heldout=held, minutes=args.minutes, grad_checkpointing=bool(args.grad_checkpointing),
        log=lambda m: print(m, flush=True), checkpoint=checkpoint, restart=bool(args.restart),
    )
    data = {"path": str(args.data), "sha256": file_sha256(args.data), "records": len(sequences),
            "cut_to_seq_len": cut, "scorer": header.get("scorer"), "corpus": header.get("corpus"),
            "config": header.get("config"), "code": header.get("code")}
    stats["seq_len"] = args.seq_len
    path = save_adapter(out, tensors, model, base_model=str(args.model), rank=rank, alpha=alpha,
                        targets=targets, data=data, training=stats)
    if stats["steps_done"] == steps:
        remove_checkpoint_dir(checkpoint)  # ours only (checked file by file): the adapter holds every step
    before, after = stats["heldout_loss_before"], stats["heldout_loss_after"]
    held_text = f"held-out loss {before:.4f} -> {after:.4f}; " if before is not None else ""
    print(f"{held_text}training loss {stats['loss_first_10pct']:.4f} (first 10%) -> "
          f"{stats['loss_last_10pct']:.4f} (last 10%); {stats['steps_done']} steps in "
          f"{stats['seconds']:.0f}s ({stats['seconds_per_step']:.2f} s/step); wrote {path}", flush=True)
    print(f"evaluate it: longlab eval --model {path} ... (the base model {args.model} with the adapter "
          "merged)", flush=True)
    return 0
