"""The face the pipeline and the CLI use: check the speculation arguments up front, then run the loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..recipe import LonglabError, Recipe, shorten
from .base import Draft, Verifier, parse_draft, parse_verifier
from .loop import speculative_decode
from .rollback import check_target_recipe

__all__ = ["SpecConfig", "prepare", "spec_name"]


@dataclass
class SpecConfig:
    """A checked ``(draft, verifier, gamma)``; :meth:`run` decodes with it."""

    draft: Draft
    verifier: Verifier
    gamma: int | None

    @property
    def name(self) -> str:
        return spec_name(self.draft, self.verifier, self.gamma)

    def check_recipe(self, recipe: Recipe) -> None:
        check_target_recipe(recipe)

    def run(
        self,
        model: Any,
        tokenizer: Any,
        stream: Any,
        logits: Any,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        eos_ids: set[int],
        temperature: float,
        top_p: float,
        seed: int,
    ):
        """Returns ``(tokens per row, stats dict)``."""
        tokens, stats = speculative_decode(
            model,
            tokenizer,
            stream,
            logits,
            prompt_ids,
            max_new_tokens,
            eos_ids,
            self.draft,
            self.verifier,
            self.gamma,
            temperature,
            top_p,
            seed,
        )
        info = stats.as_dict()
        info["spec"] = self.name
        return tokens, info


def spec_name(draft: Draft, verifier: Verifier, gamma: int | None) -> str:
    """``draft;verifier;gamma=G``: how results name a speculative configuration."""
    name = draft.spec_name or _draft_name(draft)
    return f"{name};{_verifier_name(verifier)};gamma={gamma or draft.default_gamma}"


def _draft_name(d: Draft) -> str:
    if d.name == "self":
        return f"self:{d.view}"
    if d.name == "model":
        return f"model:{d.model_name or type(d.model).__name__}"
    return d.name


def _verifier_name(v: Verifier) -> str:
    import dataclasses

    extras = [
        f"{f.name}={getattr(v, f.name)}"
        for f in dataclasses.fields(v)
        if f.init and getattr(v, f.name) != f.default
    ]
    return v.name + (":" + ",".join(extras) if extras else "")


def prepare(speculative: Any, verify: Any = None, gamma: Any = None) -> SpecConfig:
    """Check ``speculative`` (a draft name or :class:`Draft`), ``verify`` (``full``, ``dustin:...``) and
    ``gamma`` (draft tokens per step, an integer >= 1; None: the draft's default) before anything runs."""
    if speculative is None:
        raise LonglabError(
            "verify= and gamma= need speculative= (a draft: 'lookup', 'self:KVRECIPE', 'model:NAME')"
        )
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
        raise LonglabError(f"gamma (draft tokens per step) must be an integer >= 1, got {shorten(gamma)}")
    return SpecConfig(parse_draft(speculative), parse_verifier(verify), gamma)
