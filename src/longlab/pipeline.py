"""Context -> compress -> question -> decode.

``generate(model, tokenizer, context, question, recipe="snapkv@0.5")`` prefills the context in chunks
(KV policies may compress after every chunk so the cache stays within budget while the context
streams in), then appends the question and decodes. Two modes:

- **query-agnostic** (default): the context is compressed alone, then the question is asked — the
  realistic case of a cached context reused for many questions;
- **query-aware**: the question is part of the compressed prompt (the observation window sees it).

Batches of contexts of different lengths are left-padded; padding slots are marked empty in the
cache and never attended to, so each row gives the tokens it would give alone.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import LonglabCache, left_pad
from .compress.api import compress_prompts
from .hook import ATTN_NAME
from .prompt import build_prompt, encode_prompts
from .recipe import LonglabError, LonglabTypeError, Recipe, parse_recipe, shorten

__all__ = ["generate", "GenerationResult", "Stream", "build_prompt", "encode_prompts", "chunk_slices"]

MIN_LAST_CHUNK = 64  # the last chunk must cover observation windows (SnapKV's W = 32)


def chunk_slices(length: int, chunk_size: int) -> list[slice]:
    """Prefill chunks of ``chunk_size`` tokens over ``length``; a tail shorter than ``MIN_LAST_CHUNK``
    joins the chunk before it (so the last chunk, where query-aware scores come from, is never tiny)."""
    bounds = list(range(0, length, chunk_size)) + [length]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < MIN_LAST_CHUNK:
        bounds.pop(-2)  # merge a short tail into the previous chunk
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class Stream:
    """A batch of token streams flowing into one :class:`LonglabCache`.

    Tracks the padding mask of everything written (``[B, n_seen]``) and each row's next RoPE
    position (real tokens seen), so eviction never shifts positions."""

    def __init__(self, model: Any, cache: LonglabCache, batch_size: int) -> None:
        self.model = model
        self.cache = cache
        cache.model_ref = weakref.ref(model)  # for decode policies that re-run layers (RetroAttention)
        self.device = next(model.parameters()).device
        self.seen_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.pad_id = 0

    @property
    def batch_size(self) -> int:
        return self.seen_mask.shape[0]

    def fork(self, recipe: str | Recipe | None = None, *, share: bool = False) -> Stream:
        """An independent copy (cache tensors included), optionally with another recipe.

        ``share``: the copy reads the cache's key/value buffers instead of copying them
        (:meth:`LonglabCache.share`, copy on write), for recipes that never write into held slots in
        place; the harness uses it for branches it batches."""
        if share:
            twin = copy.copy(self)
            twin.cache = self.cache.share(recipe)
            twin.next_pos = self.next_pos.clone()  # feed() adds to it in place
            return twin
        model, self.model = self.model, None
        try:
            twin = copy.deepcopy(self)
        finally:
            self.model = model
        twin.model = model
        if recipe is not None:
            twin.cache.recipe = parse_recipe(recipe)
        return twin

    @torch.inference_mode()
    def feed(self, rows: list[list[int]], chunk_size: int = 1024, compress: str = "chunk") -> torch.Tensor:
        """Append one segment per row (left-padded to a common length); return last logits [B, V].

        compress: ``"chunk"`` (policies act after every chunk), ``"end"`` (after the last chunk only)
        or ``"none"``."""
        if len(rows) != self.batch_size:
            raise LonglabError(f"expected {self.batch_size} rows, got {len(rows)}")
        if any(len(r) == 0 for r in rows):
            raise LonglabError("every row must contribute at least one token to a segment")
        ids, valid = left_pad(rows, self.pad_id)
        T = ids.shape[1]
        ids, valid = ids.to(self.device), valid.to(self.device)
        chunks = chunk_slices(T, chunk_size)
        saved = self.cache.compressing
        logits = None
        try:
            for i, sl in enumerate(chunks):
                self.cache.compressing = compress == "chunk" or (compress == "end" and i == len(chunks) - 1)
                v = valid[:, sl]
                self.seen_mask = torch.cat([self.seen_mask, v], dim=1)
                pos = (self.next_pos[:, None] + v.long().cumsum(-1) - 1).clamp(min=0)
                inputs = {"input_ids": ids[:, sl], "attention_mask": self.seen_mask, "position_ids": pos,
                          "cache": self.cache, "use_cache": True}
                head = _row_blocked_head(self.model, ids.shape[0])
                if head is None:
                    logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
                else:  # the same logits, bitwise, with the LM head in row blocks (faster at a few rows)
                    logits = head(self.model.model(**inputs).last_hidden_state[:, -1].contiguous())
                self.next_pos += v.sum(-1)
        finally:
            self.cache.compressing = saved
        return logits

    @torch.inference_mode()
    def decode(
        self,
        logits: torch.Tensor,
        max_new_tokens: int,
        eos_ids: set[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        *,
        drop_finished: bool = False,
    ) -> list[list[int]]:
        """Greedy (temperature 0) or temperature/top-p sampling; stops per row at an EOS id.

        ``logits``: ``[B, V]`` next-token logits of the stream's rows; returns each row's tokens.
        ``drop_finished``: a row that emitted EOS leaves the batch (``Cache.batch_select_indices``), so
        every later step costs only the rows still running, and each row's tokens are those it gets
        without dropping (sampling still draws for all ``B`` rows, so the random stream is the same).
        Rows are dropped only when every method of the recipe declares ``batch_select_safe``; the
        stream then ends holding only the rows that ran to the last step."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n_rows = self.batch_size
        finished = torch.zeros(n_rows, dtype=torch.bool)
        out: list[list[int]] = [[] for _ in range(n_rows)]
        rows = list(range(n_rows))  # the original row of each row the stream still holds
        drop = drop_finished and all(m.batch_select_safe for m in self.cache.recipe.methods)
        # [B, V], a copy (the caller's logits may be shared); a dropped row keeps its last logits (ignored)
        last = logits.to(device="cpu", dtype=torch.float32, copy=True)
        for step in range(max_new_tokens):
            token = _sample(last, temperature, top_p, gen)  # [B]
            for b in rows:
                if not finished[b]:
                    out[b].append(int(token[b]))
            finished |= torch.tensor([int(t) in eos_ids for t in token])
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if drop and bool(finished[rows].any()):
                keep = [i for i, b in enumerate(rows) if not finished[b]]
                self._select_rows(keep)
                rows = [rows[i] for i in keep]
            logits = self.feed([[int(token[b])] for b in rows], compress="none")  # [len(rows), V]
            last[rows] = logits.float().cpu()
        return out

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only the batch rows ``keep`` (indices into the current rows), cache included."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(idx)
        self.seen_mask = self.seen_mask[idx]  # [B', n_seen]
        self.next_pos = self.next_pos[idx]  # [B']


HEAD_BLOCK = 2048  # LM head rows per block (vocabulary entries)
HEAD_MIN_ROWS = 2  # batch rows from which the blocked LM head is used (measured: slower at 1 row)
_HEAD_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM")  # forward = lm_head(last hidden states), no scaling


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, block: int = HEAD_BLOCK) -> torch.Tensor:
    """``x @ weight.T`` computed over blocks of ``block`` output rows. x: [B, D]; weight: [V, D] -> [B, V].

    Each output entry is the same dot product over D as in ``F.linear``; only the output columns are
    split, which at a few rows (decode steps) streams a large LM head faster on CPU. No gradient.
    Bit-equality with ``F.linear`` depends on the BLAS: at one row some CPUs' gemv path differs in the
    last bit, so the pipeline blocks only from ``HEAD_MIN_ROWS`` rows and checks equality at run time."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    with torch.no_grad():
        for i in range(0, weight.shape[0], block):
            torch.mm(x, weight[i : i + block].t(), out=out[:, i : i + block])
    return out


def _row_blocked_head(model: Any, rows: int) -> Any:
    """A function ``hidden [B, D] -> logits [B, V]`` equal bit for bit to the model's own head at ``rows``
    rows, or None where that is not known: fewer rows than :data:`HEAD_MIN_ROWS`, another model class,
    a head with a bias, not fp32 on CPU, a vocabulary within one block, or forward hooks that the direct
    call would skip. The first call at each row count checks bitwise equality with ``F.linear`` on its
    input and remembers the answer on the head module itself, so it lives and dies with that model
    (BLAS builds may order the sums differently)."""
    if rows < HEAD_MIN_ROWS or type(model).__name__ not in _HEAD_CLASSES or "forward" in vars(model):
        return None
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or not hasattr(model, "model"):
        return None
    w = head.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[0] <= HEAD_BLOCK:
        return None
    if (model._forward_hooks or model._forward_pre_hooks or head._forward_hooks or head._forward_pre_hooks
            or torch.nn.modules.module._global_forward_hooks
            or torch.nn.modules.module._global_forward_pre_hooks):
        return None
    block = HEAD_BLOCK
    exact: dict[tuple, bool] = head.__dict__.setdefault("_longlab_blocked_exact", {})
    key = (*w.shape, rows, block)  # (V, D, rows, block) -> blocked == F.linear, bitwise, for this head

    def apply(x: torch.Tensor) -> torch.Tensor:  # x: [B, D] -> [B, V]
        known = exact.get(key)
        if known is False:
            return torch.nn.functional.linear(x, w)
        out = blocked_linear(x, w, block)
        if known is None:
            exact[key] = torch.equal(out, torch.nn.functional.linear(x, w))
        return out if exact[key] else torch.nn.functional.linear(x, w)

    return apply


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    # logits: [B, V] -> [B]
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[:, 0]


@dataclass
class GenerationResult:
    """Answers and what they cost. Byte counts are for the context's cache (after the question in
    query-aware mode): ``kv_bytes_before`` is what an uncompressed cache holds, ``kv_bytes_after``
    what the LonglabCache holds after compression."""

    texts: list[str]
    token_ids: list[list[int]]
    context_tokens: list[int]
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    decode_s: float
    recipe: str
    cache: LonglabCache | None = field(default=None, repr=False)
    reuse: Any = field(default=None, repr=False)  # longlab.reuse.ReusePrefill when generated from docs=
    speculation: dict | None = field(default=None, repr=False)  # longlab.spec counters (acceptance, ...)
    context: list[dict] | None = field(default=None, repr=False)  # longlab.compress records, one per row

    @property
    def text(self) -> str:
        return self.texts[0]

    def summary(self) -> str:
        n = ",".join(str(t) for t in self.context_tokens)
        return (
            f"[{self.recipe}] context tokens {n} "
            f"| KV {_mib(self.kv_bytes_before)} -> {_mib(self.kv_bytes_after)} "
            f"| prefill {self.prefill_s:.2f}s compress {self.compress_s:.2f}s decode {self.decode_s:.2f}s"
        ) + "".join(  # a context compressor's record (longlab.compress)
            f" | context {c['original_tokens']} -> {c['kept_tokens']} tokens in {c['context_s']:.2f}s"
            for c in self.context or []
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def _as_list(x: Any, n: int, name: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise LonglabError(f"{name} has {len(x)} items but there are {n} contexts")
        return list(x)
    return [x] * n


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _text(value: Any, name: str, allow_none: bool = False) -> str | None:
    """A text argument: ``str``, or ``bytes`` decoded as UTF-8 (strictly); ``None`` where allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise LonglabError(
                f"{name} is bytes that are not valid UTF-8 (byte {err.start}: {err.reason}); "
                "decode it yourself, e.g. data.decode('latin-1')"
            ) from None
    if not isinstance(value, str):
        kinds = "a string, UTF-8 bytes" + (" or None" if allow_none else "")
        raise LonglabTypeError(f"{name} must be {kinds} (or a list of them), got {_type_name(value)}")
    return value


def _texts(value: Any, name: str, allow_none: bool = False) -> list[str | None] | None:
    """One text or a list/tuple of them -> a list (``None`` when ``value`` is a single text)."""
    if isinstance(value, (list, tuple)):
        return [_text(v, f"{name}[{i}]", allow_none) for i, v in enumerate(value)]
    return None


def _per_row(value: Any, n: int, name: str, allow_none: bool = False) -> list:
    """One text for every row, or a list/tuple with one per row (each checked by :func:`_text`)."""
    many = _texts(value, name, allow_none)
    return _as_list(many if many is not None else _text(value, name, allow_none), n, name)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LonglabTypeError(f"{name} must be a number, got {_type_name(value)} {shorten(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise LonglabError(f"{name} must be a finite number, got {shorten(value)}")
    return number


def _flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise LonglabTypeError(f"{name} must be True or False, got {shorten(value)}")


def _check_model(model: Any, tokenizer: Any) -> None:
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise LonglabTypeError(
            f"model must be a transformers causal LM (e.g. from longlab.load_model), got {_type_name(model)}"
        )
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise LonglabTypeError(
            f"tokenizer must be the model's transformers tokenizer (e.g. from longlab.load_model), "
            f"got {_type_name(tokenizer)}"
        )


def _check_attention(model: Any, recipe: Recipe) -> None:
    """A recipe acts only through the longlab attention hook: refuse up front a model that runs another
    attention implementation (the same check :class:`LonglabCache` makes at its second forward)."""
    attn = getattr(model.config, "_attn_implementation", None)
    if not recipe.is_empty and attn != ATTN_NAME:
        raise LonglabError(
            f"recipe {recipe.name!r} needs a model whose attention is 'longlab', but this one runs "
            f"{attn!r}, so the recipe would compress nothing. Load the model with longlab.load_model(...) "
            "(attn_implementation='longlab', the default), or wrap your own model: "
            "`with longlab.use_longlab_attention(model): ...`"
        )


def generate(
    model: Any,
    tokenizer: Any,
    context: str | list[str] | None = None,
    question: str | list[str] | None = None,
    recipe: str | Recipe | None = "snapkv@0.5",
    *,
    docs: list[str] | None = None,
    reuse: Any = None,
    store: Any = None,
    max_new_tokens: int = 32,
    chunk_size: int = 1024,
    query_aware: bool = False,
    compress: str = "chunk",
    answer_prefix: str | list[str] = "",
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    strict: bool = False,
    chat_template: bool = True,
    speculative: Any = None,
    verify: Any = None,
    gamma: int | None = None,
    position: Any = None,
) -> GenerationResult:
    """Answer ``question`` about ``context`` with the KV cache managed by ``recipe``.

    ``context`` is a string or a list of strings (one batch row each); ``bytes`` are accepted and
    decoded as UTF-8, strictly (anything else: decode it yourself). ``question`` and ``answer_prefix``
    are one value for every row or a list with one per row. ``compress="chunk"`` compresses after
    every prefill chunk (bounded memory while the context streams in); ``"end"`` compresses once after
    the whole context. ``chat_template=False`` writes the prompt as plain completion text even when the
    tokenizer has a chat template. ``speculative`` decodes with a draft (``"lookup"``,
    ``"self:streaming:budget=256"``, ``"model:NAME"``; :mod:`longlab.spec`), verified by ``verify``
    (``"full"``, exact; ``"dustin:budget=1024"``, sparse) with ``gamma`` draft tokens per step; the result's
    ``speculation`` holds acceptance and bytes read. ``docs=`` (with ``reuse=``, ``store=``) builds a RAG
    prompt from per-document KV (:mod:`longlab.reuse`); ``recipe`` then compresses the assembled cache once,
    query-aware at the end of the prompt (``query_aware``, ``compress`` and ``chunk_size`` do not apply;
    :mod:`longlab.reuse.compose`). Every argument is checked before the model runs: a
    bad one raises :class:`~longlab.recipe.LonglabError` (a ``TypeError`` too when its type is wrong)
    naming it. ``position`` (``"yarn:factor=4"``; :mod:`longlab.position`) applies a position method for
    this call only."""
    if position is not None:
        args = {k: v for k, v in locals().items() if k != "position"}  # the arguments, as given
        from .position import use_position

        with use_position(model, position):
            return generate(**args)
    _check_model(model, tokenizer)
    if docs is not None or reuse is not None:  # RAG prompt from per-document KV (longlab.reuse)
        if context is not None:
            raise LonglabError("give the prompt as context= or as docs= (with reuse=), not both")
        if docs is None:
            raise LonglabError("reuse= needs docs=: the documents whose stored KV is reused")
        context = "docs"  # placeholder for the shared checks below; longlab.reuse checks the documents
    many = _texts(context, "context")
    contexts = many if many is not None else [_text(context, "context")]
    if not contexts:
        raise LonglabError("context is empty: give at least one context string")
    for i, c in enumerate(contexts):
        if not c.strip():
            where = f" (context[{i}])" if many is not None else ""
            raise LonglabError(f"context is empty{where}: every context must be a non-empty string")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise LonglabError(f"max_new_tokens must be an integer >= 1, got {shorten(max_new_tokens)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LonglabError(f"chunk_size must be an integer >= 1, got {shorten(chunk_size)}")
    if not _number(temperature, "temperature") >= 0:
        raise LonglabError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < _number(top_p, "top_p") <= 1:
        raise LonglabError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise LonglabTypeError(f"seed must be an integer in [0, 2**64 - 1], got {_type_name(seed)}")
    if not 0 <= seed < 2**64:
        raise LonglabError(f"seed must be an integer in [0, 2**64 - 1], got {shorten(seed)}")
    if not isinstance(compress, str) or compress not in ("chunk", "end"):
        raise LonglabError(f"compress must be 'chunk' or 'end', got {shorten(compress)}")
    for flag, value in (("query_aware", query_aware), ("strict", strict), ("chat_template", chat_template)):
        _flag(value, flag)
    spec = None  # speculative decoding (longlab.spec): draft, verifier, gamma, checked before any forward
    if speculative is not None or verify is not None or gamma is not None:
        from .spec.api import prepare

        if docs is not None:
            raise LonglabError("speculative= does not combine with docs= yet")
        spec = prepare(speculative, verify, gamma)
    if docs is not None:
        if parse_recipe(recipe).context is not None:  # longlab.compress acts on a context's ids
            raise LonglabError("a context compressor (e.g. llmlingua@0.5) does not combine with docs= yet")
        return _generate_from_docs(
            model, tokenizer, docs, question, reuse, store, recipe, max_new_tokens, answer_prefix,
            temperature, top_p, seed, chat_template,
        )
    recipe = parse_recipe(recipe)
    _check_attention(model, recipe)
    if spec is not None:
        spec.check_recipe(recipe)
    questions = _per_row(question, len(contexts), "question", allow_none=True)
    prefixes = _per_row(answer_prefix, len(contexts), "answer_prefix")
    ctx_ids, q_ids = encode_prompts(tokenizer, contexts, questions, prefixes, chat_template)
    # a context compressor (longlab.compress) shortens the context ids before prefill
    squeezed = compress_prompts(model, tokenizer, recipe.context, ctx_ids, q_ids, questions)
    ctx_ids = squeezed.ids
    _check_length(model, [len(c) + len(q) + max_new_tokens for c, q in zip(ctx_ids, q_ids)], strict)

    cache = LonglabCache(recipe)
    stream = Stream(model, cache, len(contexts))
    stream.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    has_question = all(q_ids)
    start = time.perf_counter()
    if query_aware and has_question:
        logits = squeezed.feed(stream, [c + q for c, q in zip(ctx_ids, q_ids)], chunk_size, compress)
        prefill_s = time.perf_counter() - start
        before, after = cache.full_nbytes(), cache.nbytes()
    else:
        logits = squeezed.feed(stream, ctx_ids, chunk_size, compress)
        prefill_s = time.perf_counter() - start
        before, after = cache.full_nbytes(), cache.nbytes()
        if has_question:
            logits = stream.feed(q_ids, chunk_size, compress="none")
    compress_s = cache.stats["compress_s"]
    start = time.perf_counter()
    eos = eos_token_ids(model, tokenizer)
    speculation = None
    if spec is not None:
        prompts = [c + q for c, q in zip(ctx_ids, q_ids)]
        tokens, speculation = spec.run(model, tokenizer, stream, logits, prompts, max_new_tokens, eos,
                                       temperature, top_p, seed)
    else:
        tokens = squeezed.decode(stream, logits, max_new_tokens, eos, temperature, top_p, seed)  # guidance
    decode_s = time.perf_counter() - start
    texts = squeezed.postprocess([tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens])
    return GenerationResult(
        texts,
        tokens,
        [len(c) for c in ctx_ids],
        before,
        after,
        prefill_s - compress_s,
        compress_s,
        decode_s,
        recipe.name,
        cache,
        speculation=speculation,
        context=squeezed.records(),
    )


def _generate_from_docs(
    model, tokenizer, docs, question, reuse, store, recipe, max_new_tokens, answer_prefix, temperature, top_p,
    seed, chat_template,
) -> GenerationResult:
    """``generate(docs=..., reuse=...)``: prefill with :func:`longlab.reuse.reuse_prefill`, then decode."""
    from .reuse.api import reuse_prefill

    if isinstance(answer_prefix, (list, tuple)) or isinstance(question, (list, tuple)):
        raise LonglabError("with docs=, question and answer_prefix are single strings (one prompt)")
    pre = reuse_prefill(  # recipe: compresses the assembled cache, query-aware (longlab.reuse.compose)
        model, tokenizer, docs, question, reuse, store=store, answer_prefix=answer_prefix,
        chat_template=chat_template, recipe=recipe,
    )
    stream = Stream(model, pre.cache, 1)
    stream.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream.seen_mask = torch.ones(1, pre.n_positions, dtype=torch.bool, device=stream.device)
    stream.next_pos = torch.full((1,), pre.n_positions, dtype=torch.long, device=stream.device)
    start = time.perf_counter()
    eos = eos_token_ids(model, tokenizer)
    tokens = stream.decode(pre.logits, max_new_tokens, eos, temperature, top_p, seed)
    decode_s = time.perf_counter() - start
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    return GenerationResult(
        texts, tokens, [pre.prompt_tokens], pre.cache.full_nbytes(), pre.cache.nbytes(), pre.ttft_s,
        pre.compress_s, decode_s, f"reuse={pre.method}" + (f"+{pre.recipe}" if pre.recipe != "full" else ""),
        pre.cache, pre,
    )


def _check_length(model: Any, lengths: list[int], strict: bool) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(lengths)
    if limit and longest > limit:
        message = (
            f"prompt + max_new_tokens is {longest} tokens, "
            f"beyond the model's max_position_embeddings={limit}; "
            "quality will degrade"
        )
        if strict:
            raise LonglabError(message)
        warnings.warn(message, stacklevel=3)
