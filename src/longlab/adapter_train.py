"""``longlab train lora``: a LoRA adapter trained on an EntropyLong dataset's sequences (next-token loss).

Issue 34, item 4 ("does the data help?"): EntropyLong (arXiv 2510.02330) sequences are meant for continued
training; here a short LoRA fine-tune (Hu et al., arXiv 2106.09685, through peft) of a small model on each
data variant, whose adapter ``longlab eval --model DIR`` then measures against the base model
(:mod:`longlab.adapter` merges it at load).

Training, stated exactly:

- data: the records of a ``longlab data entropylong`` output (:func:`longlab.data.entropylong.read_dataset`:
  JSONL or Parquet), one token sequence each (verified chunks, fillers, then the document), in the scorer's
  tokenizer, which must be the trained model's. A sequence longer than ``seq_len`` keeps its **last**
  ``seq_len`` tokens (the document and the context nearest it; counted as ``cut``). After a seeded shuffle the
  last ``heldout`` sequences are held out; their token-weighted mean next-token loss is recorded before and
  after training.
- step s: sequence ``order[s mod n]``, loss ``-(1/(T-1)) sum_t log p(x_{t+1} | x_{<=t})``; AdamW (betas
  0.9/0.999, weight decay 0) on the LoRA tensors only, lr warmed up linearly over the first
  ``min(10, steps // 10)`` steps then constant, gradient norm clipped at 1; batch 1.
- LoRA: rank ``r`` and ``alpha`` on the ``targets`` projections of every layer (``attn``: q/k/v/o; ``all``:
  and the MLP's), ``A`` Kaiming-uniform and ``B`` zero at start (peft's default), so step 0 is the base model.

Bounded before work: steps, sequence length, rank, the training tokens ``steps x seq_len``, the records
read. ``--minutes`` stops early; the manifest records the steps done.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .adapter import (
    ADAPTER_FORMAT,
    ADAPTER_MANIFEST,
    ADAPTER_WEIGHTS,
    LORA_TARGETS,
    MAX_RANK,
    PAPER,
    is_adapter_dir,
)
from .position.variants import base_fingerprint
from .recipe import LonglabError, check_choice, check_range, shorten
from .safeio import check_output_dir, file_record, publish_dir

__all__ = [
    "LORA_DEFAULTS",
    "check_adapter_out",
    "MAX_RECORDS",
    "MAX_TRAIN_TOKENS",
    "check_lora_settings",
    "load_sequences",
    "save_adapter",
    "sequence_loss",
    "train_lora",
]

LORA_DEFAULTS = {"steps": 300, "lr": 2e-4, "rank": 8, "alpha": 16.0, "targets": "attn", "heldout": 4}
MAX_RECORDS = 1_000_000
MAX_TRAIN_TOKENS = 1 << 28  # steps x seq_len
MAX_SEQ_LEN = 1 << 17


def check_lora_settings(*, steps: int, seq_len: int, lr: float, rank: int, alpha: float, targets: str,
                        seed: int, heldout: int, minutes: float | None = None) -> None:
    """Every setting in range (a LonglabError naming the flag otherwise), before anything loads."""
    check_range("--steps", steps, 1, 1 << 20, integer=True)
    check_range("--seq-len", seq_len, 8, MAX_SEQ_LEN, integer=True)
    check_range("--lr", lr, 0, 1, low_open=True)
    check_range("--rank", rank, 1, MAX_RANK, integer=True)
    check_range("--lora-alpha", alpha, 0, 1e4, low_open=True)
    check_choice("--targets", targets, tuple(LORA_TARGETS))
    check_range("--seed", seed, 0, 2**32 - 1, integer=True)
    check_range("--heldout-windows", heldout, 0, 1024, integer=True)
    if minutes is not None:
        check_range("--minutes", minutes, 0, 7 * 24 * 60, low_open=True)
    if steps * seq_len > MAX_TRAIN_TOKENS:
        raise LonglabError(f"--steps x --seq-len = {steps * seq_len:,} training tokens, more than "
                           f"{MAX_TRAIN_TOKENS:,}; lower one of them")


def load_sequences(
    path: str | os.PathLike[str], seq_len: int, *, model_name: str | None = None,
    vocab_size: int | None = None, flag: str = "--data",
) -> tuple[dict[str, Any], list[list[int]], int]:
    """``(header, sequences, cut)`` of an EntropyLong dataset: each record's ``input_ids``, the last
    ``seq_len`` of a longer one (``cut`` counts them). Refused: a dataset tokenized by another model than
    ``model_name`` (its header's scorer), token ids outside ``[0, vocab_size)``, sequences under 2 tokens,
    more than ``MAX_RECORDS`` records, no records."""
    from .data.entropylong import read_dataset

    header, records = read_dataset(path, flag)
    scorer = header.get("scorer")
    if model_name is not None and scorer and scorer != model_name:
        raise LonglabError(
            f"{flag}: {shorten(str(path))} holds token ids of {scorer!r}'s tokenizer (its scorer), not of "
            f"--model {model_name!r}; build the data with `longlab data entropylong --model {model_name}`"
        )
    sequences, cut = [], 0
    for n, rec in enumerate(records, start=1):
        if n > MAX_RECORDS:
            raise LonglabError(f"{flag}: more than {MAX_RECORDS:,} records; give a smaller dataset")
        ids = rec["input_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise LonglabError(f"{flag}: record {n} ({shorten(rec.get('doc_id'))}) has non-integer input_ids")
        if len(ids) < 2:
            raise LonglabError(f"{flag}: record {n} ({shorten(rec.get('doc_id'))}) has under 2 tokens")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise LonglabError(f"{flag}: record {n} has token ids outside the model's vocabulary "
                               f"[0, {vocab_size})")
        if len(ids) > seq_len:
            ids, cut = ids[-seq_len:], cut + 1
        sequences.append(list(ids))
    if not sequences:
        raise LonglabError(f"{flag}: {shorten(str(path))} holds no records")
    return header, sequences, cut


def sequence_loss(model: Any, seqs: Sequence[Sequence[int]]) -> float:
    """Token-weighted mean next-token loss of ``seqs`` (no gradient): ``sum_s sum_t -log p(x_{t+1} | x_{<=t})
    / sum_s (T_s - 1)``, one forward of ``[1, T_s]`` each."""
    total = count = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for ids in seqs:
            x = torch.tensor([list(ids)], device=device)  # [1, T]
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            total += float(loss) * (len(ids) - 1)
            count += len(ids) - 1
    return total / count if count else float("nan")


def _require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LonglabError("longlab train lora needs peft: pip install 'longlab[train]'") from None
    return peft


def train_lora(
    model: Any, sequences: Sequence[Sequence[int]], *, steps: int, lr: float = 2e-4, rank: int = 8,
    alpha: float = 16.0, targets: str = "attn", seed: int = 0, heldout: int = 4, minutes: float | None = None,
    grad_checkpointing: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train a LoRA adapter on ``sequences`` (see the module docstring); the model is left as it was (the
    LoRA layers are removed after). Returns ``(tensors, stats)``: ``<module>.lora_A [r, in]`` and
    ``<module>.lora_B [out, r]`` by the base model's module names, and the loss record."""
    peft = _require_peft()
    check_choice("--targets", targets, tuple(LORA_TARGETS))
    if len(sequences) <= heldout:
        raise LonglabError(f"--heldout-windows: {heldout} held-out sequences leave none of the "
                           f"{len(sequences)} to train on; lower it or give more data")
    log = log or (lambda m: None)
    order = list(range(len(sequences)))
    random.Random(f"longlab.lora/{seed}").shuffle(order)
    held = [sequences[i] for i in order[len(order) - heldout:]] if heldout else []
    train = [sequences[i] for i in order[: len(order) - heldout]]
    was_training = model.training
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS[targets]),
                             lora_dropout=0.0, bias="none")
    wrapped = peft.get_peft_model(model, config)
    try:
        if grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in wrapped.parameters() if p.requires_grad]
        device = params[0].device
        model.eval()
        before = sequence_loss(model, held) if held else None
        log(f"lora: {len(train)} training sequences, {len(held)} held out"
            + (f" (loss {before:.4f})" if before is not None else "")
            + f"; {steps} steps, rank {rank}, alpha {alpha:g}, {targets}, {sum(p.numel() for p in params):,} "
            "trained parameters")
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        warm = min(10, steps // 10)
        model.train()
        losses: list[float] = []
        step_seconds: list[float] = []
        tokens = 0
        start = time.perf_counter()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc="lora", unit="step")
        stopped = "steps"
        try:
            for step in range(steps):
                if minutes is not None and time.perf_counter() - start > 60 * minutes:
                    stopped = "minutes"
                    break
                t0 = time.perf_counter()
                for group in opt.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / warm) if warm else lr
                ids = torch.tensor([list(train[step % len(train)])], device=device)  # [1, T]
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                value = loss.item()
                if not math.isfinite(value):
                    raise LonglabError(f"lora: the loss became {value} at step {step + 1}; lower --lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                losses.append(round(value, 5))
                step_seconds.append(round(time.perf_counter() - t0, 3))
                tokens += ids.shape[1]
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
        model.eval()
        after = sequence_loss(model, held) if held else None
        tensors: dict[str, torch.Tensor] = {}
        prefix = "base_model.model."
        for name, module in wrapped.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.lora_A:
                base = name.removeprefix(prefix)
                for part in ("lora_A", "lora_B"):
                    weight = getattr(module, part)["default"].weight  # A [r, in], B [out, r]
                    tensors[f"{base}.{part}"] = weight.detach().float().cpu().contiguous()
    finally:
        if grad_checkpointing:
            model.gradient_checkpointing_disable()
        wrapped.unload()  # the base Linear layers back in place, unchanged
        model.train(was_training)
    tenth = max(1, len(losses) // 10)
    stats = {
        "steps_planned": steps, "steps_done": len(losses), "stopped_by": stopped, "tokens": tokens,
        "seconds": round(seconds, 2), "seconds_per_step": round(seconds / max(1, len(losses)), 3),
        "threads": torch.get_num_threads(), "lr": lr, "seed": seed, "warmup_steps": warm,
        "train_sequences": len(train), "heldout_sequences": len(held),
        "loss_first_10pct": sum(losses[:tenth]) / tenth if losses else None,
        "loss_last_10pct": sum(losses[-tenth:]) / tenth if losses else None,
        "heldout_loss_before": before, "heldout_loss_after": after, "losses": losses,
        "step_seconds": step_seconds,
        "grad_checkpointing": grad_checkpointing, "peft": getattr(peft, "__version__", "?"),
    }
    return tensors, stats


def save_adapter(
    out: str | os.PathLike[str], tensors: dict[str, torch.Tensor], model: Any, *, base_model: str, rank: int,
    alpha: float, targets: str, data: dict[str, Any], training: dict[str, Any], flag: str = "--out",
) -> Path:
    """Write the adapter directory (``adapter.safetensors``, then ``adapter.json`` with the weights file's
    record) through :func:`longlab.safeio.publish_dir`: ``out`` must be new, empty or an adapter longlab
    wrote."""
    from safetensors.torch import save_file

    fingerprint = base_fingerprint(model)

    def write(tmp: Path) -> None:
        import json

        weights = tmp / ADAPTER_WEIGHTS
        save_file(tensors, str(weights), metadata={"rank": str(rank), "base_fingerprint": fingerprint,
                                                   "targets": targets, "format": "longlab-lora"})
        manifest = {
            "longlab_adapter": ADAPTER_FORMAT, "method": "lora", "paper": PAPER, "base_model": base_model,
            "base_fingerprint": fingerprint, "rank": rank, "alpha": alpha, "targets": targets,
            "modules": len(tensors) // 2, "data": data, "training": training,
            "weights_file": file_record(weights, tensors),
        }
        (tmp / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    return publish_dir(out, write, flag, owned=is_adapter_dir, last=ADAPTER_MANIFEST, what="LoRA adapter")


def check_adapter_out(out: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``--out`` checked before the model loads: new, empty, or an adapter longlab wrote."""
    return check_output_dir(out, flag, owned=is_adapter_dir, what="LoRA adapter")
