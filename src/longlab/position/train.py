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

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from ..paths import __version__
from ..recipe import LonglabError, check_choice, check_range
from ..safeio import file_record, publish_dir
from .base import PositionMethod, format_position
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
    "heldout_loss",
    "recalibrate",
    "save_variant",
    "training_windows",
]

TRAINABLE = ("drope", "ropeid", "repo")
HELD_OUT = 0.2
DATA = ("essay", "pydoc")
# pydoc: Python's documentation topics (pydoc_data, shipped with CPython), sorted and joined as
# bench/position.py ppl joins them. Its first PYDOC_EVAL tokens are that script's perplexity text and are
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
def heldout_loss(model: Any, windows: torch.Tensor) -> float:
    """Mean next-token loss of ``model`` over token ``windows`` ``[N, T]`` (one forward per window)."""
    losses = [model(w[None], labels=w[None]).loss.item() for w in windows]
    return sum(losses) / len(losses)


MAX_SEQ_LEN = 1 << 17  # tokens per training window (a model's own limit is checked once it is loaded)
MAX_TRAIN_TOKENS = 1 << 28  # steps x batch x seq_len: the token windows are built before training starts


def _check_schedule(
    steps: int, seq_len: int, batch: int, lr: float, train: str, data: str = "essay", seed: int = 0
) -> None:
    check_range("--steps", steps, 1, 1 << 20, integer=True)
    check_range("--seq-len", seq_len, 8, MAX_SEQ_LEN, integer=True)
    check_choice("--data", data, DATA)
    check_range("--batch", batch, 1, 1024, integer=True)
    check_range("--lr", lr, 0, 1, low_open=True)
    check_choice("--train", train, ("attn", "all", "added"))
    check_range("--seed", seed, 0, 2**32 - 1, integer=True)
    if steps * batch * seq_len > MAX_TRAIN_TOKENS:
        raise LonglabError(
            f"--steps x --batch x --seq-len = {steps * batch * seq_len:,} training tokens, more than "
            f"{MAX_TRAIN_TOKENS:,}; lower one of them"
        )


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
    _check_schedule(steps, seq_len, batch, lr, train, data, seed)
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
    f"(the first {PYDOC_EVAL}: bench/position.py ppl's perplexity text and a margin; the next "
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
    from ..safeio import save_tensors

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
        save_tensors(tensors, str(tmp / WEIGHTS), metadata=meta)
        manifest["weights_file"] = file_record(tmp / WEIGHTS, tensors)  # size, SHA-256, tensor list
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    return publish_dir(out, write, "--out", owned=is_variant_dir, last=MANIFEST, what="trained variant")
