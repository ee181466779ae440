"""``longlab eval``: a grid of model x recipe x task x length x sample, prefilled once per sample.

The grid is every (sample, recipe) pair; each pair is one row of the results store. For one sample
the expensive part, the prefill of its context, is shared by every recipe:

1. the prompt is tokenized once (:func:`longlab.pipeline.encode_prompts`);
2. every context token before the *tail* is fed once, uncompressed (``compress="none"``), into a
   :class:`~longlab.pipeline.Stream` whose recipe holds each observing KV policy of the grid
   (``needs_observe``, e.g. H2O's accumulated attention), so their state covers the shared prefix;
3. the tail is fed once too, with ``compress="end"`` (query-aware: tail + question), while a
   :class:`~longlab.hook.ChunkRecorder` keeps what each layer's compression step sees (the last
   chunk's queries and attention output);
4. each recipe gets a fork of that stream (:meth:`Stream.fork`), keeps only the observer state it
   owns, and replays the compression step alone (:func:`~longlab.hook.replay_compression`), then
   feeds the question (query-agnostic) and decodes greedily. A recipe whose KV policy computes
   attention itself while the tail is prefilled (``reads_attention``, e.g. a latent memory) instead
   forks before the tail and feeds it with its own recipe.

The tail is the last prefill chunk of the prompt as :func:`longlab.pipeline.generate` would chunk it
(at least 64 tokens and at least every policy's observation window), so a row equals an independent
``generate(..., compress="end")`` run token for token: same tokens, same chunk boundaries, same
compression point. Rows already in the store are skipped, so a killed run resumes where it stopped.

Recipes whose observers collide (two configurations of one observing class, e.g. two H2O settings
other than the ratio) or that differ in prefill policy or tail start get separate shared prefixes.
With ``prefill_metrics`` (``--prefill-metrics``) a recipe with a sparse prefill policy also records the
density, attention recall and output error of every prefill chunk per layer and head
(:class:`~longlab.sparse.prefill.PrefillMetrics`: the shared prefix's, copied into each branch, plus the
branch's own tail and question); they go to the store's ``metrics`` table under the row's ``run_key``, and
the time spent measuring is left out of ``prefill_s``.
With ``batch_decode`` the branches of a sample whose recipes have no decode-time behaviour are
stacked as batch rows of one cache (padded with empty slots) and ask the question and decode
together: the same computation up to float rounding of batched matmuls, several times cheaper.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..recipe import LonglabError, Method, Recipe, parse_recipe, split_recipes

if TYPE_CHECKING:
    from ..sparse.prefill import PrefillMetrics

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_RECIPES",
    "DEFAULT_TASKS",
    "EvalConfig",
    "SampleRunner",
    "add_eval_arguments",
    "build_samples",
    "main",
    "run_eval",
]

#: The default sweep (``make run``): 8 KV methods at two ratios plus the full cache.
DEFAULT_METHODS: tuple[str, ...] = ("streaming", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "knorm")
DEFAULT_RECIPES: tuple[str, ...] = ("full",) + tuple(f"{m}@{r}" for m in DEFAULT_METHODS for r in (0.5, 0.75))
DEFAULT_TASKS: tuple[str, ...] = ("passkey", "niah_single_1", "niah_multikey_1", "vt")
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048)
DEFAULT_CHUNK_SIZE = 128  # prefill chunk; the last one is what compression sees (as in generate)
GRID_TASK = "niah_grid"  # the depth x length grid (uses --depths)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
HARNESS_VERSION = 1  # bump when a change alters what a row measures (part of the config hash)
METRICS_KEY = "metrics"  # a yielded row's metric items (popped before the row is stored)


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass
class EvalConfig:
    """Everything that defines a sweep. ``identity()`` is hashed into every row's ``config_hash``."""

    out: str
    model: str = "smollm2-135m"
    recipes: list[str] = field(default_factory=lambda: list(DEFAULT_RECIPES))
    tasks: list[str] | None = None  # None: DEFAULT_TASKS (generated) or every task of --jsonl
    lengths: list[int] | None = None  # None: DEFAULT_LENGTHS (generated) or every length of --jsonl
    samples: int = 4
    seed: int = 0
    query_aware: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_new_tokens: int | None = None  # None: each sample's own max_new_tokens
    limit: int | None = None
    jsonl: str | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    backend: str = "serial"
    workers: int = 2
    threads: int | None = None  # torch threads (serial backend); None: torch's default
    batch_decode: bool = False  # decode the recipes of a sample as one batch (see SampleRunner)
    prefill_metrics: bool = False  # record sparse-prefill density / recall / error per layer and head
    metric_rows: int = 32  # sampled query rows per chunk for recall and output error
    report: bool = True
    progress: bool = True

    def validate(self) -> None:
        """Raise :class:`LonglabError` on a bad value, before any model is loaded."""
        from ..tasks import TASKS

        if not self.recipes:
            raise LonglabError("--recipes is empty: name at least one recipe (e.g. full,snapkv@0.5)")
        canonical = []
        for spec in self.recipes:
            name = parse_recipe(spec).name  # raises LonglabError naming the bad method/parameter
            if name not in canonical:
                canonical.append(name)
        self.recipes = canonical
        if self.jsonl is None:
            for task in self.tasks or DEFAULT_TASKS:
                if task not in TASKS and task != GRID_TASK:
                    valid = ", ".join([*TASKS, GRID_TASK])
                    raise LonglabError(f"unknown task {task!r}; valid tasks: {valid}")
        elif not Path(self.jsonl).is_file():
            raise LonglabError(f"--jsonl: no such file: {self.jsonl}")
        for length in self.lengths or ():
            if length <= 0:
                raise LonglabError(f"--lengths must be positive token counts, got {length}")
        for name, value, low in (
            ("--samples", self.samples, 1), ("--chunk-size", self.chunk_size, 1), ("--limit", self.limit, 1),
            ("--max-new-tokens", self.max_new_tokens, 1), ("--workers", self.workers, 1),
            ("--threads", self.threads, 1), ("--metric-rows", self.metric_rows, 1),
        ):
            if value is not None and value < low:
                raise LonglabError(f"{name} must be >= {low}, got {value}")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise LonglabError(f"--depths must lie in [0, 1], got {self.depths}")
        if self.backend not in ("serial", "ray"):
            raise LonglabError(f"--backend must be 'serial' or 'ray', got {self.backend!r}")
        if self.backend == "ray":
            from .ray_backend import require_ray

            require_ray()  # fail before loading anything
        _check_model_name(self.model)

    def identity(self) -> dict[str, Any]:
        """What changes a row's meaning without being one of the store's key fields."""
        source: Any = "generated"
        if self.jsonl is not None:
            source = {"jsonl": hashlib.sha256(Path(self.jsonl).read_bytes()).hexdigest()[:16]}
        return {
            "harness": HARNESS_VERSION,
            "chunk_size": self.chunk_size,
            "max_new_tokens": self.max_new_tokens,
            "source": source,
            "decoding": "greedy",
            "batch_decode": self.batch_decode,
        }


def _check_model_name(name: str) -> None:
    from ..models import MODEL_NAMES

    if name in MODEL_NAMES or name.endswith(".gguf") or Path(name).exists() or "/" in name:
        return  # built-in, a file, a directory or a Hugging Face id (checked when loaded)
    raise LonglabError(
        f"unknown model {name!r}; built-in models: {', '.join(MODEL_NAMES)} "
        "(or give a local directory, a .gguf file or a Hugging Face id)"
    )


# --------------------------------------------------------------------------------------------------
# samples


def build_samples(config: EvalConfig, tokenizer: Any, warn: Callable[[str], None] | None = None) -> list[Any]:
    """The samples of the grid, task-major then length then index; ``--limit`` keeps the first N.

    A (task, length) cell too short for the task's template is skipped with a warning."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    from ..tasks import generate, load_jsonl, niah_grid

    if config.jsonl is not None:
        try:
            samples = load_jsonl(config.jsonl)
        except (OSError, ValueError) as err:
            raise LonglabError(f"--jsonl: {err}") from None
        default_task = Path(config.jsonl).stem
        for s in samples:
            s.task = s.task or default_task
        if config.tasks:
            samples = [s for s in samples if s.task in config.tasks]
        if config.lengths:
            samples = [s for s in samples if s.length in config.lengths]
        if not samples:
            raise LonglabError(f"--jsonl: no sample of {config.jsonl} matches --tasks/--lengths")
    else:
        samples = []
        lengths = list(config.lengths or DEFAULT_LENGTHS)
        too_small: list[str] = []
        for task in config.tasks or DEFAULT_TASKS:
            for length in lengths:
                try:
                    if task == GRID_TASK:
                        samples += niah_grid(tokenizer, [length], config.depths, config.samples, config.seed)
                    else:
                        samples += generate(task, tokenizer, length, config.samples, config.seed)
                except ValueError as err:  # a length below what the task's template needs
                    too_small.append(f"{task}@{length}")
                    last_error = err
        if too_small:
            warn(f"longlab eval: skipping {', '.join(too_small)}: too short for the task with this tokenizer")
        if not samples:
            raise LonglabError(f"no sample could be generated: {last_error}")
    return samples[: config.limit] if config.limit else samples


# --------------------------------------------------------------------------------------------------
# prefill once, branch per recipe


class _Observer:
    """Stands in for an observing KV policy in the shared prefix: runs its ``observe`` and records
    which per-slot state (``layer.extras`` keys) it writes, so each fork keeps only its own."""

    kind = "kv"
    needs_observe = True

    def __init__(self, policy: Method) -> None:
        self.policy = policy
        self.state_keys: set[str] = set()

    def observe(self, ctx: Any) -> None:
        before = dict(ctx.layer.extras)
        self.policy.observe(ctx)
        self.state_keys.update(k for k, v in ctx.layer.extras.items() if before.get(k) is not v)

    def select(self, ctx: Any) -> None:
        return None  # the shared prefix keeps every entry; each branch compresses for itself

    def select_decode(self, ctx: Any) -> None:
        return None


def _observer_key(policy: Method) -> str:
    """Observers that observe alike share one stand-in. Assumption (true of H2O): what a policy
    observes does not depend on its budget, so ``h2o@0.5`` and ``h2o@0.75`` share an observer."""
    fields = {f.name for f in dataclasses.fields(policy)}
    changes = {k: v for k, v in (("compression_ratio", 0.0), ("budget", None)) if k in fields}
    try:
        return repr(dataclasses.replace(policy, **changes))
    except LonglabError:  # the policy requires its budget: key on the exact configuration
        return repr(policy)


def _observers(recipe: Recipe) -> dict[str, Method]:
    return {_observer_key(p): p for p in recipe.kv if getattr(p, "needs_observe", False)}


def _need(recipe: Recipe) -> int:
    """Tokens the compressed (last) chunk must hold: 64, and every policy's observation window."""
    from ..pipeline import MIN_LAST_CHUNK

    windows = [int(getattr(p, "window_size", 0) or 0) for p in recipe.kv]
    return max([MIN_LAST_CHUNK, *windows])


def tail_start(n_ctx: int, n_q: int, chunk_size: int, query_aware: bool, need: int) -> int:
    """Context tokens before the tail: the start of ``generate``'s last prefill chunk, moved earlier
    when that chunk would hold fewer than ``need`` tokens."""
    from ..pipeline import chunk_slices

    total = n_ctx + (n_q if query_aware and n_q else 0)
    start = chunk_slices(total, chunk_size)[-1].start
    # query-agnostic: the tail needs >= 1 context token; query-aware: the question can be the tail
    last_ok = n_ctx if query_aware and n_q else n_ctx - 1
    return max(0, min(start, total - need, last_ok))


@dataclass
class _PrefixGroup:
    """Recipes that branch from one shared prefix: same prefill policy and tail start, and observer
    state that each member would have computed alone.

    A member's fork keeps the state keys its own observers write; that state is right only if the
    group's writers of each such key are exactly the member's (H2O and a streaming H2O both write
    H2O's accumulator: sharing it would double-count). Which keys an observer writes is learnt when
    it first runs (``known``); before that, one configuration per observer class is allowed, and
    :meth:`unsafe` finds the members a collision spoilt, to be rerun from their own prefix."""

    prefill: Method | None
    start: int
    known: dict[str, frozenset[str]]  # observer key -> state keys it writes (shared, learnt)
    observers: dict[str, _Observer] = field(default_factory=dict)
    recipes: list[tuple[str, Recipe]] = field(default_factory=list)

    def _writers(self, members: list[Recipe]) -> dict[str, set[str]]:
        """state key -> observer keys (of ``members``) writing it; needs every key known."""
        out: dict[str, set[str]] = {}
        for recipe in members:
            for key in _observers(recipe):
                for state in self.known[key]:
                    out.setdefault(state, set()).add(key)
        return out

    def _consistent(self, members: list[Recipe]) -> bool:
        group = self._writers(members)
        for recipe in members:
            for state, own in self._writers([recipe]).items():
                if own != group[state]:
                    return False
        return True

    def accepts(self, recipe: Recipe, start: int) -> bool:
        if repr(recipe.prefill) != repr(self.prefill) or start != self.start:
            return False
        members = [r for _, r in self.recipes] + [recipe]
        keys = {k for r in members for k in _observers(r)}
        if all(k in self.known for k in keys):
            return self._consistent(members)
        held = {type(o.policy): k for k, o in self.observers.items()}
        return all(held.get(type(p), k) == k for k, p in _observers(recipe).items())

    def add(self, name: str, recipe: Recipe) -> None:
        for key, policy in _observers(recipe).items():
            self.observers.setdefault(key, _Observer(policy))
        self.recipes.append((name, recipe))

    def learn(self) -> None:
        """After the shared prefill: record which state keys each observer wrote."""
        for key, obs in self.observers.items():
            self.known[key] = frozenset(obs.state_keys) | self.known.get(key, frozenset())

    def unsafe(self) -> set[str]:
        """Members whose observer state the group's other observers changed (empty for one member)."""
        if len(self.recipes) == 1:
            return set()
        group = self._writers([r for _, r in self.recipes])
        return {
            name for name, recipe in self.recipes
            if any(own != group[state] for state, own in self._writers([recipe]).items())
        }

    def owned_state(self, recipe: Recipe) -> set[str]:
        return set().union(*(self.observers[k].state_keys for k in _observers(recipe)))


def recipe_columns(recipe: Recipe) -> tuple[str, float | None]:
    """(method, compression_ratio) of a recipe: its last eviction policy other than ``full``, else
    its quantizer, else its prefill policy; ``full`` is ratio 0, a fixed budget has no ratio."""
    evict = [p for p in recipe.kv if p.kind == "kv" and p.name != "full"]
    if evict:
        p = evict[-1]
        return p.name, (None if p.budget is not None else float(p.compression_ratio))
    quant = [p for p in recipe.kv if p.kind != "kv"]
    if quant:
        return quant[-1].name, None
    if recipe.prefill is not None:
        return recipe.prefill.name, None
    return "full", 0.0


class SampleRunner:
    """Evaluates samples under many recipes with one model, one shared prefill per sample."""

    def __init__(
        self, model: Any, tokenizer: Any, config: EvalConfig, config_hash: str, backend: str = "serial"
    ) -> None:
        from ..pipeline import eos_token_ids

        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.config_hash = config_hash
        self.backend = backend
        self.eos = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._state_keys: dict[str, frozenset[str]] = {}  # observer key -> extras keys it writes

    def identity(self, sample: Any, recipe: str) -> dict[str, Any]:
        """The store's key fields of one grid cell."""
        return {
            "model": self.config.model, "recipe": recipe, "task": sample.task, "length": sample.length,
            "sample_id": sample.sample_id, "query_aware": self.config.query_aware, "seed": self.config.seed,
            "config_hash": self.config_hash,
        }

    def run(self, sample: Any, recipes: Sequence[str]) -> Iterator[dict[str, Any]]:
        """Rows of ``sample`` under each recipe, yielded as each one finishes (as each batch with
        ``batch_decode``)."""
        from ..pipeline import encode_prompts

        chat = sample.metadata.get("prompt", "chat") != "plain"  # completion-style tasks opt out
        prompt = encode_prompts(
            self.tokenizer, [sample.context], [sample.question], [sample.answer_prefix], chat
        )
        (ctx,), (q,) = prompt  # token ids of the context part and of the question part
        pending = list(recipes)
        while pending:
            rerun: list[str] = []
            for group in self._plan(pending, ctx, q):
                yield from self._run_group(sample, group, ctx, q, rerun)
            if rerun == pending:  # cannot happen (a lone recipe is always safe); never loop
                raise RuntimeError(f"prefix sharing failed for {rerun}")
            pending = rerun

    def _plan(self, recipes: Sequence[str], ctx: list[int], q: list[int]) -> list[_PrefixGroup]:
        """Group recipes by shared prefix (first fit)."""
        cfg = self.config
        groups: list[_PrefixGroup] = []
        for name in recipes:
            recipe = parse_recipe(name)
            start = tail_start(len(ctx), len(q), cfg.chunk_size, cfg.query_aware, _need(recipe))
            group = next((g for g in groups if g.accepts(recipe, start)), None)
            if group is None:
                group = _PrefixGroup(recipe.prefill, start, self._state_keys)
                groups.append(group)
            group.add(name, recipe)
        return groups

    def _run_group(
        self, sample: Any, group: _PrefixGroup, ctx: list[int], q: list[int], rerun: list[str]
    ) -> Iterator[dict[str, Any]]:
        """Prefill the group's shared prefix once, then branch, compress and decode every member;
        members spoilt by an observer collision are appended to ``rerun`` instead."""
        from ..cache import LonglabCache
        from ..pipeline import Stream
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        observer = Recipe(prefill=group.prefill, kv=list(group.observers.values()))  # type: ignore[list-item]
        shared = Stream(self.model, LonglabCache(observer), 1)
        shared.pad_id = self.pad_id
        metrics = self._new_metrics(group.prefill)
        t0 = time.perf_counter()
        if group.start > 0:
            with collect_prefill_metrics(metrics):
                shared.feed([ctx[: group.start]], cfg.chunk_size, compress="none")
        shared_s = time.perf_counter() - t0 - (metrics.seconds if metrics is not None else 0.0)
        group.learn()
        spoilt = group.unsafe()
        rerun.extend(name for name, _ in group.recipes if name in spoilt)
        members = [(name, recipe) for name, recipe in group.recipes if name not in spoilt]
        common = {
            "shared_prefill_s": shared_s, "shared_prefill_tokens": group.start,
            "shared_by": len(members), "tail_tokens": len(ctx) - group.start,
            "question_tokens": len(q), "chunk_size": cfg.chunk_size, "backend": self.backend,
        }
        batch: list[_Branch] = []
        direct = [(name, recipe) for name, recipe in members if not _replayable(recipe)]
        replayed = [(name, recipe) for name, recipe in members if _replayable(recipe)]
        # direct members fork before the shared stream takes the tail (a chain consumes them first)
        branches = (self._branch(shared, group, n, r, ctx, q, common, metrics) for n, r in direct)
        if replayed:
            branches = itertools.chain(
                branches, self._replay_branches(shared, group, replayed, ctx, q, common, metrics)
            )
        for branch in branches:
            recipe = branch.recipe
            if cfg.batch_decode and _batchable(recipe):
                batch.append(branch)
                continue
            if not (cfg.query_aware and q) and q:
                measured = branch.metrics.seconds if branch.metrics is not None else 0.0
                t0 = time.perf_counter()
                with collect_prefill_metrics(branch.metrics):
                    branch.logits = branch.stream.feed([q], cfg.chunk_size, compress="none")
                branch.prefill_s += time.perf_counter() - t0
                if branch.metrics is not None:
                    branch.prefill_s -= branch.metrics.seconds - measured
            yield from self._decode(sample, [branch])
        if batch:
            yield from self._decode_batch(sample, batch, q)

    def _replay_branches(
        self, shared: Any, group: _PrefixGroup, members: list[tuple[str, Recipe]], ctx: list[int],
        q: list[int], common: dict[str, Any], shared_metrics: PrefillMetrics | None,
    ) -> Iterator[_Branch]:
        """Feed the tail once into the shared stream, recording what its last chunk's compression step
        sees, then fork per recipe and replay only the compression
        (:func:`longlab.hook.replay_compression`): the same cache as feeding the tail per recipe."""
        from ..hook import ChunkRecorder, replay_compression
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        observers = shared.cache.recipe
        recorder = ChunkRecorder()
        shared.cache.recipe = Recipe(prefill=observers.prefill, kv=[*observers.kv, recorder])
        measured = shared_metrics.seconds if shared_metrics is not None else 0.0
        tail = ctx[group.start:]
        rows = [tail + q] if cfg.query_aware and q else [tail]
        t0 = time.perf_counter()
        try:
            with collect_prefill_metrics(shared_metrics):
                logits = shared.feed(rows, cfg.chunk_size, compress="end")  # [1, V], for every recipe
        finally:
            shared.cache.recipe = observers  # the records stay out of every fork
        tail_s = time.perf_counter() - t0
        if shared_metrics is not None:
            tail_s -= shared_metrics.seconds - measured
        for name, recipe in members:
            stream, fork_s = _fork(shared, group, recipe)
            replay_compression(stream.cache, recorder.records)
            before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
            compress_s = float(stream.cache.stats["compress_s"])
            extra = {**common, "fork_s": fork_s, "shared_tail_s": tail_s, "replayed": True}
            metrics = shared_metrics.copy() if shared_metrics is not None else None
            if metrics is not None:
                extra["metrics_s"] = metrics.seconds
            # prefix and tail were paid once for the group; each row counts them in full
            prefill_s = common["shared_prefill_s"] + tail_s + fork_s
            yield _Branch(
                name, recipe, stream, logits, len(ctx), before, after, prefill_s, compress_s, extra, metrics
            )

    def _new_metrics(self, prefill: Method | None) -> PrefillMetrics | None:
        """A quality collector for a sparse prefill policy when ``prefill_metrics`` is on, else None."""
        from ..sparse.prefill import PrefillMetrics, SparsePrefill

        if not self.config.prefill_metrics or not isinstance(prefill, SparsePrefill):
            return None
        return PrefillMetrics(self.config.metric_rows)

    def _branch(
        self, shared: Any, group: _PrefixGroup, name: str, recipe: Recipe, ctx: list[int], q: list[int],
        common: dict[str, Any], shared_metrics: PrefillMetrics | None = None,
    ) -> _Branch:
        """Fork the shared prefix into ``recipe`` and feed the tail (compressing once, at its end)."""
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        metrics = shared_metrics.copy() if shared_metrics is not None else self._new_metrics(recipe.prefill)
        measured = metrics.seconds if metrics is not None else 0.0
        stream, fork_s = _fork(shared, group, recipe)
        tail = ctx[group.start:]
        t0 = time.perf_counter()
        rows = [tail + q] if cfg.query_aware and q else [tail]
        with collect_prefill_metrics(metrics):
            logits = stream.feed(rows, cfg.chunk_size, compress="end")  # [1, V]
        before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
        tail_s = time.perf_counter() - t0 - (metrics.seconds - measured if metrics is not None else 0.0)
        compress_s = float(stream.cache.stats["compress_s"])
        extra = {**common, "fork_s": fork_s}
        if metrics is not None:
            extra["metrics_s"] = metrics.seconds  # measuring time, not in prefill_s (question added later)
        # the shared prefix counts in full for every row (what this row cost on its own);
        # extra.shared_prefill_s says how much of it was paid once for shared_by rows
        prefill_s = common["shared_prefill_s"] + fork_s + tail_s - compress_s
        return _Branch(
            name, recipe, stream, logits, len(ctx), before, after, prefill_s, compress_s, extra, metrics
        )

    def _decode(self, sample: Any, branches: list[_Branch], stream: Any = None) -> Iterator[dict[str, Any]]:
        """Decode greedily (one stream per branch, or ``stream`` holding them all as batch rows)."""
        import torch

        from ..tasks import score
        from .store import peak_rss_mb, run_key_of

        max_new = self.config.max_new_tokens or sample.max_new_tokens
        if stream is None:
            (branch,) = branches
            stream, logits = branch.stream, branch.logits
        else:
            logits = torch.cat([b.logits for b in branches])  # [B, V]
        t0 = time.perf_counter()
        token_rows = stream.decode(logits, max_new, self.eos)
        decode_s = time.perf_counter() - t0
        for branch, tokens in zip(branches, token_rows):
            prediction = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            method, ratio = recipe_columns(branch.recipe)
            row: dict[str, Any] = {
                **self.identity(sample, branch.name),
                "method": method, "compression_ratio": ratio, "depth": sample.depth,
                "prediction": prediction, "answers": list(sample.answers),
                "score": score(sample.task, prediction, sample.answers),
                "prefill_s": branch.prefill_s, "compress_s": branch.compress_s, "decode_s": decode_s,
                "kv_bytes_before": branch.kv_bytes_before, "kv_bytes_after": branch.kv_bytes_after,
                "peak_rss_mb": peak_rss_mb(), "context_tokens": branch.context_tokens,
                "recipe_repr": "; ".join(repr(m) for m in branch.recipe.methods),
                "extra": {
                    **branch.extra, "generated_tokens": len(tokens), "max_new_tokens": max_new,
                    "decode_batch": len(branches),
                },
            }
            row["run_key"] = run_key_of(row)
            if branch.metrics is not None:
                row["extra"]["metrics_s"] = branch.metrics.seconds
                row[METRICS_KEY] = branch.metrics.items()
            yield row

    def _decode_batch(self, sample: Any, batch: list[_Branch], q: list[int]) -> Iterator[dict[str, Any]]:
        """Stack the branches' caches as batch rows, ask the question once, decode them together.

        Each branch's tokens are computed as in its own stream up to float rounding (batched matmuls,
        padded empty slots); only recipes without decode-time behaviour are batched."""
        from ..cache import LonglabLayer

        cfg = self.config
        plain = [b for b in batch if all(type(x) is LonglabLayer for x in b.stream.cache.layers)]
        for branch in batch:
            if branch not in plain:  # storage of another kind (e.g. converted by a policy): decode alone
                if not (cfg.query_aware and q) and q:
                    branch.logits = branch.stream.feed([q], cfg.chunk_size, compress="none")
                yield from self._decode(sample, [branch])
        if not plain:
            return
        batch = plain
        stream = _stack([b.stream for b in batch])
        for b in batch:
            b.stream = None  # free the per-branch caches
        if not (cfg.query_aware and q) and q:
            t0 = time.perf_counter()
            logits = stream.feed([q] * len(batch), cfg.chunk_size, compress="none")  # [B, V]
            question_s = time.perf_counter() - t0
            for i, b in enumerate(batch):
                b.logits = logits[i : i + 1]
                b.prefill_s += question_s
                b.extra["batched_question_s"] = question_s
        yield from self._decode(sample, batch, stream)


@dataclass
class _Branch:
    """One recipe's fork of a sample's shared prefix, compressed, ready to decode."""

    name: str
    recipe: Recipe
    stream: Any
    logits: Any  # [1, V] next-token logits
    context_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    extra: dict[str, Any]
    metrics: PrefillMetrics | None = None  # sparse-prefill quality (with ``prefill_metrics``)


def _fork(shared: Any, group: _PrefixGroup, recipe: Recipe) -> tuple[Any, float]:
    """A copy of the shared stream under ``recipe`` keeping only the observer state the recipe owns,
    and the seconds the copy took."""
    t0 = time.perf_counter()
    stream = shared.fork(recipe)
    keep = group.owned_state(recipe)
    for layer in stream.cache.layers:
        layer.extras = {k: v for k, v in layer.extras.items() if k in keep}
    return stream, time.perf_counter() - t0


def _replayable(recipe: Recipe) -> bool:
    """Whether the recipe's tail can come from the shared stream, its compression replayed on a fork:
    true unless a KV policy computes attention itself while the tail is prefilled (``reads_attention``)."""
    return not any(getattr(p, "reads_attention", False) for p in recipe.kv)


def _batchable(recipe: Recipe) -> bool:
    """Whether decoding ``recipe`` is plain attention over its cache (no decode policy, no quantized
    storage, no decode-time eviction), so its branch can decode in a batch under the empty recipe.
    A recipe with a prefill policy is not: the batched question would bypass it."""
    from ..kv.base import KVPolicy

    return recipe.decode is None and recipe.prefill is None and all(
        p.kind == "kv"
        and type(p).select_decode is KVPolicy.select_decode
        and not getattr(p, "reads_attention", False)
        for p in recipe.kv
    )


def _stack(streams: list[Any]) -> Any:
    """One stream whose batch rows are ``streams`` (each of batch 1, same tokens seen), under the
    empty recipe. Layers are padded to the longest with empty slots (position -1, never attended)."""
    import copy

    import torch

    from ..cache import LonglabCache
    from ..pipeline import Stream

    cache = LonglabCache(None)
    layers = []
    for per_branch in zip(*(s.cache.layers for s in streams)):
        layer = copy.copy(per_branch[0])
        T = max(x.keys.shape[-2] for x in per_branch)

        def pad(t: torch.Tensor, fill: float, T: int = T) -> torch.Tensor:  # [1, H_kv, T_i, ...] -> T
            extra = T - t.shape[2]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[2] = extra
            return torch.cat([t, t.new_full(shape, fill)], dim=2)

        layer.keys = torch.cat([pad(x.keys, 0.0) for x in per_branch])  # [B, H_kv, T, D]
        layer.values = torch.cat([pad(x.values, 0.0) for x in per_branch])
        layer.index = torch.cat([pad(x.index, -1) for x in per_branch])  # [B, H_kv, T]
        layer.n_real = torch.cat([x.n_real for x in per_branch])  # [B]
        layer.extras = {}
        layers.append(layer)
    cache.layers = layers
    first = streams[0]
    stacked = Stream(first.model, cache, len(streams))
    stacked.pad_id = first.pad_id
    stacked.seen_mask = torch.cat([s.seen_mask for s in streams])  # [B, n_seen]
    stacked.next_pos = torch.cat([s.next_pos for s in streams])  # [B]
    return stacked


# --------------------------------------------------------------------------------------------------
# the grid


@dataclass
class EvalSummary:
    """What a call to :func:`run_eval` did."""

    out: Path
    total: int
    skipped: int
    written: int
    seconds: float
    load_s: float = 0.0  # model load (driver side), included in ``seconds``
    sweep_s: float = 0.0  # the grid itself: wall seconds (included in ``seconds``)
    sweep_cpu_s: float = 0.0  # the grid itself: CPU seconds of this process (serial backend)
    report: dict[str, Path] = field(default_factory=dict)


def run_eval(config: EvalConfig, *, log: Callable[[str], None] | None = None) -> EvalSummary:
    """Run the grid of ``config`` into ``config.out``; rows already stored are skipped."""
    from ..models import load_model
    from .store import ResultStore, config_hash, make_run_key

    log = log or (lambda msg: print(msg, flush=True))
    config.validate()
    start = time.perf_counter()
    if config.threads and config.backend == "serial":
        import torch

        torch.set_num_threads(config.threads)
    model, tokenizer = load_model(config.model)
    load_s = time.perf_counter() - start
    samples = build_samples(config, tokenizer)
    chash = config_hash(config.identity())
    runner = SampleRunner(model, tokenizer, config, chash, config.backend)
    store = ResultStore(config.out)
    try:
        done = store.done_keys()
        todo: list[tuple[Any, list[str]]] = []
        skipped = 0
        for s in samples:
            missing = [r for r in config.recipes if make_run_key(**runner.identity(s, r)) not in done]
            skipped += len(config.recipes) - len(missing)
            if missing:
                todo.append((s, missing))
        total = len(samples) * len(config.recipes)
        log(
            f"longlab eval: {len(samples)} samples x {len(config.recipes)} recipes = {total} rows "
            f"({skipped} already in {store.path}); model {config.model}, backend {config.backend}"
        )
        bar = _progress(total, skipped, config.progress)
        written = 0
        sweep_start, cpu_start = time.perf_counter(), time.process_time()

        def write(row: dict[str, Any]) -> None:
            nonlocal written
            metrics = row.pop(METRICS_KEY, None)
            written += store.add(row, metrics=metrics)  # one transaction per row (and its metrics)
            bar.update(1)

        try:
            if config.backend == "ray":
                from .ray_backend import run_ray

                del model, runner  # the workers load their own copies
                run_ray(config, chash, todo, write)
            else:
                for sample, recipes in todo:
                    for row in runner.run(sample, recipes):
                        write(row)
        finally:
            bar.close()
        sweep_s, sweep_cpu_s = time.perf_counter() - sweep_start, time.process_time() - cpu_start
    finally:
        store.close()
    summary = EvalSummary(
        Path(config.out), total, skipped, written, time.perf_counter() - start, load_s, sweep_s, sweep_cpu_s
    )
    if config.report:
        from .report import write_report

        summary.report = write_report(config.out)
    return summary


def _progress(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, desc="eval", unit="row", disable=not enabled, dynamic_ncols=True,
        file=sys.stderr, smoothing=0.1,
    )


# --------------------------------------------------------------------------------------------------
# command line


def _csv(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def _recipe_list(text: str) -> list[str]:
    try:
        recipes = split_recipes(text)
    except LonglabError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not recipes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of recipes")
    return recipes


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``longlab eval`` options."""
    parser.description = (
        "Evaluate recipes on long-context tasks. Each sample's context is prefilled once and the cache "
        "is branched into every recipe; rows go to DIR/results.sqlite, finished rows are skipped on re-runs."
    )
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, local path or HF id")
    parser.add_argument(
        "--recipes", type=_recipe_list, default=list(DEFAULT_RECIPES),
        help="comma-separated recipes, e.g. full,snapkv@0.5 (default: the 15-recipe default sweep)",
    )
    parser.add_argument(
        "--tasks", type=_csv(str, "task names"), default=None,
        help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)}; {GRID_TASK} uses --depths)",
    )
    parser.add_argument(
        "--lengths", type=_csv(int, "integers"), default=None,
        help=f"comma-separated prompt lengths in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument("--samples", type=int, default=4, help="samples per task and length (default: 4)")
    parser.add_argument("--out", required=True, metavar="DIR", help="results directory")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate only the first N samples")
    parser.add_argument("--seed", type=int, default=0, help="task generation seed (default: 0)")
    parser.add_argument("--query-aware", action="store_true", help="compress with the question in the prompt")
    parser.add_argument("--jsonl", metavar="PATH", help="evaluate a JSONL file in the common format instead")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
        help=f"prefill chunk size in tokens; the last chunk is per recipe (default: {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument("--max-new-tokens", type=int, help="override each sample's max_new_tokens")
    parser.add_argument(
        "--depths", type=_csv(float, "numbers"), default=list(DEFAULT_DEPTHS),
        help="needle depths in [0, 1] for the niah_grid task",
    )
    parser.add_argument("--backend", choices=("serial", "ray"), default="serial")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers, one model each (default: 2)")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; 1 is faster on a busy machine)"
    )
    parser.add_argument(
        "--batch-decode", action="store_true",
        help="decode the recipes of a sample as one batch (faster; as separate runs up to float rounding)",
    )
    parser.add_argument(
        "--prefill-metrics", action="store_true",
        help="sparse prefill policies record density, attention recall and output error vs dense per layer "
             "and head (metrics table; off by default: normal runs pay nothing)",
    )
    parser.add_argument(
        "--metric-rows", type=int, default=32,
        help="query rows sampled per chunk for recall and output error (default: 32)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.md and the plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """``longlab eval`` entry point: run the grid, then print the summary table and plot paths."""
    config = EvalConfig(
        out=args.out, model=args.model, recipes=list(args.recipes), tasks=args.tasks, lengths=args.lengths,
        samples=args.samples, seed=args.seed, query_aware=args.query_aware, chunk_size=args.chunk_size,
        max_new_tokens=args.max_new_tokens, limit=args.limit, jsonl=args.jsonl, depths=list(args.depths),
        backend=args.backend, workers=args.workers, threads=args.threads, batch_decode=args.batch_decode,
        prefill_metrics=args.prefill_metrics, metric_rows=args.metric_rows,
        report=not args.no_report,
        progress=not args.no_progress,
    )
    summary = run_eval(config)
    print(
        f"longlab eval: {summary.written} new rows, {summary.skipped} skipped, {summary.total} in the grid; "
        f"{summary.seconds:.1f}s"
    )
    if summary.report:
        from .report import load_metrics, load_rows, prefill_table, summary_table

        rows = load_rows(config.out)
        print()
        print(summary_table(rows))
        prefill = prefill_table(rows, load_metrics(config.out))
        if prefill:
            print(prefill + "\n")
        for key, path in summary.report.items():
            print(f"{key:>22}: {path}")
    else:
        print(f"results: {Path(config.out) / 'results.sqlite'}")
    return 0
