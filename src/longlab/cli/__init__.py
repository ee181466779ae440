"""``longlab`` command line: all of its argparse, one module per command.

``generate`` / ``example`` (:mod:`.generate`), ``eval`` (:mod:`.eval`), ``report``, ``methods``, ``store``
(the document KV store), ``calibrate`` (PM-KVQ), ``train`` (IndexMem; DroPE, RoPE-ID, RePo), ``data``
(EntropyLong training data), ``lab`` (the layers lab), ``memory`` (memory systems: HGMem and its
baselines) and ``serve`` (the OpenAI-compatible server). Each module builds its parser and calls library
functions. User errors (bad arguments, unknown names, missing
files) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from ..errors import LonglabError
from .common import read_context_file
from .generate import EXAMPLE_QUESTION, EXAMPLE_RECIPES, example_context

__all__ = ["main", "build_parser", "read_context_file", "EXAMPLE_QUESTION", "EXAMPLE_RECIPES",
           "example_context"]


def build_parser() -> argparse.ArgumentParser:
    from .calibrate import add_calibrate_parser
    from .data import add_data_parser
    from .eval import add_eval_parser
    from .generate import add_example_arguments, add_generate_arguments
    from .methods import add_methods_arguments
    from .report import add_report_arguments
    from .serve import add_serve_arguments
    from .store import add_store_parser
    from .train import add_train_parser

    parser = argparse.ArgumentParser(prog="longlab", description="Long-context inference methods, measured.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_arguments(sub)
    add_store_parser(sub)
    add_methods_arguments(sub)
    add_example_arguments(sub)
    add_eval_parser(sub)
    add_calibrate_parser(sub)
    add_train_parser(sub)
    add_data_parser(sub)  # longlab data entropylong|groundtruth: long-context training data
    from .lab import add_lab_arguments  # longlab.lab: the layers lab (train/eval small LMs on CPU)

    add_lab_arguments(sub.add_parser("lab", help="layers lab: train/test small LMs with swappable mixers"))
    add_report_arguments(sub)
    add_serve_arguments(sub)
    from .memory import add_memory_parser  # longlab memory run|eval: HGMem and its baselines

    add_memory_parser(sub)
    return parser


def _terminate_as_interrupt() -> Any:
    """While a command runs, SIGTERM (a job scheduler's stop, ``kill``, the end of a session) is handled as
    Ctrl-C is: every resumable command (``eval``, ``train lora``, ``data entropylong``, ``memory ...``)
    saves what it finished before exiting (143). Only from the main thread, and only over the default
    handler (one the caller installed is kept); returns the handler to put back, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    return signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    from .eval import expand_config

    parser = build_parser()
    try:
        argv = expand_config(list(sys.argv[1:] if argv is None else argv))  # eval --config FILE
    except LonglabError as exc:
        print(f"longlab: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    previous = _terminate_as_interrupt()
    try:
        return int(args.func(args) or 0)
    except LonglabError as exc:
        print(f"longlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        terminated = bool(exc.args) and exc.args[0] == "SIGTERM"
        print(f"longlab: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:  # `longlab methods | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
