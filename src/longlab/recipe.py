"""Recipes: what to compute at prefill, what to keep in the KV cache, what to read at decode.

A *recipe* names one prefill policy, a chain of KV policies (eviction, then quantization), one decode
policy and one context compressor. Recipes have string names so the CLI, the results database and the
plots speak the same language::

    full                      # the empty recipe: dense prefill, no eviction, full decode
    snapkv@0.5                # SnapKV removing 50% of the context KV entries
    streaming:budget=512      # StreamingLLM keeping 512 entries per head
    prism+snapkv@0.5+kivi2    # sparse prefill, then eviction, then 2-bit quantization

Each part is a method of the registry's ``recipe`` family (:mod:`longlab.registry`: one syntax
``name[@r][:k=v,...]``, ``@r`` the fraction removed, values parsed as literals and checked against each
field's type and declared range). This module imports only the registry and the errors; the families
register themselves when :mod:`longlab.methods` is imported, which the package face does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import LonglabError, LonglabTypeError, check_choice, check_range, shorten
from .registry import REGISTRY, LiveView, Registered, build_method, param

__all__ = [
    "KINDS",
    "RECIPE_METHODS",
    "Method",
    "Recipe",
    "register",
    "get_method_class",
    "parse_method",
    "format_method",
    "parse_recipe",
    "format_recipe",
    "split_recipes",
    # re-exported for the method files' convenience (defined in longlab.errors / longlab.registry)
    "LonglabError",
    "LonglabTypeError",
    "check_range",
    "check_choice",
    "shorten",
    "build_method",
    "param",
    "LiveView",
]

KINDS = ("prefill", "kv", "quant", "decode", "context")  # context: a prompt transform (longlab.compress)


@dataclass
class Method(Registered):
    """Base of every recipe method (family ``recipe``). Hyper-parameters are dataclass fields (declared
    ranges with :func:`~longlab.registry.param`), checked in ``__post_init__``; ``repr(method)`` is stored
    with each result row."""

    family: ClassVar[str] = "recipe"
    kind: ClassVar[str] = "kv"

    # Capabilities: what a method needs or does, declared on its class, so the hook and the harness
    # never check concrete classes or read hyper-parameter fields (subclasses override; these defaults
    # describe a method that acts only where its kind says).
    needs_observe: ClassVar[bool] = False  # wants observe(ctx) before attention on every forward (H2O)
    reads_attention: ClassVar[bool] = False  # a KV policy that computes attention itself: attend(ctx)
    acts_during_decode: ClassVar[bool] = False  # a KV/storage policy that changes the cache or its
    #   own state at decode steps (decode-time eviction, quantizing new entries); decode policies
    #   (kind "decode") act at decode by definition
    reports_prefill_metrics: ClassVar[bool] = False  # a prefill policy whose chunks PrefillMetrics measures
    batch_select_safe: ClassVar[bool] = False  # all its decode-time state is in the cache layer's tensors,
    #   batch first, so Cache.batch_select_indices keeps it right when a batched decode drops finished rows
    # context methods (longlab.compress): what they do besides shortening the prompt
    guides_decoding: ClassVar[bool] = False  # replaces greedy decoding (guided_decode; Guidance)
    needs_scorer: ClassVar[bool] = False  # runs a language model over the context: ``scorer``
    scorer = "self"  # which model scores ("self" or a model name; a dataclass field where selectable;
    #   not annotated here, so a subclass's field keeps its place in the field order)
    transforms_prefill: ClassVar[bool] = False  # acts inside the prefill forward (prefill(); hico-forward)

    def slots_read(self, ctx: Any, held: int) -> int:
        """K/V slots this method's decode attention reads at this layer, of the ``held`` ones (all,
        unless a decode policy reads a selection: Quest's pages)."""
        return held

    def decode_records(self) -> list[dict[str, Any]]:
        """What a decode policy recorded per step (LoSA's pages and active queries); none by default."""
        return []

    def reset(self) -> None:
        """Forget per-block state (a new Jacobi block starts); nothing to forget by default."""

    @property
    def observation_window(self) -> int:
        """Tokens at the end of the compressed prefill chunk this method's compression reads (0: none);
        the harness makes the chunk it compresses at least this long."""
        return 0


#: The recipe family of the registry: ``name -> class`` (a live view).
RECIPE_METHODS = REGISTRY.view("recipe")


def register(name: str):
    """Class decorator: ``@register("snapkv")`` puts a recipe method in the one registry
    (:data:`longlab.registry.REGISTRY`, family ``recipe``)."""

    def wrap(cls: type[Method]) -> type[Method]:
        if cls.kind not in KINDS:
            raise TypeError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}")
        return REGISTRY.register(name, "recipe")(cls)

    return wrap


def get_method_class(name: str) -> type[Method]:
    return REGISTRY.get("recipe", name)


def parse_method(spec: str) -> Method:
    """``"snapkv@0.5"`` -> ``SnapKV(compression_ratio=0.5)``; ``"streaming:budget=512"`` -> ...
    (:meth:`longlab.registry.Registry.parse`)."""
    if not isinstance(spec, str):
        raise LonglabTypeError(f"a method spec must be a string, got {type(spec).__name__}")
    if not spec.strip():
        raise LonglabError("empty method name in recipe")
    return REGISTRY.parse("recipe", spec)


def format_method(method: Method) -> str:
    """Inverse of :func:`parse_method`: non-default fields only, ratio as ``@r``."""
    return REGISTRY.format(method)


_PARAM_ITEM = re.compile(r"^[A-Za-z_]\w*\s*=")


def split_recipes(text: str) -> list[str]:
    """Split a comma-separated list of recipes, keeping each method's ``key=value`` parameters together.

    ``"full,streaming:budget=512,sinks=4,snapkv@0.5"`` -> ``["full", "streaming:budget=512,sinks=4",
    "snapkv@0.5"]``: an item of the form ``key=value`` continues the parameter list of the recipe before it,
    which must end in a method with parameters (``name:...``)."""
    recipes: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if _PARAM_ITEM.match(item) and "@" not in item and ":" not in item:
            if not recipes or ":" not in recipes[-1].rsplit("+", 1)[-1]:
                raise LonglabError(
                    f"in {shorten(text)}: parameter {shorten(item)} does not follow a method with parameters "
                    "(write name:key=value,key2=value2)"
                )
            recipes[-1] += "," + item
        else:
            recipes.append(item)
    return recipes


@dataclass
class Recipe:
    """What to compute (prefill), what to keep (KV policies, in order) and what to read (decode)."""

    prefill: Method | None = None
    kv: list[Method] = field(default_factory=list)
    decode: Method | None = None
    context: Method | None = None  # shortens the prompt before prefill (longlab.compress)

    @property
    def is_empty(self) -> bool:
        return (
            self.prefill is None and self.decode is None and self.context is None
            and all(m.name == "full" for m in self.kv)
        )

    @property
    def methods(self) -> list[Method]:
        return [m for m in (self.context, self.prefill, *self.kv, self.decode) if m is not None]

    @property
    def name(self) -> str:
        return format_recipe(self)

    def __str__(self) -> str:
        return self.name


def parse_recipe(spec: str | Recipe | None) -> Recipe:
    """Parse ``"prism+snapkv@0.5+kivi2"``; ``None``/``""``/``"full"`` give the empty recipe."""
    if isinstance(spec, Recipe):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise LonglabTypeError(
            f"recipe must be a string such as 'snapkv@0.5', a Recipe or None, got {shorten(spec)}"
        )
    recipe = Recipe()
    if spec is None or not spec.strip():
        return recipe
    for part in spec.split("+"):
        method = parse_method(part)
        if method.kind == "prefill":
            if recipe.prefill is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two prefill policies")
            recipe.prefill = method
        elif method.kind == "decode":
            if recipe.decode is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two decode policies")
            recipe.decode = method
        elif method.kind == "context":
            if recipe.context is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two context compressors")
            recipe.context = method
        else:
            recipe.kv.append(method)
    # Quantization always runs after eviction: stable sort keeps the user's order within a kind.
    recipe.kv.sort(key=lambda m: m.kind == "quant")
    return recipe


def format_recipe(recipe: Recipe) -> str:
    parts = [format_method(m) for m in recipe.methods if not (m.name == "full" and len(recipe.methods) > 1)]
    return "+".join(parts) if parts else "full"
