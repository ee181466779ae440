"""Decode-step micro-benchmarks behind docs/results/vs-kvpress.md (issue 10, item 9), one thread, and an A/B.

1. The LM head (SmolLM2: 49,152 x 576) at 9 / 7 / 5 / 3 / 2 / 1 rows: ``F.linear`` against the same
   product in row blocks of the weight, concatenated or written into one buffer (bitwise equal logits).
2. Decode attention for a stacked batch of 9 rows of unequal length (1,700, 4 x 880, 4 x 460 keys;
   3 KV heads x 3 query heads, D = 64): one SDPA call per row over its own keys (what
   ``longlab.attention._ragged_rows`` does) against one padded call with a mask.

Rounds interleave the variants; medians of the per-call times are printed (microseconds).

3. ``--sweep-ab A_SRC B_SRC``: the A/B of a code change on ``longlab eval``'s default path (batched
   decode, the 9 recipes of bench/vs_kvpress.py, answers <= 32 tokens) over ``--spec`` samples, each
   side a subprocess with ``PYTHONPATH=<src>`` (e.g. ``git worktree add /tmp/old HEAD`` for A), rounds
   interleaved; medians, and whether every prediction is the same.

    bench/heavy.sh .venv/bin/python bench/decode_step_kernels.py
    bench/heavy.sh .venv/bin/python bench/decode_step_kernels.py --sweep-ab /tmp/old/src src --spec vt:1600:1
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, n: int) -> float:
    for _ in range(max(2, n // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def interleaved(variants: dict, n: int, rounds: int = 3) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(per_call_us(fn, n))
    return {name: round(statistics.median(t)) for name, t in times.items()}


def lm_head(rows_list: tuple[int, ...] = (9, 7, 5, 3, 2, 1)) -> None:
    W = torch.randn(49152, 576)  # [V, D]

    def blocks(x: torch.Tensor, c: int):
        return lambda: torch.cat([F.linear(x, W[i : i + c]) for i in range(0, W.shape[0], c)], -1)

    def into(x: torch.Tensor, c: int):  # one output buffer, each block written in place
        out = torch.empty(x.shape[0], W.shape[0])

        def run() -> torch.Tensor:
            for i in range(0, W.shape[0], c):
                torch.mm(x, W[i : i + c].t(), out=out[:, i : i + c])
            return out

        return run

    for rows in rows_list:
        x = torch.randn(rows, 576)
        ref = F.linear(x, W)
        variants = {"linear": lambda x=x: F.linear(x, W), "blocks1024": blocks(x, 1024),
                    "blocks2048": blocks(x, 2048), "blocks4096": blocks(x, 4096), "into2048": into(x, 2048)}
        same = {name: torch.equal(fn(), ref) for name, fn in variants.items()}
        print(f"LM head, {rows} rows, us: {interleaved(variants, 20)}; bitwise equal: {same}", flush=True)


def decode_attention() -> None:
    lens, H_kv, g, D = [1700] + [880] * 4 + [460] * 4, 3, 3, 64
    B, T = len(lens), max(lens)
    K, V = torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)  # rows right-aligned, leading padding
    q = torch.randn(B, H_kv, g, D)  # one decode query per row, GQA packed as rows
    lead = [T - n for n in lens]
    mask = (torch.arange(T)[None, :] >= torch.tensor(lead)[:, None])[:, None, None, :]  # [B, 1, 1, T]

    def per_row():
        sdpa = F.scaled_dot_product_attention
        rows = [sdpa(q[b : b + 1], K[b : b + 1, :, s:], V[b : b + 1, :, s:]) for b, s in enumerate(lead)]
        return torch.cat(rows)

    def padded():
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)

    err = (per_row() - padded()).abs().max().item()
    print(f"decode attention per layer, us: {interleaved({'per_row': per_row, 'padded': padded}, 300)}; "
          f"max |difference| {err:.1e}", flush=True)


METHODS = (("snapkv", ":window_size=64"), ("streaming", ""), ("tova", ""), ("knorm", ""))
RECIPES = ["full"] + [f"{m}@{r}{p}" for m, p in METHODS for r in (0.5, 0.75)]  # bench/vs_kvpress.py's 9
TIMES = ("sweep_s", "sweep_cpu_s", "decode_s", "question_s")


def sweep_once(spec: str, model: str = "smollm2-135m") -> dict:
    """``longlab eval``'s default path (batched decode, answers <= 32 tokens) on ``spec``
    (``task:length:n,...``) x the 9 recipes: times and predictions, with this process's ``longlab``
    (whatever PYTHONPATH gives)."""
    import os
    import tempfile

    import longlab
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.eval.store import ResultStore
    from longlab.models import load_model
    from longlab.tasks import generate_samples, save_jsonl

    _, tok = load_model(model)
    parts = [part.split(":") for part in spec.split(",")]
    samples = [s for t, n, k in parts for s in generate_samples(t, tok, int(n), int(k), 0)]
    tmp = tempfile.mkdtemp(prefix="ab-")
    save_jsonl(samples, f"{tmp}/s.jsonl")
    load = os.getloadavg()[0]
    config = EvalConfig(out=f"{tmp}/o", model=model, recipes=RECIPES, jsonl=f"{tmp}/s.jsonl",
                        chunk_size=4096, threads=1, batch_decode=True, report=False, progress=False,
                        max_new_tokens=32)
    summary = run_eval(config, log=lambda m: None)
    with ResultStore(f"{tmp}/o") as store:
        rows = store.rows()
    full = [r for r in rows if r["recipe"] == "full"]  # one row per sample (its batch's times)
    return {"src": longlab.__file__, "sweep_s": summary.sweep_s, "sweep_cpu_s": summary.sweep_cpu_s,
            "decode_s": sum(r["decode_s"] for r in full),
            "question_s": sum(r["extra"].get("batched_question_s", 0.0) for r in full),
            "load": [load, os.getloadavg()[0]],
            "pred": {f"{r['recipe']}|{r['sample_id']}": r["prediction"] for r in rows}}


def sweep_ab(a_src: str, b_src: str, spec: str, rounds: int, model: str = "smollm2-135m") -> None:
    """Interleaved A/B of two source trees (``PYTHONPATH=<src>``, in subprocesses, order alternating per
    round): medians of the sweep's wall/CPU, decode and batched-question seconds; predictions compared."""
    import json
    import os
    import subprocess
    import sys

    res: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(rounds):
        for name, src in (("A", a_src), ("B", b_src)) if r % 2 == 0 else (("B", b_src), ("A", a_src)):
            cmd = [sys.executable, __file__, "--sweep-once", spec, "--model", model]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
            if out.returncode:
                raise SystemExit(f"{name} ({src}) failed:\n{out.stderr[-3000:]}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            res[name].append(run)
            print(name, run["src"], {k: round(run[k], 3) for k in TIMES}, "load", run["load"], flush=True)
    for key in TIMES:
        ma, mb = (statistics.median(x[key] for x in res[n]) for n in "AB")
        print(f"median {key}: A {ma:.3f} B {mb:.3f} B/A {mb / ma:.3f} "
              f"(A {[round(x[key], 2) for x in res['A']]}, B {[round(x[key], 2) for x in res['B']]})")
    first = res["A"][0]["pred"]
    same = all(x["pred"] == first for n in "AB" for x in res[n])
    print(f"predictions identical in all {2 * rounds} runs: {same} ({len(first)} rows each)")


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep-ab", nargs=2, metavar=("A_SRC", "B_SRC"),
                   help="instead: interleaved A/B of longlab eval's default path with two source trees")
    p.add_argument("--spec", default="vt:1600:1", help="samples for --sweep-ab: task:length:n,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m", help="for --sweep-ab (tiny-llama: a quick smoke test)")
    p.add_argument("--sweep-once", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.sweep_once:
        print(json.dumps(sweep_once(args.sweep_once, args.model)))
    elif args.sweep_ab:
        sweep_ab(*args.sweep_ab, args.spec, args.rounds, args.model)
    else:
        lm_head()
        decode_attention()
