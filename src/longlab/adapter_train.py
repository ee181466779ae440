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

Resumable: every ``checkpoint_every`` steps (and when ``--minutes`` stops the run, or a step fails) the
LoRA tensors, AdamW's moments and step count, and the loss record go to ``OUT.checkpoint/`` (safetensors +
a manifest with their record). A rerun with the same settings and sequences (their SHA-256 is in the
manifest) continues from there: the data order and the lr schedule depend only on the step index, so a
resumed run gives the uninterrupted run's adapter. A checkpoint of other settings is refused
(``restart``: ignore it); it is removed once the adapter is written with every step done.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
    "is_checkpoint_dir",
    "remove_checkpoint_dir",
    "load_sequences",
    "save_adapter",
    "sequence_loss",
    "train_lora",
]

LORA_DEFAULTS = {"steps": 300, "lr": 2e-4, "rank": 8, "alpha": 16.0, "targets": "attn", "heldout": 4}
MAX_RECORDS = 1_000_000
MAX_TRAIN_TOKENS = 1 << 28  # steps x seq_len
MAX_LOADED_TOKENS = 1 << 28  # the dataset's tokens held in memory (int32: 1 GiB)
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
) -> tuple[dict[str, Any], list[np.ndarray], int]:
    """``(header, sequences, cut)`` of an EntropyLong dataset: each record's ``input_ids`` (int32 ``[T]``),
    the last ``seq_len`` of a longer one (``cut`` counts them). Refused: a dataset tokenized by another
    model than ``model_name`` (its header's scorer), token ids outside ``[0, vocab_size)``, sequences under
    2 tokens, more than ``MAX_RECORDS`` records or ``MAX_LOADED_TOKENS`` tokens, no records."""
    from .data.entropylong import read_dataset

    header, records = read_dataset(path, flag)
    scorer = header.get("scorer")
    if model_name is not None and scorer and scorer != model_name:
        raise LonglabError(
            f"{flag}: {shorten(str(path))} holds token ids of {scorer!r}'s tokenizer (its scorer), not of "
            f"--model {model_name!r}; build the data with `longlab data entropylong --model {model_name}`"
        )
    sequences, cut, total = [], 0, 0
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
        total += len(ids)
        if total > MAX_LOADED_TOKENS:
            raise LonglabError(f"{flag}: more than {MAX_LOADED_TOKENS:,} tokens (after --seq-len cuts); give "
                               "a smaller dataset")
        if max(ids) > 2**31 - 1 or min(ids) < 0:
            raise LonglabError(f"{flag}: record {n} has token ids outside [0, 2**31)")
        sequences.append(np.asarray(ids, dtype=np.int32))  # [T]: 4 bytes a token
    if not sequences:
        raise LonglabError(f"{flag}: {shorten(str(path))} holds no records")
    return header, sequences, cut


def _row(ids: Sequence[int], device: Any) -> torch.Tensor:
    """Token ids ``[T]`` -> a ``[1, T]`` int64 tensor on ``device``."""
    return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)[None]


def sequence_loss(model: Any, seqs: Sequence[Sequence[int]]) -> float:
    """Token-weighted mean next-token loss of ``seqs`` (no gradient): ``sum_s sum_t -log p(x_{t+1} | x_{<=t})
    / sum_s (T_s - 1)``, one forward of ``[1, T_s]`` each."""
    total = count = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for ids in seqs:
            x = _row(ids, device)  # [1, T]
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
    checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 25, restart: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train a LoRA adapter on ``sequences`` (see the module docstring); the model is left as it was (the
    LoRA layers are removed after). Returns ``(tensors, stats)``: ``<module>.lora_A [r, in]`` and
    ``<module>.lora_B [out, r]`` by the base model's module names, and the loss record. ``checkpoint``: a
    directory to save to every ``checkpoint_every`` steps and resume from (module docstring)."""
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
        named = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
        identity = {"base_fingerprint": base_fingerprint(model),
                    "sequences_sha256": _sequences_digest(sequences), "steps": steps, "lr": lr, "rank": rank,
                    "alpha": alpha, "targets": targets, "seed": seed, "heldout": heldout}
        losses: list[float] = []
        step_seconds: list[float] = []
        tokens, done_before, seconds_before = 0, 0, 0.0
        if checkpoint is not None and not restart:
            resumed = _load_checkpoint(Path(checkpoint), identity, named, opt)
            if resumed is not None:
                losses, step_seconds = resumed["losses"], resumed["step_seconds"]
                tokens, seconds_before = resumed["tokens"], resumed["seconds"]
                done_before = len(losses)
                log(f"lora: resumed from {checkpoint} at step {done_before}")
        model.train()
        start = time.perf_counter()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=done_before, desc="lora", unit="step")
        stopped = "steps"

        def save() -> None:
            if checkpoint is not None and len(losses) > done_before:
                _save_checkpoint(Path(checkpoint), identity, named, opt, {
                    "losses": losses, "step_seconds": step_seconds, "tokens": tokens,
                    "seconds": seconds_before + time.perf_counter() - start})

        try:
            for step in range(done_before, steps):
                if minutes is not None and time.perf_counter() - start > 60 * minutes:
                    stopped = "minutes"
                    break
                t0 = time.perf_counter()
                for group in opt.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / warm) if warm else lr
                ids = _row(train[step % len(train)], device)  # [1, T]
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
                if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                    save()
        except BaseException:
            save()  # the steps done so far survive an interrupt or a failing step
            raise
        finally:
            if bar is not None:
                bar.close()
        if stopped == "minutes":
            save()
        seconds = seconds_before + time.perf_counter() - start
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
        "resumed_at_step": done_before,
    }
    return tensors, stats


CHECKPOINT_MANIFEST = "checkpoint.json"
CHECKPOINT_WEIGHTS = "checkpoint.safetensors"


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """A ``longlab train lora`` checkpoint directory: a real directory (not a link) holding only its two
    files, each a regular file (not a link, not a directory), the manifest marked as ours."""
    import json

    p = Path(path)
    try:
        if p.is_symlink() or not p.is_dir():
            return False
        entries = list(p.iterdir())
        names = {c.name for c in entries}
        if not names <= {CHECKPOINT_MANIFEST, CHECKPOINT_WEIGHTS} or CHECKPOINT_MANIFEST not in names:
            return False
        if any(c.is_symlink() or not c.is_file() for c in entries):
            return False
        manifest = json.loads((p / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "longlab-lora-checkpoint"


def remove_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """Remove a ``longlab train lora`` checkpoint directory, file by file: only when
    :func:`is_checkpoint_dir` holds (its two named files, our manifest), never recursively, so a
    directory holding anything else is left whole. True when it was removed."""
    p = Path(path)
    if not is_checkpoint_dir(p):
        return False
    for name in (CHECKPOINT_WEIGHTS, CHECKPOINT_MANIFEST):
        (p / name).unlink(missing_ok=True)
    p.rmdir()  # fails (OSError) rather than delete a file that appeared meanwhile
    return True


def _sequences_digest(sequences: Sequence[Sequence[int]]) -> str:
    import hashlib

    h = hashlib.sha256()
    for s in sequences:
        h.update(len(s).to_bytes(8, "little"))
        h.update(np.asarray(s, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def _save_checkpoint(path: Path, identity: dict[str, Any], named: dict[str, torch.nn.Parameter],
                     opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    import json

    from .safeio import save_tensors

    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    for name, p in named.items():
        tensors[f"param/{name}"] = p.detach().float().cpu().contiguous()
        state = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}/{name}"] = state[key].detach().float().cpu().contiguous()
        if "step" in state:
            steps[name] = float(state["step"])

    def write(tmp: Path) -> None:
        save_tensors(tensors, str(tmp / CHECKPOINT_WEIGHTS))
        manifest = {"format": "longlab-lora-checkpoint", "identity": identity, "adam_steps": steps,
                    **record, "weights_file": file_record(tmp / CHECKPOINT_WEIGHTS, tensors)}
        (tmp / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")

    publish_dir(path, write, "--out", owned=is_checkpoint_dir, last=CHECKPOINT_MANIFEST,
                what="LoRA training checkpoint")


def _load_checkpoint(path: Path, identity: dict[str, Any], named: dict[str, torch.nn.Parameter],
                     opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore a checkpoint of the same run (None if there is none); another run's is a LonglabError."""
    import json

    from .safeio import read_checked_tensors

    if not (path / CHECKPOINT_MANIFEST).is_file():
        return None
    shown = f"--out: the checkpoint {shorten(str(path))}"
    if not is_checkpoint_dir(path):
        raise LonglabError(f"{shown} is not a longlab LoRA checkpoint; remove it or give another --out")
    manifest = json.loads((path / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("identity") != identity:
        raise LonglabError(f"{shown} belongs to a run with other settings or data; rerun with those, or with "
                           "--restart to train from the start")
    tensors, _ = read_checked_tensors(path / CHECKPOINT_WEIGHTS, manifest.get("weights_file"), what=shown,
                                      fix="rerun with --restart")
    steps = manifest.get("adam_steps", {})
    with torch.no_grad():
        for name, p in named.items():
            if f"param/{name}" not in tensors or tensors[f"param/{name}"].shape != p.shape:
                raise LonglabError(f"{shown} does not hold {name} of this model; rerun with --restart")
            p.copy_(tensors[f"param/{name}"])
            if name in steps:
                opt.state[p] = {"step": torch.tensor(float(steps[name])),
                                "exp_avg": tensors[f"exp_avg/{name}"].to(p.device, p.dtype).clone(),
                                "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device, p.dtype).clone()}
    return {k: manifest[k] for k in ("losses", "step_seconds", "tokens", "seconds")}


def save_adapter(
    out: str | os.PathLike[str], tensors: dict[str, torch.Tensor], model: Any, *, base_model: str, rank: int,
    alpha: float, targets: str, data: dict[str, Any], training: dict[str, Any], flag: str = "--out",
) -> Path:
    """Write the adapter directory (``adapter.safetensors``, then ``adapter.json`` with the weights file's
    record) through :func:`longlab.safeio.publish_dir`: ``out`` must be new, empty or an adapter longlab
    wrote."""
    from .safeio import save_tensors

    fingerprint = base_fingerprint(model)

    def write(tmp: Path) -> None:
        import json

        weights = tmp / ADAPTER_WEIGHTS
        save_tensors(tensors, str(weights), metadata={"rank": str(rank), "base_fingerprint": fingerprint,
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
