"""What defines a ``longlab eval`` sweep: :class:`EvalConfig`, its defaults and its validation.

Validation here needs no model: names, ranges and files are checked before anything is loaded. The
checks that need the model (lengths against its positions and this machine's memory) are made by the
grid driver (:mod:`longlab.eval.driver`) right after loading it, before any sample is generated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LonglabError, check_choice, check_range
from ..recipe import parse_recipe

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_METHODS",
    "DEFAULT_RECIPES",
    "DEFAULT_TASKS",
    "GRID_TASK",
    "HARNESS_VERSION",
    "Cell",
    "EvalConfig",
    "grid_cells",
]

#: The default sweep (``make sweep``): 7 KV methods at two ratios plus the full cache.
DEFAULT_METHODS: tuple[str, ...] = ("streaming", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "knorm")
DEFAULT_RECIPES: tuple[str, ...] = ("full",) + tuple(f"{m}@{r}" for m in DEFAULT_METHODS for r in (0.5, 0.75))
DEFAULT_TASKS: tuple[str, ...] = ("passkey", "niah_single_1", "niah_multikey_1", "vt")
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048)
DEFAULT_CHUNK_SIZE = 128  # prefill chunk; the last one is what compression sees (as in generate)
DEFAULT_SAMPLES = 4
MAX_LENGTH = 1 << 30  # a sanity bound; lengths are checked against the model and memory after it loads
MAX_JSONL_BYTES = 1 << 30
GRID_TASK = "niah_grid"  # the depth x length grid (uses --depths)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
# Bump when a change alters what a row measures (part of the config hash).
# 2: --max-new-tokens caps each sample's limit (min of the two) instead of replacing it.
# 3: the default prompt layout is kvpress's ("chat": question glued to the context, no "\n\n").
HARNESS_VERSION = 3


@dataclass
class EvalConfig:
    """Everything that defines a sweep: samples (generated tasks x lengths, or a JSONL file) crossed with
    the axes — KV ``recipes``, ``reuse`` methods over stored documents, ``speculative`` drafts x ``verify``
    verifiers, ``positions`` — each cell one :class:`~longlab.request.Request` to the engine.
    ``identity()`` is hashed into every row's ``config_hash``. Options left ``None`` take their default;
    one given where it cannot act is refused by :meth:`validate`, naming the option and the reason."""

    out: str
    model: str = "smollm2-135m"
    recipes: list[str] | None = None  # None: "full" with --reuse/--speculative, else DEFAULT_RECIPES
    tasks: list[str] | None = None  # None: DEFAULT_TASKS (generated) or every task of --jsonl
    lengths: list[int] | None = None  # None: DEFAULT_LENGTHS (generated) or every length of --jsonl
    samples: int | None = None  # per task and length (None: DEFAULT_SAMPLES); not with --jsonl
    seed: int = 0
    query_aware: bool = False
    chunk_size: int | None = None  # None: DEFAULT_CHUNK_SIZE
    max_new_tokens: int | None = None  # a cap on each sample's own max_new_tokens (None: no cap)
    limit: int | None = None
    jsonl: str | None = None
    depths: list[float] | None = None  # niah_grid only (None: DEFAULT_DEPTHS)
    backend: str = "serial"
    workers: int | None = None  # ray only (None: 2)
    threads: int | None = None  # torch threads (serial backend); None: torch's default
    batch_decode: bool | None = None  # None: on, off with --speculative (its rows decode alone)
    prefill_metrics: bool = False  # record sparse-prefill density / recall / error per layer and head
    metric_rows: int | None = None  # sampled query rows per chunk for recall and output error (None: 32)
    report: bool = True
    progress: bool = True
    positions: list[str] | None = None  # position methods as an axis, plus the model's own (longlab.position)
    positions_only: bool = False  # exactly the listed positions ("none": own RoPE), not own RoPE besides
    compress: str = "end"  # KV policies cut the cache once after the prefill ("end") or after every chunk
    skip_rows: str | None = None  # a JSON list of rows measured elsewhere: their cells are not run again
    reuse: list[str] | None = None  # reuse methods as an axis (multi-document samples)
    num_docs: int | None = None  # documents per generated multidoc sample (None: 8)
    speculative: list[str] | None = None  # drafts as an axis, next to plain decoding
    verify: list[str] | None = None  # verifiers crossed with the drafts (None: full)
    gamma: int | None = None  # draft tokens per step (None: each draft's own)
    score: str = "decode"  # "decode": the task's metric on the decoded answer; "forced": teacher forcing
    strict: bool = True  # refuse prompts beyond the model's max_position_embeddings (False: warn, run)

    @property
    def model_label(self) -> str:
        """The rows' ``model`` (without a position method; :meth:`label_of` adds it)."""
        return self.model

    @staticmethod
    def label_of(model: str, position: str | None) -> str:
        """The rows' ``model``: the model name, with ``|position`` when a position method is applied."""
        return f"{model}|{position}" if position and position != "none" else model

    @property
    def samples_per_cell(self) -> int:
        return DEFAULT_SAMPLES if self.samples is None else self.samples

    @property
    def chunk(self) -> int:
        return DEFAULT_CHUNK_SIZE if self.chunk_size is None else self.chunk_size

    @property
    def decode_in_batch(self) -> bool:
        return (not self.speculative) if self.batch_decode is None else self.batch_decode

    def validate(self) -> None:
        """Raise :class:`LonglabError` on a bad value, or an option that cannot act in this sweep, before
        any model is loaded."""
        from ..registry import REGISTRY
        from ..tasks import TASKS

        if not isinstance(self.out, (str, Path)) or not str(self.out).strip():
            raise LonglabError(
                "--out is empty: give the results directory (e.g. --out runs/x); it is created if missing"
            )
        if self.recipes is None:
            self.recipes = ["full"] if self.reuse or self.speculative else list(DEFAULT_RECIPES)
        if not self.recipes:
            raise LonglabError("--recipes is empty: name at least one recipe (e.g. full,snapkv@0.5)")
        self.recipes = _canonical("--recipes", self.recipes, lambda s: parse_recipe(s).name)
        for name, value, low, high in (
            ("--samples", self.samples, 1, 100_000), ("--chunk-size", self.chunk_size, 1, 1 << 20),
            ("--limit", self.limit, 1, None), ("--max-new-tokens", self.max_new_tokens, 1, 100_000),
            ("--workers", self.workers, 1, 1024), ("--threads", self.threads, 1, 1024),
            ("--metric-rows", self.metric_rows, 1, 1 << 16), ("--num-docs", self.num_docs, 1, 1000),
            ("--gamma", self.gamma, 1, 1024), ("--seed", self.seed, 0, 2**63 - 1),
        ):
            if value is not None:
                check_range(name, value, low, high, integer=True)
        for length in self.lengths or ():
            check_range("--lengths", length, 1, MAX_LENGTH, integer=True)
        if self.depths is not None and any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise LonglabError(f"--depths must lie in [0, 1], got {self.depths}")
        check_choice("--compress", self.compress, ("end", "chunk"))
        check_choice("--backend", self.backend, ("serial", "ray"))
        check_choice("--score", self.score, ("decode", "forced"))
        _check_model_name(self.model)
        if self.jsonl is None:
            for task in self.tasks or self.default_tasks():
                if task not in TASKS and task != GRID_TASK:
                    valid = ", ".join([*TASKS, GRID_TASK])
                    raise LonglabError(f"unknown task {task!r}; valid tasks: {valid}")
        else:
            _check_jsonl(self.jsonl)
        if self.reuse is not None:
            if not self.reuse:
                raise LonglabError("--reuse is empty: name at least one reuse method (e.g. full-prefill)")
            self.reuse = _canonical("--reuse", self.reuse, lambda s: REGISTRY.parse("reuse", s).spec)
        if self.speculative is not None:
            if not self.speculative:
                raise LonglabError(
                    "--speculative is empty: name at least one draft (lookup, self:KVRECIPE, ...)"
                )
            for spec in self.speculative:
                REGISTRY.parse("draft", spec)
        for spec in self.verify or ():
            REGISTRY.parse("verify", spec)
        if self.positions is not None:
            self.positions = _canonical("--positions", self.positions, lambda s: REGISTRY.format(
                REGISTRY.parse("position", s)))
        self._refuse_idle_options()
        if self.skip_rows is not None:
            self.skipped_cells()  # a missing or malformed file is refused before any model is loaded
        self.cells()  # every axis combination checked (e.g. a recipe that cannot follow a reuse prefill)

    def default_tasks(self) -> tuple[str, ...]:
        return ("multidoc_qa_1",) if self.reuse else DEFAULT_TASKS

    def _refuse_idle_options(self) -> None:
        """Every option acts in this sweep or is refused, naming the option and why."""
        tasks = set(self.tasks or ())
        given_tasks = self.tasks or (self.default_tasks() if self.jsonl is None else ())
        rules = [
            ((self.verify is not None or self.gamma is not None) and not self.speculative,
             "--verify/--gamma: they set speculative decoding; give --speculative DRAFT too"),
            (self.workers is not None and self.backend != "ray", "--workers: only with --backend ray"),
            (self.metric_rows is not None and not self.prefill_metrics,
             "--metric-rows: only with --prefill-metrics"),
            (self.depths is not None and GRID_TASK not in given_tasks,
             f"--depths: only the {GRID_TASK} task places needles at depths; add it to --tasks"),
            (self.samples is not None and self.jsonl is not None,
             "--samples: a --jsonl file gives its own samples (use --limit to take the first N)"),
            (self.num_docs is not None and (self.jsonl is not None or not any(
                t.startswith("multidoc_") for t in given_tasks)),
             "--num-docs: only for the generated multidoc_qa_* tasks (a --jsonl file gives its own "
             "documents)"),
            (bool(self.reuse) and bool(self.speculative), "--speculative does not combine with --reuse yet"),
            (bool(self.reuse) and self.positions is not None,
             "--positions does not combine with --reuse yet (stored document KV has the model's own RoPE)"),
            (bool(self.reuse) and self.query_aware,
             "--query-aware: with --reuse the recipe always compresses the assembled cache query-aware"),
            (bool(self.reuse) and self.compress != "end",
             "--compress chunk: with --reuse the recipe compresses the assembled cache once, at the end"),
            (bool(self.reuse) and self.chunk_size is not None,
             "--chunk-size: a reuse prefill is not chunked (documents are stored whole)"),
            (bool(self.reuse) and self.prefill_metrics,
             "--prefill-metrics: a reuse prefill runs no sparse prefill"),
            (bool(self.speculative) and self.batch_decode is True,
             "--batch-decode: with --speculative every row decodes alone, so its speed compares with plain "
             "decoding's"),
            (bool(self.speculative) and self.score == "forced",
             "--score forced scores by teacher forcing, which does not decode: it cannot time --speculative"),
            (self.positions is not None and self.backend == "ray",
             "--positions runs with --backend serial only"),
            (self.positions_only and self.positions is None,
             "--positions-only: it limits the --positions axis to the methods listed; give --positions too"),
            (bool(tasks) and self.jsonl is None and bool(self.reuse) and not all(
                t.startswith("multidoc_") for t in tasks),
             "--tasks: --reuse needs multi-document tasks (multidoc_qa_1, multidoc_qa_2) or a --jsonl of "
             "{documents, question, answers}"),
        ]
        for bad, message in rules:
            if bad:
                raise LonglabError(message)

    def cells(self) -> list[Cell]:
        """Every cell of a sample: recipes x reuse methods x (plain + drafts x verifiers); checked."""
        return grid_cells(self)

    def skipped_cells(self) -> set[tuple[str, str, str, int, str]]:
        """The ``(model, recipe, task, length, sample_id)`` cells of ``--skip-rows`` that belong to this
        sweep: rows with this ``compress`` (absent: ``"end"``) and ``query_aware`` (absent: false).

        The file is a JSON list of row objects (a committed copy of an earlier store, say: results
        directories are not committed); fields other than these are ignored."""
        import json

        from ..safeio import read_json

        if self.skip_rows is None:
            return set()
        where = f"--skip-rows {self.skip_rows}"
        try:
            rows = read_json(self.skip_rows, "--skip-rows")
        except LonglabError as err:
            message = str(err).replace("no such file", "cannot read it: no such file")
            raise LonglabError(message) from None
        if not isinstance(rows, list):
            raise LonglabError(f"{where}: expected a JSON list of rows, got {json.dumps(rows)[:60]}")
        need = ("model", "recipe", "task", "length", "sample_id")
        cells = set()
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or any(k not in row for k in need):
                raise LonglabError(f"{where}: row {i} is not an object with the fields {', '.join(need)}")
            query_aware, compress = row.get("query_aware", False), row.get("compress", "end")
            if query_aware not in (True, False, 0, 1) or isinstance(query_aware, float):  # not "false"
                got = json.dumps(query_aware)[:40]
                raise LonglabError(f"{where}: row {i}: query_aware must be true or false, got {got}")
            if compress not in ("end", "chunk"):
                raise LonglabError(f"{where}: row {i}: compress must be 'end' or 'chunk', got {compress!r}")
            if compress != self.compress or bool(query_aware) != self.query_aware:
                continue
            length = row["length"]
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise LonglabError(f"{where}: row {i}: length must be an integer >= 0, got {length!r}")
            try:
                recipe = _label(str(row["recipe"]))  # the name the store gives the recipe
            except LonglabError as err:
                raise LonglabError(f"{where}: row {i}: {err}") from None
            cells.add((str(row["model"]), recipe, str(row["task"]), length, str(row["sample_id"])))
        return cells

    def max_new_for(self, sample_limit: int) -> int:
        """Tokens to generate for a sample whose own limit is ``sample_limit``: ``--max-new-tokens``
        caps it (the smaller of the two), it never raises it."""
        return min(sample_limit, self.max_new_tokens) if self.max_new_tokens else sample_limit

    def identity(self, position: str | None = None) -> dict[str, Any]:
        """What changes a row's meaning without being one of the store's key fields (``position``: the
        cell's position method). Keys of options at their defaults are left out, so a sweep that uses
        none of the newer axes hashes as it always did."""
        source: Any = "generated"
        if self.jsonl is not None:
            source = {"jsonl": hashlib.sha256(Path(self.jsonl).read_bytes()).hexdigest()[:16]}
        return {
            "harness": HARNESS_VERSION,
            "chunk_size": self.chunk,
            "max_new_tokens": self.max_new_tokens,
            "source": source,
            "decoding": "greedy",
            "batch_decode": self.decode_in_batch,
            **({"position": position} if position and position != "none" else {}),
            **({"compress": self.compress} if self.compress != "end" else {}),
            **({"score": self.score} if self.score != "decode" else {}),
            **({"reuse": 1, "num_docs": self.num_docs} if self.reuse else {}),
            **({"gamma": self.gamma} if self.speculative else {}),
            **_adapter_identity(self.model),
        }


@dataclass(frozen=True)
class Cell:
    """One cell of a sample: the request's methods and the row's label (its ``recipe`` column).

    Labels: the recipe name (``snapkv@0.5``); with a reuse method other than full prefill, the method
    first (``cacheblend:recompute=0.15+snapkv@0.5``; full prefill + recipe is the recipe's own name, what a
    plain query-aware prefill is called); with speculation, ``<recipe>~<draft>;<verifier>;gamma=G``
    (plain decoding keeps the recipe's name)."""

    label: str
    recipe: str
    reuse: str | None = None
    speculative: str | None = None
    verify: str | None = None

    @property
    def plain_label(self) -> str:
        """The label of the same cell decoded plainly (the reference of a speculative cell)."""
        return self.label.split("~", 1)[0]


def grid_cells(config: EvalConfig) -> list[Cell]:
    """The cells of every sample, checked: each combination builds a valid request."""
    from ..registry import REGISTRY
    from ..request import Request

    cells: list[Cell] = []
    for recipe in config.recipes:
        for reuse in config.reuse or [None]:
            method = REGISTRY.parse("reuse", reuse) if reuse is not None else None
            if method is not None and method.name != "full-prefill":
                label = method.spec + ("" if recipe == "full" else "+" + recipe)
            else:
                label = recipe
            probe = Request(context=None if reuse else "x", documents=["x"] if reuse else None,
                            question="q", recipe=recipe, reuse=reuse)
            try:
                probe.check()
            except LonglabError as exc:
                where = f"--recipes {recipe}" + (f" with --reuse {reuse}" if reuse else "")
                raise LonglabError(f"{where}: {exc}") from None
            cells.append(Cell(label, recipe, reuse))
            for draft in config.speculative or []:
                for verify in config.verify or ["full"]:
                    request = Request(context="x", recipe=recipe, speculative=draft, verify=verify,
                                      gamma=config.gamma)
                    try:
                        request.check()
                    except LonglabError as exc:
                        raise LonglabError(f"--speculative {draft} with --recipes {recipe}: {exc}") from None
                    from ..spec.api import spec_name

                    name = spec_name(request.parsed.draft, request.parsed.verifier, config.gamma)
                    cells.append(Cell(f"{label}~{name}", recipe, None, draft, verify))
    return cells


def _label(label: str) -> str:
    """A row's label as the store writes it: a recipe's canonical name; a speculative cell's
    ``<recipe>~<config>`` and a reuse cell's ``<reuse method>[+<recipe>]`` with their recipe canonical.
    Anything else is refused."""
    from ..registry import REGISTRY

    head, tilde, spec = label.partition("~")
    try:
        return parse_recipe(head).name + tilde + spec
    except LonglabError:
        pass
    reuse, plus, recipe = head.partition("+")
    try:
        method = REGISTRY.parse("reuse", reuse)
        return method.spec + (plus + parse_recipe(recipe).name if plus else "") + tilde + spec
    except LonglabError:
        raise LonglabError(f"{label!r} is not a recipe, reuse or speculative label") from None


def _canonical(flag: str, specs: list[str], name: Any) -> list[str]:
    """Each spec's canonical name (a bad one refused naming ``flag``), duplicates dropped."""
    out: list[str] = []
    for spec in specs:
        try:
            canonical = name(spec)
        except LonglabError as exc:
            raise LonglabError(f"{flag}: {exc}") from None
        if canonical not in out:
            out.append(canonical)
    return out


def _check_jsonl(path: str) -> None:
    """A regular, readable file (not a directory, a FIFO or a device), bounded in size."""
    import stat

    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        raise LonglabError(f"--jsonl: no such file: {path}") from None
    except OSError as exc:
        raise LonglabError(f"--jsonl: cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a pipe or a device)"
        raise LonglabError(f"--jsonl: {path} is {kind}; give a JSONL file")
    if Path(path).stat().st_size > MAX_JSONL_BYTES:
        raise LonglabError(f"--jsonl: {path} is larger than {MAX_JSONL_BYTES // 2**20} MiB")


def _adapter_identity(model: str) -> dict[str, Any]:
    """``{"adapter": SHA-256 (16 hex) of its weights}`` when ``model`` is a LoRA adapter directory
    (:mod:`longlab.adapter`): an adapter retrained into the same directory makes new rows, not skipped ones;
    ``{}`` for any other model, so their identity is unchanged."""
    from ..adapter import adapter_of, read_adapter_manifest

    if adapter_of(model)[1] is None:
        return {}
    record = read_adapter_manifest(model).get("weights_file")
    sha = record.get("sha256") if isinstance(record, dict) else None
    return {"adapter": str(sha)[:16]}


def _check_model_name(name: str) -> None:
    from ..models import MODEL_NAMES

    if name in MODEL_NAMES or name.endswith(".gguf") or Path(name).exists() or "/" in name:
        return  # built-in, a file, a directory or a Hugging Face id (checked when loaded)
    raise LonglabError(
        f"unknown model {name!r}; built-in models: {', '.join(MODEL_NAMES)} "
        "(or give a local directory, a .gguf file or a Hugging Face id)"
    )
