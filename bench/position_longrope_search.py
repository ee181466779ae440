"""LongRoPE factor search on SmolLM2 at CPU scale, with a cheap proxy objective (issue 14).

    bench/heavy.sh .venv/bin/python bench/position_longrope_search.py --factor 2 --target 16384 --minutes 7 \\
        --out bench/results/position/longrope_search.json

The paper's objective is perplexity on samples at the target length; one 16k-token pass costs ~4 minutes at
one thread here, so the search uses a **position-gap probe** instead: ``--segments`` runs of ``--seg``
consecutive text tokens placed at positions spread evenly over ``[0, target)`` (e.g. 4 × 512 tokens at
positions 0, 5.3k, 10.6k, 15.9k), one forward pass of ``segments·seg`` tokens with a full causal mask.
Queries of the later segments see keys at distances up to ``target`` (the relative angles a 16k input
produces), while the pass costs what a 2k input costs. Objective: mean next-token NLL over the tokens of
segments 2..S, averaged over ``--probes`` probes from different parts of the text. The text is the
pydoc topics text of ``bench/position_ppl.py`` from token ``--offset`` on, so the search never sees the
first 16,384 tokens, on which the searched factors are then measured (``position_ppl.py``).

The output JSON holds ``rescale`` (loadable as ``longrope:factor=S,factors=OUT``), the search history,
the probe objective of the baselines (own RoPE, PI, NTK, YaRN, LongRoPE's NTK start) and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--target", type=int, default=16384)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--seg", type=int, default=512)
    ap.add_argument("--probes", type=int, default=2)
    ap.add_argument("--offset", type=int, default=32768)
    ap.add_argument("--population", type=int, default=8)
    ap.add_argument("--parents", type=int, default=3)
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--mutate-p", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=7.0, help="evaluation budget (from the first pass)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from position_ppl import long_text

    from longlab.models import load_model
    from longlab.position import use_position
    from longlab.position.rope import with_rescale
    from longlab.position.search import longrope_search, starting_points

    model, tok = load_model(args.model, attn_implementation="sdpa")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    base, original = float(cfg.rope_parameters["rope_theta"]), int(cfg.max_position_embeddings)
    text = tok.encode(long_text(), add_special_tokens=False)
    S, seg = args.segments, args.seg
    starts_pos = [round(j * (args.target - seg) / (S - 1)) for j in range(S)]
    pos = torch.cat([torch.arange(p, p + seg) for p in starts_pos])[None]  # [1, S·seg]
    probes = []
    for k in range(args.probes):
        lo = args.offset + k * S * seg
        if lo + S * seg > len(text):
            raise SystemExit(f"text has {len(text)} tokens, probe {k} needs {lo + S * seg}")
        probes.append(torch.tensor([text[lo : lo + S * seg]]))
    mask = torch.ones_like(probes[0])

    def probe_nll(method) -> float:
        total = 0.0
        with use_position(model, method), torch.no_grad():
            for ids in probes:
                logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0, seg - 1 : -1]
                total += torch.nn.functional.cross_entropy(logits.float(), ids[0, seg:]).item()
        return total / len(probes)

    t0 = time.perf_counter()
    baselines = {"none": probe_nll(None)}
    per_eval = time.perf_counter() - t0
    for spec in (f"pi:factor={args.factor:g}", f"ntk:factor={args.factor:g}", f"yarn:factor={args.factor:g}",
                 f"longrope:factor={args.factor:g}"):
        baselines[spec] = probe_nll(spec)
    print("baselines", {k: round(v, 4) for k, v in baselines.items()}, f"{per_eval:.1f}s/eval", flush=True)
    budget = max(args.population, int(args.minutes * 60 / per_eval))
    starts = starting_points(args.factor, head_dim, original, base)
    t1 = time.perf_counter()
    res = longrope_search(
        lambda lam: probe_nll(with_rescale(args.factor, lam)),
        starts,
        args.factor,
        population=args.population,
        parents=args.parents,
        generations=args.generations,
        mutate_p=args.mutate_p,
        seed=args.seed,
        budget=budget,
        log=lambda m: print(m, flush=True),
    )
    out = res.to_dict()
    out.update(
        probe={
            "segments": S,
            "seg": seg,
            "positions": starts_pos,
            "probes": args.probes,
            "offset": args.offset,
            "target": args.target,
            "objective": "mean NLL over segments 2..S",
        },
        baselines=baselines,
        seconds_per_eval=per_eval,
        search_seconds=time.perf_counter() - t1,
        load=os.getloadavg()[0],
        model=args.model,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, args.out)
    print("best", round(res.score, 4), res.rescale, flush=True)


if __name__ == "__main__":
    main()
