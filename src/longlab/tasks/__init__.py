"""Offline, seeded long-context tasks sized in the model's own tokens, and their scorers.

RULER's 13 tasks (Hsieh et al. 2024), pass-key retrieval and a NIAH depth x length grid, all emitting
the common JSONL format (:class:`Sample`). ``length`` counts the tokens of ``context`` + ``question``
(encoded separately, no special tokens) and is never exceeded; the answer prefix (a few tokens), the
chat template and ``max_new_tokens`` come on top. Quick use::

    from longlab.tasks import generate_samples, score
    samples = generate_samples("niah_single_2", tokenizer, length=4096, num_samples=10, seed=0)
    score(samples[0].task, prediction, samples[0].answers)

Every task is registered once with its metric (:mod:`longlab.tasks.registry`): a new generator takes
``@register_task("my_task", metric="exact_match")``; a task read from a file,
``declare_task("my_task", "token_f1")``.
"""

from __future__ import annotations

from typing import Any

from .classic import niah_grid, passkey
from .compression import (  # context compression (issue #13)
    cite_qa,
    lookup_chain,
    lookup_chain_reason,
    redundant_niah,
)
from .haystacks import Tokenizer, essay_sentences
from .loaders import load_hf_dataset, load_jsonl, save_jsonl
from .longdoc import load_memory_jsonl, longdoc_multihop  # memory systems (issue #31)
from .multidoc import load_multidoc_jsonl, multidoc_qa_1, multidoc_qa_2
from .registry import (
    DEFAULT_METRIC,
    TASK_REGISTRY,
    TASKS,
    TaskSpec,
    declare_task,
    get_task,
    metric_for,
    register_task,
    score,
    score_sample,
)
from .ruler import (
    DEPTHS,
    RULER_TASKS,
    cwe,
    fwe,
    niah,
    niah_multikey_1,
    niah_multikey_2,
    niah_multikey_3,
    niah_multiquery,
    niah_multivalue,
    niah_single_1,
    niah_single_2,
    niah_single_3,
    qa_1,
    qa_2,
    vt,
)
from .sample import Sample
from .scoring import (
    METRICS,
    exact_match,
    first_int_match,
    register_metric,
    rouge_l,
    string_match_all,
    string_match_part,
    token_f1,
)
from .summary import summ_events  # summarisation-like free text (ROUGE-L)

__all__ = [
    "Sample",
    "load_memory_jsonl",
    "longdoc_multihop",
    "Tokenizer",
    "TASKS",
    "TASK_REGISTRY",
    "TaskSpec",
    "DEFAULT_METRIC",
    "register_task",
    "declare_task",
    "register_metric",
    "score_sample",
    "RULER_TASKS",
    "DEPTHS",
    "get_task",
    "generate_samples",
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
    "passkey",
    "niah_grid",
    "essay_sentences",
    "load_jsonl",
    "save_jsonl",
    "load_hf_dataset",
    "multidoc_qa_1",
    "multidoc_qa_2",
    "load_multidoc_jsonl",
    "summ_events",
    "redundant_niah",
    "cite_qa",
    "lookup_chain",
    "lookup_chain_reason",
    "METRICS",
    "metric_for",
    "score",
    "string_match_all",
    "string_match_part",
    "exact_match",
    "token_f1",
    "rouge_l",
    "first_int_match",
]

def generate_samples(
    task: str, tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, **options: Any
) -> list[Sample]:
    """Generate ``num_samples`` samples of ``task`` whose context + question fit in ``length`` tokens."""
    return get_task(task)(tokenizer, length, num_samples, seed, **options)
