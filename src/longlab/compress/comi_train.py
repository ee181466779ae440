"""``longlab train comi``: COMI's soft variant, a :class:`~longlab.compress.comi.Fusion` layer trained on
longlab's own generated samples with the model frozen (Tang et al., ICLR 2026, arXiv 2602.01719; the
decoder's LoRA is not reproduced).

Each training sample's context is merged by COMI's two MIG stages at ``ratio`` (``COMI.merge``: merged
input embeddings ``m [G, D]`` and merged hidden states ``z [G, D]``), then the layer is trained with Adam to
minimise the answer's teacher-forced cross-entropy (:func:`~longlab.compress.comi.answer_loss`, answer =
``" " + gold``). The samples are the task's generator with seed ``TRAIN_SEED_OFFSET + seed``, so never the
samples ``longlab eval --seed S`` draws for ``S < TRAIN_SEED_OFFSET``. The weights (safetensors, metadata
``format: longlab-comi-fusion``) and a ``.json`` manifest (settings, loss log, times) are written under
temporary names and renamed; an existing file is replaced only when longlab wrote it as such.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import LonglabError, check_range
from ..safeio import check_output_file, json_format_is, safetensors_format_is, temp_path_beside

__all__ = ["FORMAT", "COMI_DEFAULTS", "TRAIN_SEED_OFFSET", "check_comi_settings", "fusion_output_path",
           "fusion_example", "train_comi", "write_fusion", "manifest_path"]

FORMAT = "longlab-comi-fusion"
TRAIN_SEED_OFFSET = 1000
COMI_DEFAULTS: dict[str, Any] = {"ratio": 0.875, "task": "redundant_niah", "samples": 40, "steps": 160,
                                 "lr": 1e-3}


def manifest_path(weights: str | Path) -> Path:
    return Path(weights).with_suffix(".json")


def check_comi_settings(*, ratio: float, task: str, samples: int, steps: int, lr: float, seq_len: int,
                        seed: int) -> None:
    """Every setting of ``train comi`` against its range (a LonglabError naming the flag)."""
    from ..tasks import TASKS

    check_range("--ratio", ratio, 0, 1, low_open=True, high_open=True)
    if task not in TASKS:
        raise LonglabError(f"--task must be one of {', '.join(sorted(TASKS))}, got {task!r}")
    check_range("--samples", samples, 1, 100_000, integer=True)
    check_range("--steps", steps, 1, 1_000_000, integer=True)
    check_range("--lr", lr, 0, 1, low_open=True)
    check_range("--seq-len", seq_len, 64, 1 << 20, integer=True)
    check_range("--seed", seed, 0, 2**32 - 1 - TRAIN_SEED_OFFSET, integer=True)


def _owned_weights(path: Path) -> bool:
    return safetensors_format_is(path, FORMAT)


def _owned_json(path: Path) -> bool:
    return json_format_is(path, FORMAT)


def fusion_output_path(out: str | Path) -> Path:
    """``--out`` checked before training: a ``.safetensors`` name whose file and ``.json`` manifest are new
    or earlier ``train comi`` outputs (a user's file is never overwritten)."""
    path = Path(out)
    if path.suffix != ".safetensors":
        raise LonglabError(
            f"--out: {path} is not a .safetensors name; give e.g. {path.with_suffix('.safetensors')}")
    check_output_file(path, "--out", owned=_owned_weights, what="COMI fusion weights file")
    check_output_file(manifest_path(path), "--out", owned=_owned_json, what="COMI fusion manifest")
    return path


def fusion_example(model: Any, tokenizer: Any, comi: Any, scorer: Any, sample: Any
                   ) -> dict[str, torch.Tensor]:
    """One training example of :func:`~longlab.compress.comi.answer_loss` from a task sample: ``lead [h, D]``
    (the template head's embeddings), ``memories``/``states`` ``[G, D]`` (COMI's merge of the context),
    ``tail [t]`` (question part, then ``" " + answers[0]``), ``n_answer``."""
    from ..prompt import encode_prompts
    from .api import template_head
    from .base import Prompt

    (ctx,), (q,) = encode_prompts(tokenizer, [sample.context], [sample.question], [sample.answer_prefix])
    head = template_head(tokenizer, ctx)
    memories, states, _, _ = comi.merge(Prompt(ctx[head:], sample.question, q, tokenizer), scorer)
    answer = list(tokenizer(" " + sample.answers[0], add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        lead = model.get_input_embeddings()(torch.tensor(ctx[:head], dtype=torch.long))
    return {"lead": lead.clone(), "memories": memories.clone(), "states": states.clone(),
            "tail": torch.tensor(q + answer, dtype=torch.long), "n_answer": torch.tensor(len(answer))}


def train_comi(model: Any, tokenizer: Any, *, ratio: float, task: str, samples: int, steps: int, lr: float,
               seq_len: int, seed: int, log: Callable[[str], None] = lambda m: None
               ) -> tuple[Any, dict[str, Any]]:
    """Generate ``samples`` samples of ``task`` at ``seq_len`` tokens (seed ``TRAIN_SEED_OFFSET + seed``),
    merge each with ``comi@ratio`` and train a Fusion layer for ``steps`` Adam steps at ``lr``.
    Returns the layer and the training record (loss every 10 steps, seconds)."""
    from ..tasks import generate_samples
    from .comi import COMI, train_fusion
    from .scorer import Scorer

    check_comi_settings(ratio=ratio, task=task, samples=samples, steps=steps, lr=lr, seq_len=seq_len,
                        seed=seed)
    comi, scorer = COMI(ratio), Scorer(model)
    t0 = time.perf_counter()
    drawn = generate_samples(task, tokenizer, seq_len, num_samples=samples, seed=TRAIN_SEED_OFFSET + seed)
    examples = []
    for i, s in enumerate(drawn):
        examples.append(fusion_example(model, tokenizer, comi, scorer, s))
        if (i + 1) % 10 == 0 or i + 1 == len(drawn):
            log(f"merged {i + 1}/{len(drawn)} training samples ({time.perf_counter() - t0:.0f}s)")
    prep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fusion, loss_log = train_fusion(model, examples, steps, lr=lr, seed=seed, log_every=10)
    train_s = time.perf_counter() - t0
    log(f"trained {steps} steps in {train_s:.0f}s; loss every 10 steps: {[round(x, 3) for x in loss_log]}")
    record = {"prep_s": prep_s, "train_s": train_s, "loss_every_10_steps": loss_log,
              "params": sum(p.numel() for p in fusion.parameters()),
              "sample_ids": [str(s.sample_id) for s in drawn[:3]] + (["..."] if len(drawn) > 3 else [])}
    return fusion, record


def write_fusion(path: Path, fusion: Any, manifest: dict[str, Any]) -> None:
    """The weights (metadata: ``format`` and the manifest's settings) and ``PATH.json``, both under
    temporary names first, then renamed: a failure leaves no half-written file."""
    import os

    from ..safeio import save_tensors

    manifest = {"format": FORMAT, **manifest}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_beside(path)
    man_tmp = temp_path_beside(path, ".json.longlab-tmp")
    try:
        metadata = {k: str(v) for k, v in manifest.items() if not isinstance(v, (dict, list))}
        save_tensors({k: v.detach().contiguous().cpu() for k, v in fusion.state_dict().items()}, str(tmp),
                  metadata=metadata)
        man_tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        os.replace(man_tmp, manifest_path(path))
    finally:
        tmp.unlink(missing_ok=True)
        man_tmp.unlink(missing_ok=True)
