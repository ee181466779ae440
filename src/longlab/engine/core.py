"""The one engine: ``Engine(model, tokenizer)`` runs requests of every family, many at a time.

``submit(request)`` checks the request (every field, every method string, its length against the model
and this machine's memory) and queues it; ``step()`` does one unit of work and returns the results that
finished in it; ``run(requests)`` does both until every request is done. A step either admits the next
prompt group from the queue (prefill) or advances every running lane by one decode step:

- requests with the same prompt share its prefill (:mod:`longlab.engine.prefill`, the prefill-once
  planner) and branch into their own recipes;
- rows whose recipe decodes as plain attention join **one batch** (:class:`~longlab.engine.decode.StreamLane`
  under the empty recipe), whatever their prompt: new rows join it between steps, finished rows leave;
- rows that cannot share a batch — a decode policy or quantized storage, speculative decoding, guided
  decoding, stored-document (reuse) caches — get a lane of their own and advance in the same steps;
- requests under a position method run while the method is applied to the model; requests under
  another one wait until the running ones have finished (a position changes the model for every row).

A request's tokens do not depend on what else runs: each samples from its own generator, and each
lane computes exactly what the request would alone (tests/test_engine.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LonglabError
from ..request import Request
from .decode import Lane, OneShotLane, Row, Sampler, SpecLane, StreamLane, stack_streams
from .limits import check_attention, check_model, check_size
from .prefill import Branch, PromptGroup, prefill_group
from .stream import Stream, eos_token_ids

__all__ = ["Engine", "Result"]


@dataclass
class Result:
    """What one request produced and what it cost. ``kv_bytes_before``: what an uncompressed cache of
    the prompt holds; ``kv_bytes_after``: what the request's cache held after compression. ``prefill_s``
    counts a shared prefix in full for every request that used it (``extra["shared_prefill_s"]`` says how
    much was shared); ``decode_s`` is the time of the decode steps the request took part in."""

    key: int
    request: Request
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "length", "stop" or "forced"
    prompt_tokens: int
    context_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    decode_s: float
    recipe: str
    extra: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] | None = None
    reuse: Any = None  # longlab.reuse.ReusePrefill for documents= requests
    context: dict[str, Any] | None = None  # a context compressor's record (tokens kept, time, spans)
    forced: list[int] | None = None  # argmax at each continuation position (continuation= requests)
    forced_ids: list[int] | None = None  # the continuation's token ids
    forced_logprobs: Any = field(default=None, repr=False)  # [T, V] log-softmax at each continuation position
    metrics: Any = None  # longlab.sparse.prefill.PrefillMetrics (prefill_metrics= requests)
    cache: Any = field(default=None, repr=False)  # the request's cache when it decoded alone


@dataclass
class _Pending:
    key: int
    request: Request
    ctx: list[int]
    q: list[int]

    def group_key(self) -> tuple:
        r = self.request
        if r.documents is not None:
            return ("documents", self.key)  # every reuse request is its own group
        return (
            tuple(self.ctx),
            tuple(self.q),
            r.chunk_size,
            r.query_aware,
            r.compress,
            r.prefill_metrics,
            _position_key(r),
        )


def _position_key(request: Request) -> str:
    from ..registry import REGISTRY

    return REGISTRY.format(request.parsed.position) if request.parsed is not None else "none"


class Engine:
    """Runs :class:`~longlab.request.Request` objects on one model: ``run(requests)``, or the step-wise
    ``submit`` / ``step`` a server drives. ``store``: the document KV store of ``documents=`` requests
    (a :class:`~longlab.reuse.DocStore`, a directory, or None: documents encoded in memory)."""

    def __init__(self, model: Any, tokenizer: Any, *, store: Any = None) -> None:
        check_model(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.store = store
        self.eos = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._waiting: deque[_Pending] = deque()
        self._lanes: list[Lane] = []
        self._batch: StreamLane | None = None  # the joinable lane (plain rows of every prompt)
        self._branches: dict[int, tuple[_Pending, dict[str, Any]]] = {}  # key -> (request, prefill info)
        self._known: dict[str, frozenset[str]] = {}  # the planner's observer knowledge
        self._position: str = "none"
        self._position_cm: contextlib.ExitStack | None = None
        self._next = 0

    # ------------------------------------------------------------------------------------ public API
    def submit(self, request: Request | dict[str, Any]) -> int:
        """Check ``request`` and queue it; returns its handle (``Result.key``)."""
        request, ctx, q = self._checked(request)
        key = self._next
        self._next += 1
        self._waiting.append(_Pending(key, request, ctx, q))
        return key

    def check(self, request: Request | dict[str, Any]) -> int:
        """Every check :meth:`submit` makes (fields, methods, the prompt's size against the model and
        memory), without queueing; returns the prompt's token count (0 for ``documents=``, which the
        reuse prefill tokenizes and checks itself)."""
        _, ctx, q = self._checked(request)
        return len(ctx) + len(q)

    def cancel(self, key: int) -> bool:
        """Drop request ``key``, queued or running: a row of the shared batch leaves it now (its cache
        rows are freed), a lane of its own is closed. It yields no result. False: no such request is
        queued or running (unknown, or already finished)."""
        for p in self._waiting:
            if p.key == key:
                self._waiting.remove(p)
                return True
        for lane in self._lanes:
            if not any(r.key == key for r in lane.rows):
                continue
            keep = [i for i, r in enumerate(lane.rows) if r.key != key]
            if not keep:
                self._lanes.remove(lane)
                if lane is self._batch:
                    self._batch = None
                lane.close()
            elif not lane.keep_rows(keep):  # its rows ride along in this lane: mark it done (never reported)
                next(r for r in lane.rows if r.key == key).finish = "cancelled"
            self._branches.pop(key, None)
            if not self._lanes and not self._waiting:
                self._set_position("none")
            return True
        return False

    def progress(self) -> dict[int, list[int]]:
        """The tokens each running (admitted, unfinished) request has produced so far, by key (a
        speculative or guided lane shows its tokens when it finishes)."""
        return {r.key: list(r.tokens) for lane in self._lanes for r in lane.rows if r.finish is None}

    def held_bytes(self) -> dict[int, int]:
        """KV bytes each running request holds now, allocated spare slots included: a lane of its own,
        its cache's; a row of the shared batch, its share of the batch cache (rows are stacked with
        empty slots up to the longest, so each row holds ``batch bytes / rows``)."""
        out: dict[int, int] = {}
        for lane in self._lanes:
            live = [r for r in lane.rows if r.finish is None]
            stream = getattr(lane, "stream", None)
            if stream is None and live:
                stream = self._branches.get(live[0].key, (None, {}))[1].get("held")
            cache = getattr(stream, "cache", None)
            if cache is None or not live:
                continue
            total = cache.nbytes() + cache.spare_nbytes()
            rows = max(len(lane.rows), 1)
            for r in live:
                out[r.key] = total // rows
        return out

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._lanes)

    def step(self) -> list[Result]:
        """One unit of work: admit the next prompt group (prefill), or advance every lane one step.
        Returns the results that finished."""
        if self._waiting and self._can_admit():
            return self._admit()
        if not self._lanes:
            return []
        done: list[Result] = []
        for lane in list(self._lanes):
            with self._lane_context():
                rows = lane.step()
            done += [self._finish(r) for r in rows]
            if not lane.rows:
                self._lanes.remove(lane)
                if lane is self._batch:
                    self._batch = None
                lane.close()
        if not self._lanes and not self._waiting:
            self._set_position("none")
        return done

    def results(self, requests: Iterable[Request | dict[str, Any]]) -> Iterator[Result]:
        """Submit every request (all checked before any runs), then yield results as they finish."""
        for _ in (keys := [self.submit(r) for r in requests]):
            pass
        del keys
        try:
            while self.busy:
                yield from self.step()
        finally:
            self._set_position("none")

    def run(self, requests: Iterable[Request | dict[str, Any]]) -> list[Result]:
        """Run ``requests`` to completion; results in the order given."""
        requests = list(requests)
        first = self._next
        out = {r.key: r for r in self.results(requests)}
        return [out[first + i] for i in range(len(requests))]

    # --------------------------------------------------------------------------------------- checks
    def _checked(self, request: Request | dict[str, Any]) -> tuple[Request, list[int], list[int]]:
        if isinstance(request, dict):
            request = Request(**request)
        if not callable(getattr(request, "check", None)):
            raise LonglabError(f"submit takes a longlab.Request, got {request.__class__.__name__}")
        request.check()
        if request.parsed.recipe.is_empty is False:
            check_attention(self.model, request.parsed.recipe)
        ctx, q = self._tokenize(request)
        if request.documents is None:  # a reuse prefill checks each document and the whole prompt itself
            check_size(self.model, request, len(ctx) + len(q))
        return request, ctx, q

    def _tokenize(self, request: Request) -> tuple[list[int], list[int]]:
        from ..prompt import encode_messages, encode_prompts

        if request.documents is not None:
            return [], []  # tokenized by the reuse prefill (documents alone, then the question)
        if request.messages is not None:
            return encode_messages(
                self.tokenizer, request.messages, request.answer_prefix, request.chat_template
            )
        (ctx,), (q,) = encode_prompts(
            self.tokenizer,
            [request.context],
            [request.question],
            [request.answer_prefix],
            request.chat_template,
        )
        return ctx, q

    # ------------------------------------------------------------------------------------- positions
    def _can_admit(self) -> bool:
        head = _position_key(self._waiting[0].request)
        return head == self._position or not self._lanes

    def _set_position(self, spec: str) -> None:
        if spec == self._position:
            return
        if self._position_cm is not None:
            self._position_cm.close()
            self._position_cm = None
        self._position = "none"
        if spec != "none":
            from ..position import use_position

            stack = contextlib.ExitStack()
            stack.enter_context(use_position(self.model, spec))
            self._position_cm, self._position = stack, spec

    def _lane_context(self) -> Any:
        return torch.inference_mode()

    # ------------------------------------------------------------------------------------- admission
    def _admit(self) -> list[Result]:
        head = self._waiting[0]
        self._set_position(_position_key(head.request))
        key = head.group_key()
        group = [p for p in self._waiting if p.group_key() == key]
        for p in group:
            self._waiting.remove(p)
        if head.request.documents is not None:
            return self._admit_documents(head)
        r0 = head.request
        pg = PromptGroup(
            head.ctx,
            head.q,
            r0.chunk_size,
            r0.query_aware,
            r0.compress,
            r0.prefill_metrics,
            question_text=r0.question,
        )
        pg.members = [(p.key, p.request.parsed.recipe) for p in group]
        by_key = {p.key: p for p in group}
        done: list[Result] = []
        to_stack: list[Branch] = []
        with torch.inference_mode():
            for branch in prefill_group(self.model, self.tokenizer, pg, self.pad_id, self._known):
                pending = by_key[branch.key]
                info = _branch_info(branch)
                self._branches[branch.key] = (pending, info)
                req = pending.request
                if req.continuation is not None:
                    self._ask(branch)
                    done.append(self._forced(pending, info, branch.stream, branch.logits[0]))
                elif self._stacks(req, branch):
                    to_stack.append(branch)
                else:
                    self._ask(branch)
                    self._lanes.append(self._solo_lane(pending, branch))
            if to_stack:
                self._join(to_stack)
        return done

    def _stacks(self, request: Request, branch: Branch) -> bool:
        """Whether a branch decodes in the shared batch: plain attention over plain layers, greedy or
        sampled, no speculation, no compressor that rewrites embeddings or guides decoding."""
        from .planner import batchable

        squeeze = branch.squeeze
        hooks = squeeze is not None and (squeeze.guides or squeeze.rewrites_embeddings)
        return (
            request.batch_decode
            and request.parsed.draft is None
            and not hooks
            and batchable(branch.recipe)
            and all(layer.batchable for layer in branch.stream.cache.layers)
        )

    def _ask(self, branch: Branch) -> None:
        """Feed a branch's pending question into its own stream (query-agnostic requests); a sparse
        prefill's metrics cover it too, their measuring time left out of ``prefill_s``."""
        from ..sparse.prefill import collect_prefill_metrics

        if not branch.question:
            return
        measured = branch.metrics.seconds if branch.metrics is not None else 0.0
        hook = branch.squeeze.applied(self.model) if branch.squeeze is not None else contextlib.nullcontext()
        t0 = time.perf_counter()
        with hook, collect_prefill_metrics(branch.metrics):
            branch.logits = branch.stream.feed([branch.question], branch.extra["chunk_size"], compress="none")
        branch.prefill_s += time.perf_counter() - t0
        if branch.metrics is not None:
            branch.prefill_s -= branch.metrics.seconds - measured
        self._branches[branch.key][1]["prefill_s"] = branch.prefill_s
        branch.question = None

    def _row(self, pending: _Pending, logits: torch.Tensor) -> Row:
        r = pending.request
        row = Row(
            pending.key,
            logits.float().cpu(),
            r.max_new_tokens,
            self.eos,
            Sampler(r.temperature, r.top_p, r.seed),
            r.stop,
            self._detokenize,
        )
        if r.parsed.grammar is not None:  # response_format: a mask per row (longlab.grammar)
            from ..grammar import grammar_mask

            row.grammar = grammar_mask(self.tokenizer, r.parsed.grammar, row.logits.shape[-1], self.eos)
        return row

    def _solo_lane(self, pending: _Pending, branch: Branch) -> Lane:
        """A lane of its own: speculative decoding, guided decoding, or a recipe that acts at decode."""
        req, squeeze = pending.request, branch.squeeze
        row = self._row(pending, branch.logits[0])
        self._branches[pending.key][1]["held"] = branch.stream  # for held_bytes()
        hook = (lambda: squeeze.applied(self.model)) if squeeze is not None else None
        if req.parsed.draft is not None:
            from ..spec.loop import speculative_steps

            steps = speculative_steps(
                self.model,
                self.tokenizer,
                branch.stream,
                branch.logits,
                [pending.ctx + pending.q],
                req.max_new_tokens,
                self.eos,
                req.parsed.draft,
                req.parsed.verifier,
                req.gamma,
                req.temperature,
                req.top_p,
                req.seed,
            )
            return SpecLane(row, steps, hook)
        if squeeze is not None and squeeze.guides:
            return OneShotLane(
                row,
                lambda: squeeze.decode(
                    branch.stream,
                    branch.logits,
                    req.max_new_tokens,
                    self.eos,
                    req.temperature,
                    req.top_p,
                    req.seed,
                )[0],
            )
        self._branches[pending.key][1]["stream"] = branch.stream
        return StreamLane(branch.stream, [row], hook=hook)

    def _join(self, branches: list[Branch]) -> None:
        """Stack branches (of one prompt group) as batch rows, ask their question in one forward, and
        join them to the running batch."""
        reserve = max(
            len(b.question or ()) + self._branches[b.key][0].request.max_new_tokens for b in branches
        )
        stream = stack_streams([b.stream for b in branches], reserve)
        for b in branches:
            b.stream = None  # free the per-branch caches
        q = branches[0].question
        if q:
            t0 = time.perf_counter()
            logits = stream.feed(
                [q] * len(branches), branches[0].extra["chunk_size"], compress="none"
            )  # [B, V]
            question_s = time.perf_counter() - t0
            for i, b in enumerate(branches):
                b.logits = logits[i : i + 1]
                info = self._branches[b.key][1]
                info["prefill_s"] += question_s
                info["extra"]["batched_question_s"] = question_s
        rows = [self._row(self._branches[b.key][0], b.logits[0]) for b in branches]
        lane = StreamLane(stream, rows, joinable=True)
        if self._batch is None:
            self._batch = lane
            self._lanes.append(lane)
        else:
            self._batch.join(lane)

    def _admit_documents(self, pending: _Pending) -> list[Result]:
        """A ``documents=`` request: its prompt's KV assembled from the store by its reuse method."""
        from ..prompt import resolve_layout
        from ..reuse.api import reuse_prefill
        from ..reuse.docstore import MemoryStore

        req = pending.request
        if self.store is None:
            self.store = MemoryStore()
        pre = reuse_prefill(
            self.model,
            self.tokenizer,
            req.documents,
            req.question,
            req.parsed.reuse,
            store=self.store,
            answer_prefix=req.answer_prefix,
            chat_template=resolve_layout(req.chat_template, self.tokenizer) != "plain",
            recipe=req.parsed.recipe,
        )
        stream = Stream(self.model, pre.cache, 1)
        stream.pad_id = self.pad_id
        stream.seen_mask = torch.ones(1, pre.n_positions, dtype=torch.bool, device=stream.device)
        stream.next_pos = torch.full((1,), pre.n_positions, dtype=torch.long, device=stream.device)
        info = {
            "prompt_tokens": pre.prompt_tokens,
            "context_tokens": pre.prompt_tokens,
            "kv_bytes_before": pre.cache.full_nbytes(),
            "kv_bytes_after": pre.cache.nbytes(),
            "prefill_s": pre.ttft_s,
            "compress_s": pre.compress_s,
            "reuse": pre,
            "stream": stream,
            "recipe": f"reuse={pre.method}" + (f"+{pre.recipe}" if pre.recipe != "full" else ""),
            "extra": {
                "fetch_s": pre.fetch_s,
                "assemble_s": pre.assemble_s,
                "compute_s": pre.compute_s,
                "recompute_fraction": pre.recompute_fraction,
                "cost_fraction": pre.cost_fraction,
            },
        }
        self._branches[pending.key] = (pending, info)
        if req.continuation is not None:
            return [self._forced(pending, info, stream, pre.logits[0])]
        self._lanes.append(StreamLane(stream, [self._row(pending, pre.logits[0])]))
        return []

    def _forced(self, pending: _Pending, info: dict[str, Any], stream: Any, logits: torch.Tensor) -> Result:
        """Teacher forcing: the argmax at each position of ``" " + continuation`` fed after the prompt (no
        decoding); the request scores 1 exactly when greedy decoding would emit the continuation first."""
        from ..prompt import continuation_ids

        ids = continuation_ids(
            self._question_ids(pending),
            self.tokenizer,
            pending.request.answer_prefix,
            pending.request.continuation,
        )
        t0 = time.perf_counter()
        steps = [logits.reshape(1, -1)]
        recipe = getattr(stream.cache, "recipe", None)
        if len(ids) > 1 and getattr(recipe, "decode", None) is not None:
            # a decode-time method (Quest, RetroAttention, LoSA) selects per decode query: feed the answer
            # one token at a time, as decoding does (one forward pass would be a prefill chunk, attended
            # densely, and would score as full attention)
            steps += [stream.feed([[tok]], 1, compress="none").reshape(1, -1) for tok in ids[:-1]]
        elif len(ids) > 1:
            out = stream.feed([ids[:-1]], len(ids), compress="none", every_position=True)  # [1, T, V]
            steps.append(out[0])
        scores = torch.cat(steps).float()  # [T, V]: the logits before each continuation token
        preds = scores.argmax(-1).tolist()
        seconds = time.perf_counter() - t0
        row = Row(pending.key, logits, len(ids), set())
        row.tokens, row.finish, row.decode_s = preds, "forced", seconds
        res = self._finish(row)
        res.forced, res.forced_ids = preds, ids
        res.forced_logprobs = torch.log_softmax(scores, -1).cpu()
        return res

    def _question_ids(self, pending: _Pending) -> Any:
        """``answer_prefix -> question-part ids`` of a request's prompt (for :func:`continuation_ids`)."""
        from ..prompt import encode_messages, encode_prompts, resolve_layout

        req, tok = pending.request, self.tokenizer
        if req.documents is not None:
            from ..reuse.api import split_prompt

            templated = resolve_layout(req.chat_template, tok) != "plain"
            return lambda prefix: split_prompt(tok, req.question, prefix, templated)[1]
        if req.messages is not None:
            return lambda prefix: encode_messages(tok, req.messages, prefix, req.chat_template)[1]
        return lambda prefix: encode_prompts(tok, [req.context], [req.question], [prefix], req.chat_template)[
            1
        ][0]

    # ------------------------------------------------------------------------------------------ results
    def _detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _finish(self, row: Row) -> Result:
        pending, info = self._branches.pop(row.key)
        req = pending.request
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True).strip()
        if row.finish == "stop" and req.stop:
            cut = min((text.find(s) for s in req.stop if s in text), default=-1)
            text = text[:cut].rstrip() if cut >= 0 else text
        squeeze = info.get("squeeze")
        raw, context = text, info.get("context")
        if squeeze is not None and squeeze.method is not None:
            (text,) = squeeze.postprocess([text])
            context = squeeze.records()[0]  # read now: decoding adds to it (iterations, lookaheads)
        extra = {
            **info.get("extra", {}),
            "generated_tokens": len(row.tokens),
            "max_new_tokens": req.max_new_tokens,
            **{k: v for k, v in row.info.items() if k != "speculation"},
        }
        if text != raw:
            extra["raw_prediction"] = raw
        if context is not None:
            extra["context"], extra["context_s"] = context, context["context_s"]
        spec = row.info.get("speculation")
        speculation = None
        if spec is not None:
            from ..spec.api import spec_name

            speculation = {
                **spec.as_dict(),
                "spec": spec_name(req.parsed.draft, req.parsed.verifier, req.gamma),
            }
        return Result(
            row.key,
            req,
            text,
            list(row.tokens),
            row.finish or "length",
            info.get("prompt_tokens", len(pending.ctx) + len(pending.q)),
            info["context_tokens"],
            info["kv_bytes_before"],
            info["kv_bytes_after"],
            info["prefill_s"],
            info["compress_s"],
            row.decode_s,
            info.get("recipe", req.parsed.recipe.name),
            extra,
            speculation,
            info.get("reuse"),
            context,
            metrics=info.get("metrics"),
            cache=_cache_of(info.get("stream")),
        )


def _branch_info(branch: Branch) -> dict[str, Any]:
    return {
        "context_tokens": branch.context_tokens,
        "kv_bytes_before": branch.kv_bytes_before,
        "kv_bytes_after": branch.kv_bytes_after,
        "prefill_s": branch.prefill_s,
        "compress_s": branch.compress_s,
        "extra": dict(branch.extra),
        "metrics": branch.metrics,
        "squeeze": branch.squeeze,
        "context": branch.extra.get("context"),
    }


def _cache_of(stream: Any) -> Any:
    return stream.cache if stream is not None else None
