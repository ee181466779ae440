"""The harness's batched branches, old way against new, side by side on one sample (SmolLM2, one thread).

    python bench/batched_branches.py                   # niah_single_1 at 1,024 tokens, 9 recipes, 3 rounds

One context is prefilled once (the last chunk recorded). Per round, interleaved, each variant forks the
9 branches of ``bench/vs_kvpress.py``'s sweep, replays their compression, stacks them and feeds the
question and five greedy tokens as one batch:

- ``copy+padded``: deep-copied forks (``Stream.fork``), rows padded without per-row attention
  (``layer.lead_pad = None``), no slots reserved;
- ``shared+ragged``: what ``SampleRunner`` does now: copy-on-write forks (``fork(share=True)``), leading
  padding that attention skips per row, slots reserved for the question and the answer.

Prints the median seconds of each step over the rounds; writes ``bench/results/batched_branches.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, write_json  # noqa: E402

RECIPES = ["full"] + [f"{m}@{r}{p}" for m, p in (("snapkv", ":window_size=64"), ("streaming", ""),
                                               ("tova", ""), ("knorm", "")) for r in (0.5, 0.75)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for new in ((False, True) if r % 2 == 0 else (True, False)):
            name = "shared+ragged" if new else "copy+padded"
            t = times.setdefault(name, {"fork+replay": [], "stack": [], "question": [], "decode5": []})
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
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    print(f"{args.task} at {args.length} tokens, {len(RECIPES)} branches, {args.rounds} rounds; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    for name, m in med.items():
        print(f"{name:<14} " + "  ".join(f"{k} {v:.3f}s" for k, v in m.items()))
    write_json(args.out, {"hardware": hw, "setup": vars(args), "recipes": RECIPES, "median_s": med,
                          "all_s": times, "load_after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
