"""Keep the training figures of recalibrated variants (runs/ is not committed): copy each variant's manifest,
without its weights record, into ``bench/results/position/variants.json`` keyed by the position spec the
sweep evaluates it under (``repo:weights=runs/position/repo-smollm2-s80``).

    .venv/bin/python bench/position_variants.py --add runs/position/repo-smollm2-s80

``bench/position_report.py`` makes the *Recalibrated variants* table from this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--add", nargs="+", required=True, help="variant directories written by `longlab train`")
    ap.add_argument("--out", default="bench/results/position/variants.json")
    args = ap.parse_args()
    from longlab.position.variants import read_manifest

    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    for directory in args.add:
        manifest = read_manifest(directory)  # checked: format 2, fields present
        manifest.pop("weights_file", None)
        spec = manifest["position"]
        key = f"{spec}{',' if ':' in spec else ':'}weights={directory}"
        data[key] = manifest
        print(f"{key}: {manifest['steps']} steps x {manifest['batch']} x {manifest['seq_len']} tokens, "
              f"held-out {manifest['heldout_loss_before']:.3f} -> {manifest['heldout_loss_after']:.3f}",
              flush=True)
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
