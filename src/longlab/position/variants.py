"""Position methods that need recalibrated weights: DroPE and RoPE-ID, and the variant files they load.

A *variant* is a directory written by ``longlab train``: ``manifest.json`` (base model, position spec,
training budget, a fingerprint of the base weights) and ``model.safetensors`` holding only the tensors
the recalibration changed (plus modules it added). ``drope:weights=DIR`` loads it onto the base model;
weights made for another base model are refused with a LonglabError.
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
from .base import LayerRope, PositionMethod, register_position
from .rope import ropeid_inv_freq

__all__ = [
    "DroPE",
    "RoPEID",
    "MANIFEST",
    "WEIGHTS",
    "base_fingerprint",
    "read_manifest",
    "attention_modules",
    "is_variant_dir",
]

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


def attention_modules(model: Any) -> list[Any]:
    """The ``self_attn`` module of every decoder layer (Llama/Qwen2/Gemma3 layout)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise LonglabError(
            f"{type(model).__name__}: expected model.model.layers[i].self_attn (a Llama-style LM)"
        )
    return [layer.self_attn for layer in layers]


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


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory)
    if not (path / MANIFEST).is_file() or not (path / WEIGHTS).is_file():
        raise LonglabError(
            f"weights={shorten(str(directory))}: not a longlab variant directory "
            f"(needs {MANIFEST} and {WEIGHTS}; "
            "write one with `longlab train`)"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LonglabError(f"weights={shorten(str(directory))}: cannot read {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict) or "position" not in manifest or "base_fingerprint" not in manifest:
        raise LonglabError(f"weights={shorten(str(directory))}: {MANIFEST} lacks position/base_fingerprint")
    return manifest


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
        from safetensors.torch import load_file

        manifest = read_manifest(self.weights)
        shown = shorten(self.weights)
        if manifest["position"] != self.without_weights():
            raise LonglabError(
                f"weights={shown} were trained for position {manifest['position']!r}, "
                f"not {self.without_weights()!r}; "
                f"use position={manifest['position']},weights=..."
            )
        if base_model is not None and manifest.get("base_model") not in (None, base_model):
            raise LonglabError(
                f"weights={shown} were trained on base model {manifest['base_model']!r}, not {base_model!r}; "
                f"load {manifest['base_model']!r} with them"
            )
        if manifest["base_fingerprint"] != base_fingerprint(model):
            raise LonglabError(
                f"weights={shown} were trained on other base weights "
                f"(fingerprint {manifest['base_fingerprint']}, "
                f"this model {base_fingerprint(model)}; base model {manifest.get('base_model')!r})"
            )
        state = load_file(str(Path(self.weights) / WEIGHTS))
        own = dict(model.named_parameters())
        bad = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
        if bad:
            raise LonglabError(f"weights={shown}: {len(bad)} tensors do not fit this model (e.g. {bad[0]})")
        added = ("longlab_q_norm", "longlab_k_norm", "longlab_repo")
        self._saved = {k: own[k].detach().clone() for k in state if not any(a in k.split(".") for a in added)}
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
    qk_norm: bool = False
    weights: str = ""
    layers: str = ""

    def validate(self) -> None:
        self.check("layers", choices=("", "full", "all"))

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
    cycles: float = 1.0
    train_len: int = 0
    rotated: float = 0.5
    temp_len: int = 0
    qk_norm: bool = False
    weights: str = ""
    layers: str = ""

    def validate(self) -> None:
        self.check("cycles", 0, None, low_open=True)
        self.check("train_len", 0, None, integer=True)
        self.check("rotated", 0, 1, low_open=True)
        self.check("temp_len", 0, None, integer=True)
        self.check("layers", choices=("", "full", "all"))

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
    any other name is returned unchanged."""
    path = Path(name)
    if not (path / MANIFEST).is_file():
        return name, position
    manifest = read_manifest(path)
    if position is not None:
        raise LonglabError(
            f"{shorten(name)} is a trained variant with position {manifest['position']!r}; "
            "leave position= out"
        )
    spec = manifest["position"]
    return str(manifest["base_model"]), f"{spec}{',' if ':' in spec else ':'}weights={path}"
