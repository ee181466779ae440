"""Where the time of continuous batching goes, engine only (no HTTP): SmolLM2, N requests of ~1k-token
contexts (recipes alternating full / snapkv@0.5, at most 32 greedy tokens), first 4 of them one at a time,
then all N as the server's scheduler drives them (one admission, then one decode step, alternating).
Prints the prefill seconds per admission and the median decode step time by batch rows.

    bench/heavy.sh .venv/bin/python bench/serve_profile.py 16
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import _context  # noqa: E402


def main() -> int:
    from longlab import Engine, Request, load_model

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    if not 1 <= n <= 64:
        raise SystemExit("N: 1-64")
    model, tok = load_model("smollm2-135m")
    contexts = [_context(tok, 1000, i) for i in range(n)]

    def req(i: int) -> Request:
        return Request(messages=[{"role": "user", "content": contexts[i]}],
                       recipe=("full", "snapkv@0.5")[i % 2], max_new_tokens=32)

    engine, t0, pre, dec = Engine(model, tok), time.perf_counter(), 0.0, 0.0
    for i in range(min(n, 4)):
        engine.submit(req(i))
        while engine.busy:
            admitting, s = engine.progress() == {} and engine.busy, time.perf_counter()
            engine.step()
            if admitting:
                pre += time.perf_counter() - s
            else:
                dec += time.perf_counter() - s
    print(f"one at a time, {min(n, 4)} requests: {time.perf_counter() - t0:.1f} s, prefill {pre:.1f} s, "
          f"decode {dec:.1f} s", flush=True)
    engine, queue, log, last = Engine(model, tok), list(range(n)), [], False
    t0 = time.perf_counter()
    while queue or engine.busy:
        rows = len(engine.progress())
        kind = "decode"
        if queue and not (last and rows):
            engine.submit(req(queue.pop(0)))
            kind, last = "admit", True
        else:
            last = False
        s = time.perf_counter()
        engine.step()
        log.append((kind, rows, time.perf_counter() - s))
    admits = [d for k, _, d in log if k == "admit"]
    steps = [(r, d) for k, r, d in log if k == "decode" and r]
    print(f"batched, {n} requests: {time.perf_counter() - t0:.1f} s, admissions {sum(admits):.1f} s, "
          f"decode {sum(d for _, d in steps):.1f} s over {len(steps)} steps")
    by: dict[int, list[float]] = defaultdict(list)
    for r, d in steps:
        by[r].append(d)
    for r in sorted(by):
        print(f"  {r} rows: {len(by[r])} steps, median {statistics.median(by[r]) * 1000:.0f} ms")
    print("admission (prefill) seconds:", " ".join(f"{d:.2f}" for d in admits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
