"""Cost of dynamic NTK's re-rotation of cached keys: decode ms/token with and without it.

    bench/heavy.sh .venv/bin/python bench/position_rerotate_bench.py --cached 4096 8192 \\
        --out bench/results/position/rerotate.json

``dynamic-ntk:rerotate=true`` (the default) re-rotates every cached key once per forward pass that grows
the base, i.e. at every decode step past the trained length ``L``: O(T) work per step on top of the
attention's own O(T). This times one decode step of SmolLM2-135M (1 token, a cache of ``T`` tokens) for
``dynamic-ntk:factor=2`` with and without the re-rotation, side by side with interleaved repeats (medians),
and the re-rotation of all layers' keys alone.

Set-up, stated because it is not a real prompt: the cache holds ``T`` random keys/values per layer
(N(0, 1); decode cost does not depend on their values), and the model's ``L`` is set to ``--trained``
(default 2,048) in both variants so that every decode step at ``T`` = 4k and 8k is past ``L`` and grows
the base (with SmolLM2's own L = 8,192 a 4k cache never re-rotates). After each step the cache is cropped
back to ``T``, so each step meets the same cache size and re-rotates ``T`` keys per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def _fill(model, cached: int, seed: int):
    """A transformers DynamicCache holding ``cached`` random entries per layer, ``[1, H_kv, T, D]``."""
    from transformers import DynamicCache

    cfg = model.config
    h_kv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(1, h_kv, cached, d, generator=gen)
        v = torch.randn(1, h_kv, cached, d, generator=gen)
        cache.update(k, v, layer)
    return cache


def _set_trained(model, trained: int) -> None:
    from longlab.position.base import find_rotary

    _, _, rotary = find_rotary(model)
    rotary.original_max_seq_len = trained
    rotary.max_seq_len_cached = trained
    rotary.config.max_position_embeddings = trained


def _step(model, cache, cached: int) -> float:
    """Seconds of one decode step at position ``cached``; the cache is cropped back to ``cached`` after."""
    ids = torch.tensor([[42]])
    pos = torch.tensor([[cached]])
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    dt = time.perf_counter() - t0
    cache.crop(-1)  # transformers 5: a negative count removes that many tokens
    return dt


def _rotate_only(cache, cached: int) -> float:
    """Seconds to re-rotate every layer's ``cached`` keys once (the work the hook adds per step)."""
    from longlab.position.rope import rotate_keys

    _, h_kv, _, d = cache.layers[0].keys.shape
    delta = torch.full((d // 2,), 1e-6)
    positions = torch.arange(cached).expand(1, h_kv, cached)
    t0 = time.perf_counter()
    for layer in cache.layers:
        layer.keys = rotate_keys(layer.keys, positions, delta)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cached", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--trained", type=int, default=2048, help="L set in both variants (below every --cached)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="decode steps per repeat and variant")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if min(args.cached) <= args.trained:
        raise SystemExit(f"--cached must all exceed --trained={args.trained} (else no step re-rotates)")
    from longlab.models import load_model

    variants = {"rerotate": "dynamic-ntk:factor=2", "no_rerotate": "dynamic-ntk:factor=2,rerotate=false"}
    models = {}
    for name, spec in variants.items():
        models[name], _ = load_model(args.model, attn_implementation="sdpa", position=spec)
        models[name].eval()
        _set_trained(models[name], args.trained)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_start = os.getloadavg()
    results = []
    for cached in args.cached:
        caches = {name: _fill(models[name], cached, seed=cached) for name in variants}
        moved = {}
        for name in variants:  # warm-up, and a check that exactly the re-rotating variant turns old keys
            before = caches[name].layers[0].keys[..., :8].clone()
            _step(models[name], caches[name], cached)
            moved[name] = not torch.equal(before, caches[name].layers[0].keys[..., :8])
        if moved != {"rerotate": True, "no_rerotate": False}:
            raise SystemExit(f"re-rotation did not happen as expected: cached keys changed = {moved}")
        times: dict[str, list[float]] = {name: [] for name in variants}
        rot: list[float] = []
        for rep in range(args.repeats):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))  # interleaved, alternating
            for name in order:
                for _ in range(args.steps):
                    times[name].append(_step(models[name], caches[name], cached))
            rot.append(_rotate_only(caches["no_rerotate"], cached))
        on = statistics.median(times["rerotate"]) * 1e3
        off = statistics.median(times["no_rerotate"]) * 1e3
        row = {
            "cached": cached,
            "ms_per_token_rerotate": on,
            "ms_per_token_no_rerotate": off,
            "ratio": on / off,
            "ms_rotate_keys_all_layers": statistics.median(rot) * 1e3,
            "samples_per_variant": len(times["rerotate"]),
            "cached_keys_changed_by_a_step": moved,
            "raw_ms": {k: [round(1e3 * t, 2) for t in v] for k, v in times.items()},
            "load": os.getloadavg()[0],
        }
        print(
            f"T={cached}: rerotate {on:.1f} ms/token, without {off:.1f} ms/token, ratio {on / off:.2f}; "
            f"rotation alone {row['ms_rotate_keys_all_layers']:.1f} ms; load {row['load']:.2f}",
            flush=True,
        )
        results.append(row)
        del caches
    record = {
        "model": args.model,
        "methods": variants,
        "trained_len_set": args.trained,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "steps": args.steps,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "rows": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
