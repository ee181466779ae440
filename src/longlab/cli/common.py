"""What the subcommands share: reading a user's text files, comma-separated lists for argparse."""

from __future__ import annotations

import argparse
import codecs
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LonglabError, shorten
from ..recipe import split_recipes

__all__ = ["read_context_file", "csv_of", "recipe_list"]


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def read_context_file(name: str, encoding: str = "utf-8", flag: str = "--context-file") -> str:
    """The text of a context file, or a LonglabError saying what is wrong: missing, a directory or a
    device (``/dev/null``), unreadable, empty, binary (NUL characters) or not in ``encoding``
    (UTF-8 by default; a leading BOM is dropped)."""
    path = Path(name)
    try:
        codec = codecs.lookup(encoding).name
    except LookupError:
        raise LonglabError(
            f"--encoding: unknown encoding {shorten(encoding)} (e.g. utf-8, latin-1, cp1252)"
        ) from None
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")
            raise LonglabError(f"{flag}: {path} is {kind}, not a text file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise LonglabError(f"{flag}: no such file: {path}") from None
    except OSError as exc:
        raise LonglabError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig" if codec == "utf-8" else codec)
    except UnicodeDecodeError as err:
        raise LonglabError(
            f"{flag}: {path} is not valid {codec} text (byte {err.start}: {err.reason}); "
            "give the file's encoding with --encoding, e.g. --encoding latin-1"
        ) from None
    except LookupError:  # e.g. rot13: a codec, but not a text encoding
        raise LonglabError(f"--encoding: {shorten(encoding)} is not a text encoding") from None
    if "\x00" in text:
        raise LonglabError(f"{flag}: {path} looks binary (it contains NUL characters); give a text file")
    if not text.strip():
        raise LonglabError(f"{flag}: {path} is empty (context is empty)")
    return text


def csv_of(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def recipe_list(text: str) -> list[str]:
    try:
        recipes = split_recipes(text)
    except LonglabError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not recipes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of recipes")
    return recipes
