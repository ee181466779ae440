"""LoRA adapters: the directory ``longlab train lora`` writes, checked and merged into its base model.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685): a frozen linear
layer ``W [out, in]`` gains a trained low-rank update, ``W' = W + (alpha / r) · B A`` with ``A [r, in]``
and ``B [out, r]``. longlab evaluates an adapter by merging it into the base weights once at load
(``load_model(DIR)``, ``longlab eval --model DIR``), so the merged model runs the one engine path, hook and
cache methods unchanged, and nothing of peft is needed to use it.

An adapter directory holds exactly two files:

- ``adapter.json``: ``longlab_adapter`` (format), ``base_model`` (a name :func:`longlab.models.load_model`
  resolves; never another adapter or variant directory), ``base_fingerprint`` (SHA-256 of the base
  embedding matrix, :func:`longlab.position.variants.base_fingerprint`), ``rank``, ``alpha``, ``targets``,
  the training data and settings, and the record (size, SHA-256, tensor names/shapes/dtypes) of the
  weights file;
- ``adapter.safetensors``: ``<module>.lora_A [r, in]`` and ``<module>.lora_B [out, r]`` (float32) for each
  adapted ``nn.Linear``, ``<module>`` its name in ``model.named_modules()``.

Before anything is merged (:func:`apply_adapter`) the weights file is checked against the manifest's record
(:func:`longlab.safeio.read_checked_tensors`: size, digest, tensor list, finite values), its own metadata
against the manifest (rank, base fingerprint), and every pair against the model: a Linear of that name,
``A`` of shape ``[rank, in_features]``, ``B`` of ``[out_features, rank]``. Only safetensors is read (never a
pickle), and anything wrong is a LonglabError naming the file and the command that trains it again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .position.variants import base_fingerprint
from .recipe import LonglabError, shorten
from .safeio import read_checked_tensors

__all__ = [
    "ADAPTER_MANIFEST",
    "ADAPTER_WEIGHTS",
    "ADAPTER_FORMAT",
    "LORA_TARGETS",
    "PAPER",
    "adapter_of",
    "apply_adapter",
    "is_adapter_dir",
    "read_adapter_manifest",
    "retrain_command",
]

PAPER = "arXiv 2106.09685"
ADAPTER_MANIFEST = "adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_FORMAT = 1
#: ``--targets``: the projections LoRA adapts in every decoder layer
LORA_TARGETS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
MAX_RANK = 1024
_MANIFEST_BYTES = 16 << 20


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Did ``longlab train lora`` write this directory? Only ``adapter.json`` (with ``longlab_adapter``)
    and ``adapter.safetensors`` in it: ``--out`` replaces such a directory and nothing else."""
    p = Path(path)
    try:
        names = {c.name for c in p.iterdir()}
        if not names <= {ADAPTER_MANIFEST, ADAPTER_WEIGHTS} or ADAPTER_MANIFEST not in names:
            return False
        if (p / ADAPTER_MANIFEST).stat().st_size > _MANIFEST_BYTES:
            return False
        manifest = json.loads((p / ADAPTER_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "longlab_adapter" in manifest


def retrain_command(manifest: dict[str, Any], directory: str | os.PathLike[str]) -> str:
    """The ``longlab train lora`` command that writes this adapter again (from its manifest)."""
    t = manifest.get("training") if isinstance(manifest.get("training"), dict) else {}
    data = manifest.get("data") if isinstance(manifest.get("data"), dict) else {}
    parts = ["longlab train lora", f"--model {manifest.get('base_model') or 'MODEL'}",
             f"--data {data.get('path') or 'DATA'}"]
    for key, flag, src in (("steps_planned", "--steps", t), ("seq_len", "--seq-len", t), ("lr", "--lr", t),
                           ("rank", "--rank", manifest), ("alpha", "--lora-alpha", manifest),
                           ("targets", "--targets", manifest), ("seed", "--seed", t)):
        value = src.get(key)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and value != "":
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    parts.append(f"--out {directory}")
    return " ".join(parts)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_adapter_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of an adapter directory (its weights are checked when they merge)."""
    path = Path(directory)
    shown = f"adapter {shorten(str(directory))}"
    if not path.is_dir():
        raise LonglabError(f"{shown}: no such directory; write one with `longlab train lora`")
    if not (path / ADAPTER_MANIFEST).is_file() or not (path / ADAPTER_WEIGHTS).exists():
        present = sorted(p.name for p in path.iterdir())[:5]
        raise LonglabError(
            f"{shown}: not a longlab LoRA adapter (needs {ADAPTER_MANIFEST} and {ADAPTER_WEIGHTS}; it holds "
            f"{', '.join(present) or 'nothing'}); write one with `longlab train lora`"
        )
    if (path / ADAPTER_MANIFEST).stat().st_size > _MANIFEST_BYTES:
        raise LonglabError(f"{shown}: {ADAPTER_MANIFEST} is over {_MANIFEST_BYTES >> 20} MiB: not an adapter")
    try:
        text = (path / ADAPTER_MANIFEST).read_text(encoding="utf-8")
        manifest = json.loads(text, parse_constant=_no_constant)
    except (OSError, ValueError) as exc:
        raise LonglabError(f"{shown}: cannot read {ADAPTER_MANIFEST}: {shorten(str(exc))}") from None
    if not isinstance(manifest, dict) or "longlab_adapter" not in manifest:
        raise LonglabError(f"{shown}: {ADAPTER_MANIFEST} is not a longlab adapter manifest "
                           "(no longlab_adapter)")
    again = f"train it again: {retrain_command(manifest, directory)}"
    if manifest["longlab_adapter"] != ADAPTER_FORMAT:
        raise LonglabError(f"{shown}: longlab_adapter={shorten(manifest['longlab_adapter'])} is not a format "
                           f"this longlab reads ({ADAPTER_FORMAT}); {again}")
    for key in ("base_model", "base_fingerprint", "targets"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise LonglabError(f"{shown}: {ADAPTER_MANIFEST} lacks {key} (a string); {again}")
    if manifest["targets"] not in LORA_TARGETS:
        raise LonglabError(f"{shown}: targets={shorten(manifest['targets'])} is not one of "
                           f"{', '.join(LORA_TARGETS)}; {again}")
    rank, alpha = manifest.get("rank"), manifest.get("alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise LonglabError(f"{shown}: rank={shorten(rank)} is not an integer in [1, {MAX_RANK}]; {again}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1e4:
        raise LonglabError(f"{shown}: alpha={shorten(alpha)} is not a number in (0, 10000]; {again}")
    return manifest


def adapter_of(name: str) -> tuple[str, str | None]:
    """``load_model(DIR)`` for an adapter directory: ``(its base model, DIR)``; any other name is returned
    as ``(name, None)``. An adapter whose base model is itself a directory of longlab's (an adapter or a
    trained variant) is refused: an adapter loads onto the plain model it was trained from."""
    path = Path(name)
    if not path.is_dir() or not (path / ADAPTER_MANIFEST).exists():
        return name, None
    manifest = read_adapter_manifest(path)
    base = manifest["base_model"]
    candidate = Path(base)
    ours = (candidate / ADAPTER_MANIFEST).exists() or (candidate / "manifest.json").exists()
    if candidate.is_dir() and ours:
        raise LonglabError(
            f"adapter {shorten(name)}: its {ADAPTER_MANIFEST} names a longlab directory ({shorten(base)}) as "
            f"base model; an adapter is loaded onto the plain model it was trained from: "
            f"{retrain_command(manifest, path)}"
        )
    return str(base), str(path)


@torch.no_grad()
def apply_adapter(
    model: Any, directory: str | os.PathLike[str], base_model: str | None = None
) -> dict[str, Any]:
    """Check the adapter in ``directory`` against ``model`` and merge it: ``W += (alpha / r) · B A`` for
    every adapted Linear (in float32, then cast to the weight's dtype). Returns the manifest; the model
    gets ``longlab_adapter = {"path", "sha256", "modules"}``. Refused (nothing merged) when the base
    model's name or embedding fingerprint differs, or the weights file fails its checks."""
    manifest = read_adapter_manifest(directory)
    shown = f"adapter {shorten(str(directory))}"
    again = f"train it again: {retrain_command(manifest, directory)}"
    if base_model is not None and manifest["base_model"] != base_model:
        raise LonglabError(f"{shown} was trained on base model {manifest['base_model']!r}, not "
                           f"{base_model!r}; load {manifest['base_model']!r} with it")
    fingerprint = base_fingerprint(model)
    if manifest["base_fingerprint"] != fingerprint:
        raise LonglabError(f"{shown} was trained on other base weights (fingerprint "
                           f"{manifest['base_fingerprint']}, this model {fingerprint}; base model "
                           f"{manifest['base_model']!r})")
    state, meta = read_checked_tensors(Path(directory) / ADAPTER_WEIGHTS, manifest.get("weights_file"),
                                       what=shown, fix=again)
    rank = int(manifest["rank"])
    for key, want in (("rank", str(rank)), ("base_fingerprint", manifest["base_fingerprint"]),
                      ("targets", manifest["targets"])):
        if meta.get(key) != want:
            raise LonglabError(f"{shown}: {ADAPTER_MANIFEST} says {key}={want!r} but {ADAPTER_WEIGHTS} was "
                               f"trained with {key}={meta.get(key)!r} (the manifest was edited); {again}")
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B") or not name:
            raise LonglabError(f"{shown}: tensor {shorten(key)} is not <module>.lora_A / .lora_B; {again}")
        pairs.setdefault(name, {})[part] = tensor
    if not pairs:
        raise LonglabError(f"{shown}: {ADAPTER_WEIGHTS} holds no LoRA pairs; {again}")
    targets = LORA_TARGETS[manifest["targets"]]
    for name, pair in pairs.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            raise LonglabError(f"{shown}: {name} is not a linear layer of this model; {again}")
        if name.rpartition(".")[2] not in targets:
            raise LonglabError(f"{shown}: {name} is not one of the --targets {manifest['targets']} "
                               f"projections; {again}")
        if set(pair) != {"lora_A", "lora_B"}:
            raise LonglabError(f"{shown}: {name} lacks {({'lora_A', 'lora_B'} - set(pair)).pop()}; {again}")
        a, b = pair["lora_A"], pair["lora_B"]
        if tuple(a.shape) != (rank, module.in_features) or tuple(b.shape) != (module.out_features, rank):
            raise LonglabError(
                f"{shown}: {name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this model needs "
                f"[{rank}, {module.in_features}] and [{module.out_features}, {rank}]; {again}"
            )
    scale = float(manifest["alpha"]) / rank
    for name, pair in pairs.items():
        w = modules[name].weight
        delta = scale * (pair["lora_B"].float() @ pair["lora_A"].float())  # [out, r] @ [r, in] -> [out, in]
        w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
    model.longlab_adapter = {"path": str(directory), "sha256": manifest["weights_file"]["sha256"],
                             "modules": len(pairs)}
    return manifest
