"""Position methods that need recalibrated weights: DroPE and RoPE-ID, and the variant files they load.

A *variant* is a directory written by ``longlab train``: ``manifest.json`` (base model, position spec,
training budget, a fingerprint of the base weights) and ``model.safetensors`` holding only the tensors
the recalibration changed (plus modules it added). ``drope:weights=DIR`` loads it onto the base model.
The manifest (format 2) records the weights file's size, SHA-256 and tensor list, and the file's own
metadata names the position, base fingerprint and ``--train`` mode it was trained with; every load checks
them all (:meth:`_Trainable._load`), so corrupt, truncated, partial, rescaled, NaN-filled or relabelled
weights, weights for another base model, and format-1 variants (no digest: retrain) are refused with a
LonglabError naming the file, what is wrong and the command that trains it again.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..recipe import LonglabError, shorten
from ..registry import MAX_TOKENS, param
from ..safeio import read_checked_tensors
from .base import LayerRope, PositionMethod, register_position
from .rope import ropeid_inv_freq

__all__ = [
    "DroPE",
    "RoPEID",
    "MANIFEST",
    "WEIGHTS",
    "base_fingerprint",
    "read_manifest",
    "retrain_command",
    "attention_modules",
    "trainable_parameters",
    "is_variant_dir",
    "variant_of",
]

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
VARIANT_FORMAT = 2  # 2: the manifest records the weights file's size, SHA-256 and tensor list
ADDED = ("longlab_q_norm", "longlab_k_norm", "longlab_repo")  # modules a method adds to the model
TRAIN_MODES = ("attn", "all", "added")
SCALE_LIMIT = 10.0  # a trained tensor's RMS within [1/10, 10] x the base tensor's it replaces
_MANIFEST_BYTES = 64 << 20


def attention_modules(model: Any) -> list[Any]:
    """The ``self_attn`` module of every decoder layer (Llama/Qwen2/Gemma3 layout)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise LonglabError(
            f"{type(model).__name__}: expected model.model.layers[i].self_attn (a Llama-style LM)"
        )
    return [layer.self_attn for layer in layers]


def trainable_parameters(model: Any, which: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The tensors ``longlab train --train which`` trains: ``attn`` (q/k/v/o projections), ``all`` (every
    weight but the embeddings) or ``added`` (none of those); the modules a method adds, always."""
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    emb = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    out = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        take = any(a in parts for a in ADDED)
        if which in ("attn", "all") and not take:
            take = which == "all" and id(p) not in emb or which == "attn" and any(a in parts for a in attn)
        if take:
            out.append((name, p))
    return out


def base_fingerprint(model: Any) -> str:
    """SHA-256 (16 hex) of the input embedding matrix: which base weights a variant was trained on."""
    emb = model.get_input_embeddings().weight.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(emb.numpy().tobytes()).hexdigest()[:16]


def is_variant_dir(path: Path) -> bool:
    """Did ``longlab train`` write this directory? Only ``manifest.json`` (with ``longlab_variant``) and
    ``model.safetensors`` in it: ``longlab train --out`` replaces such a directory and nothing else."""
    try:
        names = {p.name for p in path.iterdir()}
        if not names <= {MANIFEST, WEIGHTS} or MANIFEST not in names:
            return False
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "longlab_variant" in manifest


def retrain_command(manifest: dict[str, Any], directory: str | Path) -> str:
    """The ``longlab train`` command that writes this variant again (from its manifest's settings)."""
    spec = str(manifest.get("position") or "METHOD")
    method, _, params = spec.partition(":")
    parts = [f"longlab train {method if method in ('drope', 'ropeid', 'repo') else 'METHOD'}"]
    parts.append(f"--model {manifest.get('base_model') or 'MODEL'}")
    for key, flag in (("steps_planned", "--steps"), ("seq_len", "--seq-len"), ("batch", "--batch"),
                      ("lr", "--lr"), ("train", "--train"), ("data_source", "--data")):
        value = manifest.get(key)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and value != "":
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    if params:
        parts.append(f"--params {params}")
    parts.append(f"--out {directory}")
    return " ".join(parts)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The checked manifest of a variant directory (weights are checked when they load: ``_load``)."""
    path = Path(directory)
    shown = f"weights={shorten(str(directory))}"
    if not path.is_dir():
        raise LonglabError(f"{shown}: not a longlab variant directory (no such directory); write one with "
                           "`longlab train`")
    if not (path / MANIFEST).is_file() or not (path / WEIGHTS).exists():
        present = sorted(p.name for p in path.iterdir())[:5] if path.is_dir() else []
        raise LonglabError(
            f"{shown}: not a longlab variant directory (needs {MANIFEST} and {WEIGHTS}; "
            f"it holds {', '.join(present) or 'nothing'}); write one with `longlab train`"
        )
    if (path / MANIFEST).stat().st_size > _MANIFEST_BYTES:
        raise LonglabError(f"{shown}: {MANIFEST} is over {_MANIFEST_BYTES >> 20} MiB: not a variant manifest")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError) as exc:
        raise LonglabError(f"{shown}: cannot read {MANIFEST}: {shorten(str(exc))}") from None
    if not isinstance(manifest, dict) or "longlab_variant" not in manifest:
        raise LonglabError(f"{shown}: {MANIFEST} is not a longlab variant manifest (no longlab_variant)")
    version = manifest["longlab_variant"]
    if version != VARIANT_FORMAT:
        why = (
            "it was written before variants recorded their weights' SHA-256 and tensor list, so its weights "
            "cannot be checked"
            if version == 1
            else f"longlab_variant={shorten(version)} is not a format this longlab reads ({VARIANT_FORMAT})"
        )
        raise LonglabError(f"{shown}: {why}; train it again: {retrain_command(manifest, directory)}")
    for key in ("position", "base_model", "base_fingerprint"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise LonglabError(f"{shown}: {MANIFEST} lacks {key} (a string); train it again: "
                               f"{retrain_command(manifest, directory)}")
    if manifest.get("train") not in TRAIN_MODES:
        raise LonglabError(
            f"{shown}: {MANIFEST} gives train={shorten(manifest.get('train'))}, not one of "
            f"{', '.join(TRAIN_MODES)}; train it again: {retrain_command(manifest, directory)}"
        )
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


class _Trainable(PositionMethod):
    """Shared by DroPE and RoPE-ID: optional full-width q/k RMSNorm and loading trained weights."""

    default_layers = "all"
    needs_training = True
    qk_norm: bool
    weights: str

    def without_weights(self) -> str:
        import dataclasses

        from .base import format_position

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return format_position(type(self)(**{**values, "weights": ""}))

    def attach(self, model: Any, base_model: str | None) -> None:
        self._hooks: list[Any] = []
        if self.qk_norm:
            eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
            for attn in attention_modules(model):
                for proj, label in ((attn.q_proj, "longlab_q_norm"), (attn.k_proj, "longlab_k_norm")):
                    norm = torch.nn.RMSNorm(proj.out_features, eps=eps).to(
                        proj.weight.device, proj.weight.dtype
                    )
                    attn.add_module(label, norm)
                    self._hooks.append(proj.register_forward_hook(_apply_norm(norm)))
        if self.weights:
            self._load(model, base_model)

    def detach(self, model: Any) -> None:
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._hooks = []
        saved = getattr(self, "_saved", {})
        if saved:  # the base weights the trained ones replaced
            own = dict(model.named_parameters())
            with torch.no_grad():
                for key, value in saved.items():
                    own[key].copy_(value)
        self._saved = {}
        for attn in attention_modules(model):
            for label in ("longlab_q_norm", "longlab_k_norm"):
                if hasattr(attn, label):
                    delattr(attn, label)

    def _load(self, model: Any, base_model: str | None) -> None:
        """Check the variant directory ``weights`` against this model, then copy its tensors in. Refused
        with a LonglabError: another position, base model or base weights; a weights file whose size,
        SHA-256 or tensor list differs from the manifest's record; a manifest relabelled after training
        (the weights file's own metadata names the position it was trained for); a tensor set other than
        the one ``--train`` trains on this model; non-finite values; a tensor far off the scale of the
        base tensor it replaces."""
        manifest = read_manifest(self.weights)
        shown = f"weights={shorten(self.weights)}"
        again = f"train it again: {retrain_command(manifest, self.weights)}"
        if manifest["position"] != self.without_weights():
            raise LonglabError(
                f"{shown} were trained for position {manifest['position']!r}, "
                f"not {self.without_weights()!r}; "
                f"use position={manifest['position']},weights=..."
            )
        if base_model is not None and manifest["base_model"] != base_model:
            raise LonglabError(
                f"{shown} were trained on base model {manifest['base_model']!r}, not {base_model!r}; "
                f"load {manifest['base_model']!r} with them"
            )
        if manifest["base_fingerprint"] != base_fingerprint(model):
            raise LonglabError(
                f"{shown} were trained on other base weights "
                f"(fingerprint {manifest['base_fingerprint']}, "
                f"this model {base_fingerprint(model)}; base model {manifest.get('base_model')!r})"
            )
        state, meta = read_checked_tensors(
            Path(self.weights) / WEIGHTS, manifest.get("weights_file"), what=shown, fix=again
        )
        for key in ("position", "base_fingerprint", "train"):
            if meta.get(key) != manifest[key]:
                raise LonglabError(
                    f"{shown}: {MANIFEST} says {key}={manifest[key]!r} but {WEIGHTS} was trained with "
                    f"{key}={meta.get(key)!r} (the manifest was edited after training); {again}"
                )
        own = dict(model.named_parameters())
        want = {n for n, _ in trainable_parameters(model, manifest["train"])}
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        if missing or extra:
            what = f"{len(missing)} of the {len(want)} tensors --train {manifest['train']} trains are missing"
            if extra:
                what = f"{len(extra)} tensors are not ones --train {manifest['train']} trains on this model"
            raise LonglabError(f"{shown}: {what} (e.g. {(missing or extra)[0]}); {again}")
        bad = [k for k, v in state.items() if own[k].shape != v.shape]
        if bad:
            raise LonglabError(f"{shown}: {len(bad)} tensors do not fit this model (e.g. {bad[0]}); {again}")
        for key, value in state.items():
            if any(a in key.split(".") for a in ADDED):
                continue
            base_rms = own[key].detach().float().pow(2).mean().sqrt().item()
            rms = value.float().pow(2).mean().sqrt().item()
            if base_rms > 0 and not 1 / SCALE_LIMIT <= rms / base_rms <= SCALE_LIMIT:
                raise LonglabError(
                    f"{shown}: tensor {key} is {rms / base_rms:.3g}x the scale (RMS) of the base weights it "
                    f"replaces: not a recalibration of them; {again}"
                )
        self._saved = {k: own[k].detach().clone() for k in state if not any(a in k.split(".") for a in ADDED)}
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value.to(own[key].dtype))


def _apply_norm(norm: torch.nn.Module):
    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return norm(output)  # [B, T, H*D] -> same

    return hook


@register_position("drope")
@dataclass
class DroPE(_Trainable):
    """DroPE (Gelberg et al. 2025, arXiv 2512.12167): drop RoPE in every layer, ``cos = 1``, ``sin = 0``
    (all inverse frequencies 0), keep every weight, then recalibrate with next-token loss at the original
    length (``longlab train drope``). ``qk_norm=true`` adds a freshly initialised RMSNorm on the full-width
    ``q_proj`` and ``k_proj`` outputs (the ``qk_norm_nope`` variant). ``weights=DIR`` loads a recalibration.
    Without recalibration the model is a NoPE model it was never trained as: expect it to be much worse."""

    paper = "arXiv 2512.12167"
    qk_norm: bool = param(False, choices=(True, False))
    weights: str = ""
    layers: str = param("", choices=("", "full", "all"))

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        return LayerRope({**params, "rope_type": "default"}, torch.zeros(head_dim // 2), 1.0)


@register_position("ropeid")
@dataclass
class RoPEID(_Trainable):
    """RoPE-ID (Wertheimer et al. 2026, "Frayed RoPE and Long Inputs", arXiv 2603.18017): high-frequency RoPE
    on the first ``P = rotated·D/2`` rotation pairs (``rotated=0.5``: quarters 1 and 3 of the head in the
    rotate-half layout), NoPE on the rest. Frequencies ``ω_i = (ω_min)^{i/(P-1)}``, ``ω_min = 2π·c/L_train``,
    so every rotated pair turns at least ``cycles`` times within ``train_len`` (0: the model's trained
    length) and no angle at test time is new. ``temp_len > 0`` applies the logit temperature
    ``τ = max(1, ln(temp_len)/ln(train_len))`` for inputs of ``temp_len`` tokens (cos and sin × ``sqrt(τ)``,
    so logits × τ; the paper's τ(n) fixed at one length). A train-from-scratch method in the paper; here a
    recalibration of a RoPE model (``longlab train ropeid``)."""

    paper = "arXiv 2603.18017"
    cycles: float = param(1.0, low=0, high=MAX_TOKENS, low_open=True)
    train_len: int = param(0, low=0, high=MAX_TOKENS, integer=True)  # 0: the model's trained length
    rotated: float = param(0.5, low=0, high=1, low_open=True)
    temp_len: int = param(0, low=0, high=MAX_TOKENS, integer=True)
    qk_norm: bool = param(False, choices=(True, False))
    weights: str = ""
    layers: str = param("", choices=("", "full", "all"))

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        train_len = self.train_len or original
        if 2 * math.pi * self.cycles / train_len > 1:
            raise LonglabError(
                f"ropeid: cycles={self.cycles:g} turns within train_len={train_len} needs ω_min > ω_max = 1; "
                f"use cycles <= {train_len / (2 * math.pi):.1f}"
            )
        tau = max(1.0, math.log(self.temp_len) / math.log(train_len)) if self.temp_len > 1 else 1.0
        inv = ropeid_inv_freq(head_dim, train_len, self.cycles, self.rotated)
        return LayerRope({**params, "rope_type": "default"}, inv, math.sqrt(tau))


def variant_of(name: str, position: Any) -> tuple[str, Any]:
    """``load_model(DIR)`` for a variant directory: ``(its base model, "its position,weights=DIR")``;
    any other name is returned unchanged. A directory that is neither a variant (``manifest.json``) nor a
    Hugging Face model directory (``config.json``), and a variant whose base model is itself or another
    variant directory, are refused here, before anything loads."""
    path = Path(name)
    if not path.is_dir():
        return name, position
    if (path / "config.json").exists() and not is_variant_dir(path):
        return name, position  # a Hugging Face model directory (a manifest.json of its own is not ours)
    if not (path / MANIFEST).exists():
        present = sorted(p.name for p in path.iterdir())[:5]
        hint = (
            f"; it holds {WEIGHTS} without {MANIFEST}: a variant whose manifest is gone cannot be checked, "
            "train it again with `longlab train`"
            if (path / WEIGHTS).exists()
            else f" (it holds {', '.join(present) or 'nothing'})"
        )
        raise LonglabError(
            f"model {shorten(name)} is a directory but neither a longlab variant (no {MANIFEST}) nor a "
            f"Hugging Face model directory (no config.json){hint}"
        )
    manifest = read_manifest(path)
    if position is not None:
        raise LonglabError(
            f"{shorten(name)} is a trained variant with position {manifest['position']!r}; "
            "leave position= out"
        )
    base = manifest["base_model"]
    candidate = Path(base)  # resolved as load_model resolves it
    if candidate.is_dir() and (candidate / MANIFEST).exists():
        same = candidate.resolve() == path.resolve()
        raise LonglabError(
                f"model {shorten(name)}: its {MANIFEST} names "
                + ("the variant itself" if same else f"another variant ({shorten(base)})")
                + f" as base model (base_model={shorten(base)}); a variant is loaded onto the model it was "
                f"trained from: {retrain_command(manifest, path)}"
            )
    spec = manifest["position"]
    return str(base), f"{spec}{',' if ':' in spec else ':'}weights={path}"
