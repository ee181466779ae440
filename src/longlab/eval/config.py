"""What defines a ``longlab eval`` sweep: :class:`EvalConfig`, its defaults and its validation.

Validation here needs no model: names, ranges and files are checked before anything is loaded. The
checks that need the model (lengths against its positions and this machine's memory) are made by the
grid driver (:mod:`longlab.eval.grid`) right after loading it, before any sample is generated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..recipe import LonglabError, parse_recipe

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_METHODS",
    "DEFAULT_RECIPES",
    "DEFAULT_TASKS",
    "GRID_TASK",
    "HARNESS_VERSION",
    "EvalConfig",
]

#: The default sweep (``make sweep``): 7 KV methods at two ratios plus the full cache.
DEFAULT_METHODS: tuple[str, ...] = ("streaming", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "knorm")
DEFAULT_RECIPES: tuple[str, ...] = ("full",) + tuple(f"{m}@{r}" for m in DEFAULT_METHODS for r in (0.5, 0.75))
DEFAULT_TASKS: tuple[str, ...] = ("passkey", "niah_single_1", "niah_multikey_1", "vt")
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048)
DEFAULT_CHUNK_SIZE = 128  # prefill chunk; the last one is what compression sees (as in generate)
GRID_TASK = "niah_grid"  # the depth x length grid (uses --depths)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
# Bump when a change alters what a row measures (part of the config hash).
# 2: --max-new-tokens caps each sample's limit (min of the two) instead of replacing it.
# 3: the default prompt layout is kvpress's ("chat": question glued to the context, no "\n\n").
HARNESS_VERSION = 3


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
    max_new_tokens: int | None = None  # a cap on each sample's own max_new_tokens (None: no cap)
    limit: int | None = None
    jsonl: str | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    backend: str = "serial"
    workers: int = 2
    threads: int | None = None  # torch threads (serial backend); None: torch's default
    batch_decode: bool = True  # decode the recipes of a sample as one batch (see SampleRunner)
    prefill_metrics: bool = False  # record sparse-prefill density / recall / error per layer and head
    metric_rows: int = 32  # sampled query rows per chunk for recall and output error
    report: bool = True
    progress: bool = True
    position: str | None = None  # a position method applied at load (longlab.position); rows name it
    compress: str = "end"  # KV policies cut the cache once after the prefill ("end") or after every chunk
    skip_rows: str | None = None  # a JSON list of rows measured elsewhere: their cells are not run again

    @property
    def model_label(self) -> str:
        """The rows' ``model``: the model name, with ``|position`` when a position method is applied."""
        return f"{self.model}|{self.position}" if self.position else self.model

    def validate(self) -> None:
        """Raise :class:`LonglabError` on a bad value, before any model is loaded."""
        from ..tasks import TASKS

        if not isinstance(self.out, (str, Path)) or not str(self.out).strip():
            raise LonglabError(
                "--out is empty: give the results directory (e.g. --out runs/x); it is created if missing"
            )
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
        if self.compress not in ("end", "chunk"):
            raise LonglabError(f"--compress must be 'end' or 'chunk', got {self.compress!r}")
        if self.backend not in ("serial", "ray"):
            raise LonglabError(f"--backend must be 'serial' or 'ray', got {self.backend!r}")
        _check_model_name(self.model)
        if self.skip_rows is not None:
            self.skipped_cells()  # a missing or malformed file is refused before any model is loaded
        if self.position is not None:
            from ..position import format_position, parse_position

            self.position = None if (m := parse_position(self.position)) is None else format_position(m)
            if self.position and self.backend == "ray":
                raise LonglabError("--positions runs with --backend serial only")

    def skipped_cells(self) -> set[tuple[str, str, str, int, str]]:
        """The ``(model, recipe, task, length, sample_id)`` cells of ``--skip-rows`` that belong to this
        sweep: rows with this ``compress`` (absent: ``"end"``) and ``query_aware`` (absent: false).

        The file is a JSON list of row objects (a committed copy of an earlier store, say: results
        directories are not committed); fields other than these are ignored."""
        import json

        if self.skip_rows is None:
            return set()
        where = f"--skip-rows {self.skip_rows}"
        try:
            rows = json.loads(Path(self.skip_rows).read_text(encoding="utf-8"))
        except OSError as err:
            raise LonglabError(f"{where}: cannot read it ({err.strerror or err})") from None
        except ValueError as err:
            raise LonglabError(f"{where}: not JSON ({err})") from None
        if not isinstance(rows, list):
            raise LonglabError(f"{where}: expected a JSON list of rows, got {json.dumps(rows)[:60]}")
        need = ("model", "recipe", "task", "length", "sample_id")
        cells = set()
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or any(k not in row for k in need):
                raise LonglabError(f"{where}: row {i} is not an object with the fields {', '.join(need)}")
            other_sweep = row.get("compress", "end") != self.compress
            if other_sweep or bool(row.get("query_aware")) != self.query_aware:
                continue
            try:
                recipe = parse_recipe(str(row["recipe"])).name  # the name the store gives the recipe
                length = int(row["length"])
            except (LonglabError, TypeError, ValueError) as err:
                raise LonglabError(f"{where}: row {i}: {err}") from None
            cells.add((str(row["model"]), recipe, str(row["task"]), length, str(row["sample_id"])))
        return cells

    def max_new_for(self, sample_limit: int) -> int:
        """Tokens to generate for a sample whose own limit is ``sample_limit``: ``--max-new-tokens``
        caps it (the smaller of the two), it never raises it."""
        return min(sample_limit, self.max_new_tokens) if self.max_new_tokens else sample_limit

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
            **({"position": self.position} if self.position else {}),
            **({"compress": self.compress} if self.compress != "end" else {}),
        }


def _check_model_name(name: str) -> None:
    from ..models import MODEL_NAMES

    if name in MODEL_NAMES or name.endswith(".gguf") or Path(name).exists() or "/" in name:
        return  # built-in, a file, a directory or a Hugging Face id (checked when loaded)
    raise LonglabError(
        f"unknown model {name!r}; built-in models: {', '.join(MODEL_NAMES)} "
        "(or give a local directory, a .gguf file or a Hugging Face id)"
    )
