"""RULER's 13 synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", NVIDIA/RULER ``scripts/synthetic.yaml``), written for longlab.

Retrieval (NIAH x 8), multi-hop tracing (``vt``), aggregation (``cwe``, ``fwe``) and QA (``qa_1``,
``qa_2``). Templates, needle formats, key/value types and answer sets follow the paper's code as
summarised in the longlab spec (§8). Deviations, all forced by "offline, no data downloads":

* key words are adjective-noun pairs from longlab's own word list (RULER: ``wonderwords``);
* ``essay`` haystacks use :func:`longlab.tasks.haystacks.essay_sentences` (RULER: Paul Graham essays);
* ``qa_1``/``qa_2`` use synthetic documents about invented people and organisations (RULER: SQuAD and
  HotpotQA); ``qa_2`` needs two hops (organisation -> founder -> founder's biography).

Every generator has the signature ``(tokenizer, length, num_samples=1, seed=0, **options)`` and
returns :class:`~longlab.tasks.sample.Sample` objects whose context + question is at most ``length``
tokens of ``tokenizer``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..sample import Sample

# registration order is the paper's (NIAH x 8, vt, cwe, fwe, qa_1, qa_2): imports not sorted
# isort: off
from .common import DEPTHS
from .niah import (
    niah,
    niah_single_1,
    niah_single_2,
    niah_single_3,
    niah_multikey_1,
    niah_multikey_2,
    niah_multikey_3,
    niah_multivalue,
    niah_multiquery,
)
from .vt import vt
from .cwe import cwe
from .fwe import fwe
from .qa import qa_1, qa_2
# isort: on

__all__ = [
    "DEPTHS",
    "RULER_TASKS",
    "niah",
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
]

RULER_TASKS: dict[str, Callable[..., list[Sample]]] = {
    "niah_single_1": niah_single_1,
    "niah_single_2": niah_single_2,
    "niah_single_3": niah_single_3,
    "niah_multikey_1": niah_multikey_1,
    "niah_multikey_2": niah_multikey_2,
    "niah_multikey_3": niah_multikey_3,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "vt": vt,
    "cwe": cwe,
    "fwe": fwe,
    "qa_1": qa_1,
    "qa_2": qa_2,
}
"""RULER's 13 tasks in the paper's order."""
