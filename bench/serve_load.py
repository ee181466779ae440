"""Load on ``longlab serve``: continuous batching vs the same requests one at a time, side by side.

Two servers on loopback in this process, on one loaded model: *batched* (``max_batch`` 16: requests join
the running batch between decode steps) and *serial* (``max_batch`` 1: one request at a time, as a
global lock around generation does, e.g. llama-cpp-python's server). For each concurrency (bounded
asyncio clients, each sending ``--requests`` streaming chat requests one after another), both servers
answer the same requests, the order alternating by repeat. Contexts are ~``--tokens`` tokens, recipes
alternate ``full`` / ``snapkv@0.5``, greedy, ``--max-tokens`` each. Recorded per run: generated tokens
per second of wall time, p50/p95 TTFT (first content chunk) and latency, the scheduler's peak KV bytes
and peak running requests (docs/results/serve-load.md shows the stored results: ``longlab report
--docs``). A budget phase then sends the same requests all-``full`` and
all-``snapkv@0.5`` to a server whose ``kv_budget`` is ``--budget-rows`` full requests: the peak rows it
admitted and the bytes it held under each.

    bench/heavy.sh .venv/bin/python bench/serve_load.py --clients 1,4,16 --requests 2 \
        --out bench/results/serve_load.json

Other modes (one at a time):

- ``--profile``: engine only (no HTTP), where the time of continuous batching goes: ``max(--clients)``
  requests of the same load, first a few one at a time, then all as the server's scheduler drives them
  (one admission, then one decode step, alternating); the prefill seconds of each admission and the
  decode step time by batch rows (``--out``, default ``bench/results/serve_profile.json``).
- ``--router POLICY``: N ``longlab serve`` processes behind a router on loopback (the recipe of
  docs/serving.md, end to end): ``prefix-hash`` (``python -m longlab.serve.router``) or one of
  sglang-router's policies (``cache_aware``, ``round_robin``, ...; ``--router-python``: a Python with
  ``sglang-router`` installed, not a longlab dependency). ``--prompts`` distinct long prompts are sent
  ``--repeats`` times each through the router (recipes alternating full / snapkv@0.5); recorded: which
  worker served each request (from each worker's ``/metrics``), the share of repeats that reached the
  worker their prompt first went to, whether the recipe reached the worker, and whether every answer
  equals the same request sent straight to a worker.
- ``--replicas N``: the same load on Ray Serve with 1 replica and with N.
- ``--budget-only``: only the budget phase (snapkv@0.5 vs full under one ``kv_budget``).

    bench/heavy.sh .venv/bin/python bench/serve_load.py --profile --clients 16
    python bench/serve_load.py --router prefix-hash --model tiny-llama \
        --out bench/results/serve_router_prefix-hash.json
    python bench/serve_load.py --router cache_aware --router-python /tmp/sglvenv/bin/python \
        --model tiny-llama --out bench/results/serve_router_cache_aware.json
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
        ttft, text, usage, last, gap, info = None, "", None, None, 0.0, {}
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
            info = (chunk.model_extra or {}).get("longlab") or info  # the final chunk: recipe, KV bytes
        out.append({"recipe": recipe, "ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": text,
                    "max_gap_s": gap, "tokens": usage.completion_tokens if usage else 0,
                    "kv_bytes_before": info.get("kv_bytes_before"),
                    "kv_bytes_after": info.get("kv_bytes_after"), "served_recipe": info.get("recipe")})
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
        "kv_bytes_after_median": {  # per recipe: what a request's cache held after its prefill (compressed)
            rec: statistics.median(r["kv_bytes_after"] for r in reqs if r["recipe"] == rec)
            for rec in sorted({r["recipe"] for r in reqs if r.get("kv_bytes_after") is not None})},
    }
    if sched is not None:  # an in-process server: what its scheduler thread did
        out.update(peak_kv_bytes=sched.peak_held, peak_running=sched.peak_running,
                   scheduler=dict(sched.stats))
    return out


def _reset(sched: Any) -> None:
    sched.peak_held = sched.peak_running = 0
    sched.stats = {k: 0 for k in sched.stats}


def replicas_main(args: Any, clients: list[int]) -> int:
    """``--replicas N``: the same load on Ray Serve with 1 replica and with N (each replica one thread,
    ``max_batch`` 16), the order alternating by repeat; the same requests as the batched/serial runs."""
    from longlab import load_model
    from longlab.serve.replicas import start_replicas, stop_replicas

    _, tok = load_model(args.model)
    contexts = [_context(tok, args.tokens, i) for i in range(max(max(clients) * args.requests, 16))]
    if args.question is not None:
        contexts = [c.rsplit("\n\n", 1)[0] + "\n\n" + args.question for c in contexts]
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


def profile_main(args: Any, n: int) -> int:
    """``--profile``: the engine alone (no HTTP, no scheduler thread) on ``n`` requests of the load; the
    time inside ``Stream.feed`` (the model's forwards) is split from the rest of each step."""
    from collections import defaultdict

    from longlab import Engine, Request, load_model
    from longlab.engine.stream import Stream

    model, tok = load_model(args.model)
    contexts = [_context(tok, args.tokens, i) for i in range(n)]
    recipes = ("full", "snapkv@0.5")
    forward = {"s": 0.0}
    feed = Stream.feed

    def timed_feed(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return feed(self, *a, **k)
        finally:
            forward["s"] += time.perf_counter() - t

    Stream.feed = timed_feed  # type: ignore[method-assign]

    def req(i: int) -> Any:
        return Request(messages=[{"role": "user", "content": contexts[i]}], recipe=recipes[i % 2],
                       max_new_tokens=args.max_tokens)

    serial_n = min(n, 4)
    engine, t0, pre, dec, tokens = Engine(model, tok), time.perf_counter(), 0.0, 0.0, 0
    for i in range(serial_n):
        engine.submit(req(i))
        while engine.busy:
            admitting, s = engine.progress() == {} and engine.busy, time.perf_counter()
            done = engine.step()
            tokens += sum(len(r.token_ids) for r in done)
            if admitting:
                pre += time.perf_counter() - s
            else:
                dec += time.perf_counter() - s
    serial = {"requests": serial_n, "wall_s": time.perf_counter() - t0, "prefill_s": pre, "decode_s": dec,
              "generated_tokens": tokens}
    print(f"one at a time, {serial_n} requests: {serial['wall_s']:.1f} s, prefill {pre:.1f} s, "
          f"decode {dec:.1f} s, {tokens} tokens", flush=True)
    engine, queue, log, last, tokens = Engine(model, tok), list(range(n)), [], False, 0
    t0 = time.perf_counter()
    while queue or engine.busy:
        rows = len(engine.progress())
        kind = "decode"
        if queue and not (last and rows):
            engine.submit(req(queue.pop(0)))
            kind, last = "admit", True
        else:
            last = False
        forward["s"] = 0.0
        s = time.perf_counter()
        done = engine.step()
        log.append((kind, rows, time.perf_counter() - s, forward["s"]))
        tokens += sum(len(r.token_ids) for r in done)
    wall = time.perf_counter() - t0
    admits = [d for k, _, d, _ in log if k == "admit"]
    steps = [(r, d, f) for k, r, d, f in log if k == "decode" and r]
    print(f"batched, {n} requests: {wall:.1f} s, admissions {sum(admits):.1f} s, "
          f"decode {sum(d for _, d, _ in steps):.1f} s over {len(steps)} steps, {tokens} tokens")
    by: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r, d, f in steps:
        by[r].append((d, f))
    by_rows = {}
    for r in sorted(by):
        med = statistics.median(d for d, _ in by[r])
        fwd = statistics.median(f for _, f in by[r])
        by_rows[str(r)] = {"steps": len(by[r]), "step_median_s": med, "forward_median_s": fwd,
                           "per_row_s": med / r}
        print(f"  {r:2d} rows: {len(by[r]):3d} steps, median {med * 1000:.0f} ms "
              f"(forward {fwd * 1000:.0f} ms), {med / r * 1000:.0f} ms per row", flush=True)
    print("admission (prefill) seconds:", " ".join(f"{d:.2f}" for d in admits))
    batched = {"requests": n, "wall_s": wall, "admissions_s": admits, "decode_s": sum(d for _, d, _ in steps),
               "decode_steps": len(steps), "decode_by_rows": by_rows, "generated_tokens": tokens}
    # all n admitted first, then decoded to the end: the decode step time from n rows down to 1 (rows leave
    # as they finish), the most a step can batch
    engine, t0, sweep, tokens, admit_s = Engine(model, tok), time.perf_counter(), defaultdict(list), 0, []
    for i in range(n):
        engine.submit(req(i))
        s = time.perf_counter()
        engine.step()
        admit_s.append(time.perf_counter() - s)
    while engine.busy:
        rows, s = len(engine.progress()), time.perf_counter()
        forward["s"] = 0.0
        done = engine.step()
        sweep[rows].append((time.perf_counter() - s, forward["s"]))
        tokens += sum(len(r.token_ids) for r in done)
    Stream.feed = feed  # type: ignore[method-assign]
    admit_all = {"requests": n, "wall_s": time.perf_counter() - t0, "admissions_s": admit_s,
                 "generated_tokens": tokens, "decode_by_rows": {}}
    for r in sorted(sweep):
        med = statistics.median(d for d, _ in sweep[r])
        admit_all["decode_by_rows"][str(r)] = {
            "steps": len(sweep[r]), "step_median_s": med, "per_row_s": med / r,
            "forward_median_s": statistics.median(f for _, f in sweep[r])}
        print(f"  admit all, then decode: {r:2d} rows: {len(sweep[r]):3d} steps, median {med * 1000:.0f} ms, "
              f"{med / r * 1000:.0f} ms per row", flush=True)
    path = write_json(args.out or "bench/results/serve_profile.json",
                      {"hardware": hardware(), "args": vars(args), "one_at_a_time": serial,
                       "batched": batched, "admit_all_then_decode": admit_all})
    print(f"wrote {path}")
    return 0


def decode_sweep_main(args: Any) -> int:
    """``--decode-sweep``: the decode step time by batch rows on ~``--tokens``-token caches, without the
    scheduler: one ``full`` and one ``snapkv@0.5`` prefill of the load's first prompt, copied into R rows
    (all ``full``, or alternating ``full`` / ``snapkv@0.5``: rows of unequal length) and stacked as the
    engine's shared batch stacks them; median of 5 steps after one warm-up, a lone stream (a request
    decoding alone) beside them."""
    from longlab import load_model
    from longlab.cache import LonglabCache
    from longlab.engine.decode import stack_streams
    from longlab.engine.stream import Stream
    from longlab.prompt import encode_messages

    model, tok = load_model(args.model)
    ctx, q = encode_messages(tok, [{"role": "user", "content": _context(tok, args.tokens, 0)}], "", True)
    caches = {}
    for recipe in ("full", "snapkv@0.5"):
        stream = Stream(model, LonglabCache(recipe), 1)
        t0 = time.perf_counter()
        stream.feed([ctx + q], 4096, compress="end")
        caches[recipe] = (stream, time.perf_counter() - t0, stream.cache.nbytes())

    def median_step(stream: Any) -> float:
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            stream.feed([[100]] * stream.batch_size, compress="none")
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    lone = median_step(caches["full"][0].fork())
    rows: dict[str, dict[str, float]] = {}
    for r in (1, 2, 4, 8, 16):
        for kind in ("full", "mixed"):
            streams = [caches["full" if kind == "full" or i % 2 == 0 else "snapkv@0.5"][0].fork()
                       for i in range(r)]
            rows.setdefault(str(r), {})[kind] = median_step(stack_streams(streams, 8))
            del streams
        step = rows[str(r)]
        print(f"{r:2d} rows: full {step['full'] * 1000:.0f} ms, mixed {step['mixed'] * 1000:.0f} ms per step",
              flush=True)
    path = write_json(args.out or "bench/results/serve_decode_sweep.json", {
        "hardware": hardware(), "args": vars(args), "prompt_tokens": len(ctx) + len(q),
        "prefill_s": {k: v[1] for k, v in caches.items()},
        "cache_bytes": {k: v[2] for k, v in caches.items()},
        "lone_step_s": lone, "step_s_by_rows": rows})
    print(f"lone stream {lone * 1000:.0f} ms per step; wrote {path}")
    return 0


def _requests_per_worker(url: str) -> float:
    try:  # openai's HTTP library: httpx or httpx2
        import httpx
    except ImportError:
        import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "longlab_requests"
               for s in f.samples if s.name.endswith("_total"))


def _wait(url: str, timeout: float = 300) -> None:
    try:  # openai's HTTP library: httpx or httpx2
        import httpx
    except ImportError:
        import httpx2 as httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {timeout:.0f} s")


def router_main(args: Any, p: argparse.ArgumentParser) -> int:
    """``--router POLICY``: ``--workers`` servers behind a router; see the module docstring."""
    import subprocess

    import openai

    repeats = args.repeats or 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ports = [args.base_port + 1 + i for i in range(args.workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "longlab.cli", "serve", "--model", args.model, "--port",
                               str(port), "--log-level", "warning"], env=env) for port in ports]
    workers = [f"http://127.0.0.1:{port}" for port in ports]
    router = f"http://127.0.0.1:{args.base_port}"
    try:
        for w in workers:
            _wait(w + "/health")
        if args.router == "prefix-hash":
            cmd = [sys.executable, "-m", "longlab.serve.router", "--port", str(args.base_port), "--workers",
                   *workers]
        else:
            if not args.router_python:
                p.error("--router-python is needed for sglang-router's policies")
            cmd = [args.router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(args.base_port), "--policy", args.router, "--worker-urls", *workers]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(router + "/health")
        time.sleep(3)
        prompts = [" ".join(f"Record {j}: crate {(j * 7 + i) % 97} sits on shelf {(j * 13 + i) % 89}."
                            for j in range(60)) + f"\nWhich shelf holds crate {i}?"
                   for i in range(args.prompts)]
        via = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=workers[0] + "/v1", api_key="none", max_retries=0, timeout=120)
        rows, counts = [], [_requests_per_worker(w) for w in workers]
        for rep in range(repeats):
            for i, prompt in enumerate(prompts):
                recipe = ("full", "snapkv@0.5")[i % 2]
                body = dict(model=args.model, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                            temperature=0, extra_body={"recipe": recipe})
                out = via.chat.completions.create(**body)
                text = out.choices[0].message.content
                now = [_requests_per_worker(w) for w in workers]
                worker = next(k for k in range(args.workers) if now[k] > counts[k])
                counts = now
                served_as = out.model_extra.get("longlab", {}).get("recipe")  # what the worker ran
                rows.append({"repeat": rep, "prompt": i, "recipe": recipe, "worker": worker, "text": text,
                             "worker_recipe": served_as})
        for r in rows:  # the same request straight to worker 0 (after routing, so it does not skew it)
            body = dict(model=args.model, messages=[{"role": "user", "content": prompts[r["prompt"]]}],
                        max_tokens=8, temperature=0, extra_body={"recipe": r["recipe"]})
            answer = direct.chat.completions.create(**body).choices[0].message.content
            r["same_as_direct"] = answer == r["text"]
        first = {r["prompt"]: r["worker"] for r in rows if r["repeat"] == 0}
        again = [r for r in rows if r["repeat"] > 0]
        sticky = sum(r["worker"] == first[r["prompt"]] for r in again) / max(len(again), 1)
        spread = sorted({w for w in first.values()})
        summary = {"policy": args.router, "workers": args.workers, "requests": len(rows),
                   "repeats_on_first_worker": sticky, "workers_used_by_first_requests": spread,
                   "answers_equal_direct": sum(r["same_as_direct"] for r in rows),
                   "recipe_reached_worker": sum(r["worker_recipe"] == r["recipe"] for r in rows)}
        print(summary)
        path = write_json(args.out or f"bench/results/serve_router_{args.router}.json",
                          {"hardware": hardware(), "args": vars(args), "rows": rows, "summary": summary})
        print(f"wrote {path}")
    finally:
        for proc in procs[::-1]:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--tokens", type=int, default=1000, help="context tokens per request")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats of the load (default 1) or, with --router, of each prompt (default 3)")
    p.add_argument("--budget-rows", type=float, default=4.5,
                   help="budget phase: the budget in full requests (prompt + max_tokens bytes; default 4.5: "
                   "a half keeps the row counts off the edge where batch padding decides)")
    p.add_argument("--budget-clients", type=int, default=12, help="budget phase: requests sent at once")
    p.add_argument("--modes", default="batched,serial",
                   help="servers compared, side by side: batched (prefills sliced every --slice-s), whole "
                   "(batched, prefills not sliced), serial (one request at a time)")
    p.add_argument("--slice-s", type=float, default=0.5, help="the batched server's prefill_slice_s")
    p.add_argument("--budget-slice-s", type=float, default=0.0,
                   help="the budget server's prefill_slice_s (default 0: rows stay long enough for the "
                   "budget, not their lifetime, to bound how many run at once)")
    p.add_argument("--budget-only", action="store_true", help="only the budget phase")
    p.add_argument("--budget-question", default="Copy the first ten records above, one per line.",
                   help="the budget phase's question (a long answer keeps the rows running)")
    p.add_argument("--question", default=None,
                   help="the load phase's question instead of each context's own (e.g. the budget question: "
                        "long answers make a decode-dominated load)")
    p.add_argument("--no-budget", action="store_true", help="skip the budget phase")
    p.add_argument("--profile", action="store_true",
                   help="engine only: prefill per admission and decode step time by rows, max(--clients) "
                   "requests")
    p.add_argument("--decode-sweep", action="store_true",
                   help="the decode step time by batch rows (1-16) on --tokens caches, full and mixed rows")
    p.add_argument("--replicas", type=int, default=0,
                   help="N >= 2: compare Ray Serve with 1 and N replicas instead (one thread each)")
    p.add_argument("--router", metavar="POLICY",
                   help="prefix-hash (longlab.serve.router) or an sglang-router policy (cache_aware, "
                   "round_robin, ...): --workers servers behind the router")
    p.add_argument("--router-python", help="--router: a Python with sglang-router installed")
    p.add_argument("--workers", type=int, default=2, help="--router: servers behind it")
    p.add_argument("--prompts", type=int, default=6, help="--router: distinct prompts")
    p.add_argument("--base-port", type=int, default=18200, help="--router: its port (workers above it)")
    p.add_argument("--out", default=None,
                   help="the JSON written (default bench/results/serve_load.json; serve_profile.json, "
                   "serve_router_POLICY.json, serve_replicas.json, serve_budget.json in the other modes)")
    args = p.parse_args()
    if sum(map(bool, (args.profile, args.replicas, args.router, args.budget_only, args.decode_sweep))) > 1:
        p.error("one of --profile, --decode-sweep, --replicas, --router, --budget-only at a time")
    if args.router:
        if not (2 <= args.workers <= 8 and 1 <= args.prompts <= 64 and 1 <= (args.repeats or 3) <= 10):
            p.error("--router: workers 2-8, prompts 1-64, repeats 1-10")
        return router_main(args, p)
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        p.error("--clients: comma-separated integers, e.g. 1,4,16")
    args.repeats = args.repeats or 1
    if not (1 <= args.requests <= 20 and 1 <= min(clients) and max(clients) <= 64
            and 64 <= args.tokens <= 8192 and 1 <= args.max_tokens <= 512
            and 1 <= args.repeats <= 5 and 1 <= args.budget_rows <= 64
            and 1 <= args.budget_clients <= 16):
        p.error("sizes out of range (requests 1-20, clients 1-64, tokens 64-8192, max-tokens 1-512, "
                "repeats 1-5, budget-rows 1-64, budget-clients 1-16)")
    if set(args.modes.split(",")) - {"batched", "whole", "serial"} or not 0 <= args.slice_s <= 60 \
            or not 0 <= args.budget_slice_s <= 60:
        p.error("--modes: batched, whole, serial; --slice-s and --budget-slice-s: 0-60")
    if args.question is not None and not 1 <= len(args.question) <= 2000:
        p.error("--question: 1-2000 characters")
    if args.profile:
        return profile_main(args, max(clients))
    if args.decode_sweep:
        return decode_sweep_main(args)
    args.out = args.out or ("bench/results/serve_budget.json" if args.budget_only
                            else "bench/results/serve_replicas.json" if args.replicas
                            else "bench/results/serve_load.json")
    if args.replicas:
        if not 2 <= args.replicas <= 8:
            p.error("--replicas: 2-8")
        return replicas_main(args, clients)

    from longlab import Engine, Request, load_model
    from longlab.engine.limits import cache_bytes_per_token
    from longlab.serve import create_app

    model, tok = load_model(args.model)
    modes = [] if args.budget_only else args.modes.split(",")
    # whole: prefills not sliced; serial: its slices never wait for a decode step (no other row runs)
    slices = {"batched": args.slice_s, "whole": 0.0, "serial": args.slice_s}
    apps = {mode: create_app(Engine(model, tok), model_name=args.model, prefill_slice_s=slices[mode],
                             max_batch=1 if mode == "serial" else 16) for mode in modes}
    contexts = [_context(tok, args.tokens, i) for i in range(max(max(clients) * args.requests, 16))]
    if args.question is not None:
        contexts = [c.rsplit("\n\n", 1)[0] + "\n\n" + args.question for c in contexts]
    # a full request's KV bytes: the longest prompt of the budget phase (chat template included) + max_tokens
    # the budget phase asks for a long answer, so rows stay until the budget, not their answer, bounds them
    budget_prompts = [c.rsplit("\n\n", 1)[0] + "\n\n" + args.budget_question
                      for c in contexts[:args.budget_clients]]
    longest = max(Engine(model, tok).check(Request(messages=[{"role": "user", "content": c}]))
                  for c in budget_prompts)
    full_bytes = (longest + args.max_tokens) * cache_bytes_per_token(model)
    if not args.no_budget:
        apps["budget"] = create_app(Engine(model, tok), model_name=args.model, max_batch=16,
                                    kv_budget_bytes=int(args.budget_rows * full_bytes),
                                    prefill_slice_s=args.budget_slice_s)
    servers = {name: _server(app) for name, app in apps.items()}
    recipes = ("full", "snapkv@0.5")
    runs: list[dict] = []
    for rep in range(args.repeats if modes else 0):
        for n in clients:
            per_client = [
                [(contexts[c * args.requests + k], recipes[(c + k) % 2]) for k in range(args.requests)]
                for c in range(n)
            ]
            shift = (rep + clients.index(n)) % len(modes)
            order = modes[shift:] + modes[:shift]  # the order rotates with the concurrency and the repeat
            answers = {}
            for mode in order:
                sched = apps[mode].state.scheduler
                _reset(sched)
                run = asyncio.run(_load(servers[mode][1], args.model, per_client, args.max_tokens))
                answers[mode] = [r["text"] for r in run["requests"]]
                row = {"repeat": rep, "clients": n, "mode": mode, "prefill_slice_s": slices[mode],
                       **_summary(run, sched)}
                runs.append(row)
                print(f"{mode:8s} clients={n:3d} {row['tokens_per_s']:.2f} tok/s  "
                      f"ttft p50 {row['ttft_p50_s']:.2f}s "
                      f"p95 {row['ttft_p95_s']:.2f}s  latency p50 {row['latency_p50_s']:.2f}s "
                      f"p95 {row['latency_p95_s']:.2f}s  peak KV {row['peak_kv_bytes'] / 2**20:.1f} MiB "
                      f"peak rows {row['peak_running']}", flush=True)
            if "serial" in answers:
                for row in runs[-len(modes):]:
                    same = sum(a == b for a, b in zip(answers[row["mode"]], answers["serial"]))
                    row["same_answers_as_serial"] = same
                    print(f"  {row['mode']}: answers equal to serial {same}/{len(answers['serial'])}",
                          flush=True)
            write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs, "partial": True})
    budget = []
    n = args.budget_clients
    for recipe in () if args.no_budget else recipes:
        sched = apps["budget"].state.scheduler
        _reset(sched)
        per_client = [[(budget_prompts[c], recipe)] for c in range(n)]  # n: --budget-clients
        run = asyncio.run(_load(servers["budget"][1], args.model, per_client, args.max_tokens))
        row = {"recipe": recipe, "clients": n, "budget_bytes": int(args.budget_rows * full_bytes),
               **_summary(run, sched)}
        budget.append(row)
        print(f"budget {args.budget_rows:g} full rows, all {recipe}: peak rows {row['peak_running']} (rows "
              f"when the budget refused one: {row['scheduler']['rows_when_budget_full']}), peak KV "
              f"{row['peak_kv_bytes'] / 2**20:.1f} MiB, {row['tokens_per_s']:.2f} tok/s", flush=True)
    ratios: dict[str, dict[str, float]] = {}
    for mode in (m for m in modes if m != "serial"):
        for n in clients:
            b = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["mode"] == mode]
            s = [r["tokens_per_s"] for r in runs if r["clients"] == n and r["mode"] == "serial"]
            if not b or not s:
                continue
            ratios.setdefault(mode, {})[str(n)] = statistics.median(x / y for x, y in zip(b, s))
            print(f"throughput {mode} / serial at {n} clients: {ratios[mode][str(n)]:.2f}x "
                  f"(median of {len(b)} repeats)")
    if budget:
        snap, full = budget[1], budget[0]
        print(f"under the budget, snapkv@0.5 / full: peak rows {snap['peak_running']}/"
              f"{full['peak_running']}, "
              f"peak KV {snap['peak_kv_bytes'] / max(full['peak_kv_bytes'], 1):.2f}x")
    for server, _ in servers.values():
        server.should_exit = True
    path = write_json(args.out, {"hardware": hardware(), "args": vars(args), "runs": runs, "budget": budget,
                                 "throughput_ratio": ratios.get("batched", {}), "throughput_ratios": ratios})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
