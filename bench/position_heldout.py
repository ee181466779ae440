"""Held-out next-token loss at the recalibration length (512) for the base model and each position variant,
untrained and recalibrated: how far the recalibration got back (the windows ``longlab train`` holds out).

    bench/heavy.sh .venv/bin/python bench/position_heldout.py --out bench/results/position/heldout.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SPECS = [
    "none",
    "drope",
    "drope:weights=runs/position/drope-smollm2",
    "ropeid:train_len=512",
    "ropeid:train_len=512,weights=runs/position/ropeid-smollm2",
    "repo",
    "repo:weights=runs/position/repo-smollm2",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", default="bench/results/position/heldout.json")
    ap.add_argument("--specs", default="", help="comma-separated specs (default: the list above); merged "
                    "into --out, other entries kept")
    args = ap.parse_args()
    from longlab.models import load_model
    from longlab.position.train import heldout_loss, training_windows
    from longlab.recipe import split_recipes

    out = Path(args.out)
    result = {"seq_len": 512, "windows": args.windows, "load": os.getloadavg()[0], "loss": {}}
    if args.specs and out.exists():
        old = json.loads(out.read_text())
        if old.get("windows") == args.windows:
            result["loss"] = old["loss"]
    for spec in split_recipes(args.specs) if args.specs else SPECS:
        weights = spec.split("weights=")[-1] if "weights=" in spec else None
        if weights and not Path(weights).is_dir():
            continue
        model, tok = load_model(
            args.model, attn_implementation="sdpa", position=None if spec == "none" else spec
        )
        held = training_windows(tok, 512, args.windows, seed=1, split="held-out")
        result["loss"][spec] = heldout_loss(model, held)
        print(f"{spec:60s} {result['loss'][spec]:.3f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
