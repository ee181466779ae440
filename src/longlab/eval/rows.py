"""Result rows for the report: read them from a results directory, pick one per (sample, recipe), and
group their scores into table cells and paired samples.

A *sample* is identified by (model, task, length, sample_id, query_aware, seed); the store's
``run_key`` adds the recipe and the config hash. Rows of the same sample and recipe under several
config hashes (a re-run with other settings into the same directory) are counted once by default,
the newest (``created_at``, then insertion order) kept: :func:`one_per_sample`.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..recipe import LonglabError
from .store import DB_NAME, ResultStore

__all__ = [
    "FULL",
    "SAMPLE_FIELDS",
    "Selection",
    "family_of",
    "load_metrics",
    "load_rows",
    "method_of",
    "one_per_sample",
    "ratio_of",
    "recipe_order",
    "sample_key",
]

FULL = "full"

Row = Mapping[str, Any]

#: Fields that identify one evaluated sample (one prompt) regardless of the recipe.
SAMPLE_FIELDS: tuple[str, ...] = ("model", "task", "length", "sample_id", "query_aware", "seed")


# --------------------------------------------------------------------------------------------------
# recipe names


def method_of(recipe_name: str) -> str:
    """Method of a recipe name, for rows that lack ``method``.

    The last ``+``-part that carries ``@ratio`` decides (``prism+snapkv@0.5+kivi2`` -> ``snapkv``);
    without one, the last part with ``:params`` (``streaming:budget=512`` -> ``streaming``), else
    the last part (``full`` -> ``full``).
    """
    parts = [p.strip() for p in str(recipe_name).split("+") if p.strip()]
    if not parts:
        return str(recipe_name)
    for marker in ("@", ":"):
        tagged = [p for p in parts if marker in p]
        if tagged:
            return re.split(r"[@:]", tagged[-1], maxsplit=1)[0]
    return parts[-1]


def ratio_of(recipe_name: str) -> float | None:
    """Compression ratio written in a recipe name (last ``@x``), or ``None``."""
    found = re.findall(r"@([0-9]*\.?[0-9]+)", str(recipe_name))
    return float(found[-1]) if found else None


def family_of(recipe_name: str) -> str:
    """Recipe name with ratios and parameters removed: the line a recipe belongs to in a ratio plot.

    ``snapkv@0.5`` -> ``snapkv``; ``prism+snapkv@0.75+kivi2`` -> ``prism+snapkv+kivi2``;
    ``streaming:budget=512`` -> ``streaming``.
    """
    parts = [re.split(r"[@:]", p.strip(), maxsplit=1)[0] for p in str(recipe_name).split("+")]
    return "+".join(p for p in parts if p) or str(recipe_name)


def row_ratio(row: Row) -> float | None:
    """The row's compression ratio (column, else the one written in its recipe name)."""
    value = row.get("compression_ratio")
    if value is None:
        return ratio_of(str(row.get("recipe")))
    return float(value)


def is_full(recipe: str) -> bool:
    return recipe == FULL


def recipe_order(rows: Iterable[Row]) -> list[str]:
    """Recipes sorted: ``full`` first, then by family, compression ratio and name."""
    info: dict[str, tuple[Any, ...]] = {}
    for r in rows:
        name = str(r.get("recipe"))
        if name not in info:
            ratio = row_ratio(r)
            info[name] = (not is_full(name), family_of(name), ratio is None, ratio or 0.0, name)
    return sorted(info, key=lambda n: info[n])


def sort_key(value: Any) -> tuple[bool, Any]:
    """Sort key that puts ``None`` last."""
    return (value is None, value if value is not None else 0)


def str_sort_key(value: Any) -> tuple[bool, Any]:
    return sort_key(None if value is None else str(value))


# --------------------------------------------------------------------------------------------------
# numbers


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are not ``None``/NaN (``None`` when there are none)."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def scored(rows: Iterable[Row]) -> list[Row]:
    """Rows that have a score."""
    return [r for r in rows if r.get("score") is not None]


# --------------------------------------------------------------------------------------------------
# one row per (sample, recipe)


def sample_key(row: Row, *, with_config: bool = False) -> tuple[Any, ...]:
    """The sample a row was evaluated on (:data:`SAMPLE_FIELDS`, plus ``config_hash`` when asked)."""
    key = tuple(None if row.get(f) is None else str(row.get(f)) for f in SAMPLE_FIELDS)
    return key + (row.get("config_hash"),) if with_config else key


@dataclass
class Selection:
    """Rows chosen for a report: ``rows`` counted; ``dropped`` older rows of the same (sample, recipe)
    under other config hashes that were left out; ``configs`` distinct config hashes in all rows."""

    rows: list[dict[str, Any]]
    dropped: int
    duplicated: int  # (sample, recipe) pairs stored more than once
    configs: int
    all_configs: bool

    def note(self) -> str:
        """One line saying what was left out (or counted twice); empty when every pair is stored once."""
        if not self.duplicated:
            return ""
        if self.all_configs:
            return (
                f"Note: {self.duplicated} (sample, recipe) pairs are stored under several config hashes "
                f"({self.configs} hashes in all) and every row is counted (--all-configs)."
            )
        return (
            f"Note: {self.dropped} older rows of {self.duplicated} (sample, recipe) pairs stored under "
            f"other config hashes ({self.configs} hashes in all) are not counted: each (sample, recipe) "
            "counts once, newest first; `longlab report --all-configs` counts every row."
        )


def _age(row: Row, position: int) -> tuple[str, int, int]:
    return (str(row.get("created_at") or ""), int(row.get("id") or 0), position)


def one_per_sample(rows: Sequence[Row], *, all_configs: bool = False) -> Selection:
    """Keep one row per (sample, recipe): the newest (``created_at``, then ``id``); order is kept.

    With ``all_configs`` every row is kept (only counted for :meth:`Selection.note`)."""
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(str(r.get("recipe")), *sample_key(r))].append(i)
    configs = len({r.get("config_hash") for r in rows})
    duplicated = sum(1 for idx in groups.values() if len(idx) > 1)
    if all_configs:
        return Selection([dict(r) for r in rows], 0, duplicated, configs, True)
    keep = {max(idx, key=lambda i: _age(rows[i], i)) for idx in groups.values()}
    kept = [dict(r) for i, r in enumerate(rows) if i in keep]
    return Selection(kept, len(rows) - len(kept), duplicated, configs, False)


# --------------------------------------------------------------------------------------------------
# reading a results directory


def _db_path(out_dir: str | os.PathLike[str], what: str) -> Path | None:
    """``DIR/results.sqlite`` (or its compressed ``results.sqlite.gz``, which the store reads from a
    private copy), or ``None`` when neither exists; a LonglabError when DIR is not a directory or the
    database path is not a file."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LonglabError(f"{what}: {out} is a file, not a results directory")
    path = out / DB_NAME
    if not path.exists() and Path(f"{path}.gz").is_file():
        path = Path(f"{path}.gz")
    if not path.exists():
        return None
    if not path.is_file():
        raise LonglabError(f"{what}: {path} is not a file (a directory?), so it is not a results database")
    return path


def load_rows(out_dir: str | os.PathLike[str], *, what: str = "results directory") -> list[dict[str, Any]]:
    """Rows of ``DIR/results.sqlite``, opened read-only (empty list when it does not exist or is an
    empty file; nothing is created). A corrupt database raises a LonglabError naming ``what``."""
    path = _db_path(out_dir, what)
    if path is None or path.stat().st_size == 0:
        return []
    with ResultStore(out_dir, readonly=True, what=what) as store:
        return store.rows()


def load_metrics(
    out_dir: str | os.PathLike[str], *, what: str = "results directory"
) -> dict[str, dict[str, float]]:
    """Whole-model metrics (``layer = head = -1``) of ``DIR/results.sqlite``: run_key -> {name: value}."""
    path = _db_path(out_dir, what)
    if path is None or path.stat().st_size == 0:
        return {}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    with ResultStore(out_dir, readonly=True, what=what) as store:
        for m in store.metrics(layer=-1, head=-1):
            if m["value"] is not None:
                out[m["run_key"]][m["name"]] = float(m["value"])
    return dict(out)


# --------------------------------------------------------------------------------------------------
# grouping scores


def scores_by(rows: Iterable[Row], *fields: str) -> dict[tuple[Any, ...], list[float]]:
    """Scores grouped by the values of ``fields`` (rows without a score are left out)."""
    out: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for r in scored(rows):
        out[tuple(str(r.get(f)) if f == "recipe" else r.get(f) for f in fields)].append(float(r["score"]))
    return out


def paired_scores(
    rows: Iterable[Row], recipe: str, baseline: str, *, with_config: bool = False
) -> tuple[list[float], list[float]]:
    """Scores of ``recipe`` and ``baseline`` on the samples both were scored on, in the same order."""
    by_sample: dict[str, dict[tuple[Any, ...], float]] = {recipe: {}, baseline: {}}
    for r in scored(rows):
        name = str(r.get("recipe"))
        if name in by_sample:
            by_sample[name][sample_key(r, with_config=with_config)] = float(r["score"])
    common = [k for k in by_sample[recipe] if k in by_sample[baseline]]
    return [by_sample[recipe][k] for k in common], [by_sample[baseline][k] for k in common]
