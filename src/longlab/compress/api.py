"""Where context compression meets the pipeline and the harness (above ``models``, below ``pipeline``).

- :func:`compress_prompts` runs a recipe's context compressor on each row's context ids (timed, the
  scorer loaded once per process) and returns a :class:`Squeeze`: the shorter ids, the
  :class:`~longlab.compress.base.Compressed` records, and :meth:`Squeeze.feed` /
  :meth:`Squeeze.applied`, which make the model read merged input embeddings where a method produced
  them (a forward pre-hook active only inside the ``with`` block, replacing the embeddings of the tokens
  at positions ``< T'`` of each row — the compressed context — and nothing else).
- :func:`compressed_rows` is the harness's hook: it groups a sample's recipes by their compressor,
  compresses once per compressor, runs the group on the shorter context and adds the record to each
  row (``extra["context"]``; the answer post-processed and re-scored where the method recovers text).
  It hands the group's :class:`Squeeze` to ``run``, which passes it on to :func:`prefill_rows` and
  :func:`decode_rows` as an argument: no module-level state connects the harness to a compression.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..recipe import LonglabError, Method, parse_recipe
from .base import Compressed, Prompt
from .scorer import Scorer

__all__ = ["compress_prompts", "Squeeze", "compressed_rows", "decode_rows", "prefill_rows", "scorer_for",
           "template_head"]

_LOADED: dict[str, Any] = {}


def scorer_for(method: Method, model: Any) -> Scorer | None:
    """The scorer a compressor asks for: the model itself (``scorer="self"``) or a named model loaded
    once per process with :func:`longlab.load_model` (e.g. ``smollm2-135m``)."""
    if not method.needs_scorer:
        return None
    name = method.scorer
    if name == "self":
        return Scorer(model)
    if name not in _LOADED:
        from ..models import load_model

        _LOADED[name] = load_model(name)[0]
    return Scorer(_LOADED[name])


@dataclass
class Squeeze:
    """The compressed rows of one batch (``method`` None: nothing compressed, ids unchanged)."""

    method: Method | None
    prompts: list[Prompt]
    rows: list[Compressed] = field(default_factory=list)

    @property
    def ids(self) -> list[list[int]]:
        return [r.ids for r in self.rows] if self.method is not None else [p.ids for p in self.prompts]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    def records(self) -> list[dict[str, Any]] | None:
        return [r.record() for r in self.rows] if self.method is not None else None

    def postprocess(self, texts: Sequence[str]) -> list[str]:
        if self.method is None:
            return list(texts)
        return [self.method.postprocess(t, p, r) for t, p, r in zip(texts, self.prompts, self.rows)]  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def applied(self, model: Any) -> Iterator[None]:
        """Within the block, the model reads ``rows[b].embeds`` for row ``b``'s positions ``< T'``."""
        embeds = [r.embeds for r in self.rows] if self.method is not None else []
        if not any(e is not None for e in embeds):
            yield
            return
        table = model.get_input_embeddings()

        def pre_hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
            if ids is None or pos is None or args:
                return args, kwargs
            x = table(ids)  # [B, T, D]
            for b, e in enumerate(embeds):
                if e is None or b >= x.shape[0]:
                    continue
                hit = pos[b] < e.shape[0]  # [T]
                if bool(hit.any()):
                    x[b, hit] = e.to(x.dtype)[pos[b][hit]]
            kwargs = {**kwargs, "input_ids": None, "inputs_embeds": x}
            return args, kwargs

        handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    @property
    def rewrites_embeddings(self) -> bool:
        """Whether the model must read merged embeddings for this compression (:meth:`applied`)."""
        return self.method is not None and any(r.embeds is not None for r in self.rows)

    @property
    def guides(self) -> bool:
        return self.method is not None and self.method.guides_decoding

    def decode(
        self, stream: Any, logits: torch.Tensor, max_new_tokens: int, eos: set[int], temperature: float = 0.0,
        top_p: float = 1.0, seed: int = 0, **options: Any,
    ) -> list[list[int]]:
        """``stream.decode(...)``, or the method's guided decoding (Guidance: greedy, one row)."""
        if not self.guides:
            return stream.decode(logits, max_new_tokens, eos, temperature, top_p, seed, **options)
        if temperature != 0:
            raise LonglabError(f"{self.method.name} decodes greedily: use temperature=0")  # type: ignore[union-attr]
        tokens, stats = self.method.guided_decode(  # type: ignore[union-attr]
            stream, logits, max_new_tokens, eos, self.prompts[0].tokenizer, self.rows[0]
        )
        self.rows[0].info.update(stats)
        return [tokens]

    @property
    def transforms_prefill(self) -> bool:
        return self.method is not None and self.method.transforms_prefill

    def feed(self, stream: Any, rows: list[list[int]], chunk_size: int, compress: str) -> torch.Tensor:
        """``stream.feed(rows, ...)`` with the merged embeddings applied; for a method that
        ``transforms_prefill`` (``hico-forward``), its own prefill of ``rows`` as one forward, every token
        after row ``b``'s compressed context (the question, when fed with it) protected."""
        if self.transforms_prefill:
            extra = {len(r) - len(c) for r, c in zip(rows, self.ids)}
            if len(extra) != 1 or min(extra) < 0:
                name = self.method.name  # type: ignore[union-attr]
                raise LonglabError(f"{name}: every row must be its context plus the same number of question "
                                   "tokens (rows of different lengths are not supported)")
            after = extra.pop()
            protect = max(after, int(self.method.protect)) if after else None  # type: ignore[union-attr]
            logits = self.method.prefill(stream, rows, protect, compress)  # type: ignore[union-attr]
            info = self.method.info  # type: ignore[union-attr]
            for r in self.rows:
                r.info.update(layers=info["layers"], tokens_per_stage=info["tokens_per_stage"])
            return logits
        with self.applied(stream.model):
            return stream.feed(rows, chunk_size, compress)


def compress_prompts(
    model: Any, tokenizer: Any, method: Method | None, ctx_ids: list[list[int]], q_ids: list[list[int]],
    questions: Sequence[str | None],
) -> Squeeze:
    """Compress each row's context ids with ``method`` (a ``context`` method; None: unchanged)."""
    prompts = [Prompt(list(c), q, list(qi), tokenizer) for c, q, qi in zip(ctx_ids, questions, q_ids)]
    squeeze = Squeeze(method, prompts)
    if method is None:
        return squeeze
    if method.kind != "context":
        raise LonglabError(f"{method.name} is a {method.kind} method, not a context compressor")
    scorer = scorer_for(method, model)
    for p in prompts:
        t0 = time.perf_counter()
        head = template_head(tokenizer, p.ids)  # the chat template's opening: never compressed
        body = Prompt(p.ids[head:], p.question, p.question_ids, tokenizer)
        out = method.compress(body, scorer)  # type: ignore[attr-defined]
        if not out.ids:
            raise LonglabError(f"{method.name} removed every context token; lower the ratio")
        if head:
            out.ids = p.ids[:head] + out.ids
            out.source = list(range(head)) + [s + head if s >= 0 else s for s in out.source]
            if out.embeds is not None:
                with torch.inference_mode():
                    lead = model.get_input_embeddings()(torch.tensor(p.ids[:head], device=out.embeds.device))
                out.embeds = torch.cat([lead.to(out.embeds.dtype), out.embeds])
                out.sizes = [1] * head + list(out.sizes or [])
            out.info["template_tokens"] = head
            out.original_tokens = len(p.ids)
        memo = scorer.memo_s if scorer is not None else 0.0
        if memo:  # scoring reused from an earlier ratio of this context: count what it cost then
            out.info["memo_s"] = memo
            scorer.memo_s = 0.0  # type: ignore[union-attr]
        out.seconds = time.perf_counter() - t0 + memo
        squeeze.rows.append(out)
    return squeeze


_MARK = "\u2063LONGLAB_COMPRESS\u2063"


def template_head(tokenizer: Any, ids: list[int]) -> int:
    """Leading tokens of ``ids`` that are the chat template's opening (system turn, user header), as
    :func:`longlab.prompt.build_prompt` renders it; 0 without a template or when ``ids`` do not start
    with it (plain completion prompts)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that needs more than one user turn: compress everything
        return 0
    head = list(tokenizer(rendered.split(_MARK, 1)[0], add_special_tokens=False)["input_ids"])
    for n in (len(head), len(head) - 1):  # the last piece may merge with the context's first character
        if n > 0 and ids[:n] == head[:n] and n < len(ids):
            return n
    return 0


def compressed_rows(
    model: Any, tokenizer: Any, sample: Any, recipes: Sequence[str], ctx: list[int], q: list[int],
    run: Callable[[Sequence[str], list[int], Squeeze | None], Iterator[dict[str, Any]]],
) -> Iterator[dict[str, Any]]:
    """The harness hook: ``run(recipes, ctx, squeeze)`` per group of recipes sharing a context
    compressor, on that compressor's ids, with that group's :class:`Squeeze` (None for the recipes
    without a compressor), which ``run`` hands to :func:`prefill_rows` and :func:`decode_rows`; rows gain
    ``extra["context"]`` (tokens kept, time, spans)."""
    groups: dict[str, tuple[Method | None, list[str]]] = {}
    for name in recipes:
        method = parse_recipe(name).context
        groups.setdefault(repr(method), (method, []))[1].append(name)
    for method, names in groups.values():
        if method is None:
            yield from run(names, ctx, None)
            continue
        squeeze = compress_prompts(model, tokenizer, method, [ctx], [q], [sample.question])
        with squeeze.applied(model):
            for row in run(names, squeeze.ids[0], squeeze):
                yield annotate(row, squeeze, squeeze.records()[0], sample)  # type: ignore[index]


def _squeeze_of(method: Method, squeeze: Squeeze | None) -> Squeeze:
    """``squeeze`` checked to be the compression of ``method`` (the recipe's context part)."""
    if squeeze is None or squeeze.method is None or repr(squeeze.method) != repr(method):
        raise LonglabError(f"{method.name}: give the Squeeze that compressed this recipe's context "
                           "(compressed_rows passes it to run)")
    return squeeze


def decode_rows(
    recipes: Sequence[Any], stream: Any, logits: torch.Tensor, max_new_tokens: int, eos: set[int],
    squeeze: Squeeze | None = None, **options: Any,
) -> list[list[int]]:
    """The harness's decode: ``stream.decode(...)``, or guided decoding for a lone recipe whose context
    method ``guides_decoding``, through ``squeeze``, that method's compression of this sample."""
    method = recipes[0].context if len(recipes) == 1 else None
    if method is not None and method.guides_decoding:
        return _squeeze_of(method, squeeze).decode(stream, logits, max_new_tokens, eos)
    return stream.decode(logits, max_new_tokens, eos, **options)


def prefill_rows(recipe: Any, stream: Any, rows: list[list[int]], chunk_size: int,
                 compress: str = "end", squeeze: Squeeze | None = None) -> torch.Tensor:
    """The harness's prefill of a branch: ``stream.feed(...)``, or, for a recipe whose context method
    ``transforms_prefill`` (``hico-forward``), that method's prefill through ``squeeze`` (its
    compression of this sample); ``rows`` are then the whole context (+ the question, query-aware)."""
    method = recipe.context
    if method is None or not method.transforms_prefill:
        return stream.feed(rows, chunk_size, compress)
    return _squeeze_of(method, squeeze).feed(stream, rows, chunk_size, compress)


def annotate(row: dict[str, Any], squeeze: Squeeze, record: dict[str, Any], sample: Any) -> dict[str, Any]:
    """Add the compression record to a result row; post-process its answer (re-scored if it changed)."""
    from ..tasks import score_sample

    row["extra"] = {**row.get("extra", {}), "context": record, "context_s": record["context_s"]}
    (text,) = squeeze.postprocess([row["prediction"]])
    if text != row["prediction"]:
        row["extra"]["raw_prediction"] = row["prediction"]
        row["prediction"] = text
        row["score"] = score_sample(sample, text)
    return row
