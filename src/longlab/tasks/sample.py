"""The common sample format shared by generators, loaders and the harness.

One sample is one JSON object: ``context``, ``question``, ``answer_prefix``, ``answers`` (list),
``max_new_tokens``, plus free metadata (``task``, ``length``, ``depth``, ...). This is the layout of
the public long-context sets as re-hosted for KV-cache work (RULER, Hsieh et al. 2024; LongBench;
InfiniteBench), so users can bring their own files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..prompt import LAYOUTS
from .scoring import METRICS

__all__ = ["Sample", "DEFAULT_MAX_NEW_TOKENS"]

DEFAULT_MAX_NEW_TOKENS = 128
_REQUIRED = ("context", "question")
_FIELDS = (
    "context",
    "question",
    "answer_prefix",
    "answers",
    "max_new_tokens",
    "task",
    "length",
    "depth",
    "sample_id",
    "metric",
    "metadata",
)


@dataclass
class Sample:
    """One long-context example.

    The prompt is ``context`` followed by ``question`` (query-aware mode puts both in the prefill;
    query-agnostic mode compresses ``context`` alone, then appends ``question``); decoding starts
    after ``answer_prefix``. ``metadata["prompt"]`` (a top-level ``"prompt"`` key of a file lands there)
    names the prompt layout of :mod:`longlab.prompt` (``"chat"``, the default; ``"chat-sep"``;
    ``"plain"``). ``length`` is the target prompt size in the model's tokens (0 when
    unknown); ``depth`` is the needle's relative position in [0, 1] for single-needle tasks.
    ``metric`` names the scorer of this sample (a name in :data:`~longlab.tasks.scoring.METRICS`) when
    the file declares one; empty means the metric its task is registered with.
    """

    context: str
    question: str
    answer_prefix: str = ""
    answers: list[str] = field(default_factory=list)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    task: str = ""
    length: int = 0
    depth: float | None = None
    sample_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    metric: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict in the common format (metadata kept under ``metadata``; ``metric``
        only when declared)."""
        out = {
            "context": self.context,
            "question": self.question,
            "answer_prefix": self.answer_prefix,
            "answers": list(self.answers),
            "max_new_tokens": self.max_new_tokens,
            "task": self.task,
            "length": self.length,
            "depth": self.depth,
            "sample_id": self.sample_id,
            "metadata": dict(self.metadata),
        }
        if self.metric:
            out["metric"] = self.metric
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Build a sample from a common-format dict.

        ``answers`` may be a string, a list, or SQuAD's ``{"text": [...]}``; ``answer`` is an alias.
        Unknown top-level keys are kept in ``metadata``. Raises ``ValueError`` naming the offending key.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a sample must be a JSON object, got {type(data).__name__}")
        missing = [k for k in _REQUIRED if k not in data]
        if "answers" not in data and "answer" not in data:
            missing.append("answers")
        if missing:
            raise ValueError(f"missing required key(s): {', '.join(missing)}")
        for key in ("context", "question"):
            if not isinstance(data[key], str):
                raise ValueError(f"'{key}' must be a string, got {type(data[key]).__name__}")
        answers = _coerce_answers(data["answers"] if "answers" in data else data["answer"])

        answer_prefix = data.get("answer_prefix") or ""
        if not isinstance(answer_prefix, str):
            raise ValueError(f"'answer_prefix' must be a string, got {type(answer_prefix).__name__}")
        max_new_tokens = data.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"'max_new_tokens' must be an integer >= 1, got {max_new_tokens!r}")
        length = data.get("length") or 0
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"'length' must be an integer >= 0, got {length!r}")
        depth = data.get("depth")
        if depth is not None:
            if isinstance(depth, bool) or not isinstance(depth, (int, float)):
                raise ValueError(f"'depth' must be a number or null, got {depth!r}")
            depth = float(depth)
        metric = data.get("metric") or ""
        if metric and (not isinstance(metric, str) or metric not in METRICS):
            raise ValueError(f"'metric' must be one of {', '.join(sorted(METRICS))}, got {metric!r}")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ValueError(f"'metadata' must be an object, got {type(metadata).__name__}")
        metadata = dict(metadata)
        for key, value in data.items():
            if key not in _FIELDS and key != "answer":
                metadata[key] = value
        layout = metadata.get("prompt")
        if layout is not None and (not isinstance(layout, str) or layout not in LAYOUTS):
            raise ValueError(
                f"'prompt' names the prompt layout, one of {', '.join(map(repr, LAYOUTS))} "
                f"(longlab.prompt), got {str(layout)[:40]!r}; rename the key if it holds something else"
            )
        return cls(
            context=data["context"],
            question=data["question"],
            answer_prefix=answer_prefix,
            answers=answers,
            max_new_tokens=max_new_tokens,
            task=str(data.get("task") or ""),
            length=length,
            depth=depth,
            sample_id=str(data.get("sample_id") or ""),
            metadata=metadata,
            metric=metric,
        )


def _coerce_answers(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, dict) and "text" in value:  # SQuAD-style {"text": [...], "answer_start": [...]}
        return _coerce_answers(value["text"])
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, (int, float)) and not isinstance(item, bool):
                out.append(str(item))
            else:
                raise ValueError(f"'answers' items must be strings, got {type(item).__name__}")
        return out
    raise ValueError(f"'answers' must be a string or a list of strings, got {type(value).__name__}")
