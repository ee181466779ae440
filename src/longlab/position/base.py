"""Position methods: registry, ``name:key=value`` parsing, and applying a method to a loaded model.

A position method changes how a RoPE model encodes positions. It acts through the model's **rope
parameters** (``config.rope_parameters``, transformers 5): :func:`apply_position` writes the method's
parameters into a copy of the config's rope parameters and rebuilds the model's own rotary-embedding
module (``model.model.rotary_emb``, the model's own class) from them, so transformers computes the
cos/sin tables wherever it implements the method (``linear``, ``dynamic``, ``yarn``, ``longrope``).
Methods transformers lacks (NTK-aware with a new base is a plain ``rope_theta``; YaRN's paper ramp,
DroPE, RoPE-ID) then set the rebuilt module's ``inv_freq`` buffer and ``attention_scaling`` — data of
the module instance, never a patched class. Trained variants (DroPE's ``qk_norm``, RePo) add small
modules to the attention layers and act through PyTorch forward hooks on those instances.

Models with per-layer-type rope (Gemma 3: ``sliding_attention`` and ``full_attention``) get the
method on the ``full_attention`` layers only unless ``layers="all"``; sliding layers keep theirs
(as Gemma 3 itself scales only its global layers). DroPE and RoPE-ID default to every layer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, shorten
from ..registry import REGISTRY, Registered

__all__ = [
    "PositionMethod",
    "POSITIONS",
    "register_position",
    "parse_position",
    "format_position",
    "apply_position",
    "use_position",
    "find_rotary",
    "rope_tables",
    "LayerRope",
]

#: The position family of the one registry (a live view ``name -> class``).
POSITIONS = REGISTRY.view("position")


def register_position(name: str):
    """Class decorator: ``@register_position("yarn")`` puts the method in the one registry (family
    ``position``), known to ``position=``, ``--positions`` and ``longlab methods``."""
    return REGISTRY.register(name, "position")


@dataclass
class LayerRope:
    """What a method gives one layer type: its new rope-parameter dict (transformers' format) and,
    where transformers does not compute the table itself, the inverse frequencies ``[D/2]`` and the
    factor that multiplies cos and sin (``attention_scaling``; the logits scale by its square)."""

    params: dict[str, Any]
    inv_freq: torch.Tensor | None = None
    attention_scaling: float | None = None


@dataclass
class PositionMethod(Registered):
    """Base of every position method (family ``position``). Hyper-parameters are dataclass fields,
    checked on construction (declared ranges, then ``validate``)."""

    family: ClassVar[str] = "position"
    default_layers: ClassVar[str] = "full"  # per-layer-type models: which layer types it changes
    needs_training: ClassVar[bool] = False  # changes the function enough that weights must be recalibrated
    # fields some methods have: the subclasses' dataclass fields override these defaults (not annotated
    # here, so those fields keep their place in each method's field order and spec)
    original = 0  # the trained length L the method scales from (0: max_position_embeddings)
    layers = ""  # which layer types it changes ("": default_layers)
    weights = ""  # trained weights it loads ("": none)
    changes_positions: ClassVar[bool] = True

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        """The new rope of one layer type from its current ``params`` (``rope_theta``, ``rope_type``),
        the rotary dimension ``head_dim`` (D) and the trained length ``original`` (L)."""
        raise NotImplementedError

    def attach(self, model: Any, base_model: str | None) -> None:
        """Add modules/hooks beyond the rope tables (DroPE qk_norm, trained weights, RePo)."""

    def detach(self, model: Any) -> None:
        """Undo :meth:`attach`."""


def parse_position(spec: str | PositionMethod | None) -> PositionMethod | None:
    """``"yarn:factor=4"`` -> ``YaRN(factor=4)``; ``None``, ``""``, ``"none"`` -> ``None`` (own RoPE)."""
    return REGISTRY.parse("position", spec)


def format_position(method: PositionMethod | None) -> str:
    """Inverse of :func:`parse_position`: non-default fields only (``"none"`` for no method)."""
    return REGISTRY.format(method)


# ---------------------------------------------------------------------------------------------- applying


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def find_rotary(model: Any) -> tuple[Any, str, Any]:
    """``(parent, attribute, module)`` of the model's one rotary-embedding module; a LonglabError when the
    model has no RoPE (learned or no positions) or several rotary modules (not supported)."""
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if name.rpartition(".")[2] == "rotary_emb" and any("inv_freq" in b for b, _ in mod.named_buffers())
    ]
    kind = type(model).__name__
    if not found:
        raise LonglabError(
            f"position methods change RoPE, but {kind} has no rotary embedding (rotary_emb with inv_freq): "
            "it uses learned or no positions; use position=none"
        )
    if len(found) > 1:
        raise LonglabError(f"{kind} has {len(found)} rotary embeddings; position methods support one")
    name, mod = found[0]
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return parent, name.rpartition(".")[2], mod


def _head_dim(config: Any, params: dict[str, Any]) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _per_type(config: Any) -> bool:
    rp = config.rope_parameters
    types = set(getattr(config, "layer_types", None) or ())
    return (
        bool(types) and isinstance(rp, dict) and set(rp) <= types | {"rope_type"} and set(rp) & types != set()
    )


def apply_position(model: Any, spec: str | PositionMethod | None, *, base_model: str | None = None) -> Any:
    """Apply ``spec`` to ``model`` in place; return the method (``None``: nothing to do).

    ``base_model`` names the model as loaded (``"smollm2-135m"``), checked against trained weights'
    manifests. The previous rotary module and rope parameters are kept so :func:`remove_position`
    (and :func:`use_position` on exit) restore the model exactly."""
    method = parse_position(spec)
    if method is None:
        return None
    if hasattr(model, "apply_position_method"):  # a model of longlab's own (the UPI hybrid) applies it itself
        model.apply_position_method(method)
        return method
    if getattr(model, "longlab_position", None) is not None:
        raise LonglabError(
            f"model already has position method {model.longlab_position.spec}; "
            "load it again (or use use_position) to try another"
        )
    parent, attr, rotary = find_rotary(model)
    config = _text_config(model)
    old_params = copy.deepcopy(config.rope_parameters)
    new_params = copy.deepcopy(old_params)
    original = int(method.original or config.max_position_embeddings)
    layers = method.layers or method.default_layers
    per_type = _per_type(config)
    if per_type:
        targets = sorted(t for t in new_params if t != "rope_type" and new_params[t] is not None)
        if layers == "full":
            targets = [t for t in targets if t == "full_attention"] or targets
    else:
        targets = [None]
    overrides: dict[str | None, LayerRope] = {}
    for layer_type in targets:
        params = new_params[layer_type] if layer_type is not None else new_params
        if "rope_theta" not in params:
            raise LonglabError(f"{type(model).__name__}: rope parameters {params} have no rope_theta")
        if params.get("rope_type", "default") != "default":
            raise LonglabError(
                f"the model already scales its RoPE (rope_type={params['rope_type']!r}); position methods "
                "start from plain RoPE"
            )
        lr = method.layer_rope(dict(params), _head_dim(config, params), original)
        if layer_type is None:
            new_params = lr.params
        else:
            new_params[layer_type] = lr.params
        overrides[layer_type] = lr
    config.rope_parameters = new_params
    try:
        device = rotary_device(rotary)
        new_rotary = type(rotary)(config).to(device)
        for layer_type, lr in overrides.items():
            prefix = f"{layer_type}_" if layer_type is not None else ""
            if lr.inv_freq is not None:
                inv = lr.inv_freq.to(device=device, dtype=torch.float32)
                setattr(new_rotary, f"{prefix}inv_freq", inv.clone())
                setattr(new_rotary, f"{prefix}original_inv_freq", inv.clone())
            if lr.attention_scaling is not None:
                setattr(new_rotary, f"{prefix}attention_scaling", float(lr.attention_scaling))
        setattr(parent, attr, new_rotary)
        model.longlab_position = method
        model.longlab_position_restore = (parent, attr, rotary, old_params)
        method.attach(model, base_model)
    except BaseException:
        config.rope_parameters = old_params
        setattr(parent, attr, rotary)
        model.longlab_position = None
        raise
    return method


def rotary_device(rotary: Any) -> torch.device:
    for _, buf in rotary.named_buffers():
        return buf.device
    return torch.device("cpu")


def remove_position(model: Any) -> None:
    """Undo :func:`apply_position`: the original rotary module, rope parameters and no added modules."""
    method = getattr(model, "longlab_position", None)
    if method is None:
        return
    method.detach(model)
    parent, attr, rotary, old_params = model.longlab_position_restore
    setattr(parent, attr, rotary)
    _text_config(model).rope_parameters = old_params
    model.longlab_position = None
    del model.longlab_position_restore


@contextmanager
def use_position(model: Any, spec: str | PositionMethod | None) -> Iterator[PositionMethod | None]:
    """``with use_position(model, "yarn:factor=4"):`` the method inside, the model's own rope after."""
    method = parse_position(spec)
    if method is None:
        yield None
        return
    apply_position(model, method)
    try:
        yield method
    finally:
        remove_position(model)


def rope_tables(
    model: Any, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` ``[T, D]`` the model's rotary module gives at ``positions`` ``[T]`` (tests, plots)."""
    _, _, rotary = find_rotary(model)
    x = torch.zeros(1, dtype=torch.float32, device=rotary_device(rotary))
    pos = positions.reshape(1, -1).to(x.device)
    cos, sin = rotary(x, pos, layer_type) if layer_type is not None else rotary(x, pos)
    return cos[0], sin[0]


def check_factor(method: PositionMethod, field: str = "factor") -> None:
    """A scale factor s = L'/L: a finite number >= 1 (s < 1 would shrink the usable context)."""
    value = getattr(method, field)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 1
    ):
        raise LonglabError(
            f"{method.name}: {field} must be a number >= 1 (the target length over the trained length), "
            f"got {shorten(value)}"
        )
