"""``longlab train indexmem``: train IndexMem's indexer and feature maps with the backbone frozen.

Each step runs the frozen model once on a training text, recording every layer's post-RoPE
``q [1, H, T, D]``, ``k, v [1, H_kv, T, D]`` (:func:`longlab.capture.capture_attention`: causal SDPA
like the model's own, unregistered afterwards), then takes ``inner_steps`` Adam steps on, summed over layers:

- **indexer**: ``KL(p_bar_t || softmax_j I(t, j))`` for the last 32 queries and 32 random ones, ``p_bar``
  the true causal attention averaged over the layer's query heads;
- **memory**: the last 64 queries read a cache from which a random fraction (0.5 to 0.95) of the
  earlier tokens (sinks excluded) was evicted into the memory; the loss is the squared error of the
  residual readout against full attention, divided by the squared error of kept-only attention
  (``mse_ratio``: 1 = the memory recovers nothing, 0 = exact). It trains the feature maps and gate.

Text, all shipped or generated offline: longlab's essay haystack (shuffled sentences) and RULER-style
prompts with their answers from generators *not* in the standard sweep (``niah_single_2``,
``niah_multivalue``, ``niah_multiquery``), seeds from 10 000. Tensors go to safetensors (never pickle)
with a JSON manifest, by default under ``<longlab cache>/indexmem/<model key>``. A non-finite loss stops
training with an error (lower ``--lr``), and weights that are not all finite are never written; the
files are written to temporary names and renamed, so a failed run leaves the previous weights intact.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..capture import capture_attention
from ..recipe import LonglabError, check_range, shorten
from ..safeio import (
    check_output_file,
    file_record,
    json_format_is,
    os_error,
    safetensors_format_is,
    temp_path_beside,
)
from .indexmem import (
    D_FEATURE,
    D_INDEX,
    FORMAT,
    LAYER_TENSORS,
    N_INDEX,
    default_weights_path,
    indexer_logits,
    init_layer,
    log_features,
    manifest_path,
    memory_write,
    model_key,
    residual_attention,
)

__all__ = ["check_settings", "train_indexmem", "training_texts", "CLI_FLAGS"]

RULER_TRAIN_TASKS = ("niah_single_2", "niah_multivalue", "niah_multiquery")
SINKS, WINDOW, QUERIES = 4, 32, 64
MAX_SEQ_LEN = 1 << 17  # tokens per training text (the model's own limit is checked once it is loaded)


def training_texts(tokenizer: Any, seq_len: int, seed: int = 0) -> Iterator[tuple[str, list[int]]]:
    """Endless ``(source, token ids)`` of at most ``seq_len`` tokens: essay haystack and RULER prompts
    (context + question + answer prefix + answer) from tasks outside the standard sweep."""
    from ..tasks import essay_sentences, generate_samples

    label, sentences = essay_sentences()
    rng = random.Random(seed)
    i = 0
    while True:
        i += 1
        kind = i % (len(RULER_TRAIN_TASKS) + 1)
        if kind < len(RULER_TRAIN_TASKS):
            task = RULER_TRAIN_TASKS[kind]
            try:
                (s,) = generate_samples(task, tokenizer, max(16, seq_len - 48), 1, 10_000 + seed * 1000 + i)
                text = s.context + s.question + s.answer_prefix + " " + (s.answers[0] if s.answers else "")
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                yield task, ids[-seq_len:]
                continue
            except ValueError:  # too short for the task's template (tiny test runs): use the essay
                pass
        ids: list[int] = []
        while len(ids) < seq_len:
            order = list(sentences)
            rng.shuffle(order)
            ids += tokenizer(" ".join(order), add_special_tokens=False)["input_ids"]
        yield f"essay:{label}", ids[:seq_len]


def _layer_losses(
    p: dict[str, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indexer KL, memory mse_ratio) of one layer. q: [1, H, T, D]; k, v: [1, H_kv, T, D]."""
    T = q.shape[2]
    H, H_kv = q.shape[1], k.shape[1]
    pos = torch.arange(T)
    # indexer: the last WINDOW queries and WINDOW random ones
    lo = min(T // 8, T - WINDOW - 1)
    rand = torch.randint(max(lo, 1), max(T - WINDOW, lo + 2), (WINDOW,), generator=gen)
    rows = torch.cat([rand, pos[-WINDOW:]]).clamp(max=T - 1)
    causal = pos[None, :] <= rows[:, None]  # [R, T]
    with torch.no_grad():
        kf = k.float().repeat_interleave(H // H_kv, dim=1)
        logits = (q[:, :, rows].float() @ kf.transpose(-1, -2)) * scaling  # [1, H, R, T]
        p_bar = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)  # [1, R, T]
    index = indexer_logits(q[:, :, rows], k, p["wq"], p["wk"], p["ww"], p["wb"])  # [1, R, T]
    log_q = torch.log_softmax(index.masked_fill(~causal, float("-inf")), -1)
    kl = (p_bar * (torch.log(p_bar.clamp(min=1e-12)) - log_q.masked_fill(~causal, 0.0))).sum(-1).mean()

    # memory: the last QUERIES rows read a cache with a random part of the earlier tokens evicted
    Q = min(QUERIES, T // 2)
    P = T - Q
    frac = 0.5 + 0.45 * torch.rand((), generator=gen).item()
    evict = (torch.rand(P, generator=gen) < frac) & (pos[:P] >= SINKS)
    evict = torch.cat([evict, torch.zeros(Q, dtype=torch.bool)])  # [T]
    qr = q[:, :, P:]  # [1, H, Q, D]
    full_mask = (pos[None, :] <= pos[P:, None])[None, None]  # [1, 1, Q, T]
    kept_mask = full_mask & ~evict[None, None, None, :]
    with torch.no_grad():
        target = residual_attention(qr, k, v, full_mask, scaling)  # [1, H, Q, D]
        o_kept = residual_attention(qr, k, v, kept_mask, scaling)
        base = ((o_kept - target) ** 2).sum().clamp(min=1e-12)
    D = q.shape[-1]
    M0 = torch.zeros(1, H_kv, D_FEATURE, D)
    n0 = torch.zeros(1, H_kv, D_FEATURE)
    c0 = torch.full((1, H_kv), float("-inf"))
    logf_k = log_features(k, p["fk_w"], p["fk_b"], p["fk_a"])  # [1, H_kv, T, d_f]
    memory = memory_write(M0, n0, c0, logf_k, v, evict[None, None, :].expand(1, H_kv, T))
    logf_q = log_features(qr, p["fq_w"], p["fq_b"], p["fq_a"])  # [1, H, Q, d_f]
    gate = (qr.float() * p["gate_w"][None, :, None, :]).sum(-1) + p["gate_b"][None, :, None]
    out = residual_attention(qr, k, v, kept_mask, scaling, logf_q, memory, gate)
    mse_ratio = ((out - target) ** 2).sum() / base
    return kl, mse_ratio


CLI_FLAGS = {
    "minutes": "--minutes",
    "max_steps": "--max-steps",
    "seq_len": "--seq-len",
    "inner_steps": "--inner-steps",
    "lr": "--lr",
    "lr_memory": "--lr-memory",
    "seed": "--seed",
}


def check_settings(
    *,
    minutes: float,
    max_steps: int | None,
    seq_len: int,
    inner_steps: int,
    lr: float,
    lr_memory: float,
    seed: int,
    flags: dict[str, str] | None = None,
) -> None:
    """Refuse settings before any work: learning rates positive and finite (a NaN or negative rate
    would write NaN weights), counts positive integers. ``flags`` names the arguments in errors."""

    def label(name: str) -> str:
        return flags[name] if flags else f"train indexmem: {name}"

    check_range(label("minutes"), minutes, 0, 7 * 24 * 60, low_open=True)
    if max_steps is not None:
        check_range(label("max_steps"), max_steps, 1, 1 << 30, integer=True)
    check_range(label("seq_len"), seq_len, 2 * QUERIES, MAX_SEQ_LEN, integer=True)
    check_range(label("inner_steps"), inner_steps, 1, 1024, integer=True)
    check_range(label("lr"), lr, 0, 1, low_open=True)
    check_range(label("lr_memory"), lr_memory, 0, 1, low_open=True)
    check_range(label("seed"), seed, 0, 2**32 - 1, integer=True)


def _finite_or_raise(tensors: dict[str, torch.Tensor], what: str) -> None:
    bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise LonglabError(
            f"train indexmem: {what} {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} not finite; "
            "nothing was written (lower --lr / --lr-memory)"
        )


def train_indexmem(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str,
    minutes: float = 15.0,
    max_steps: int | None = None,
    seq_len: int = 1024,
    inner_steps: int = 4,
    lr: float = 1e-4,
    lr_memory: float = 2e-3,
    seed: int = 0,
    out: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Train for ``minutes`` (or ``max_steps`` model forwards); write safetensors + manifest; return
    the weights path. Raises :class:`LonglabError` on bad settings, on a non-finite loss during
    training and on non-finite weights; in each case nothing is written."""
    from tqdm.auto import tqdm

    from ..paths import __version__

    check_settings(minutes=minutes, max_steps=max_steps, seq_len=seq_len, inner_steps=inner_steps, lr=lr,
                   lr_memory=lr_memory, seed=seed)
    config = model.config
    L, H = config.num_hidden_layers, config.num_attention_heads
    H_kv = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    key = model_key(config)
    path = output_path(out, key)

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params: list[dict[str, torch.Tensor]] = []
    texts = training_texts(tokenizer, seq_len, seed)
    budget = minutes * 60.0
    history: list[tuple[float, float]] = []
    sources: dict[str, int] = {}
    forwards = 0
    grads = [p.requires_grad for p in model.parameters()]
    bar = None
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        with capture_attention(model) as capture:
            with torch.no_grad():  # one short forward: each layer's softmax scale
                model(input_ids=torch.tensor([[tokenizer.eos_token_id or 0] * 4]), use_cache=False)
            for i in range(L):
                scaling = capture.records[i].scaling
                params.append(
                    {n: t.requires_grad_(True) for n, t in init_layer(H, H_kv, D, scaling, gen).items()}
                )
            indexer = ("wq", "wk", "ww", "wb")  # starts at the backbone's attention: small steps keep it
            memory = [t for p in params for n, t in p.items() if n not in indexer]
            opt = torch.optim.Adam(
                [
                    {"params": [p[n] for p in params for n in indexer], "lr": lr},
                    {"params": memory, "lr": lr_memory},
                ]
            )
            start = time.perf_counter()
            bar = tqdm(
                total=max_steps if max_steps else round(budget),
                unit="step" if max_steps else "s",
                disable=not progress,
                desc="train indexmem",
                file=sys.stderr,
            )
            while True:
                elapsed = time.perf_counter() - start
                if (max_steps and forwards >= max_steps) or (not max_steps and elapsed >= budget):
                    break
                source, ids = next(texts)
                sources[source.split(":")[0]] = sources.get(source.split(":")[0], 0) + 1
                capture.records.clear()
                with torch.no_grad():
                    model(input_ids=torch.tensor([ids]), use_cache=False)
                records = [capture.records[i] for i in range(L)]
                for _ in range(inner_steps):
                    kl_sum, mse_sum = 0.0, 0.0
                    loss = 0.0
                    for i in range(L):
                        _, q, k, v, scaling = records[i]
                        kl, mse = _layer_losses(params[i], q.detach(), k.detach(), v.detach(), scaling, gen)
                        loss = loss + kl + mse
                        kl_sum, mse_sum = kl_sum + kl.item(), mse_sum + mse.item()
                    if not torch.isfinite(loss):
                        raise LonglabError(
                            f"train indexmem: the loss became {float(loss)} at optimizer step "
                            f"{len(history) + 1} (lr={lr:g}, lr_memory={lr_memory:g}); nothing was written "
                            "(lower --lr / --lr-memory)"
                        )
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_([t for p in params for t in p.values()], 10.0)
                    opt.step()
                    history.append((kl_sum / L, mse_sum / L))
                forwards += 1
                kl_avg, mse_avg = history[-1]
                bar.set_postfix(step=forwards, kl=f"{kl_avg:.3f}", mse_ratio=f"{mse_avg:.3f}")
                bar.update(1 if max_steps else round(time.perf_counter() - start) - bar.n)
    finally:
        if bar is not None:
            bar.close()
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)
    seconds = time.perf_counter() - start
    if not history:
        raise LonglabError("train indexmem: no training step fitted in the time limit")

    def summary(col: int) -> dict[str, float]:
        xs = [h[col] for h in history]
        tenth = max(1, len(xs) // 10)
        return {
            "first": round(xs[0], 4),
            "first_10pct": round(sum(xs[:tenth]) / tenth, 4),
            "last_10pct": round(sum(xs[-tenth:]) / tenth, 4),
            "last": round(xs[-1], 4),
        }

    tensors = {f"layers.{i}.{n}": params[i][n].detach().contiguous() for i in range(L) for n in LAYER_TENSORS}
    _finite_or_raise(tensors, "the trained weights")
    manifest = {
        "format": FORMAT,
        "model": model_name,
        "model_key": key,
        "model_type": config.model_type,
        "num_layers": L,
        "num_heads": H,
        "num_kv_heads": H_kv,
        "head_dim": D,
        "config": {
            "n_index": N_INDEX,
            "d_index": D_INDEX,
            "d_feature": D_FEATURE,
            "seq_len": seq_len,
            "inner_steps": inner_steps,
            "lr": lr,
            "lr_memory": lr_memory,
            "seed": seed,
            "window": WINDOW,
            "sinks": SINKS,
            "memory_queries": QUERIES,
        },
        "training": {
            "forwards": forwards,
            "optimizer_steps": len(history),
            "seconds": round(seconds, 1),
            "texts": sources,
        },
        "loss": {"indexer_kl": summary(0), "memory_mse_ratio": summary(1)},
        "longlab_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write(path, tensors, manifest, key)
    return path


def _owned_json(path: Path) -> bool:
    return json_format_is(path, FORMAT)


def _owned_weights(path: Path) -> bool:
    return safetensors_format_is(path, FORMAT)


def output_path(out: str | Path | None, key: str) -> Path:
    """Where ``train indexmem`` writes: ``--out`` as a ``.safetensors`` file, or ``DIR/<key>.safetensors``
    for a directory (default: the cache). The weights file and its ``.json`` manifest must be new or
    earlier IndexMem outputs: a user's file is never overwritten (checked before training)."""
    path = Path(out) if out else default_weights_path(key)
    if path.is_dir() or (path.suffix != ".safetensors" and not path.suffix):
        path = path / f"{key}.safetensors"
    elif path.suffix != ".safetensors":
        raise LonglabError(
            f"--out: {shorten(str(path))} is not a .safetensors name; give e.g. "
            f"{shorten(str(path.with_suffix('.safetensors')))} or a directory"
        )
    check_output_file(path, "--out", owned=_owned_weights, what="IndexMem weights file")
    check_output_file(manifest_path(path), "--out", owned=_owned_json, what="IndexMem manifest")
    return path


def _write(path: Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any], key: str) -> None:
    """Both files under temporary names first, then renamed: a failure leaves no half-written file."""

    from ..safeio import save_tensors

    path.parent.mkdir(parents=True, exist_ok=True)  # checked writable before training (output_path)
    tmp = temp_path_beside(path)
    man_tmp = temp_path_beside(path, ".json.longlab-tmp")
    try:
        save_tensors(tensors, str(tmp), metadata={"format": FORMAT, "model_key": key})
        manifest = {**manifest, "weights_file": file_record(tmp, tensors)}  # size, SHA-256, tensor list
        man_tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        tmp.replace(path)
        man_tmp.replace(manifest_path(path))
    except OSError as exc:
        raise os_error(exc, "--out", path) from None
    finally:
        tmp.unlink(missing_ok=True)
        man_tmp.unlink(missing_ok=True)
