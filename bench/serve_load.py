"""Load on ``longlab serve``: continuous batching vs the same requests one at a time, side by side.

Two servers on loopback in this process, on one loaded model: *batched* (``max_batch`` 16: requests join
the running batch between decode steps) and *serial* (``max_batch`` 1: one request at a time, as a
global lock around generation does, e.g. llama-cpp-python's server). For each concurrency (bounded
asyncio clients, each sending ``--requests`` streaming chat requests one after another), both servers
answer the same requests, the order alternating by repeat. Contexts are ~``--tokens`` tokens, recipes
alternate ``full`` / ``snapkv@0.5``, greedy, ``--max-tokens`` each. Recorded per run: generated tokens
per second of wall time, p50/p95 TTFT (first content chunk) and latency, the scheduler's peak KV bytes
and peak running requests. A budget phase then sends the same requests all-``full`` and
all-``snapkv@0.5`` to a server whose ``kv_budget`` is ``--budget-rows`` full requests: the peak rows it
admitted and the bytes it held under each.

    bench/heavy.sh .venv/bin/python bench/serve_load.py --clients 1,4,16 --requests 2 \
        --out bench/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, write_json  # noqa: E402


def _server(app: Any) -> tuple[Any, str]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}/v1"


def _context(tokenizer: Any, n_tokens: int, i: int) -> str:
    lines, text = [], ""
    j = 0
    while len(tokenizer(text)["input_ids"]) < n_tokens:
        lines.append(f"Record {j}: item {(j * 7 + i) % 97} is kept in box {(j * 13 + i) % 89}.")
        if j == (i * 5) % 40 + 3:
            lines.append(f"The access code for request {i} is {4000 + i * 37}.")
        j += 1
        if j % 20 == 0:
            text = " ".join(lines)
    return " ".join(lines) + f"\n\nWhat is the access code for request {i}?"


async def _client(client: Any, model: str, jobs: list[tuple[str, str]], max_tokens: int) -> list[dict]:
    out = []
    for ctx, recipe in jobs:
        t0 = time.perf_counter()
        ttft, text, usage, last, gap = None, "", None, None, 0.0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ctx}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"recipe": recipe})
        async for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - t0
                gap = max(gap, now - last) if last is not None else gap  # the longest stall between chunks
                last = now
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        out.append({"recipe": recipe, "ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": text,
                    "max_gap_s": gap, "tokens": usage.completion_tokens if usage else 0})
    return out


async def _load(url: str, model: str, per_client: list[list[tuple[str, str]]], max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    load = os.getloadavg()
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(_client(client, model, jobs, max_tokens) for jobs in per_client))
    wall = time.perf_counter() - t0
    await client.close()
    flat = [r for rs in rows for r in rs]
    return {"wall_s": wall, "requests": flat, "load": load}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(run: dict, sched: Any = None) -> dict:
    reqs = run["requests"]
    tokens = sum(r["tokens"] for r in reqs)
    out = {
        "wall_s": run["wall_s"], "requests": len(reqs), "generated_tokens": tokens,
        "tokens_per_s": tokens / run["wall_s"],
        "ttft_p50_s": _pct([r["ttft_s"] for r in reqs], 0.5),
        "ttft_p95_s": _pct([r["ttft_s"] for r in reqs], 0.95),
        "latency_p50_s": _pct([r["latency_s"] for r in reqs], 0.5),
        "latency_p95_s": _pct([r["latency_s"] for r in reqs], 0.95),
        "max_gap_p50_s": _pct([r["max_gap_s"] for r in reqs], 0.5),
        "max_gap_p95_s": _pct([r["max_gap_s"] for r in reqs], 0.95),
        "load_before": run.get("load"), "load_after": os.getloadavg(),
        "peak_kv_bytes": 0, "peak_running": 0,
    }
    if sched is not None:  # an in-process server: what its scheduler thread did
        out.update(peak_kv_bytes=sched.peak_held, peak_running=sched.peak_running,
                   scheduler=dict(sched.stats))
    return out


def _reset(sched: Any) -> None:
    sched.peak_held = sched.peak_running = 0
    sched.stats = {k: 0 for k in sched.stats}


def _cells(r: dict) -> str:
    sched = r.get("scheduler")
    split = (f"{sched['prefill_s']:.0f} / {sched['decode_s']:.0f} / {sched['other_s']:.1f}"
             if sched else "-")
    load = r.get("load_before")
    gap = f"{r['max_gap_p50_s']:.1f} / {r['max_gap_p95_s']:.1f}" if "max_gap_p50_s" in r else "-"
    return (f"{r['tokens_per_s']:.2f} | {r['ttft_p50_s']:.1f} / {r['ttft_p95_s']:.1f} | "
            f"{r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} | {r['peak_kv_bytes'] / 2**20:.1f} | "
            f"{r['peak_running']} | {gap} | {split} | {load[0]:.1f} |" if load else "- |")


def table(path: str) -> str:
    """A Markdown table of a stored run (``--table JSON``): one row per repeat, concurrency and mode, then
    the medians of the ratios. Scheduler split: seconds the scheduler thread spent in prefill steps /
    decode steps / the rest of its loop; load: the 1-minute load average when the run started."""
    import json

    data = json.loads(Path(path).read_text())
    lines = ["| repeat | clients | mode | tokens/s | TTFT p50 / p95 (s) | latency p50 / p95 (s) "
             "| peak KV (MiB) | peak rows | longest stall p50 / p95 (s) | prefill / decode / other (s) "
             "| load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r.get('repeat', 0)} | {r['clients']} | {r['mode']} | {_cells(r)}")
    for r in data.get("budget", []):
        mib = r["budget_bytes"] / 2**20
        lines.append(f"| - | {r['clients']} | budget {mib:.0f} MiB, all {r['recipe']} | {_cells(r)}")
    for name, label in (("throughput_ratio", "batched / serial"), ("replica_ratio", "N replicas / 1")):
        for n, x in data.get(name, {}).items():
            lines.append(f"\n{label} throughput at {n} clients: **{x:.2f}x** (median over repeats)")
    return "\n".join(lines)


def replicas_main(args: Any, clients: list[int]) -> int:
    """``--replicas N``: the same load on Ray Serve with 1 replica and with N (each replica one thread,
    ``max_batch`` 16), the order alternating by repeat; the same requests as the batched/serial runs."""
    from longlab import load_model
    from longlab.serve.replicas import start_replicas, stop_replicas

    _, tok = load_model(args.model)
    contexts = [_context(tok, args.tokens, i) for i in range(max(max(clients) * args.requests, 16))]
    recipes = ("full", "snapkv@0.5")
    spec = {"model": args.model, "max_batch": 16, "max_queue": 256, "threads": 1}
    runs: list[dict] = []
    port = _free_port()
    try:
        for rep in range(args.repeats):
            for n in clients:
                per_client = [
                    [(contexts[c * args.requests + k], recipes[(c + k) % 2]) for k in range(args.requests)]
                    for c in range(n)
                ]
                order = (1, args.replicas) if (rep + n) % 2 == 0 else (args.replicas, 1)
                for replicas in order:
                    url = start_replicas(spec, replicas, port=port, cpus_per_replica=1)
                    time.sleep(2)
                    run = asyncio.run(_load(url, args.model, per_client, args.max_tokens))
                    row = {"repeat": rep, "clients": n, "mode": f"ray {replicas} replica(s)",
                           "replicas": replicas, **_summary(run)}
                    runs.append(row)
                    print(f"{row['mode']} clients={n:3d} {row['tokens_per_s']:.2f} tok/s ttft p50 "
                          f"{row['ttft_p50_s']:.2f}s latency p50 {row['latency_p50_s']:.2f}s load "
                          f"{row['load_before'][0]:.2f}", flush=True)
                    write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs,
                                          "partial": True})
    finally:
        stop_replicas()
    ratios = {}
    for n in clients:
        one = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["replicas"] == 1]
        many = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["replicas"] == args.replicas]
        ratios[str(n)] = statistics.median(x / y for x, y in zip(many, one))
        print(f"throughput {args.replicas} replicas / 1 at {n} clients: {ratios[str(n)]:.2f}x "
              f"(median of {len(one)} repeats)")
    path = write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs,
                                 "replica_ratio": ratios})
    print(f"wrote {path}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--tokens", type=int, default=1000, help="context tokens per request")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget-rows", type=int, default=4, help="budget phase: the budget in full requests")
    p.add_argument("--budget-clients", type=int, default=12, help="budget phase: requests sent at once")
    p.add_argument("--replicas", type=int, default=0,
                   help="N >= 2: compare Ray Serve with 1 and N replicas instead (one thread each; not "
                   "through bench/heavy.sh, which gives one process one slot)")
    p.add_argument("--out", default="bench/results/serve_load.json")
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    if not (1 <= args.requests <= 20 and 1 <= max(clients) <= 64 and 64 <= args.tokens <= 8192
            and 1 <= args.max_tokens <= 512 and 1 <= args.repeats <= 5 and 1 <= args.budget_rows <= 64
            and 1 <= args.budget_clients <= 16):
        p.error("sizes out of range (requests 1-20, clients 1-64, tokens 64-8192, max-tokens 1-512)")
    if args.replicas:
        if not 2 <= args.replicas <= 8:
            p.error("--replicas: 2-8")
        return replicas_main(args, clients)

    from longlab import Engine, load_model
    from longlab.engine.limits import kv_bytes_per_token
    from longlab.serve import create_app

    model, tok = load_model(args.model)
    apps = {"batched": create_app(Engine(model, tok), model_name=args.model, max_batch=16),
            "serial": create_app(Engine(model, tok), model_name=args.model, max_batch=1)}
    full_bytes = (args.tokens + 40 + args.max_tokens) * kv_bytes_per_token(model)
    apps["budget"] = create_app(Engine(model, tok), model_name=args.model, max_batch=16,
                                kv_budget_bytes=args.budget_rows * full_bytes)
    servers = {name: _server(app) for name, app in apps.items()}
    contexts = [_context(tok, args.tokens, i) for i in range(max(max(clients) * args.requests, 16))]
    recipes = ("full", "snapkv@0.5")
    runs: list[dict] = []
    for rep in range(args.repeats):
        for n in clients:
            per_client = [
                [(contexts[c * args.requests + k], recipes[(c + k) % 2]) for k in range(args.requests)]
                for c in range(n)
            ]
            order = ("batched", "serial") if (rep + n) % 2 == 0 else ("serial", "batched")
            answers = {}
            for mode in order:
                sched = apps[mode].state.scheduler
                _reset(sched)
                run = asyncio.run(_load(servers[mode][1], args.model, per_client, args.max_tokens))
                answers[mode] = [r["text"] for r in run["requests"]]
                row = {"repeat": rep, "clients": n, "mode": mode, **_summary(run, sched)}
                runs.append(row)
                print(f"{mode:8s} clients={n:3d} {row['tokens_per_s']:.2f} tok/s  "
                      f"ttft p50 {row['ttft_p50_s']:.2f}s "
                      f"p95 {row['ttft_p95_s']:.2f}s  latency p50 {row['latency_p50_s']:.2f}s "
                      f"p95 {row['latency_p95_s']:.2f}s  peak KV {row['peak_kv_bytes'] / 2**20:.1f} MiB "
                      f"peak rows {row['peak_running']}", flush=True)
            same = sum(a == b for a, b in zip(answers["batched"], answers["serial"]))
            runs[-1]["same_answers_as_other_mode"] = runs[-2]["same_answers_as_other_mode"] = same
            print(f"  answers equal between modes: {same}/{len(answers['batched'])}", flush=True)
            write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs, "partial": True})
    budget = []
    n = args.budget_clients
    for recipe in recipes:
        sched = apps["budget"].state.scheduler
        _reset(sched)
        per_client = [[(contexts[c], recipe)] for c in range(n)]  # n: --budget-clients
        run = asyncio.run(_load(servers["budget"][1], args.model, per_client, args.max_tokens))
        row = {"recipe": recipe, "clients": n, "budget_bytes": args.budget_rows * full_bytes,
               **_summary(run, sched)}
        budget.append(row)
        print(f"budget {args.budget_rows} full rows, all {recipe}: peak rows {row['peak_running']}, peak KV "
              f"{row['peak_kv_bytes'] / 2**20:.1f} MiB, {row['tokens_per_s']:.2f} tok/s", flush=True)
    ratios = {}
    for n in clients:
        b = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["mode"] == "batched"]
        s = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["mode"] == "serial"]
        ratios[str(n)] = statistics.median(x / y for x, y in zip(b, s))
        print(f"throughput batched / serial at {n} clients: {ratios[str(n)]:.2f}x "
              f"(median of {len(b)} repeats)")
    snap, full = budget[1], budget[0]
    print(f"under the budget, snapkv@0.5 / full: peak rows {snap['peak_running']}/{full['peak_running']}, "
          f"peak KV {snap['peak_kv_bytes'] / max(full['peak_kv_bytes'], 1):.2f}x")
    for server, _ in servers.values():
        server.should_exit = True
    path = write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs, "budget": budget,
                                 "throughput_ratio": ratios})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
