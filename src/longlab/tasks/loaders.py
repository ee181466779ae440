"""Read and write samples in the common format (one JSON object per line), or from a local
Hugging Face dataset (e.g. RULER / LongBench / InfiniteBench as re-hosted for KV-cache work)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..recipe import LonglabError
from .sample import Sample

__all__ = ["load_jsonl", "save_jsonl", "load_hf_dataset"]


def _check_sample(sample: Sample) -> None:
    """What ``Sample.from_dict`` lets through but no run can use: an empty context."""
    if not sample.context.strip():
        raise ValueError("'context' is empty (a sample needs a non-empty context string)")


def load_jsonl(path: str | os.PathLike) -> list[Sample]:
    """Samples from a UTF-8 JSONL file; blank lines are skipped.

    ``answers`` may be a string or a list, ``answer`` is an alias. A malformed line, a missing key, an
    empty ``context`` or bytes that are not UTF-8 raise :class:`~longlab.recipe.LonglabError` (a
    ``ValueError``) naming the file and line number, before any sample is used.
    """
    path = Path(path)
    if path.is_dir():
        raise LonglabError(f"{path} is a directory, not a JSONL file")
    samples: list[Sample] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is fine
            except UnicodeDecodeError as err:
                raise LonglabError(
                    f"{path}:{lineno}: not UTF-8 text (byte {err.start} of the line: {err.reason}); "
                    "JSONL files must be UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise LonglabError(
                    f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno})"
                ) from None
            try:
                sample = Sample.from_dict(data)
                _check_sample(sample)
            except ValueError as err:
                raise LonglabError(f"{path}:{lineno}: {err}") from None
            if not sample.sample_id:
                sample.sample_id = f"{path.stem}-{lineno}"
            samples.append(sample)
    return samples


def save_jsonl(samples: Iterable[Sample], path: str | os.PathLike) -> None:
    """Write samples as JSONL (UTF-8, one ``Sample.to_dict()`` per line); parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.to_dict(), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def load_hf_dataset(path: str | os.PathLike, split: str | None = None) -> list[Sample]:
    """Samples from a LOCAL Hugging Face dataset: a ``save_to_disk`` folder, a folder of data files,
    or a single ``.json/.jsonl/.csv/.parquet/.arrow`` file. Never touches the network.

    ``split`` picks one split of a multi-split dataset (required when there are several). Rows must
    be in the common format; a bad row raises ``ValueError`` naming its index.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(
            "path must be an existing local file or folder (hub ids are not fetched offline), "
            f"got {str(path)!r}"
        )
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "load_hf_dataset needs the 'datasets' package (pip install datasets); "
            "JSONL files can be read without it via load_jsonl"
        ) from err

    if path.is_dir() and any(
        (path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        ds: Any = datasets.load_from_disk(str(path))
    elif path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"path must be a folder or one of {sorted(_FILE_BUILDERS)} files, got {path.name!r}"
            )
        ds = datasets.load_dataset(builder, data_files=str(path))
    else:
        ds = datasets.load_dataset(str(path))

    if isinstance(ds, (datasets.DatasetDict, dict)):
        names = list(ds.keys())
        if split is None:
            if len(names) != 1:
                raise ValueError(f"split must be one of {names} for this multi-split dataset, got None")
            split = names[0]
        if split not in ds:
            raise ValueError(f"split must be one of {names}, got {split!r}")
        ds = ds[split]
    elif split is not None and getattr(ds, "split", None) not in (None, split):
        raise ValueError(f"split must be {str(ds.split)!r} (the dataset's only split), got {split!r}")

    samples = []
    for i, row in enumerate(ds):
        try:
            sample = Sample.from_dict(dict(row))
            _check_sample(sample)
        except ValueError as err:
            raise LonglabError(f"{path} row {i}: {err}") from None
        if not sample.sample_id:
            sample.sample_id = f"{path.stem}-{i}"
        samples.append(sample)
    return samples
