"""longlab against NVIDIA kvpress: the side-by-side sweep, unseen cases, prompt-layout ablations, and the
harness's batched branches old against new.

Subcommands (``python bench/vs_kvpress.py SUB --help`` for each one's options):

- ``run``: longlab vs NVIDIA kvpress on the same samples, methods and ratios: accuracy with paired 95% CIs,
  wall time.
- ``cases``: Unseen long-context cases in the common JSONL format, for comparing longlab's default path with
  kvpress's.
- ``layout``: Which part of the prompt protocol makes longlab and kvpress answer differently: per-factor
  ablations.
- ``batched-branches``: The harness's batched branches, old way against new, side by side on one sample
  (SmolLM2, one thread).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import hardware, interleaved, run_subcommand, write_json

# ---- run (was bench/vs_kvpress.py run) ----------------------------------------

DOC_RUN = """
longlab vs NVIDIA kvpress on the same samples, methods and ratios: accuracy with paired 95% CIs, wall time.

    make kvpress-venv                      # kvpress in .venv-kvpress (it pins an older transformers)
    python bench/vs_kvpress.py run --samples 2 # or: make vs-kvpress (VS_KVPRESS_ARGS="--samples 18")

Both sides run SmolLM2-135M-Instruct from the same local files (the safetensors that
``longlab.load_model("smollm2-135m")`` caches), fp32 on CPU, greedy decoding, query-agnostic (the
context is compressed alone, then the question is asked), the same prompt token ids (checked id for
id, every sample) and the same torch thread count. Samples: longlab's generated RULER tasks saved as
JSONL; ``--samples`` counts samples per (task, length), so each recipe is scored on
``len(tasks) x len(lengths) x samples`` samples; or any common-format file with ``--jsonl`` (e.g. the
unseen cases of ``bench/vs_kvpress.py cases``), scored with each row's metric.

- **kvpress** runs in its own venv through a subprocess (this file, with ``--kvpress-driver``), with
  its ``"kv-press-text-generation"`` pipeline: one call per (press, sample), each prefilling the
  whole context in one forward under the press (compression once, after the full context), then
  feeding the question and decoding greedily.
- **longlab** runs ``longlab eval``'s grid driver (``run_eval``) on the JSONL: one shared prefill per
  sample, compression replayed per recipe on a fork, the recipes' answers decoded as one batch
  (``--longlab-modes`` adds the unbatched path, ``plain``, and ``chunked``: ``longlab.generate`` with
  ``compress="chunk"``, compressing after every ``--chunk-size`` prefill chunk).

The prompt layout (``--kvpress-question``): ``raw`` (the default) hands kvpress's pipeline the bare
question and the row's ``answer_prefix`` verbatim (as kvpress's own ``evaluation/evaluate.py`` does),
its default layout (user turn = context + question, the
prefix after the assistant header), and longlab runs its default layout ``"chat"``, which is that
layout (``longlab.prompt``); ``longlab`` hands kvpress ``question="\\n\\n" + question`` and longlab runs
``"chat-sep"``, longlab's former default (user turn = context + ``"\\n\\n"`` + question). Either way
both sides see the same ids (checked). Each sample's own ``max_new_tokens`` is used on both sides
(``--max-new-tokens`` caps both). Tasks with a plain-completion prompt (``passkey``) are refused:
kvpress's pipeline always applies the chat template, so the ids could not match.

Methods and ratios (kvpress defaults mirrored in longlab's parameters): no press / ``full``;
``SnapKVPress`` / ``snapkv:window_size=64`` (kernel 5, avg pooling); ``StreamingLLMPress`` /
``streaming`` (4 sinks); ``TOVAPress`` / ``tova``; ``KnormPress`` / ``knorm``; each at 0.5 and 0.75.
Known differences: kvpress keeps ``int((1-r) n)`` entries, longlab ``ceil((1-r) n)``; kvpress's
TOVA always keeps the last token. ``--chunk-size`` is longlab's prefill chunk (default 4096: one
forward over these contexts, as kvpress does; the compression step sees the whole context either
way).

Statistics per recipe: the score's mean with a 95% interval on each side (Wilson when every score is
0/1, else a percentile bootstrap) and the paired bootstrap of longlab - kvpress over the same samples
(``longlab.eval.stats``); "equal accuracy" means that interval contains 0 for every recipe. Wall time:
the sides are interleaved by (task, length) block -- kvpress on a block's samples, then longlab on the
same samples, then the next block -- so a load that drifts during the run weighs on both alike; each
side's sweep time is its sum over blocks (model loads excluded), with CPU seconds and the load average
before/after every block, since wall time on a shared machine is noisy.

``--blocks`` runs only some blocks and ``--sample-part I/K`` only the I-th of K contiguous parts of each
block's samples, writing a parts file; ``--merge`` builds the table from such files (each side's times
summed over them), so a long sweep runs as several short jobs.

``--kept-check`` instead compares the kept indices of KnormPress/StreamingLLMPress with longlab's
``knorm``/``streaming`` on each side's own forward of the same prompt ids (one chunk, compression once).

Writes ``--out`` (default ``bench/results/vs_kvpress.json``): hardware header, setup, the table with
CIs, both sides' predictions and times. This file's top level imports only the standard library (the
driver runs in the kvpress venv).
""".lstrip("\n")

ROOT = Path(__file__).resolve().parents[1]


RATIOS = (0.5, 0.75)


LONGLAB_SEPARATOR = "\n\n"  # longlab's former layout ("chat-sep"): user turn = context + "\n\n" + question


LAYOUT_OF = {"raw": "chat", "longlab": "chat-sep"}


METHODS: dict[str, tuple[str, str]] = {
    "snapkv": ("SnapKVPress", ":window_size=64"),
    "streaming": ("StreamingLLMPress", ""),
    "tova": ("TOVAPress", ""),
    "knorm": ("KnormPress", ""),
}


KEPT_METHODS = ("knorm", "streaming")  # policies whose kept set depends on no attention weights


MODES = {"batched": True, "plain": False, "chunked": None}


def recipes(ratios: tuple[float, ...], methods: tuple[str, ...] = tuple(METHODS)) -> list[list]:
    """[longlab recipe, kvpress press class or None, ratio] for every cell of the sweep."""
    out: list[list] = [["full", None, 0.0]]
    for method in methods:
        press, params = METHODS[method]
        out += [[f"{method}@{r:g}{params}", press, r] for r in ratios]
    return out


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _question(question: str, mode: str) -> str:
    return LONGLAB_SEPARATOR + question if mode == "longlab" else question


def kvpress_driver_run(args: argparse.Namespace) -> int:
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
    t0 = time.perf_counter()
    pipe = pipeline("kv-press-text-generation", model=args.model_dir, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    kept: dict[int, list[list[int]]] = {}
    if args.kept_check:
        from kvpress.presses.scorer_press import ScorerPress
        from kvpress.utils import compute_n_kept

        original = ScorerPress.compress

        def recording(self, module, hidden_states, keys, values, attentions, kw):  # noqa: ANN001
            # the indices ScorerPress.compress keeps (its own scores and top-k), sorted per head
            scores = self.score(module, hidden_states, keys, values, attentions, kw)  # [1, H_kv, T]
            n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
            kept[module.layer_idx] = scores.topk(n_kept, dim=-1).indices.sort(-1).values[0].tolist()
            return original(self, module, hidden_states, keys, values, attentions, kw)

        ScorerPress.compress = recording
    rows = []
    t1, c1 = time.perf_counter(), time.process_time()
    for recipe, press_name, ratio in cells:
        press = getattr(kvpress, press_name)(compression_ratio=ratio) if press_name else None
        for s in samples:
            kept.clear()
            max_new = min(s["max_new_tokens"], args.max_new_tokens or s["max_new_tokens"])
            start = time.perf_counter()
            answer = pipe(
                s["context"], question=_question(s["question"], args.kvpress_question),
                answer_prefix=s.get("answer_prefix") or "", press=press, max_new_tokens=max_new,
            )["answer"]
            row = {
                "recipe": recipe, "sample_id": s["sample_id"], "prediction": answer.strip(),
                "seconds": time.perf_counter() - start,
            }
            if args.kept_check:
                row["kept"] = [kept[i] for i in sorted(kept)]
            rows.append(row)
            print(f"kvpress {len(rows)}/{len(cells) * len(samples)}: {recipe} {s['sample_id']} "
                  f"{row['seconds']:.1f}s", file=sys.stderr, flush=True)
    sweep_s, sweep_cpu = time.perf_counter() - t1, time.process_time() - c1
    # the prompt token ids kvpress used, to check both sides saw the same tokens
    ids = {}
    for s in samples:
        question = _question(s["question"], args.kvpress_question)
        inputs = pipe.preprocess(s["context"], [question], s.get("answer_prefix") or "", 10**9)
        ids[s["sample_id"]] = [inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()]
    result = {
        "rows": rows, "load_s": load_s, "sweep_s": sweep_s, "sweep_cpu_s": sweep_cpu, "prompt_ids": ids,
        "versions": {
            "kvpress": _version("kvpress"), "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "attn_implementation": pipe.model.config._attn_implementation,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def fail(message: str) -> int:
    print(f"vs_kvpress: {message}", file=sys.stderr)
    return 2


def sweep_kvpress(args: argparse.Namespace, jsonl: Path, model_dir: Path, cells: list, tmp: Path) -> dict:
    """Run the kvpress driver in the kvpress venv; its JSON result plus the process wall time."""
    out = tmp / "kvpress.json"
    cmd = [
        str(args.kvpress_python), str(Path(__file__).resolve()), "run", "--kvpress-driver",
        "--samples-jsonl", str(jsonl), "--model-dir", str(model_dir), "--cells", json.dumps(cells),
        "--threads", str(args.threads), "--out", str(out), "--kvpress-question", args.kvpress_question,
    ]
    if args.max_new_tokens:
        cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    if args.kept_check:
        cmd.append("--kept-check")
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


def sweep_longlab(args: argparse.Namespace, jsonl: Path, cells: list, tmp: Path, batch_decode: bool) -> dict:
    """Run longlab's grid driver (prefill once per sample) on the same JSONL and recipes."""
    import torch

    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.eval.store import ResultStore

    torch.set_num_threads(args.threads)
    out = tmp / ("longlab-batched" if batch_decode else "longlab")
    summary = run_eval(EvalConfig(
        out=str(out), model="smollm2-135m", recipes=[c[0] for c in cells], jsonl=str(jsonl),
        chunk_size=args.chunk_size, threads=args.threads, batch_decode=batch_decode, report=False,
        progress=True, max_new_tokens=args.max_new_tokens,
    ), log=lambda msg: None)
    with ResultStore(out) as store:
        rows = store.rows()
    return {
        "rows": [{"recipe": r["recipe"], "sample_id": r["sample_id"], "prediction": r["prediction"],
                  "score": r["score"], "generated_tokens": r["extra"].get("generated_tokens"),
                  "shared_prefill_s": r["extra"].get("shared_prefill_s")} for r in rows],
        "load_s": summary.load_s, "sweep_s": summary.sweep_s, "sweep_cpu_s": summary.sweep_cpu_s,
        "versions": {"longlab": _version("longlab"), "transformers": _version("transformers"),
                     "torch": torch.__version__},
    }


def run_generate(args: argparse.Namespace, samples: list, cells: list) -> dict:
    """longlab's ``generate`` per (recipe, sample) with ``compress="chunk"``: the policies compress after
    every prefill chunk of ``--chunk-size`` tokens, so later chunks are computed over an already
    compressed past (generate's default; kvpress and the eval runner compress once, at the end)."""
    import torch

    from longlab.generation import generate
    from longlab.models import load_model
    from longlab.tasks import score_sample

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    load_s = time.perf_counter() - t0
    rows = []
    t1, c1 = time.perf_counter(), time.process_time()
    for recipe, _, _ in cells:
        for s in samples:
            max_new = min(s.max_new_tokens, args.max_new_tokens or s.max_new_tokens)
            result = generate(
                model, tokenizer, s.context, s.question, recipe, answer_prefix=s.answer_prefix,
                max_new_tokens=max_new, compress="chunk", chunk_size=args.chunk_size,
            )
            rows.append({"recipe": recipe, "sample_id": s.sample_id, "prediction": result.text,
                         "score": score_sample(s, result.text),
                         "generated_tokens": len(result.token_ids[0])})
    return {
        "rows": rows, "load_s": load_s, "sweep_s": time.perf_counter() - t1,
        "sweep_cpu_s": time.process_time() - c1,
        "versions": {"longlab": _version("longlab"), "transformers": _version("transformers"),
                     "torch": torch.__version__},
    }


def kept_longlab(samples: list, cells: list, chunk_size: int) -> dict[tuple[str, str], list[list[list[int]]]]:
    """Kept context positions per layer and KV head of each (recipe, sample) under longlab's
    ``generate(..., compress="end")`` (one forward of ``chunk_size`` tokens, compression once)."""
    from longlab.generation import generate
    from longlab.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    out = {}
    for recipe, press, _ in cells:
        if press is None:
            continue
        for s in samples:
            result = generate(
                model, tokenizer, s.context, s.question, recipe, answer_prefix=s.answer_prefix,
                max_new_tokens=1, compress="end", chunk_size=chunk_size,
            )
            n_ctx = result.context_tokens[0]
            out[(recipe, s.sample_id)] = [
                [sorted(int(p) for p in head if 0 <= p < n_ctx) for head in layer.index[0]]
                for layer in result.cache.layers
            ]
    return out


def kept_check(args: argparse.Namespace, samples: list, jsonl: Path, model_dir: Path, tmp: Path) -> int:
    """Compare kept indices of both sides on their own forward of the same prompt ids."""
    cells = recipes(tuple(float(r) for r in args.ratios.split(",")), KEPT_METHODS)[1:]
    kv = sweep_kvpress(args, jsonl, model_dir, cells, tmp)
    ll = kept_longlab(samples, cells, args.chunk_size)
    table = []
    for recipe, press, ratio in cells:
        shared = kv_total = ll_total = 0
        for row in (r for r in kv["rows"] if r["recipe"] == recipe):
            ours = ll[(recipe, row["sample_id"])]
            for kv_layer, ll_layer in zip(row["kept"], ours):
                for kv_head, ll_head in zip(kv_layer, ll_layer):
                    shared += len(set(kv_head) & set(ll_head))
                    kv_total, ll_total = kv_total + len(kv_head), ll_total + len(ll_head)
        table.append({"recipe": recipe, "kvpress_press": press, "ratio": ratio,
                      "kvpress_kept": kv_total, "longlab_kept": ll_total, "shared": shared,
                      "overlap_of_kvpress": shared / max(kv_total, 1)})
        print(f"{recipe:>16} vs {press:<18}: kvpress keeps {kv_total}, longlab {ll_total} (ceil vs int), "
              f"shared {shared} = {100 * shared / max(kv_total, 1):.2f}% of kvpress's")
    result = {"kept_check": table, "samples": [s.sample_id for s in samples],
              "versions": kv["versions"], "chunk_size": args.chunk_size}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _merge(parts: list[dict]) -> dict:
    """One side's result over the interleaved blocks: times and counts summed, rows concatenated, dicts
    merged, per-block load averages listed, anything else from the first block."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if key == "load_average":
                out.setdefault("load_average_per_block", []).append(value)
            elif key not in out:
                copied = list(value) if isinstance(value, list) else value
                out[key] = dict(copied) if isinstance(copied, dict) else copied
            elif isinstance(value, bool) or not isinstance(value, (int, float, list, dict)):
                continue
            elif isinstance(value, list):
                out[key] += value
            elif isinstance(value, dict):
                out[key].update(value)
            else:
                out[key] += value
    blocks = out.get("load_average_per_block", [])
    out["load_average"] = [blocks[0][0], blocks[-1][1]] if blocks else []
    return out


def _part_slice(part: tuple[int, int, str], n: int) -> tuple[int, int]:
    """(I, K, "/") -> the I-th of K contiguous parts of n samples; (LO, HI, ":") -> LO..HI."""
    a, b, kind = part
    return (n * a // b, n * (a + 1) // b) if kind == "/" else (a, b)


def _sample_parts(text: str | None, selected: set[int] | None) -> dict[int, tuple[int, int, str]] | str:
    """``--sample-part``: ``"I/K"`` (every selected block) or ``"B=I/K,..."`` / ``"B=LO:HI,..."`` ->
    {block: (I, K, "/") or (LO, HI, ":")}; an error message for anything else; {} when not given."""
    if text is None:
        return {}
    if selected is None:
        return "--sample-part needs --blocks (it writes a parts file for --merge)"
    out: dict[int, tuple[int, int, str]] = {}
    for entry in text.split(","):
        block, _, part = entry.rpartition("=")
        kind = ":" if ":" in part else "/"
        try:
            i, k = (int(x) for x in part.split(kind))
            blocks = [int(block)] if block else sorted(selected)
        except ValueError:
            return f"--sample-part: expected I/K, B=I/K,... or B=LO:HI,... (integers), got {text!r}"
        if not (0 <= i < k) or not set(blocks) <= selected:
            return f"--sample-part: need 0 <= I < K (or LO < HI) and B among --blocks, got {text!r}"
        out.update({b: (i, k, kind) for b in blocks})
    return out


def _cis(a: list[float], b: list[float]) -> dict:
    """Per-side estimates and the paired difference a - b (same samples, same order)."""
    from longlab.eval.stats import paired_difference, score_estimate

    ea, eb, d = score_estimate(a), score_estimate(b), paired_difference(a, b)
    return {
        "longlab": [ea.mean, ea.low, ea.high, ea.method], "kvpress": [eb.mean, eb.low, eb.high, eb.method],
        "difference": [d.mean, d.low, d.high], "significant": d.significant,
    }


def _pct(x: list) -> str:
    return f"{100 * x[0]:.1f} [{100 * x[1]:.1f}, {100 * x[2]:.1f}]"


def _answer_tokens(tokenizer, kv: dict) -> dict[str, float]:
    """Tokens per answer on the kvpress side (re-tokenised, EOS not counted)."""
    lengths = [len(tokenizer(r["prediction"], add_special_tokens=False)["input_ids"]) for r in kv["rows"]]
    return {"mean": sum(lengths) / max(len(lengths), 1), "max": max(lengths, default=0)}


def run_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_RUN.splitlines()[0])
    p.add_argument("--kvpress-python", type=Path, default=ROOT / ".venv-kvpress" / "bin" / "python")
    p.add_argument("--tasks", default="niah_single_1,vt")
    p.add_argument("--lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length)")
    p.add_argument("--seed", type=int, default=0, help="sample generation seed")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--chunk-size", type=int, default=4096, help="longlab's prefill chunk size")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap each sample's own limit, both sides")
    p.add_argument("--longlab-modes", default="batched",
                   help="comma-separated: batched (the default eval path), plain (unbatched decode), "
                   "chunked (generate with compress='chunk' after every --chunk-size chunk)")
    p.add_argument("--kvpress-question", choices=("raw", "longlab"), default="raw",
                   help="raw: kvpress gets the bare question (its pipeline's own layout) and longlab runs "
                   "its default layout 'chat', the same ids; longlab: kvpress gets '\\n\\n' + question and "
                   "longlab runs its layout 'chat-sep' (longlab's former default), the same ids")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="samples from this common-format JSONL file (e.g. bench/vs_kvpress.py cases's) "
                   "instead of --tasks/--lengths/--samples; blocks are its (task, length) pairs")
    p.add_argument("--kept-check", action="store_true",
                   help="compare kept indices of knorm/streaming on both sides instead of the sweep")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_kvpress.json")
    p.add_argument("--blocks", default=None,
                   help="run only these (task, length) blocks (0-based, comma-separated, --tasks x --lengths "
                   "order) and write their raw parts to --out, to be combined by --merge")
    p.add_argument("--sample-part", default=None, metavar="I/K",
                   help="with --blocks: run only the I-th of K contiguous parts of each block's samples "
                   "(0-based), so that a long block splits into shorter jobs; --merge combines the parts. "
                   "Per block: 'B=I/K,...' or 'B=LO:HI,...' (samples LO..HI-1 of block B); a selected "
                   "block without an entry runs whole")
    p.add_argument("--merge", default=None,
                   help="comma-separated parts files written with --blocks (same other arguments): build the "
                   "table from them instead of running")
    p.add_argument("--kvpress-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples-jsonl", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--cells", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kvpress_driver:
        return kvpress_driver_run(args)

    for name in ("samples", "threads", "chunk_size", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    modes = [m.strip() for m in args.longlab_modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        return fail(f"--longlab-modes: choose from {', '.join(MODES)}, got {args.longlab_modes!r}")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods or any(m not in METHODS for m in methods):
        return fail(f"--methods: choose from {', '.join(METHODS)}, got {args.methods!r}")
    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError as err:
        return fail(f"--ratios / --lengths: {err}")
    if any(not 0 < r < 1 for r in ratios) or any(n < 1 for n in lengths):
        return fail("--ratios must lie in (0, 1) and --lengths must be positive")
    if not args.kvpress_python.exists():
        return fail(f"no kvpress python at {args.kvpress_python}: run `make kvpress-venv` first "
                    "(kvpress goes into its own venv: it pins an older transformers)")
    check = subprocess.run([str(args.kvpress_python), "-c", "import kvpress"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ""})
    if check.returncode != 0:
        return fail(f"kvpress does not import in {args.kvpress_python}:\n{check.stderr.strip()[-2000:]}")

    from longlab.models import load_model
    from longlab.paths import cache_dir
    from longlab.prompt import encode_prompts
    from longlab.tasks import generate_samples, load_jsonl, save_jsonl, score_sample

    _, tokenizer = load_model("smollm2-135m")  # also caches the safetensors kvpress loads
    model_dir = cache_dir() / "models" / "smollm2-135m"
    cells = recipes(ratios, methods)
    try:
        if args.jsonl is not None:
            samples = load_jsonl(args.jsonl)
            for s in samples:
                s.task = s.task or args.jsonl.stem
        else:
            samples = [s for t in args.tasks.split(",") for n in lengths
                       for s in generate_samples(t, tokenizer, n, args.samples, args.seed)]
    except ValueError as err:
        return fail(str(err))
    if "chunked" in modes and args.kvpress_question != "raw":
        return fail("--longlab-modes chunked runs longlab.generate, whose layout is the default ('chat'): "
                    "use it with --kvpress-question raw")
    if args.kept_check and args.kvpress_question != "raw":
        return fail("--kept-check runs longlab.generate, whose layout is the default ('chat'): "
                    "use it with --kvpress-question raw")
    plain = sorted({s.task for s in samples if s.metadata.get("prompt", "chat") == "plain"})
    if plain:
        return fail(f"tasks {plain} use a plain completion prompt in longlab; kvpress's pipeline always "
                    "applies the chat template, so the prompts would differ: leave them out")
    if len({s.sample_id for s in samples}) != len(samples):
        return fail("sample ids repeat across tasks/lengths; the sides are matched by sample id")
    layout = LAYOUT_OF[args.kvpress_question]
    for s in samples:  # longlab's runner reads the layout from each sample (longlab.prompt)
        s.metadata["prompt"] = layout
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vs_kvpress-") as tmp_name:
        tmp = Path(tmp_name)
        jsonl = tmp / "samples.jsonl"
        save_jsonl(samples, jsonl)
        if args.kept_check:
            args.max_new_tokens = 1  # the kept sets are fixed before decoding starts
            return kept_check(args, samples, jsonl, model_dir, tmp)
        source = str(args.jsonl) if args.jsonl is not None else f"{args.tasks} at {args.lengths} tokens"
        print(f"{len(samples)} samples ({source}) x {len(cells)} recipes, layout {layout!r}, "
              f"{args.threads} thread(s); load average {_load()}", flush=True)
        # interleaved: per (task, length) block, kvpress then each longlab mode, so both sides run under
        # the same load as it drifts; the sweep times are the sums over blocks (model loads excluded)
        blocks: dict[tuple[str, int], list] = {}
        for s in samples:
            blocks.setdefault((s.task, s.length), []).append(s)
        try:
            selected = None if args.blocks is None else {int(x) for x in args.blocks.split(",")}
        except ValueError as err:
            return fail(f"--blocks: {err}")
        if selected is not None and (not selected or not selected <= set(range(len(blocks)))):
            return fail(f"--blocks: choose from 0..{len(blocks) - 1}, got {args.blocks!r}")
        part_of = _sample_parts(args.sample_part, selected)
        if isinstance(part_of, str):
            return fail(part_of)
        kv_parts: list[dict] = []
        side_parts: dict[str, list[dict]] = {m: [] for m in modes}
        block_commands: list[str] = []
        missing: list[str] = []
        if args.merge is not None:  # parts of earlier --blocks runs, in block order
            found: dict[int, list[dict]] = {}  # block -> its parts (several with --sample-part)
            seen_ids: set[str] = set()
            for name in args.merge.split(","):
                part = json.loads(Path(name).read_text())
                if part.get("longlab_modes") != modes or part.get("cells") != cells:
                    return fail(f"--merge: {name} was run with other modes or recipes")
                block_commands.append(part["command"])
                for i, kvp, sides_of in zip(part["blocks"], part["kvpress"], part["longlab"]):
                    ids = {r["sample_id"] for r in kvp["rows"]}
                    if ids & seen_ids:
                        return fail(f"--merge: samples {sorted(ids & seen_ids)} appear in two parts")
                    seen_ids |= ids
                    found.setdefault(i, []).append({"kvpress": kvp, "longlab": sides_of})
            if not set(found) <= set(range(len(blocks))):
                return fail(f"--merge: parts cover blocks {sorted(found)}, not all in 0..{len(blocks) - 1}")
            keys = list(blocks)
            missing = [f"{keys[i][0]}@{keys[i][1]}" for i in range(len(blocks)) if i not in found]
            if missing:  # a partial merge: the table covers the blocks that ran, and says which did not
                print(f"warning: --merge: blocks {missing} missing; the table covers the others", flush=True)
            absent = [s.sample_id for s in samples if (s.task, s.length) in {keys[i] for i in found}
                      and s.sample_id not in seen_ids]
            if absent:  # a block of which some --sample-part parts did not run
                print(f"warning: --merge: samples {absent} missing; the table covers the others", flush=True)
                missing += absent
            samples = [s for s in samples if s.sample_id in seen_ids]
            for i in sorted(found):
                for piece in found[i]:
                    kv_parts.append(piece["kvpress"])
                    for m in modes:
                        side_parts[m].append(piece["longlab"][m])
        for b, ((task, length), block) in enumerate(blocks.items()):
            if args.merge is not None or (selected is not None and b not in selected):
                continue
            if b in part_of:
                lo, hi = _part_slice(part_of[b], len(block))
                block = block[lo:hi]
                if not block:
                    return fail(f"--sample-part {args.sample_part}: block {b} has no sample in that part")
            block_jsonl = tmp / f"block{b}.jsonl"
            save_jsonl(block, block_jsonl)
            load_before = _load()
            try:
                part = sweep_kvpress(args, block_jsonl, model_dir, cells, tmp)
            except RuntimeError as err:
                return fail(str(err))
            part["load_average"] = [load_before, _load()]
            kv_parts.append(part)
            print(f"[{b + 1}/{len(blocks)}] {task}@{length}: kvpress {part['sweep_s']:.1f}s wall, "
                  f"{part['sweep_cpu_s']:.1f}s CPU", flush=True)
            for mode in modes:
                load_before = _load()
                if mode == "chunked":
                    part = run_generate(args, block, cells)
                else:
                    part = sweep_longlab(args, block_jsonl, cells, tmp, MODES[mode])
                    ids = {s.sample_id for s in block}
                    part["rows"] = [r for r in part["rows"] if r["sample_id"] in ids]
                part["load_average"] = [load_before, _load()]
                side_parts[mode].append(part)
                print(f"[{b + 1}/{len(blocks)}] {task}@{length}: longlab {mode} {part['sweep_s']:.1f}s wall, "
                      f"{part['sweep_cpu_s']:.1f}s CPU", flush=True)
        if selected is not None:
            args.out.write_text(json.dumps({
                "blocks": sorted(selected), "kvpress": kv_parts, "sample_part": args.sample_part,
                "longlab": [{m: side_parts[m][i] for m in modes} for i in range(len(kv_parts))],
                "longlab_modes": modes, "cells": cells,
                "command": "python bench/vs_kvpress.py run "
                + " ".join(sys.argv[1:] if argv is None else argv),
            }) + "\n")
            print(f"wrote the parts of blocks {sorted(selected)} to {args.out}; combine them with --merge")
            return 0
        kv = _merge(kv_parts)
        sides = {m: _merge(parts) for m, parts in side_parts.items()}
        for m in modes:
            print(f"longlab {m}: sweep {sides[m]['sweep_s']:.1f}s wall, {sides[m]['sweep_cpu_s']:.1f}s CPU; "
                  f"kvpress {kv['sweep_s']:.1f}s wall, {kv['sweep_cpu_s']:.1f}s CPU", flush=True)

    by_id = {s.sample_id: s for s in samples}
    for row in kv["rows"]:
        s = by_id[row["sample_id"]]
        row["score"] = score_sample(s, row["prediction"])
    # the ids longlab's runner builds (chat template: every task here) against kvpress's
    mismatched = []
    for s in samples:
        (ctx,), (q,) = encode_prompts(tokenizer, [s.context], [s.question], [s.answer_prefix], layout)
        if [ctx, q] != kv["prompt_ids"][s.sample_id]:
            mismatched.append(s.sample_id)
    order = [s.sample_id for s in samples]

    def scores(rows: list[dict], recipe: str) -> tuple[list[float], dict[str, str]]:
        chosen = {r["sample_id"]: r for r in rows if r["recipe"] == recipe}
        return [chosen[i]["score"] for i in order], {i: chosen[i]["prediction"] for i in order}

    table = []
    # per-sample mean over the compressed recipes (the sample is the unit the paired bootstrap resamples)
    pooled: dict[str, list[float]] = {"kvpress": [0.0] * len(order), **{m: [0.0] * len(order) for m in modes}}
    n_compressed = sum(1 for c in cells if c[0] != "full")
    for recipe, press, ratio in cells:
        kv_scores, kv_pred = scores(kv["rows"], recipe)
        entry = {"recipe": recipe, "kvpress_press": press or "none", "ratio": ratio, "n": len(order),
                 "kvpress_correct": sum(kv_scores)}
        if recipe != "full":
            pooled["kvpress"] = [p + x / n_compressed for p, x in zip(pooled["kvpress"], kv_scores)]
        for mode in modes:
            ll_scores, ll_pred = scores(sides[mode]["rows"], recipe)
            entry[f"longlab_{mode}_correct"] = sum(ll_scores)
            entry[f"longlab_{mode}"] = _cis(ll_scores, kv_scores)
            entry[f"same_predictions_{mode}"] = sum(kv_pred[i] == ll_pred[i] for i in order)
            if recipe != "full":
                pooled[mode] = [p + x / n_compressed for p, x in zip(pooled[mode], ll_scores)]
        table.append(entry)
    equal = {m: not any(t[f"longlab_{m}"]["significant"] for t in table) for m in modes}
    timing = {m: {"wall_ratio": kv["sweep_s"] / sides[m]["sweep_s"],
                  "cpu_ratio": kv["sweep_cpu_s"] / sides[m]["sweep_cpu_s"]} for m in modes}
    result = {
        "hardware": {
            "cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "threads": args.threads,
        },
        "setup": {
            "model": "smollm2-135m (fp32, CPU)", "tasks": args.tasks, "lengths": lengths,
            "jsonl": str(args.jsonl) if args.jsonl is not None else None, "longlab_layout": layout,
            "samples_per_task_length": args.samples, "samples_per_recipe": len(order), "seed": args.seed,
            "ratios": list(ratios), "chunk_size": args.chunk_size, "max_new_tokens_cap": args.max_new_tokens,
            "query_aware": False, "kvpress_question": args.kvpress_question,
            "prompt_id_mismatches": mismatched, "longlab_modes": modes,
            "command": "python bench/vs_kvpress.py run "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "block_commands": block_commands,
            "blocks_missing": missing if args.merge is not None else [],
        },
        "table": table,
        "mean_of_compressed": {m: _cis(pooled[m], pooled["kvpress"]) for m in modes},
        "equal_accuracy": equal,
        "timing": timing,
        "kvpress_answer_tokens": _answer_tokens(tokenizer, kv),
    }
    for key, side in (("kvpress", kv), *((f"longlab_{m}", sides[m]) for m in modes)):
        result[key] = {k: v for k, v in side.items() if k not in ("rows", "prompt_ids")} | {
            "predictions": side["rows"]}
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    n = len(order)
    for m in modes:
        what = "generate, compress after every chunk" if m == "chunked" else f"{m} decode"
        print(f"\nlonglab ({what}) vs kvpress, {n} samples per recipe; accuracy % with 95% CI "
              "(Wilson / bootstrap), difference = paired bootstrap over the same samples")
        print("| recipe | kvpress press | kvpress | longlab | longlab - kvpress | same predictions |")
        print("|---|---|---:|---:|---:|---:|")
        for t in table:
            c = t[f"longlab_{m}"]
            star = " *" if c["significant"] else ""
            print(f"| {t['recipe']} | {t['kvpress_press']} | {_pct(c['kvpress'])} | {_pct(c['longlab'])} "
                  f"| {_pct(c['difference'])}{star} | {t[f'same_predictions_{m}']}/{n} |")
        c = result["mean_of_compressed"][m]
        print(f"| mean of compressed | | {_pct(c['kvpress'])} | {_pct(c['longlab'])} "
              f"| {_pct(c['difference'])}{' *' if c['significant'] else ''} | |")
        print("(* = the paired difference's CI excludes 0; 'mean of compressed' averages each sample over "
              "the compressed recipes first, so its CI resamples samples, not rows)")
        print(f"equal accuracy (no recipe's paired CI excludes 0): {equal[m]}")
        side, kv_cpu = sides[m], kv["sweep_cpu_s"]
        print(f"sweep time, kvpress vs longlab {m}: wall {kv['sweep_s']:.1f}s vs {side['sweep_s']:.1f}s "
              f"-> {timing[m]['wall_ratio']:.2f}x; CPU {kv_cpu:.1f}s vs {side['sweep_cpu_s']:.1f}s "
              f"-> {timing[m]['cpu_ratio']:.2f}x; load average {kv['load_average']} / {side['load_average']}")
    print(f"model load (not in the sweep times): kvpress {kv['load_s']:.1f}s, "
          f"longlab {sides[modes[0]]['load_s']:.1f}s")
    if mismatched:
        print(f"warning: prompt token ids differ for {mismatched}")
    else:
        print(f"prompt token ids identical on both sides for all {n} samples")
    print(f"wrote {args.out}")
    return 0


def _run_run() -> object:
    sys.exit(run_main())


# ---- cases (was bench/vs_kvpress.py cases) ----------------------------------------

DOC_CASES = """
Unseen long-context cases in the common JSONL format, for comparing longlab's default path with kvpress's.

    python bench/vs_kvpress.py cases --out runs/kvpress-cases.jsonl          # 36 cases, seed 0
    python bench/vs_kvpress.py cases --per-cell 8 --seed 1 --out FILE         # 48 cases

Three kinds of retrieval, none of them a longlab task generator or a RULER template, each at
``--lengths`` (default 800 and 1,600 tokens of context in SmolLM2's tokenizer):

- ``code``: one sentence "The access code for the <colour> <place> is <7 digits>." in a log-book
  haystack; asked for that code.
- ``attribute``: a register of people whose names look alike (same first names, surnames one letter
  apart), each with a home town, a trade and a pet, scattered through the haystack; asked for one
  attribute of one person.
- ``chain``: a value assigned to a variable, then passed along a chain of four more variables
  (``let kappa_17 = 48213`` ... ``let sigma_04 = kappa_17``), the lines spread through the haystack in
  order, next to a second, distractor chain; asked for every variable that ends up holding the value.

The haystack is a seeded log book: sentences drawn from small word lists (crew, task, object, place,
reading), so no two sentences repeat verbatim. Every row carries its own ``answer_prefix`` (a sentence
start without a trailing space, to which the answer is the continuation) and ``max_new_tokens``, a
``task`` and ``length``; scoring is longlab's default for an unregistered task, ``string_match_all``
(every answer contained in the prediction, case-insensitive).

The data is not committed: this script regenerates it exactly from ``--seed`` (the standard library's
``random``; the tokenizer only measures lengths).
""".lstrip("\n")

KINDS = ("code", "attribute", "chain")


_CREW = ("the night shift", "the pump crew", "Inspector Hale", "the second mate", "two apprentices",
         "the duty engineer", "the harbour pilot", "Dr. Okafor", "the quartermaster", "the survey team",
         "the radio operator", "Mrs. Brandt", "the cook", "the relief crew", "the foreman")


_DID = ("checked", "cleaned", "repaired", "logged", "inspected", "painted", "moved", "tested", "measured",
        "replaced", "oiled", "sealed", "counted", "weighed", "labelled")


_THING = ("the north valve", "a cracked pulley", "the spare batteries", "the rain gauge",
          "three crates of rope", "the signal lamp", "the boiler gauge", "a leaking hose", "the tide table",
          "the winch brake",
          "the cold store", "the ballast pump", "a set of charts", "the anchor chain", "the barometer")


_WHERE = ("near the east jetty", "in the lower hold", "behind the boathouse", "on the upper deck",
          "beside the fuel shed", "in the chart room", "at the west gate", "under the main stairs",
          "in the workshop", "by the slipway", "in the storeroom", "on the breakwater")


_WHEN = ("Early in the morning", "Shortly after noon", "Before the tide turned", "At dusk", "Around midnight",
         "After breakfast", "During the afternoon watch", "Late in the evening", "At first light",
         "Before the supply boat arrived")


_NOTE = ("Nothing unusual was found.", "The reading was within limits.", "It took longer than planned.",
         "The weather stayed calm.", "A note was left for the next shift.", "The work was signed off.",
         "Wind from the south-west, light rain.", "The log was countersigned by the foreman.",
         "Two more hours were needed.", "Parts were ordered from the mainland.")


_COLOURS = ("amber", "cobalt", "crimson", "ivory", "jade", "saffron", "slate", "violet", "copper", "teal")


_PLACES = ("vault", "archive", "locker", "hangar", "greenhouse", "cellar", "pavilion", "observatory")


_FIRST = ("Lena", "Marek", "Ines", "Tomas", "Hanna", "Viktor", "Oskar", "Petra")


_SURNAMES = ("Varga", "Varda", "Vargo", "Barga", "Marga", "Vanga", "Varma", "Darga")


_TOWNS = ("Tallinn", "Porto", "Bergen", "Ghent", "Lublin", "Kassel", "Lyon", "Tartu", "Split", "Turku",
          "Aarhus", "Bilbao", "Graz", "Brno", "Malmo", "Cork")


_TRADES = ("baker", "welder", "chemist", "pilot", "carpenter", "surveyor", "librarian", "glazier", "tailor",
           "plumber", "jeweller", "printer")


_PETS = ("parrot", "tortoise", "ferret", "goldfish", "beagle", "canary", "hamster", "iguana", "rabbit",
         "tabby cat")


_ATTRIBUTES = {  # attribute -> (question, answer prefix); {name} is the person
    "town": ("Which town does {name} come from?", "{name} comes from"),
    "trade": ("What is the trade of {name}?", "{name} works as a"),
    "pet": ("Which pet does {name} keep?", "{name} keeps a"),
}


_GREEK = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "theta", "zeta", "rho",
          "tau")


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_WHEN)}, {rng.choice(_CREW)} {rng.choice(_DID)} {rng.choice(_THING)}"
    s += f" {rng.choice(_WHERE)}."
    return s + (" " + rng.choice(_NOTE) if rng.random() < 0.4 else "")


def _person(first: str, last: str, p: dict[str, str]) -> str:
    return f"{first} {last}, a {p['trade']} from {p['town']}, keeps a {p['pet']}."


def _plan(kind: str, rng: random.Random) -> dict:
    """The inserts (sentences placed in the haystack in order), question, prefix, answers, limit."""
    if kind == "code":
        colour, place = rng.choice(_COLOURS), rng.choice(_PLACES)
        code = str(rng.randint(1_000_000, 9_999_999))
        what = f"the access code for the {colour} {place}"
        return {"inserts": [f"The access code for the {colour} {place} is {code}."],
                "intro": "Below is the maintenance log of a harbour station.",
                "question": f"What is {what}?",
                "answer_prefix": f"The access code for the {colour} {place} is",
                "answers": [code], "max_new_tokens": 16}
    if kind == "attribute":
        first = rng.choice(_FIRST)
        lasts = rng.sample(_SURNAMES, 6)
        people = []
        for last in lasts:
            people.append((first, last, {"town": rng.choice(_TOWNS), "trade": rng.choice(_TRADES),
                                         "pet": rng.choice(_PETS)}))
        target = rng.randrange(len(people))
        attribute = rng.choice(tuple(_ATTRIBUTES))
        f, last, p = people[target]
        # look-alikes must not share the asked attribute's value, or the answer would be ambiguous
        for i, (_, _, other) in enumerate(people):
            while i != target and other[attribute] == p[attribute]:
                other[attribute] = rng.choice({"town": _TOWNS, "trade": _TRADES, "pet": _PETS}[attribute])
        name = f"{f} {last}"
        question, prefix = _ATTRIBUTES[attribute]
        return {"inserts": [_person(*x) for x in people],
                "intro": "Below is the log of a harbour station; it mentions several visitors.",
                "question": question.format(name=name), "answer_prefix": prefix.format(name=name),
                "answers": [p[attribute]], "max_new_tokens": 12}
    names = [f"{g}_{rng.randint(10, 99)}" for g in rng.sample(_GREEK, 10)]
    values = rng.sample(range(10_000, 100_000), 2)
    chains = [names[:5], names[5:]]
    lines = []
    for chain, value in zip(chains, values):
        lines.append([f"let {chain[0]} = {value}"] + [f"let {b} = {a}" for a, b in zip(chain, chain[1:])])
    order = sorted(range(10), key=lambda _: rng.random())  # interleave the two chains, each in order
    merged, pos = [], [0, 0]
    for k in order:
        c = k % 2
        if pos[c] < 5:
            merged.append(lines[c][pos[c]])
            pos[c] += 1
    merged += lines[0][pos[0]:] + lines[1][pos[1]:]
    return {"inserts": merged,
            "intro": "Below is the log of a harbour station; some lines assign variables.",
            "question": f"Which variables end up holding the value {values[0]}?",
            "answer_prefix": f"The variables holding {values[0]} are", "answers": list(chains[0]),
            "max_new_tokens": 32}


def _build(plan: dict, haystack: list[str], rng: random.Random) -> str:
    """The intro, then the haystack with the inserts at sorted random places."""
    spots = sorted(rng.sample(range(1, len(haystack)), len(plan["inserts"])))
    out, j = [], 0
    for i, sentence in enumerate(haystack):
        while j < len(spots) and spots[j] == i:
            out.append(plan["inserts"][j])
            j += 1
        out.append(sentence)
    return plan["intro"] + "\n\n" + " ".join(out)


def make_cases(tokenizer, lengths: list[int], per_cell: int, seed: int) -> list[dict]:
    """``per_cell`` cases per (kind, length): each context within 2% of its length in tokens."""
    cases = []
    for kind in KINDS:
        for length in lengths:
            for i in range(per_cell):
                rng = random.Random(f"{seed}:{kind}:{length}:{i}")
                plan = _plan(kind, rng)
                haystack = [_sentence(rng) for _ in range(length)]
                n = max(len(plan["inserts"]) + 2, length // 20)
                layout_seed = rng.random()
                while True:  # grow or shrink the haystack to the target length (token count of the context)
                    context = _build(plan, haystack[:n], random.Random(layout_seed))
                    have = len(tokenizer(context, add_special_tokens=False)["input_ids"])
                    if abs(have - length) <= 0.02 * length or n >= len(haystack):
                        break
                    n = max(len(plan["inserts"]) + 2, round(n * length / have))
                cases.append({
                    "context": context, "question": plan["question"], "answer_prefix": plan["answer_prefix"],
                    "answers": plan["answers"], "max_new_tokens": plan["max_new_tokens"], "task": kind,
                    "length": length, "sample_id": f"{kind}-{length}-{i}",
                    "metadata": {"context_tokens": have, "seed": seed, "generator": "bench/kvpress_cases.py"},
                })
    return cases


def _ours(path: Path) -> bool:
    """Whether ``path`` is a cases file this script wrote (its first row names the generator)."""
    try:
        with path.open(encoding="utf-8") as fh:
            first = json.loads(fh.readline(1_000_000))
        # (the tag of the files written before this script became a subcommand of vs_kvpress.py)
        return first.get("metadata", {}).get("generator") == "bench/kvpress_cases.py"
    except (OSError, ValueError, AttributeError):
        return False


def cases_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_CASES.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--lengths", default="800,1600", help="context lengths in tokens, comma-separated")
    p.add_argument("--per-cell", type=int, default=6, help="cases per (kind, length); 6 -> 36 cases")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(not 200 <= n <= 32_768 for n in lengths):
        print(f"--lengths: integers in [200, 32768], comma-separated, got {args.lengths!r}", file=sys.stderr)
        return 2
    if not 1 <= args.per_cell <= 1000:
        print(f"--per-cell must be in [1, 1000], got {args.per_cell}", file=sys.stderr)
        return 2
    from longlab.models import load_model
    from longlab.recipe import LonglabError
    from longlab.safeio import check_output_file, write_file_atomic

    try:  # never overwrite a file this script did not write
        check_output_file(args.out, "--out", owned=_ours, what="cases file")
    except LonglabError as err:
        print(err, file=sys.stderr)
        return 2
    _, tokenizer = load_model("smollm2-135m")  # also caches the safetensors kvpress loads
    cases = make_cases(tokenizer, lengths, args.per_cell, args.seed)
    write_file_atomic(args.out, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases), "--out")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


def _run_cases() -> object:
    sys.exit(cases_main())


# ---- layout (was bench/vs_kvpress.py layout) ----------------------------------------

DOC_LAYOUT = """
Which part of the prompt protocol makes longlab and kvpress answer differently: per-factor ablations.

    python bench/vs_kvpress.py cases --out runs/cases.jsonl
    python bench/vs_kvpress.py layout --cases runs/cases.jsonl --side longlab --variants kvpress,longlab \\
        --out runs/layout-longlab.json
    python bench/vs_kvpress.py layout --cases runs/cases.jsonl --side kvpress --variants kvpress,longlab \\
        --out runs/layout-kvpress.json
    python bench/vs_kvpress.py layout --table runs/layout-longlab.json,runs/layout-kvpress.json

A *variant* fixes the prompt's token ids; both sides then run on exactly those ids, so a difference
between variants on one side is the layout's, and a difference between sides on one variant is the
engine's (chunking, budget rounding, ties). Every variant uses the chat template and splits the
prompt where kvpress's pipeline does (the context part, chat header included, is compressed; the rest
is fed after compression):

- ``kvpress``: user turn = context + question (glued), then the assistant header, then
  ``answer_prefix + " "`` -- kvpress's pipeline called as ``pipe(context, question=q,
  answer_prefix=prefix + " ")``; the driver checks that its own ``preprocess`` gives these ids;
- ``kvpress-bare``: the same with ``answer_prefix`` as given (no added space);
- ``longlab``: longlab's layout before this change: user turn = context + ``"\\n\\n"`` + question,
  ``answer_prefix`` as given;
- ``longlab-space``: that layout with ``answer_prefix + " "``;
- ``plain``: longlab's completion layout (no chat template): context, newline, question, space-led prefix.

``--side longlab`` runs longlab's eval runner (:class:`longlab.eval.sample_runner.SampleRunner`: one
shared prefill in ``--chunk-size`` chunks, compression once at the end, batched decode) on the ids;
``--side kvpress`` runs kvpress's pipeline (its ``_forward``: one prefill forward under the press,
then the question and greedy decoding) on the same ids, in ``--kvpress-python`` through a subprocess.
Both score with longlab's scorer of the row (``string_match_all`` for these cases).
``--table`` prints correct counts per (side, variant, recipe) with Wilson intervals, and paired
differences against a reference cell (``--reference SIDE:VARIANT``, default ``kvpress:kvpress``).
""".lstrip("\n")

VARIANTS = {  # name -> (separator between context and question, space after the answer prefix, chat)
    "kvpress": ("", True, True),
    "kvpress-bare": ("", False, True),
    "longlab": ("\n\n", False, True),
    "longlab-space": ("\n\n", True, True),
    "plain": ("\n", False, False),
}


PRESSES = {"full": None, "knorm": "KnormPress", "streaming": "StreamingLLMPress", "snapkv": "SnapKVPress",
           "tova": "TOVAPress", "expected": "ExpectedAttentionPress"}


def variant_ids(tokenizer, sample: dict, variant: str) -> tuple[list[int], list[int]]:
    """(context part, question part) token ids of ``sample`` under ``variant`` (split as kvpress does)."""
    sep, space, chat = VARIANTS[variant]
    prefix = sample.get("answer_prefix") or ""
    if space and prefix and not prefix.endswith(" "):
        prefix += " "
    if not chat:
        if prefix and not prefix[0].isspace():
            prefix = " " + prefix
        ctx_text, q_text = sample["context"], sep + sample["question"] + prefix
        ctx = tokenizer(ctx_text)["input_ids"]
    else:
        marker = "\u2063SPLIT\u2063"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample["context"] + marker}], add_generation_prompt=True,
            tokenize=False,
        )
        head, suffix = rendered.split(marker)
        ctx = tokenizer(head, add_special_tokens=False)["input_ids"]
        q_text = sep + sample["question"] + suffix + prefix
    return list(ctx), list(tokenizer(q_text, add_special_tokens=False)["input_ids"])


def _press_of(recipe: str) -> tuple[str | None, float]:
    """kvpress press class and compression ratio of a recipe name such as ``knorm@0.5``."""
    name, _, ratio = recipe.partition("@")
    name = name.split(":")[0]
    if name not in PRESSES:
        raise SystemExit(f"kvpress_layout: no kvpress press for {recipe!r}; known: {', '.join(PRESSES)}")
    return PRESSES[name], float(ratio.split(":")[0]) if ratio else 0.0


def layout_kvpress_driver(args: argparse.Namespace) -> int:
    """Inside the kvpress venv: run the pipeline's ``_forward`` on the given ids; write predictions."""
    import kvpress
    import torch
    import transformers
    from transformers import pipeline

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    job = json.loads(Path(args.job).read_text())
    pipe = pipeline("kv-press-text-generation", model=job["model_dir"], device="cpu", dtype=torch.float32)
    rows, checked = [], []
    for item in job["items"]:
        if item["variant"] == "kvpress":  # the pipeline's own preprocessing must give the same ids
            s = item["sample"]
            prefix = s.get("answer_prefix") or ""
            inputs = pipe.preprocess(s["context"], [s["question"]], prefix + " " if prefix else "", 10**9)
            own = [inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()]
            checked.append([s["sample_id"], own == [item["ctx"], item["q"]]])
        for recipe in job["recipes"]:
            press_name, ratio = _press_of(recipe)
            press = getattr(kvpress, press_name)(compression_ratio=ratio) if press_name else None
            t0 = time.perf_counter()
            (answer,) = pipe._forward(
                {"context_ids": torch.tensor([item["ctx"]]), "questions_ids": [torch.tensor([item["q"]])]},
                max_new_tokens=item["max_new_tokens"], press=press,
            )
            rows.append({"variant": item["variant"], "recipe": recipe,
                         "sample_id": item["sample"]["sample_id"], "prediction": answer.strip(),
                         "seconds": time.perf_counter() - t0})
            print(f"kvpress {item['variant']} {recipe} {item['sample']['sample_id']}: {answer.strip()!r}",
                  file=sys.stderr, flush=True)
            with open(job["out"] + ".partial", "a") as fh:  # progress survives an interrupted run
                fh.write(json.dumps(rows[-1]) + "\n")
    Path(job["out"]).write_text(json.dumps({"rows": rows, "own_ids_equal": checked,
                                            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                                            else "", "transformers": transformers.__version__}))
    return 0


def layout_run_longlab(samples: list, variants: list[str], recipes: list[str], chunk_size: int) -> list[dict]:
    """longlab on the given ids: the context prefilled under each recipe (compressed once, after its last
    chunk, as kvpress compresses), the question part fed uncompressed, greedy decoding; scored by the
    harness's metric."""
    import torch

    from longlab.cache import LonglabCache
    from longlab.engine.stream import Stream, eos_token_ids
    from longlab.models import load_model
    from longlab.recipe import parse_recipe
    from longlab.tasks.registry import score_sample
    from longlab.tasks.sample import Sample

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    eos = eos_token_ids(model, tokenizer)
    rows = []
    for variant in variants:
        for raw in samples:
            sample = Sample.from_dict(raw)
            ctx, q = variant_ids(tokenizer, raw, variant)
            t0 = time.perf_counter()
            for recipe in recipes:
                with torch.inference_mode(), LonglabCache(parse_recipe(recipe)) as cache:
                    stream = Stream(model, cache, 1)
                    stream.feed([ctx], chunk_size, compress="end")
                    logits = stream.feed([q], chunk_size, compress="none")
                    (tokens,) = stream.decode(logits, raw["max_new_tokens"], eos)
                prediction = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                rows.append({"variant": variant, "recipe": recipe, "sample_id": sample.sample_id,
                             "prediction": prediction, "score": score_sample(sample, prediction)})
            print(f"longlab {variant} {sample.sample_id}: {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                  flush=True)
    return rows


def layout_run_kvpress(
    args: argparse.Namespace, samples: list, variants: list[str], recipes: list[str]
) -> list[dict]:
    from longlab.models import load_model
    from longlab.paths import cache_dir
    from longlab.tasks.registry import score_sample
    from longlab.tasks.sample import Sample

    _, tokenizer = load_model("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="kvpress-layout-") as tmp:
        job = {"model_dir": str(cache_dir() / "models" / "smollm2-135m"), "recipes": recipes,
               "out": str(Path(tmp) / "out.json"), "items": []}
        for variant in variants:
            for s in samples:
                ctx, q = variant_ids(tokenizer, s, variant)
                job["items"].append({"variant": variant, "sample": s, "ctx": ctx, "q": q,
                                     "max_new_tokens": s["max_new_tokens"]})
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        proc = subprocess.run([str(args.kvpress_python), __file__, "layout", "--kvpress-driver", "--job",
                               str(Path(tmp) / "job.json")], env=env)
        if proc.returncode != 0:
            raise SystemExit(f"kvpress_layout: the kvpress driver failed (exit {proc.returncode})")
        out = json.loads((Path(tmp) / "out.json").read_text())
    bad = [sid for sid, ok in out["own_ids_equal"] if not ok]
    if bad:
        print(f"warning: kvpress's own preprocessing differs from variant 'kvpress' for {bad}",
              file=sys.stderr)
    by_id = {s["sample_id"]: Sample.from_dict(s) for s in samples}
    for row in out["rows"]:
        row["score"] = score_sample(by_id[row["sample_id"]], row["prediction"])
    return out["rows"]


def table(paths: list[str], reference: str) -> int:
    from longlab.eval.stats import paired_difference, score_estimate

    cells: dict[tuple[str, str, str], dict[str, float]] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        side = result["label"]
        for row in result["rows"]:
            cells.setdefault((side, row["variant"], row["recipe"]), {})[row["sample_id"]] = row["score"]
    ref_side, _, ref_variant = reference.partition(":")
    recipes = list(dict.fromkeys(k[2] for k in cells))
    print(f"| side | variant | {' | '.join(recipes)} |")
    print("|---|---|" + "---:|" * len(recipes))
    for side, variant in dict.fromkeys((k[0], k[1]) for k in cells):
        out = []
        for recipe in recipes:
            mine = cells.get((side, variant, recipe))
            ref = cells.get((ref_side, ref_variant, recipe))
            if mine is None:
                out.append("")
                continue
            ids = sorted(mine)
            est = score_estimate([mine[i] for i in ids])
            text = f"{sum(mine.values()):g}/{len(ids)}"
            if ref is not None and (side, variant) != (ref_side, ref_variant) and set(ref) >= set(ids):
                d = paired_difference([mine[i] for i in ids], [ref[i] for i in ids])
                star = "*" if d.significant else ""
                text += f" ({100 * d.mean:+.0f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{star})"
            else:
                text += f" [{100 * est.low:.0f}, {100 * est.high:.0f}]%"
            out.append(text)
        print(f"| {side} | {variant} | {' | '.join(out)} |")
    print(f"(correct / n; in brackets: Wilson 95% interval for the reference {reference}, else the paired "
          "difference from it in points with its 95% bootstrap interval, * = excludes 0)")
    return 0


def layout_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_LAYOUT.splitlines()[0])
    p.add_argument("--cases", type=Path, help="JSONL cases (bench/vs_kvpress.py cases)")
    p.add_argument("--side", choices=("longlab", "kvpress"))
    p.add_argument("--variants", default="kvpress,longlab", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--recipes", default="full,knorm@0.5,streaming@0.5,snapkv@0.5,tova@0.5")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="longlab's prefill chunk (eval's default: 128)")
    p.add_argument("--only", default=None, help="comma-separated sample ids (default: every case)")
    p.add_argument("--label", default=None, help="the side's name in --table (default: --side and chunk)")
    p.add_argument("--kvpress-python", type=Path, default=ROOT / ".venv-kvpress" / "bin" / "python")
    p.add_argument("--out", type=Path)
    p.add_argument("--table", default=None, help="comma-separated result files: print the table")
    p.add_argument("--reference", default="kvpress:kvpress", help="SIDE:VARIANT the table compares with")
    p.add_argument("--kvpress-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kvpress_driver:
        return layout_kvpress_driver(args)
    if args.table:
        return table(args.table.split(","), args.reference)
    if not (args.cases and args.side and args.out):
        p.error("--cases, --side and --out are required (or --table)")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    recipes = [r for r in args.recipes.split(",") if r]
    lines = args.cases.read_text(encoding="utf-8").splitlines()
    samples = [json.loads(line) for line in lines if line.strip()]
    if args.only:
        keep = set(args.only.split(","))
        samples = [s for s in samples if s["sample_id"] in keep]
    t0 = time.perf_counter()
    if args.side == "longlab":
        rows = layout_run_longlab(samples, variants, recipes, args.chunk_size)
        label = args.label or f"longlab/chunk{args.chunk_size}"
    else:
        rows = layout_run_kvpress(args, samples, variants, recipes)
        label = args.label or "kvpress"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"label": label, "cases": str(args.cases), "variants": variants,
                                    "recipes": recipes, "chunk_size": args.chunk_size, "rows": rows,
                                    "seconds": time.perf_counter() - t0,
                                    "command": "python bench/vs_kvpress.py layout " + " ".join(
                                        sys.argv[1:] if argv is None else argv)}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _run_layout() -> object:
    sys.exit(layout_main())


# ---- batched-branches (was bench/vs_kvpress.py batched-branches) ----------------------------------------

DOC_BATCHED_BRANCHES = """
The harness's batched branches, old way against new, side by side on one sample (SmolLM2, one thread).

    python bench/vs_kvpress.py batched-branches   # niah_single_1 at 1,024 tokens, 9 recipes, 3 rounds

One context is prefilled once (the last chunk recorded). Per round, interleaved, each variant forks the
9 branches of ``bench/vs_kvpress.py run``'s sweep, replays their compression, stacks them and feeds the
question and five greedy tokens as one batch:

- ``copy+padded``: deep-copied forks (``Stream.fork``), rows padded without per-row attention
  (``layer.lead_pad = None``), no slots reserved;
- ``shared+ragged``: what ``SampleRunner`` does now: copy-on-write forks (``fork(share=True)``), leading
  padding that attention skips per row, slots reserved for the question and the answer.

Prints the median seconds of each step over the rounds; writes ``bench/results/batched_branches.json``.
""".lstrip("\n")

RECIPES = ["full"] + [f"{m}@{r}{p}" for m, p in (("snapkv", ":window_size=64"), ("streaming", ""),
                                               ("tova", ""), ("knorm", "")) for r in (0.5, 0.75)]


def batched_branches_main() -> int:
    p = argparse.ArgumentParser(description=DOC_BATCHED_BRANCHES.splitlines()[0])
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "batched_branches.json"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from longlab import load_model
    from longlab.cache import LonglabCache
    from longlab.engine.decode import stack_streams
    from longlab.engine.stream import Stream
    from longlab.hook import ChunkRecorder, replay_compression
    from longlab.prompt import encode_prompts
    from longlab.recipe import Recipe
    from longlab.tasks import generate_samples

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    s = generate_samples(args.task, tok, args.length, 1, 0)[0]
    (ctx,), (q,) = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix], True)
    shared = Stream(model, LonglabCache(None), 1)
    rec = ChunkRecorder()
    shared.cache.recipe = Recipe(kv=[rec])
    shared.feed([ctx], 4096, compress="end")
    shared.cache.recipe = Recipe()
    hw = hardware()
    times: dict[str, dict[str, list[float]]] = {
        name: {"fork+replay": [], "stack": [], "question": [], "decode5": []}
        for name in ("copy+padded", "shared+ragged")
    }

    def one_round(new: bool) -> None:  # the four steps of one variant, each timed
        t = times["shared+ragged" if new else "copy+padded"]
        t0 = time.perf_counter()
        forks = []
        for recipe in RECIPES:
            f = shared.fork(recipe, share=new)
            replay_compression(f.cache, rec.records)
            forks.append(f)
        t1 = time.perf_counter()
        st = stack_streams(forks, len(q) + 6 if new else 0)
        if not new:
            for layer in st.cache.layers:
                layer.lead_pad = None
        t2 = time.perf_counter()
        logits = st.feed([q] * len(forks), 4096, compress="none")
        t3 = time.perf_counter()
        for _ in range(5):
            logits = st.feed([[int(x)] for x in logits.argmax(-1)], 4096, compress="none")
        t4 = time.perf_counter()
        for key, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[key].append(v)

    # rounds interleaved, the order rotated per round (copy, shared; shared, copy; ...): common.interleaved
    timing = interleaved(
        {"copy+padded": lambda: one_round(False), "shared+ragged": lambda: one_round(True)},
        repeats=args.rounds,
        warmup=0,
    )
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    print(f"{args.task} at {args.length} tokens, {len(RECIPES)} branches, {args.rounds} rounds; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    for name, m in med.items():
        print(f"{name:<14} " + "  ".join(f"{k} {v:.3f}s" for k, v in m.items()))
    write_json(args.out, {"hardware": hw, "setup": vars(args), "recipes": RECIPES, "median_s": med,
                          "all_s": times, "load_before": timing["load_before"],
                          "load_after": os.getloadavg()})
    return 0


def _run_batched_branches() -> object:
    sys.exit(batched_branches_main())


SUBCOMMANDS = {
    "run": _run_run,
    "cases": _run_cases,
    "layout": _run_layout,
    "batched-branches": _run_batched_branches,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/vs_kvpress.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
