"""longlab vs NVIDIA kvpress on the same samples, methods and ratios: accuracy and wall time.

    make kvpress-venv                      # kvpress in .venv-kvpress (it pins transformers < 5.3)
    python bench/vs_kvpress.py             # or: make vs-kvpress

Both sides run SmolLM2-135M-Instruct from the same local files (the safetensors that
``longlab.load_model("smollm2-135m")`` caches), fp32 on CPU, greedy decoding, query-agnostic
(the context is compressed alone, then the question is asked), the same prompt token ids
(checked), and the same torch thread count. Samples: longlab's generated RULER tasks saved as JSONL.

- **kvpress** runs in its own venv through a subprocess (this file, with ``--kvpress-driver``), with
  its ``"kv-press-text-generation"`` pipeline: one call per (press, sample), each prefilling the
  whole context under the press, then decoding.
- **longlab** runs ``longlab.eval.runner.run_eval`` on the JSONL: one shared prefill per sample,
  branched into every recipe.

Methods and ratios (kvpress defaults mirrored in longlab's parameters): no press / ``full``;
``SnapKVPress`` / ``snapkv:window_size=64`` (kernel 5, avg pooling); ``StreamingLLMPress`` /
``streaming`` (4 sinks); ``TOVAPress`` / ``tova``; ``KnormPress`` / ``knorm``; each at 0.5 and 0.75.
Known differences: kvpress keeps ``int((1-r) n)`` entries, longlab ``ceil((1-r) n)``; kvpress's TOVA
always keeps the last token; longlab compresses once after the last 256-token prefill chunk,
kvpress after one full-context forward.

Writes ``bench/results/vs_kvpress.json`` (hardware header, per-recipe accuracy, predictions, times).
Wall time on a shared machine is noisy: CPU seconds and the load average are recorded too.
This file's top level imports only the standard library (the driver runs in the kvpress venv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (0.5, 0.75)
# longlab method -> (kvpress press class, longlab parameters mirroring the press's defaults)
METHODS: dict[str, tuple[str, str]] = {
    "snapkv": ("SnapKVPress", ":window_size=64"),
    "streaming": ("StreamingLLMPress", ""),
    "tova": ("TOVAPress", ""),
    "knorm": ("KnormPress", ""),
}


def recipes(ratios: tuple[float, ...]) -> list[tuple[str, str | None, float]]:
    """(longlab recipe, kvpress press class or None, ratio) for every cell of the sweep."""
    out: list[tuple[str, str | None, float]] = [("full", None, 0.0)]
    for method, (press, params) in METHODS.items():
        out += [(f"{method}@{r:g}{params}", press, r) for r in ratios]
    return out


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# --------------------------------------------------------------------------------------------------
# the kvpress side (runs inside .venv-kvpress; no longlab import)


def kvpress_driver(args: argparse.Namespace) -> int:
    """Run every (press, ratio) x sample through kvpress's pipeline; write predictions as JSON."""
    import kvpress
    import torch
    import transformers
    from transformers import pipeline

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    samples = [json.loads(line) for line in Path(args.samples_jsonl).read_text().splitlines() if line.strip()]
    cells = json.loads(args.cells)
    t0, c0 = time.perf_counter(), time.process_time()
    pipe = pipeline("kv-press-text-generation", model=args.model_dir, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    rows = []
    t1, c1 = time.perf_counter(), time.process_time()
    for recipe, press_name, ratio in cells:
        press = getattr(kvpress, press_name)(compression_ratio=ratio) if press_name else None
        for s in samples:
            # longlab's prompt is user turn = context + "\n\n" + question: give kvpress the same text
            question = "\n\n" + s["question"]
            start = time.perf_counter()
            answer = pipe(
                s["context"], question=question, answer_prefix=s.get("answer_prefix") or "", press=press,
                max_new_tokens=s["max_new_tokens"],
            )["answer"]
            rows.append({
                "recipe": recipe, "sample_id": s["sample_id"], "prediction": answer.strip(),
                "seconds": time.perf_counter() - start,
            })
            print(f"kvpress {len(rows)}/{len(cells) * len(samples)}: {recipe} {s['sample_id']} "
                  f"{rows[-1]['seconds']:.1f}s", file=sys.stderr, flush=True)
    sweep_s, sweep_cpu = time.perf_counter() - t1, time.process_time() - c1
    # the prompt token ids kvpress used, to check both sides saw the same tokens
    tokens = {}
    for s in samples:
        inputs = pipe.preprocess(s["context"], ["\n\n" + s["question"]], s.get("answer_prefix") or "", 10**9)
        n_q = int(inputs["questions_ids"][0].shape[1])
        tokens[s["sample_id"]] = [int(inputs["context_ids"].shape[1]), n_q]
    result = {
        "rows": rows, "load_s": load_s, "sweep_s": sweep_s, "sweep_cpu_s": sweep_cpu,
        "process_cpu_s": time.process_time() - c0, "prompt_tokens": tokens,
        "versions": {
            "kvpress": _version("kvpress"), "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "attn_implementation": pipe.model.config._attn_implementation,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# --------------------------------------------------------------------------------------------------
# the comparison (runs in longlab's venv)


def fail(message: str) -> int:
    print(f"vs_kvpress: {message}", file=sys.stderr)
    return 2


def run_kvpress(args: argparse.Namespace, jsonl: Path, model_dir: Path, cells: list, tmp: Path) -> dict:
    """Run the kvpress driver in the kvpress venv; its JSON result plus the process wall time."""
    out = tmp / "kvpress.json"
    cmd = [
        str(args.kvpress_python), str(Path(__file__).resolve()), "--kvpress-driver",
        "--samples-jsonl", str(jsonl), "--model-dir", str(model_dir), "--cells", json.dumps(cells),
        "--threads", str(args.threads), "--out", str(out),
    ]
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": "",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # stderr: progress, errors
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the kvpress driver failed (exit {proc.returncode}); its errors are above")
    result = json.loads(out.read_text())
    result["process_wall_s"] = wall
    return result


def run_longlab(args: argparse.Namespace, jsonl: Path, cells: list, tmp: Path, batch_decode: bool) -> dict:
    """Run longlab's runner (prefill once per sample) on the same JSONL and recipes."""
    import torch

    from longlab.eval.runner import EvalConfig, run_eval
    from longlab.eval.store import ResultStore

    torch.set_num_threads(args.threads)
    out = tmp / ("longlab-batched" if batch_decode else "longlab")
    summary = run_eval(EvalConfig(
        out=str(out), model="smollm2-135m", recipes=[c[0] for c in cells], jsonl=str(jsonl),
        chunk_size=args.chunk_size, threads=args.threads, batch_decode=batch_decode, report=False,
        progress=True,
    ), log=lambda msg: None)
    with ResultStore(out) as store:
        rows = store.rows()
    return {
        "rows": [{"recipe": r["recipe"], "sample_id": r["sample_id"], "prediction": r["prediction"],
                  "score": r["score"], "prompt_tokens": [r["context_tokens"], r["extra"]["question_tokens"]],
                  "shared_prefill_s": r["extra"]["shared_prefill_s"]} for r in rows],
        "load_s": summary.load_s, "sweep_s": summary.sweep_s, "sweep_cpu_s": summary.sweep_cpu_s,
        "versions": {"longlab": _version("longlab"), "transformers": _version("transformers"),
                     "torch": torch.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvpress-python", type=Path, default=ROOT / ".venv-kvpress" / "bin" / "python")
    p.add_argument("--tasks", default="niah_single_1,vt")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--chunk-size", type=int, default=128, help="longlab's prefill chunk size")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_kvpress.json")
    p.add_argument("--kvpress-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples-jsonl", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--cells", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kvpress_driver:
        return kvpress_driver(args)

    if not args.kvpress_python.exists():
        return fail(f"no kvpress venv at {args.kvpress_python.parent.parent}: run `make kvpress-venv` first "
                    "(kvpress goes into its own venv: it pins transformers < 5.3)")
    check = subprocess.run([str(args.kvpress_python), "-c", "import kvpress"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ""})
    if check.returncode != 0:
        return fail(f"kvpress does not import in {args.kvpress_python}:\n{check.stderr.strip()[-2000:]}")

    from longlab.models import cache_dir, load_model
    from longlab.tasks import generate, save_jsonl, score

    _, tokenizer = load_model("smollm2-135m")  # also caches the safetensors kvpress loads
    model_dir = cache_dir() / "models" / "smollm2-135m"
    ratios = tuple(float(r) for r in args.ratios.split(","))
    cells = recipes(ratios)
    samples = [s for t in args.tasks.split(",") for s in generate(t, tokenizer, args.length, args.samples, 0)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vs_kvpress-") as tmp_name:
        tmp = Path(tmp_name)
        jsonl = tmp / "samples.jsonl"
        save_jsonl(samples, jsonl)
        print(f"{len(samples)} samples ({args.tasks} at {args.length} tokens) x {len(cells)} recipes, "
              f"{args.threads} thread(s); load average {_load()}", flush=True)
        load_before_kv = _load()
        try:
            kv = run_kvpress(args, jsonl, model_dir, cells, tmp)
        except RuntimeError as err:
            return fail(str(err))
        kv["load_average"] = [load_before_kv, _load()]
        print(f"kvpress: sweep {kv['sweep_s']:.1f}s wall, {kv['sweep_cpu_s']:.1f}s CPU", flush=True)
        sides = {}
        for key, batch_decode in (("longlab", False), ("longlab_batched", True)):
            load_before = _load()
            sides[key] = run_longlab(args, jsonl, cells, tmp, batch_decode)
            sides[key]["load_average"] = [load_before, _load()]
            print(f"{key}: sweep {sides[key]['sweep_s']:.1f}s wall, {sides[key]['sweep_cpu_s']:.1f}s CPU",
                  flush=True)

    answers = {s.sample_id: (s.task, s.answers) for s in samples}
    for row in kv["rows"]:
        task, refs = answers[row["sample_id"]]
        row["score"] = score(task, row["prediction"], refs)
    ll, lb = sides["longlab"], sides["longlab_batched"]
    mismatched = sorted(
        r["sample_id"] for r in ll["rows"] if r["recipe"] == "full"
        and r["prompt_tokens"] != kv["prompt_tokens"][r["sample_id"]]
    )

    def cell(rows: list[dict], recipe: str) -> tuple[float, dict[str, str]]:
        chosen = [r for r in rows if r["recipe"] == recipe]
        return sum(r["score"] for r in chosen), {r["sample_id"]: r["prediction"] for r in chosen}

    table = []
    for recipe, press, ratio in cells:
        (k, kp), (g, gp) = cell(kv["rows"], recipe), cell(ll["rows"], recipe)
        b, bp = cell(lb["rows"], recipe)
        n = len(kp)
        table.append({
            "recipe": recipe, "kvpress_press": press or "none", "ratio": ratio, "n": n,
            "kvpress_correct": k, "longlab_correct": g, "longlab_batched_correct": b,
            "kvpress_acc": 100 * k / max(n, 1), "longlab_acc": 100 * g / max(n, 1),
            "longlab_batched_acc": 100 * b / max(n, 1),
            "same_predictions": sum(kp[i] == gp.get(i) for i in kp),
            "same_predictions_batched": sum(kp[i] == bp.get(i) for i in kp),
        })
    within = all(
        abs(t["kvpress_correct"] - t[f"{key}_correct"]) <= 1
        for t in table for key in ("longlab", "longlab_batched")
    )
    result = {
        "hardware": {
            "cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "threads": args.threads,
        },
        "setup": {"model": "smollm2-135m (fp32, CPU)", "tasks": args.tasks, "length": args.length,
                  "samples_per_task": args.samples, "ratios": list(ratios), "chunk_size": args.chunk_size,
                  "query_aware": False, "prompt_token_mismatches": mismatched},
        "table": table,
        "wall_ratio": kv["sweep_s"] / ll["sweep_s"],
        "cpu_ratio": kv["sweep_cpu_s"] / ll["sweep_cpu_s"],
        "wall_ratio_batched": kv["sweep_s"] / lb["sweep_s"],
        "cpu_ratio_batched": kv["sweep_cpu_s"] / lb["sweep_cpu_s"],
        "accuracy_within_one_sample": within,
    }
    for key, side in (("kvpress", kv), ("longlab", ll), ("longlab_batched", lb)):
        result[key] = {k: v for k, v in side.items() if k != "rows"} | {"predictions": side["rows"]}
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print("\n| recipe | kvpress press | n | kvpress acc | longlab acc | longlab batched acc "
          "| same predictions |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for t in table:
        print(f"| {t['recipe']} | {t['kvpress_press']} | {t['n']} | {t['kvpress_acc']:.1f} "
              f"| {t['longlab_acc']:.1f} | {t['longlab_batched_acc']:.1f} "
              f"| {t['same_predictions']}/{t['n']}, {t['same_predictions_batched']}/{t['n']} |")
    total = sum(t["n"] for t in table)
    accs = {key: 100 * sum(t[f"{key}_correct"] for t in table) / total
            for key in ("kvpress", "longlab", "longlab_batched")}
    print(f"\naccuracy over the sweep: kvpress {accs['kvpress']:.1f}, longlab {accs['longlab']:.1f}, "
          f"longlab --batch-decode {accs['longlab_batched']:.1f} (within one sample per recipe: {within})")
    for key, side in (("longlab", ll), ("longlab --batch-decode", lb)):
        print(f"sweep time, kvpress vs {key}: wall {kv['sweep_s']:.1f}s vs {side['sweep_s']:.1f}s -> "
              f"{kv['sweep_s'] / side['sweep_s']:.2f}x; CPU {kv['sweep_cpu_s']:.1f}s vs "
              f"{side['sweep_cpu_s']:.1f}s -> {kv['sweep_cpu_s'] / side['sweep_cpu_s']:.2f}x")
    print(f"model load: kvpress {kv['load_s']:.1f}s, longlab {ll['load_s']:.1f}s (not in the sweep times); "
          f"load average kvpress {kv['load_average']}, longlab {ll['load_average']}, "
          f"batched {lb['load_average']}")
    if mismatched:
        print(f"warning: prompt token counts differ for {mismatched}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
