"""The one grid driver: ``run_eval`` runs every sample under every cell of the sweep into a results store.

A cell is one combination of the axes of :class:`~longlab.eval.config.EvalConfig` — a KV recipe, a reuse
method over stored documents, a speculative configuration (next to plain decoding), a position method —
and becomes one :class:`~longlab.request.Request` to the :class:`~longlab.engine.Engine`. The driver
validates the configuration, loads the model once, checks the lengths against the model and this
machine's memory, builds the samples, skips the rows already stored (a killed run resumes where it
stopped) and hands each sample with the cells it still lacks to a
:class:`~longlab.eval.runner.SampleRunner` — in this process (``backend="serial"``) or on Ray workers
(``backend="ray"``, :mod:`longlab.eval.ray_backend`). It is the single writer of the store, one
transaction per row: one row function, one config hash per position, one run key.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LonglabError
from .config import DEFAULT_DEPTHS, DEFAULT_LENGTHS, GRID_TASK, Cell, EvalConfig
from .runner import METRICS_KEY, SampleRunner

__all__ = ["EvalSummary", "build_samples", "check_lengths", "check_samples", "run_eval"]


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


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# samples


def build_samples(config: EvalConfig, tokenizer: Any, warn: Callable[[str], None] | None = None) -> list[Any]:
    """The samples of the grid, task-major then length then index; ``--limit`` keeps the first N.

    A (task, length) cell too short for the task's template is skipped with a warning. Two JSONL
    samples with the same (task, length, sample_id) would be one row of the store: refused, naming them."""
    warn = warn or _stderr
    from ..tasks import generate_samples, niah_grid

    if config.jsonl is not None:
        samples = _load_jsonl(config.jsonl)
        default_task = Path(config.jsonl).stem
        for s in samples:
            s.task = s.task or default_task
        _refuse_duplicate_ids(config.jsonl, samples)
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
        n, depths = config.samples_per_cell, list(config.depths or DEFAULT_DEPTHS)
        for task in config.tasks or config.default_tasks():
            multidoc = config.num_docs and task.startswith("multidoc_")
            options = {"num_docs": config.num_docs} if multidoc else {}
            for length in lengths:
                try:
                    if task == GRID_TASK:
                        samples += niah_grid(tokenizer, [length], depths, n, config.seed)
                    else:
                        samples += generate_samples(task, tokenizer, length, n, config.seed, **options)
                except ValueError as err:  # a length below what the task's template needs
                    too_small.append(f"{task}@{length}")
                    last_error = err
        if too_small:
            warn(f"longlab eval: skipping {', '.join(too_small)}: too short for the task with this tokenizer")
        if not samples:
            raise LonglabError(f"no sample could be generated: {last_error}")
    samples = samples[: config.limit] if config.limit else samples
    if config.reuse:
        flat = [s for s in samples if not s.metadata.get("documents")]
        if flat:
            raise LonglabError(
                "--reuse needs multi-document samples ({documents, question, answers}); "
                f"{flat[0].task} has none: "
                "use --tasks multidoc_qa_1,multidoc_qa_2 or a --jsonl of documents"
            )
    return samples


def check_samples(config: EvalConfig, samples: list[Any], tokenizer: Any, model: Any) -> None:
    """Before any sample runs: each has an answer to score against, and (from a file) its prompt fits
    the model's positions (``--no-strict`` lets a longer one run) and longlab's input bound."""
    from ..request import MAX_CONTEXT_CHARS

    cfg = getattr(model.config, "text_config", None) or model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    for s in samples:
        name = f"sample {s.sample_id or '?'} (task {s.task})"
        if not s.answers or not any(a.strip() for a in s.answers):
            raise LonglabError(f"--jsonl: {name} has no answer to score against ('answers' is empty)")
        if config.jsonl is None:
            continue  # generated to fit --lengths, checked against the model already
        text = s.context + (s.question or "")
        if len(text) > MAX_CONTEXT_CHARS:
            raise LonglabError(f"--jsonl: {name} has {len(text):,} characters, beyond longlab's input limit "
                               f"of {MAX_CONTEXT_CHARS:,}")
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + config.max_new_for(s.max_new_tokens)
        if limit and n > limit and config.strict and not config.positions:
            raise LonglabError(f"--jsonl: {name} needs {n} tokens, beyond {config.model}'s "
                               f"max_position_embeddings={limit} (--no-strict runs it anyway)")


def _load_jsonl(path: str) -> list[Any]:
    """A JSONL file in the common format: ``context`` rows, or ``documents`` rows (multi-document)."""
    import json

    from ..tasks import load_jsonl
    from ..tasks.multidoc import load_multidoc_jsonl

    try:
        with open(path, encoding="utf-8") as fh:
            first = next((line for line in fh if line.strip()), "")
        try:
            documents = isinstance(json.loads(first), dict) and "documents" in json.loads(first)
        except ValueError:
            documents = False
        return load_multidoc_jsonl(path) if documents else load_jsonl(path)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise LonglabError(f"--jsonl: {err}") from None


def _refuse_duplicate_ids(path: str, samples: list[Any]) -> None:
    """A row is keyed by (task, length, sample_id): duplicates would silently share one row."""
    counts = Counter((s.task, s.length, s.sample_id) for s in samples)
    dups = [(key, n) for key, n in counts.items() if n > 1]
    if not dups:
        return
    shown = ", ".join(f"{sid!r} (task {task!r}, {n} times)" for (task, _, sid), n in dups[:5])
    more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
    raise LonglabError(
        f"--jsonl: {path} has duplicate sample_id values: {shown}{more}; every sample of a task and length "
        "must have its own sample_id (or none: then the line number is used)"
    )


# --------------------------------------------------------------------------------------------------
# lengths vs the model and the machine


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_lengths(
    config: EvalConfig, model: Any, warn: Callable[[str], None] | None = None, available: int | None = None
) -> None:
    """Refuse prompt lengths this machine cannot hold, warn about risky ones, before generating samples.

    A length ``L`` needs at least two uncompressed caches (the shared prefix and one fork:
    ``2 L kv_bytes_per_token``) plus the attention workspace of one prefill chunk (about
    ``2 H chunk_size L`` floats): beyond the available memory it is refused with the allowed range.
    Beyond the model's ``max_position_embeddings`` it warns (quality degrades); when the whole sample
    (one branch per recipe, kept for the batched decode) may not fit, it warns too."""
    from ..engine import available_bytes, kv_bytes_per_token

    warn = warn or _stderr
    if config.jsonl is not None and not config.lengths:
        return  # the file's own samples: nothing to generate
    lengths = sorted(set(config.lengths or DEFAULT_LENGTHS))
    cfg = getattr(model.config, "text_config", None) or model.config
    per_token = kv_bytes_per_token(model)
    work_per_token = 2 * cfg.num_attention_heads * config.chunk * 4
    available = available if available is not None else available_bytes(model)
    longest = lengths[-1]
    if available is not None:
        per_len = 2 * per_token + work_per_token
        allowed = max(1, available // per_len)
        if longest > allowed:
            raise LonglabError(
                f"--lengths {longest} cannot be held here: a {longest}-token prompt of {config.model} needs "
                f"about {_gib(longest * per_len)} (two {_gib(longest * per_token)} caches plus the attention "
                f"workspace) and {_gib(available)} is free; allowed range: 1..{allowed} tokens"
            )
        whole = (2 + len(config.cells())) * per_token * longest + work_per_token * longest
        if whole > available:
            warn(
                f"longlab eval: --lengths {longest} with {len(config.cells())} cells may need about "
                f"{_gib(whole)} (one cache per recipe until the batch decodes) and {_gib(available)} is "
                "free: fewer recipes per run or --no-batch-decode need less"
            )
    limit = getattr(cfg, "max_position_embeddings", None)
    beyond = [n for n in lengths if limit and n > limit]
    if beyond:
        message = (
            f"--lengths {','.join(map(str, beyond))} is beyond {config.model}'s "
            f"max_position_embeddings={limit}; quality will degrade"
        )
        if config.strict and not config.positions:
            raise LonglabError(f"{message} (--no-strict runs them anyway; --positions extends the positions)")
        if config.positions:
            message = message.replace("; quality will degrade", ", which --positions extend")
            if not config.positions_only or "none" in config.positions:
                message += " (the model's own RoPE rows run there too, and will degrade)"
        warn(f"longlab eval: {message}")


# --------------------------------------------------------------------------------------------------
# the grid


def run_eval(config: EvalConfig, *, log: Callable[[str], None] | None = None) -> EvalSummary:
    """Run every cell of ``config`` on every sample into ``config.out``; rows already stored are skipped."""
    from ..models import load_model
    from .identity import config_hash, make_run_key
    from .store import ResultStore, check_results_dir

    log = log or (lambda msg: print(msg, flush=True))
    config.validate()
    if config.backend == "ray":
        from .ray_backend import require_ray

        require_ray()  # fail before loading anything
    check_results_dir(config.out)  # checked before the model loads; created once the samples are
    start = time.perf_counter()
    store = writer = None
    try:
        if config.threads and config.backend == "serial":
            import torch

            torch.set_num_threads(config.threads)
        if config.progress:
            _stderr(f"longlab eval: loading {config.model} ...")
        model, tokenizer = load_model(config.model)
        load_s = time.perf_counter() - start
        check_lengths(config, model)
        samples = build_samples(config, tokenizer)
        check_samples(config, samples, tokenizer, model)
        cells = config.cells()
        # position methods first, the model's own RoPE ("none") last; with --positions-only, exactly the list
        positions = [p for p in config.positions or [] if p != "none"]
        if not config.positions_only or "none" in (config.positions or ()):
            positions.append("none")
        hashes = {p: config_hash(config.identity(p)) for p in positions}
        runner = SampleRunner(model, tokenizer, config, hashes, config.backend)
        store = ResultStore(config.out)
        writer = _writer_lock(store.path.parent)  # one run writes a results directory at a time
        done = store.done_keys()
        elsewhere = config.skipped_cells()  # --skip-rows: measured elsewhere
        todo: list[tuple[Any, list[Cell], str]] = []
        skipped = skipped_elsewhere = 0
        for position in positions:
            label = EvalConfig.label_of(config.model, position)
            for s in samples:
                missing = []
                for c in cells:
                    if make_run_key(**runner.identity(s, c, position)) in done:
                        skipped += 1
                    elif (label, c.label, s.task, s.length, str(s.sample_id)) in elsewhere:
                        skipped_elsewhere += 1
                    else:
                        missing.append(c)
                if missing:
                    todo.append((s, missing, position))
        total = len(samples) * len(cells) * len(positions)
        also = f", {skipped_elsewhere} in --skip-rows" if config.skip_rows else ""
        axes = f"{len(cells)} cells" + (f" x {len(positions)} positions" if len(positions) > 1 else "")
        log(
            f"longlab eval: {len(samples)} samples x {axes} = {total} rows "
            f"({skipped} already in {store.path}{also}); model {config.model}, backend {config.backend}"
        )
        skipped += skipped_elsewhere
        progress = _Progress(todo, len(samples) * len(positions), [c.label for c in cells], config.progress)
        written = 0
        sweep_start, cpu_start = time.perf_counter(), time.process_time()

        def write(row: dict[str, Any]) -> None:
            nonlocal written
            metrics = row.pop(METRICS_KEY, None)
            written += store.add(row, metrics=metrics)  # one transaction per row (and its metrics)
            progress.row(row)

        try:
            if config.backend == "ray":
                from .ray_backend import run_ray

                del model, runner  # the workers load their own copies
                run_ray(config, hashes, todo, write)
            else:
                for sample, missing, position in todo:
                    progress.start(sample)
                    for row in runner.run(sample, missing, position):
                        write(row)
        finally:
            progress.close()
        sweep_s, sweep_cpu_s = time.perf_counter() - sweep_start, time.process_time() - cpu_start
    finally:
        if store is not None:
            store.close()
        if writer is not None:
            writer.close()
    summary = EvalSummary(
        Path(config.out), total, skipped, written, time.perf_counter() - start, load_s, sweep_s, sweep_cpu_s
    )
    if config.report:
        from .report import write_report

        if config.progress:
            _stderr("longlab eval: writing the report and plots ...")
        summary.report = write_report(config.out)
    return summary


class _WriterLock:
    """An exclusive lock on a results directory (``.longlab-eval.lock``, an advisory ``flock`` that the
    kernel releases when the process dies): a second ``longlab eval`` on the same ``--out`` is told so
    instead of redoing the first one's rows."""

    NAME = ".longlab-eval.lock"

    def __init__(self, directory: Path) -> None:
        import fcntl
        import os

        self.path = directory / self.NAME
        _check_lock_file(self.path, directory)  # a file of that name that is not a lock is the user's
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self._inode = os.fstat(self._fd).st_ino
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(self._fd)
            raise LonglabError(
                f"--out {directory}: another longlab eval (pid {holder}) is writing these results; wait for "
                "it to finish (a re-run then skips its rows) or give another --out"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def close(self) -> None:
        import os

        if self._fd is not None:
            try:  # remove the lock file only while it is still the one this lock opened
                if os.stat(self.path, follow_symlinks=False).st_ino == self._inode:
                    self.path.unlink()
            except OSError:
                pass
            os.close(self._fd)  # releases the lock
            self._fd = None


def _check_lock_file(path: Path, directory: Path) -> None:
    """An existing ``path`` must be a lock longlab wrote (a regular file holding at most a pid): anything
    else is the user's, and is never truncated or removed."""
    import stat

    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    ours = stat.S_ISREG(st.st_mode) and st.st_size <= 32
    if ours:
        text = path.read_bytes().strip()
        ours = not text or text.isdigit()
    if not ours:
        raise LonglabError(
            f"--out {directory}: {path.name} exists and is not longlab's writer lock; longlab never replaces "
            "it: move it away or choose another --out"
        )


def _writer_lock(directory: Path) -> _WriterLock:
    return _WriterLock(directory)


class _Progress:
    """A tqdm bar over samples (the rows done in its postfix), and when every row of a (task, length)
    cell has arrived, one line with each recipe's mean score on the cell's new rows."""

    def __init__(self, todo: list[tuple[Any, list[Cell], str]], n_samples: int, recipes: list[str],
                 enabled: bool) -> None:
        from tqdm import tqdm

        self.enabled = enabled
        self.recipes = recipes
        self.left: dict[str, int] = defaultdict(int)  # sample key -> rows still to come
        self.cell_left: dict[tuple[str, int], int] = defaultdict(int)
        self.scores: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for sample, missing, position in todo:
            self.left[self._key(sample.task, sample.length, sample.sample_id, position)] += len(missing)
            self.cell_left[(sample.task, sample.length)] += len(missing)
        self.bar = tqdm(
            total=n_samples, initial=n_samples - len(todo), desc="eval", unit="sample", disable=not enabled,
            dynamic_ncols=True, file=sys.stderr, smoothing=0.1,
        )
        self.rows = 0

    @staticmethod
    def _key(task: str, length: int, sample_id: str, position: str) -> str:
        return f"{task}\0{length}\0{sample_id}\0{position}"

    def start(self, sample: Any) -> None:
        self.bar.set_postfix_str(f"{sample.task}@{sample.length} {sample.sample_id}", refresh=True)

    def row(self, row: dict[str, Any]) -> None:
        self.rows += 1
        position = row["model"].partition("|")[2] or "none"
        key = self._key(row["task"], row["length"], row["sample_id"], position)
        self.left[key] -= 1
        if self.left[key] == 0:
            self.bar.update(1)
        cell = (row["task"], row["length"])
        if row.get("score") is not None:
            self.scores[cell][row["recipe"]].append(float(row["score"]))
        self.cell_left[cell] -= 1
        if self.cell_left[cell] == 0 and self.enabled:
            self.bar.write(self._cell_line(cell), file=sys.stderr)

    def _cell_line(self, cell: tuple[str, int]) -> str:
        scores = self.scores.pop(cell, {})
        n = max((len(v) for v in scores.values()), default=0)
        parts = [f"{r} {100 * sum(v) / len(v):.0f}" for r in self.recipes if (v := scores.get(r))]
        return f"  {cell[0]} @ {cell[1]} tokens, {n} new samples, score ×100: " + " | ".join(parts)

    def close(self) -> None:
        self.bar.close()
