"""``longlab calibrate pmkvq``: PM-KVQ's offline bit allocation (:mod:`longlab.quant.calibrate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import LonglabError
from ..quant.base import FP_DTYPES
from ..quant.calibrate import CLI_FLAGS, calibrate_pmkvq, check_settings, is_allocation_file
from ..safeio import check_output_file, write_file_atomic

__all__ = ["add_calibrate_parser", "add_calibrate_arguments", "calibrate_main"]


def add_calibrate_parser(sub: Any) -> None:
    c = sub.add_parser("calibrate", help="offline calibration (PM-KVQ bit allocation)")
    add_calibrate_arguments(c)
    c.set_defaults(func=calibrate_main)


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``longlab calibrate``: ``pmkvq --model M --budget-mb X [--out FILE] ...``."""
    parser.add_argument("method", choices=["pmkvq"], help="method to calibrate")
    parser.add_argument("--model", default="smollm2-135m", help="model name or path (default: smollm2-135m)")
    parser.add_argument(
        "--budget-mb",
        type=float,
        required=True,
        help="KV memory budget in MiB per sequence, whole cache, at --max-tokens tokens",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="longest context (+ generation) the budget must hold (default 4096)",
    )
    parser.add_argument("--out", default=None, help="allocation JSON to write (default pmkvq-MODEL-XMB.json)")
    parser.add_argument(
        "--bits", default="16,8,4,2", help="widths the integer program may choose (default 16,8,4,2)"
    )
    parser.add_argument("--samples", type=int, default=4, help="calibration samples (default 4)")
    parser.add_argument("--sample-tokens", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument(
        "--target-tokens",
        type=int,
        default=None,
        help="positional interpolation extent E (default --max-tokens): stride E // sample-tokens",
    )
    parser.add_argument("--no-smooth", action="store_true", help="skip the key smoothing search")
    parser.add_argument("--window", type=int, default=128, help="full-precision window (default 128)")
    parser.add_argument("--sink", type=int, default=1, help="full-precision sink entries (default 1)")
    parser.add_argument(
        "--fp-dtype",
        default="16bit",
        choices=list(FP_DTYPES),
        help="dtype of the sink and window the budgets assume (default 16bit, as in the paper)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def calibrate_main(args: argparse.Namespace) -> int:
    """Run ``longlab calibrate pmkvq`` from parsed arguments; write the allocation JSON."""
    from ..models import load_model

    try:
        bits = [int(b) for b in str(args.bits).split(",") if b.strip()]
    except ValueError:
        raise LonglabError(f"--bits must be comma-separated integers, got {args.bits!r}") from None
    check_settings(  # before the model loads: nothing is computed for a file the recipe would refuse
        budget_mb=args.budget_mb, bits_choices=bits, max_tokens=args.max_tokens, num_samples=args.samples,
        sample_tokens=args.sample_tokens, target_tokens=args.target_tokens, smooth_samples=2, sink=args.sink,
        window=args.window, group_size=128, scale_dtype="float16", fp_dtype=args.fp_dtype, seed=args.seed,
        flags=CLI_FLAGS,
    )
    out = Path(args.out or f"pmkvq-{Path(args.model).name}-{args.budget_mb:g}MB.json")
    # before the model loads: a user's file is never overwritten
    check_output_file(out, "--out", owned=is_allocation_file, what="PM-KVQ allocation")
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    if args.sample_tokens > getattr(model.config, "max_position_embeddings", args.sample_tokens):
        raise LonglabError("--sample-tokens exceeds the model's max_position_embeddings")
    alloc = calibrate_pmkvq(
        model,
        tokenizer,
        args.budget_mb,
        bits_choices=bits,
        max_tokens=args.max_tokens,
        num_samples=args.samples,
        sample_tokens=args.sample_tokens,
        target_tokens=args.target_tokens,
        smooth=not args.no_smooth,
        sink=args.sink,
        window=args.window,
        fp_dtype=args.fp_dtype,
        seed=args.seed,
        model_name=args.model,
    )
    write_file_atomic(out, json.dumps(alloc, indent=1), "--out")  # written whole or not at all
    print(f"wrote {out}; use the recipe pmkvq:allocation={out}")
    return 0
