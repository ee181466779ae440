"""``longlab train drope|ropeid|repo``: recalibrate a RoPE model after changing its positions.

DroPE's recipe (Gelberg et al. 2025, arXiv 2512.12167) at CPU scale: ordinary next-token loss at a fixed
length, AdamW (β = (0.9, 0.999), weight decay 0), gradient clipping 1.0, linear warmup (10% of the steps)
then cosine decay to 0. Text: longlab's shipped essay haystack, its sentences shuffled into documents
(EOS between documents), packed into ``seq_len`` windows; the last 20% of the sentences are held out
for the before/after loss in the manifest. Trained tensors: ``attn`` (q/k/v/o projections and any
modules the method adds; default for DroPE and RoPE-ID), ``all`` (every weight but the embeddings) or
``added`` (only the added modules; default for RePo). Files: ``model.safetensors`` with only the trained
tensors (its metadata: position, base fingerprint, ``--train``) and ``manifest.json`` (base model and a
fingerprint of its weights, position spec, steps, tokens, losses, and the weights file's size, SHA-256 and
tensor list, checked on every load: :mod:`longlab.position.variants`), written to a temporary directory
and renamed, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from ..paths import __version__, cache_dir
from ..recipe import LonglabError, check_choice, check_range
from ..safeio import check_output_dir, file_record, publish_dir
from .base import PositionMethod, format_position, parse_position
from .variants import (
    MANIFEST,
    VARIANT_FORMAT,
    WEIGHTS,
    base_fingerprint,
    is_variant_dir,
    trainable_parameters,
)

__all__ = [
    "TRAINABLE",
    "recalibrate",
    "save_variant",
    "training_windows",
    "add_position_train_arguments",
    "position_train_main",
]

TRAINABLE = ("drope", "ropeid", "repo")
HELD_OUT = 0.2
DATA = ("essay", "pydoc")
# pydoc: Python's documentation topics (pydoc_data, shipped with CPython), sorted and joined as
# bench/position_ppl.py joins them. Its first PYDOC_EVAL tokens are that script's perplexity text and are
# never trained on nor held out (plus a margin: the script may count a BOS); the next PYDOC_HELD_OUT tokens
# are held out; the rest (~85k SmolLM2 tokens) is the training text.
PYDOC_EVAL = 16384 + 1024
PYDOC_HELD_OUT = 8192
# the learning rate each method trains at when --lr is not given (RePo's zero-initialised W_f needs far
# larger steps than recalibrating pretrained projections: at 1e-3, 10 steps moved positions by 0.005)
DEFAULT_LR = {"drope": 1e-4, "ropeid": 1e-4, "repo": 5e-3}


def _sentences(split: str) -> list[str]:
    from ..tasks.haystacks import essay_sentences

    _, sentences = essay_sentences("builtin")
    cut = int(len(sentences) * (1 - HELD_OUT))
    return list(sentences[:cut] if split == "train" else sentences[cut:])


def _pydoc_tokens(tokenizer: Any, split: str) -> list[int]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if split == "train":
        return ids[PYDOC_EVAL + PYDOC_HELD_OUT :]
    return ids[PYDOC_EVAL : PYDOC_EVAL + PYDOC_HELD_OUT]


def training_windows(
    tokenizer: Any, seq_len: int, count: int, seed: int = 0, split: str = "train", data: str = "essay"
) -> torch.Tensor:
    """``[count, seq_len]`` token windows (``split``: train or held-out) of ``data``: ``essay`` (longlab's
    essay haystack, 1.8k training / 0.5k held-out SmolLM2 tokens: its sentences shuffled into documents,
    EOS between) or ``pydoc`` (see ``PYDOC_EVAL``; training windows at seeded random offsets, held-out
    windows consecutive, at most ``PYDOC_HELD_OUT / seq_len`` of them)."""
    check_choice("--data", data, DATA)
    rng = random.Random(seed)
    if data == "pydoc":
        ids = _pydoc_tokens(tokenizer, split)
        if split != "train":
            if count * seq_len > len(ids):
                raise LonglabError(
                    f"--data pydoc holds out {len(ids)} tokens: at most {len(ids) // seq_len} windows of "
                    f"{seq_len}"
                )
            return torch.tensor(ids[: count * seq_len]).view(count, seq_len)
        if len(ids) < 2 * seq_len:
            raise LonglabError(f"--seq-len {seq_len}: --data pydoc has only {len(ids)} training tokens")
        starts = [rng.randrange(0, len(ids) - seq_len + 1) for _ in range(count)]
        return torch.tensor([ids[i : i + seq_len] for i in starts])
    sentences = _sentences(split)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    while len(stream) < count * seq_len:
        rng.shuffle(sentences)
        stream += tokenizer.encode(" ".join(sentences), add_special_tokens=False)
        if eos is not None:
            stream.append(eos)
    return torch.tensor(stream[: count * seq_len]).view(count, seq_len)


def _trainable(model: Any, which: str) -> list[tuple[str, torch.nn.Parameter]]:
    return trainable_parameters(model, which)


@torch.no_grad()
def _loss(model: Any, windows: torch.Tensor) -> float:
    losses = [model(w[None], labels=w[None]).loss.item() for w in windows]
    return sum(losses) / len(losses)


def _check_schedule(steps: int, seq_len: int, batch: int, lr: float, train: str, data: str = "essay") -> None:
    check_range("--steps", steps, 1, None, integer=True)
    check_range("--seq-len", seq_len, 8, None, integer=True)
    check_choice("--data", data, DATA)
    check_range("--batch", batch, 1, None, integer=True)
    check_range("--lr", lr, 0, 1, low_open=True)
    check_choice("--train", train, ("attn", "all", "added"))


def recalibrate(
    model: Any,
    tokenizer: Any,
    *,
    steps: int,
    seq_len: int = 1024,
    batch: int = 1,
    lr: float = 1e-4,
    train: str = "attn",
    seed: int = 0,
    minutes: float | None = None,
    log: Any = None,
    eval_windows: int = 2,
    data: str = "essay",
) -> dict[str, Any]:
    """Train ``model`` (its position method already applied) in place; return the figures for the manifest
    (with the held-out loss of each window before and after, and for RePo the learned offsets ``|δ|``)."""
    _check_schedule(steps, seq_len, batch, lr, train, data)
    log = log or (lambda msg: None)
    torch.manual_seed(seed)
    params = _trainable(model, train)
    if not params:
        raise LonglabError(f"--train {train}: no tensors to train in this model")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in params:
        p.requires_grad_(True)
    held = training_windows(tokenizer, seq_len, eval_windows, seed=seed + 1, split="held-out", data=data)
    model.eval()
    before = _window_losses(model, held)
    windows = training_windows(tokenizer, seq_len, steps * batch, seed=seed, data=data)
    opt = torch.optim.AdamW([p for _, p in params], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    done = 0
    for step in range(steps):
        chunk = windows[step * batch : (step + 1) * batch]
        loss = model(chunk, labels=chunk).loss
        if not torch.isfinite(loss):
            raise LonglabError(f"loss is {loss.item()} at step {step}: lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        done = step + 1
        log(
            f"step {done}/{steps} loss {losses[-1]:.3f} lr {sched.get_last_lr()[0]:.2e} "
            f"{time.perf_counter() - start:.0f}s"
        )
        if minutes is not None and time.perf_counter() - start > 60 * minutes:
            break
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    seconds = time.perf_counter() - start
    head = losses[: max(1, min(10, len(losses) // 4))]
    tail = losses[-max(1, min(10, len(losses) // 4)) :]
    after = _window_losses(model, held, offsets := [])
    out = {
        "steps": done,
        "steps_planned": steps,
        "seq_len": seq_len,
        "batch": batch,
        "tokens": done * batch * seq_len,
        "lr": lr,
        "schedule": f"linear warmup {warmup} steps, cosine to 0",
        "optimizer": "AdamW(0.9,0.999), wd 0, clip 1",
        "train": train,
        "trained_tensors": len(params),
        "trained_parameters": sum(p.numel() for _, p in params),
        "train_loss_first": sum(head) / len(head),
        "train_loss_last": sum(tail) / len(tail),
        "train_losses": [round(x, 5) for x in losses],
        "heldout_loss_before": sum(before) / len(before),
        "heldout_loss_after": sum(after) / len(after),
        "heldout_losses_before": before,
        "heldout_losses_after": after,
        "heldout_tokens": eval_windows * seq_len,
        "seconds": seconds,
        "data_source": data,
        "data": DATA_NOTES[data],
        "_names": [n for n, _ in params],
    }
    if offsets:  # RePo: how far the learned positions moved from i (|δ| over the held-out tokens, per head)
        d = torch.cat(offsets)
        out["repo_offset_abs_mean"] = d.mean().item()
        out["repo_offset_abs_median"] = d.median().item()
        out["repo_offset_abs_max"] = d.max().item()
    return out


DATA_NOTES = {
    "essay": "builtin essay haystack (tasks_essay.txt), first 80% of sentences, shuffled per document",
    "pydoc": f"pydoc_data.topics (CPython), sorted and joined; tokens from {PYDOC_EVAL + PYDOC_HELD_OUT} on "
    f"(the first {PYDOC_EVAL}: bench/position_ppl.py's perplexity text and a margin; the next "
    f"{PYDOC_HELD_OUT}: held out), windows at random offsets",
}


@torch.no_grad()
def _window_losses(
    model: Any, windows: torch.Tensor, offsets: list[torch.Tensor] | None = None
) -> list[float]:
    """Next-token loss of each window ``[N, T]``; ``offsets`` collects RePo's ``|δ|`` ``[B*T*H_kv]``."""
    from .variants import attention_modules

    hooks = []
    if offsets is not None:
        for attn in attention_modules(model):
            if hasattr(attn, "longlab_repo"):
                hooks.append(attn.longlab_repo.register_forward_hook(
                    lambda mod, args, out: offsets.append(out.detach().abs().flatten().float())
                ))
    try:
        return [model(w[None], labels=w[None]).loss.item() for w in windows]
    finally:
        for h in hooks:
            h.remove()


def save_variant(
    model: Any, method: PositionMethod, out: str | Path, base_model: str, stats: dict[str, Any]
) -> Path:
    """Write ``out/model.safetensors`` (the trained tensors) and ``out/manifest.json`` into a temporary
    directory beside ``out``, then move them into place (:func:`longlab.safeio.publish_dir`): ``out`` must
    be new, empty or an earlier variant; a user's directory is refused and left untouched."""
    from safetensors.torch import save_file

    out = Path(out)
    names = stats.pop("_names")
    own = dict(model.named_parameters())
    tensors = {n: own[n].detach().to("cpu", torch.float32).contiguous() for n in names}
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise LonglabError("trained weights are not all finite; nothing written (lower --lr)")
    position = method.without_weights() if hasattr(method, "without_weights") else format_position(method)
    fingerprint = base_fingerprint(model)
    manifest = {
        "longlab_variant": VARIANT_FORMAT,
        "base_model": base_model,
        "base_fingerprint": fingerprint,
        "position": position,
        "paper": method.paper,
        "longlab_version": __version__,
        **stats,
    }
    # the file names what it was trained for: a manifest edited afterwards (relabelled) is refused on load
    meta = {"longlab_variant": str(VARIANT_FORMAT), "position": position, "base_fingerprint": fingerprint,
            "train": str(stats.get("train", ""))}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS), metadata=meta)
        manifest["weights_file"] = file_record(tmp / WEIGHTS, tensors)  # size, SHA-256, tensor list
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    return publish_dir(out, write, "--out", owned=is_variant_dir, last=MANIFEST, what="trained variant")


class _UnsetLr(float):
    """``--lr``'s default when not given: IndexMem reads it as a float; drope/ropeid/repo use
    :data:`DEFAULT_LR` of their method instead."""


def add_position_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Extend ``longlab train`` with ``drope``, ``ropeid`` and ``repo`` and their options."""
    for action in parser._actions:
        if action.dest == "method" and action.choices is not None:
            action.choices = [*action.choices, *TRAINABLE]
        if action.dest == "lr" and isinstance(action.default, float):
            action.default = _UnsetLr(action.default)
            action.help = (
                f"learning rate (indexmem: the indexer's, default {action.default:g}; drope/ropeid/repo: "
                + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")"
            )
    parser.add_argument(
        "--steps", type=int, default=None, help="drope/ropeid/repo: optimizer steps (default 50)"
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="drope/ropeid/repo: windows per step (default 1)"
    )
    parser.add_argument(
        "--params",
        default="",
        help="drope/ropeid/repo: the method's parameters, e.g. qk_norm=true or cycles=2",
    )
    parser.add_argument(
        "--train",
        default=None,
        choices=("attn", "all", "added"),
        help="drope/ropeid/repo: tensors to train (default attn; added for repo)",
    )
    parser.add_argument(
        "--heldout-windows",
        type=int,
        default=2,
        help="drope/ropeid/repo: held-out windows scored before and after, each in the manifest (default 2)",
    )
    parser.add_argument(
        "--data",
        default="essay",
        choices=DATA,
        help="drope/ropeid/repo: training text: essay (longlab's essay haystack, 1.8k tokens: short runs "
        "memorise it) or pydoc (CPython's documentation topics, ~85k tokens, disjoint from "
        "bench/position_ppl.py's text); default essay",
    )


def position_train_main(args: argparse.Namespace) -> int:
    """Run ``longlab train drope|ropeid|repo`` from parsed arguments."""
    from ..models import load_model

    spec = args.method + (f":{args.params}" if args.params else "")
    method = parse_position(spec)  # checked before the model loads
    if method.weights:
        raise LonglabError("--params: weights= is what training writes (use --out)")
    steps = args.steps if args.steps is not None else 50
    train = args.train or ("added" if args.method == "repo" else "attn")
    lr = DEFAULT_LR[args.method] if isinstance(args.lr, _UnsetLr) else args.lr
    data = getattr(args, "data", "essay")
    _check_schedule(steps, args.seq_len, args.batch, lr, train, data)  # before the model loads
    held = getattr(args, "heldout_windows", 2)
    check_range("--heldout-windows", held, 1, 1024, integer=True)
    if data == "pydoc" and held * args.seq_len > PYDOC_HELD_OUT:
        raise LonglabError(
            f"--heldout-windows: --data pydoc holds out {PYDOC_HELD_OUT} tokens: at most "
            f"{PYDOC_HELD_OUT // args.seq_len} windows of --seq-len {args.seq_len}, got {held}"
        )
    if args.threads is not None:
        check_range("--threads", args.threads, 1, 1024, integer=True)
    key = Path(str(args.model)).name.replace(".gguf", "")
    out = Path(args.out) if args.out else cache_dir() / "variants" / f"{key}-{method.spec.replace(':', '-')}"
    check_output_dir(out, "--out", owned=is_variant_dir, what="trained variant")  # before the model loads
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, attn_implementation="sdpa", position=method)
    print(
        f"longlab train {args.method}: {args.model} with {method.spec}; {steps} steps x {args.batch} x "
        f"{args.seq_len} tokens of {data}, lr {lr:g}, threads {torch.get_num_threads()}",
        flush=True,
    )
    stats = recalibrate(
        model,
        tokenizer,
        steps=steps,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=lr,
        train=train,
        seed=args.seed,
        data=data,
        eval_windows=held,
        minutes=args.minutes if args.max_steps is None else None,
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
        print(f"RePo positions moved by |δ| = {moved:.3g} on average (max {stats['repo_offset_abs_max']:.3g})"
              f"{still}", flush=True)
    print(f"load it: load_model({str(out)!r}) or --model {out}", flush=True)
    return 0
