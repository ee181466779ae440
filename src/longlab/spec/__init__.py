"""Speculative and parallel decoding on the longlab cache: drafts (``lookup``, ``self:KVRECIPE``,
``model:NAME``), verifiers (``full``, ``dustin``), exact cache rollback, and Jacobi block decoding with
LoSA's decode attention (:mod:`longlab.spec.jacobi`)."""

from .base import DRAFTS, VERIFIERS, Draft, Proposal, SpecStats, Verifier, parse_draft, parse_verifier
from .loop import speculative_decode

__all__ = [
    "DRAFTS",
    "VERIFIERS",
    "Draft",
    "Verifier",
    "Proposal",
    "SpecStats",
    "parse_draft",
    "parse_verifier",
    "speculative_decode",
]
