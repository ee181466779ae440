"""N ``longlab serve`` processes behind sglang-router's cache-aware router, on loopback (the recipe of
docs/results/serve-load.md, run end to end).

Starts ``--workers`` servers (``longlab serve --model M --port P_i``, one thread each) and
``python -m sglang_router.launch_router --policy POLICY`` in front of them (``--router-python``: a Python
with ``sglang-router`` installed; it is not a longlab dependency), or ``--policy prefix-hash``:
``python -m longlab.serve.router``, sends ``--prompts`` distinct long prompts
``--repeats`` times each through the router with the ``openai`` client (recipes alternating full /
snapkv@0.5), and reports which worker served each request (from each worker's ``/metrics``), the share of
repeats that reached the worker their prompt first went to, and whether every answer equals the same
request sent straight to a worker.

    python bench/serve_router.py --router-python /tmp/sglvenv/bin/python --model tiny-llama \\
        --out bench/results/serve_router_sglang.json
    python bench/serve_router.py --policy prefix-hash --model tiny-llama \\
        --out bench/results/serve_router_prefix_hash.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, write_json  # noqa: E402


def _requests_per_worker(url: str) -> float:
    try:  # openai's HTTP library: httpx or httpx2
        import httpx
    except ImportError:
        import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "longlab_requests"
               for s in f.samples if s.name.endswith("_total"))


def _wait(url: str, timeout: float = 120) -> None:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--router-python", help="a Python with sglang-router installed (sglang policies)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="cache_aware",
                   help="sglang-router's (cache_aware, round_robin, ...), or prefix-hash "
                   "(longlab.serve.router)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--base-port", type=int, default=18200)
    p.add_argument("--out", default="bench/results/serve_router.json")
    args = p.parse_args()
    if not (2 <= args.workers <= 8 and 1 <= args.prompts <= 64 and 1 <= args.repeats <= 10):
        p.error("workers 2-8, prompts 1-64, repeats 1-10")
    import openai

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ports = [args.base_port + 1 + i for i in range(args.workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "longlab.cli", "serve", "--model", args.model, "--port",
                               str(port), "--log-level", "warning"], env=env) for port in ports]
    workers = [f"http://127.0.0.1:{port}" for port in ports]
    router = f"http://127.0.0.1:{args.base_port}"
    try:
        for w in workers:
            _wait(w + "/health")
        if args.policy == "prefix-hash":
            cmd = [sys.executable, "-m", "longlab.serve.router", "--port", str(args.base_port), "--workers",
                   *workers]
        else:
            if not args.router_python:
                p.error("--router-python is needed for sglang-router's policies")
            cmd = [args.router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(args.base_port), "--policy", args.policy, "--worker-urls", *workers]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(router + "/health")
        time.sleep(3)
        prompts = [" ".join(f"Record {j}: crate {(j * 7 + i) % 97} sits on shelf {(j * 13 + i) % 89}."
                            for j in range(60)) + f"\nWhich shelf holds crate {i}?"
                   for i in range(args.prompts)]
        via = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=workers[0] + "/v1", api_key="none", max_retries=0, timeout=120)
        rows, counts = [], [_requests_per_worker(w) for w in workers]
        for rep in range(args.repeats):
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
        summary = {"policy": args.policy, "workers": args.workers, "requests": len(rows),
                   "repeats_on_first_worker": sticky, "workers_used_by_first_requests": spread,
                   "answers_equal_direct": sum(r["same_as_direct"] for r in rows),
                   "recipe_reached_worker": sum(r["worker_recipe"] == r["recipe"] for r in rows)}
        print(summary)
        path = write_json(args.out, {"hardware": hardware(), "args": vars(args), "rows": rows,
                                     "summary": summary})
        print(f"wrote {path}")
    finally:
        for proc in procs[::-1]:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
