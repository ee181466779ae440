"""Position methods on SmolLM2: perplexity, held-out loss, long passkey, LongRoPE search, re-rotation cost,
task rows, UPI on a hybrid.

Subcommands (``python bench/position.py SUB --help`` for each one's options):

- ``ppl``: Perplexity vs position for position methods on one long text (chunked prefill, so memory is
  O(chunk · n)).
- ``heldout``: Held-out next-token loss at the recalibration length (512) for the base model and each
  position variant, untrained and recalibrated: how far the recalibration got back (the windows ``longlab
  train`` holds out).
- ``longrope-search``: LongRoPE factor search on SmolLM2 at CPU scale, with a cheap proxy objective (issue
  14).
- ``rerotate``: Cost of dynamic NTK's re-rotation of cached keys: decode ms/token with and without it.
- ``tasks``: Task rows for chosen position methods only (``longlab eval --positions-only``; ``none`` = own
  RoPE), also with a KV budget applied after every chunk (``--compress chunk``, 16k-32k), added to the
  committed copy the position page reads.
- ``variants``: Keep the training figures of recalibrated variants (runs/ is not committed): copy each
  variant's manifest, without its weights record, into ``bench/results/position/variants.json`` keyed by the
  position spec the sweep evaluates it under (``repo:weights=runs/position/repo-smollm2-s80``).
- ``upi``: UPI on a small hybrid Mamba2-attention model trained on a synthetic recall task, evaluated at
  1×-8× the training length with no scaling, YaRN alone, UPI (Δ/n on the top-20% ERF heads + YaRN) and all
  heads scaled.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
from common import run_subcommand

# ---- ppl (was bench/position.py ppl) ----------------------------------------

DOC_PPL = """
Perplexity vs position for position methods on one long text (chunked prefill, so memory is O(chunk · n)).

    bench/heavy.sh .venv/bin/python bench/position.py ppl --methods none,yarn:factor=2 --length 16384 \\
        --out bench/results/position/ppl.json

The text is Python's own documentation (``pydoc_data.topics``, shipped with CPython: natural English prose
none of the recalibrated variants saw), topics in sorted order, joined. One forward pass per method, fed
in ``--chunk`` token chunks through a transformers cache; the per-token negative log-likelihood is binned
by position. Resumable: methods already in ``--out`` are skipped (one JSON object per method).

``--block B`` also keeps the NLL sums of consecutive ``B``-token blocks (``block_nll``: block ``j`` holds
the NLL of predicting tokens ``jB+1 .. (j+1)B``), so that ``longlab report --docs --page results/position``
can give each
perplexity a block-bootstrap interval and each pair of methods a paired test on the same blocks:

    bench/heavy.sh .venv/bin/python bench/position.py ppl --methods yarn:factor=2,ntk:factor=2 \\
        --length 16384 --block 64 --out bench/results/position/ppl_blocks.json
""".lstrip("\n")

def long_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def nll_by_position(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """NLL ``[T-1]`` of each next token, prefilling ``ids [1, T]`` in chunks through a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    prev_last = None
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()  # [C, V]
            logp = torch.log_softmax(logits, dim=-1)
            if prev_last is not None:  # the previous chunk's last token predicts this chunk's first
                out.append(-prev_last[piece[0, 0]].reshape(1))
            out.append(-logp[:-1].gather(1, piece[0, 1:, None])[:, 0])
            prev_last = logp[-1]
    return torch.cat(out)


def ppl_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", required=True, help="comma-separated position specs (none = own RoPE)")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument(
        "--bins", default="0,1024,2048,4096,6144,8192,10240,12288,14336,16384,20480,24576,28672,32768"
    )
    ap.add_argument("--block", type=int, default=0, help="keep NLL sums of blocks of N tokens (0: off)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from longlab.models import load_model
    from longlab.recipe import split_recipes

    out = Path(args.out)
    done = json.loads(out.read_text()) if out.exists() else {}
    bins = [int(b) for b in args.bins.split(",") if int(b) <= args.length]
    for spec in split_recipes(args.methods):
        key = f"{spec}@{args.length}"
        if key in done:
            print(f"skip {key}", flush=True)
            continue
        model, tok = load_model(
            args.model, attn_implementation="sdpa", position=None if spec == "none" else spec
        )
        ids = torch.tensor([tok.encode(long_text(), add_special_tokens=False)[: args.length]])
        start = time.perf_counter()
        nll = nll_by_position(model, ids, args.chunk)
        seconds = time.perf_counter() - start
        rows = []
        for lo, hi in zip(bins, bins[1:]):
            part = nll[lo : hi - 1] if hi - 1 <= len(nll) else nll[lo:]
            if len(part):
                rows.append(
                    {"lo": lo, "hi": hi, "nll": part.mean().item(), "ppl": math.exp(part.mean().item())}
                )
        done[key] = {
            "method": spec,
            "length": args.length,
            "bins": rows,
            "seconds": seconds,
            "tokens": ids.shape[1],
            "chunk": args.chunk,
            "load": os.getloadavg()[0],
        }
        if args.block > 0:
            done[key]["block"] = args.block
            done[key]["block_nll"] = [
                round(nll[j : j + args.block].sum().item(), 4) for j in range(0, len(nll), args.block)
            ]
        print(
            key, " ".join(f"{r['lo']}-{r['hi']}:{r['ppl']:.1f}" for r in rows), f"{seconds:.0f}s", flush=True
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=1))
        os.replace(tmp, out)
        del model


def _run_ppl() -> object:
    ppl_main()


# ---- heldout (was bench/position.py heldout) ----------------------------------------

DOC_HELDOUT = """
Held-out next-token loss at the recalibration length (512) for the base model and each position variant,
untrained and recalibrated: how far the recalibration got back (the windows ``longlab train`` holds out).

    bench/heavy.sh .venv/bin/python bench/position.py heldout --out bench/results/position/heldout.json
""".lstrip("\n")

SPECS = [
    "none",
    "drope",
    "drope:weights=runs/position/drope-smollm2",
    "ropeid:train_len=512",
    "ropeid:train_len=512,weights=runs/position/ropeid-smollm2",
    "repo",
    "repo:weights=runs/position/repo-smollm2",
]


def heldout_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", default="bench/results/position/heldout.json")
    ap.add_argument("--specs", default="", help="comma-separated specs (default: the list above); merged "
                    "into --out, other entries kept")
    args = ap.parse_args()
    from longlab.models import load_model
    from longlab.position.train import heldout_loss, training_windows
    from longlab.recipe import split_recipes

    out = Path(args.out)
    result = {"seq_len": 512, "windows": args.windows, "load": os.getloadavg()[0], "loss": {}}
    if args.specs and out.exists():
        old = json.loads(out.read_text())
        if old.get("windows") == args.windows:
            result["loss"] = old["loss"]
    for spec in split_recipes(args.specs) if args.specs else SPECS:
        weights = spec.split("weights=")[-1] if "weights=" in spec else None
        if weights and not Path(weights).is_dir():
            continue
        model, tok = load_model(
            args.model, attn_implementation="sdpa", position=None if spec == "none" else spec
        )
        held = training_windows(tok, 512, args.windows, seed=1, split="held-out")
        result["loss"][spec] = heldout_loss(model, held)
        print(f"{spec:60s} {result['loss'][spec]:.3f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def _run_heldout() -> object:
    heldout_main()


# ---- longrope-search (was bench/position.py longrope-search) ----------------------------------------

DOC_LONGROPE_SEARCH = """
LongRoPE factor search on SmolLM2 at CPU scale, with a cheap proxy objective (issue 14).

    bench/heavy.sh .venv/bin/python bench/position.py longrope-search --factor 2 --target 16384 --minutes 7 \\
        --out bench/results/position/longrope_search.json

The paper's objective is perplexity on samples at the target length; one 16k-token pass costs ~4 minutes at
one thread here, so the search uses a **position-gap probe** instead: ``--segments`` runs of ``--seg``
consecutive text tokens placed at positions spread evenly over ``[0, target)`` (e.g. 4 × 512 tokens at
positions 0, 5.3k, 10.6k, 15.9k), one forward pass of ``segments·seg`` tokens with a full causal mask.
Queries of the later segments see keys at distances up to ``target`` (the relative angles a 16k input
produces), while the pass costs what a 2k input costs. Objective: mean next-token NLL over the tokens of
segments 2..S, averaged over ``--probes`` probes from different parts of the text. The text is the
pydoc topics text of ``bench/position.py ppl`` from token ``--offset`` on, so the search never sees the
first 16,384 tokens, on which the searched factors are then measured (``position.py ppl``).

The output JSON holds ``rescale`` (loadable as ``longrope:factor=S,factors=OUT``), the search history,
the probe objective of the baselines (own RoPE, PI, NTK, YaRN, LongRoPE's NTK start) and timings.
""".lstrip("\n")

def longrope_search_main() -> None:
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


def _run_longrope_search() -> object:
    longrope_search_main()


# ---- rerotate (was bench/position.py rerotate) ----------------------------------------

DOC_REROTATE = """
Cost of dynamic NTK's re-rotation of cached keys: decode ms/token with and without it.

    bench/heavy.sh .venv/bin/python bench/position.py rerotate --cached 4096 8192 \\
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
""".lstrip("\n")

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


def rerotate_main() -> None:
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


def _run_rerotate() -> object:
    rerotate_main()


# ---- tasks (was bench/position.py tasks) ----------------------------------------

DOC_TASKS = """
Task rows for chosen position methods only, then kept: ``longlab eval --positions M --positions-only``
(exactly the methods given, ``none`` = own RoPE; without ``--positions-only`` eval adds own RoPE, which at
16k costs a ~4-minute prefill per sample), then the new rows are added to the committed copy
(``--committed``, which the position page reads; runs/ is not committed).

    bench/heavy.sh .venv/bin/python bench/position.py tasks --positions yarn:factor=2,dynamic-ntk:factor=2 \\
        --tasks passkey --length 16384 --samples 1
    bench/heavy.sh .venv/bin/python bench/position.py tasks --positions yarn:factor=4 --tasks passkey \\
        --length 32768 --samples 1 --recipe snapkv:budget=4096 --compress chunk

Same settings as ``bench/configs/position.toml`` (full cache, chunk 1,024, greedy, one thread), same
results store (``runs/position/eval``), so rows are resumable and paired by sample id. Cells already in
``--committed`` are not run again (``longlab eval --skip-rows``). With ``--recipe snapkv:budget=4096
--compress chunk`` the cache is cut back to the budget after every 1,024-token chunk (bounded memory and
attention work at 16k-32k: every chunk attends to at most budget + 1,024 keys).
""".lstrip("\n")

#: The fields of a row the committed copy keeps (and ``compress`` when it is ``chunk``).
KEPT_FIELDS = ("model", "recipe", "task", "length", "sample_id", "score", "prediction", "answers",
               "context_tokens", "prefill_s", "created_at")


def export_rows(config, committed: Path) -> int:
    """Add the store's rows of this sweep (its configuration hashes, so not another ``--compress``'s rows
    of the same cells) to the committed JSON list: rows already there are kept as they are; written
    atomically. Returns the number added."""
    from longlab.eval.identity import config_hash
    from longlab.eval.rows import load_rows
    from longlab.safeio import read_json, write_file_atomic

    specs = list(config.positions)
    hashes = {config_hash(config.identity(p)) for p in specs}
    rows = read_json(committed, "--committed") if committed.exists() else []
    if not isinstance(rows, list):
        raise SystemExit(f"--committed {committed}: expected a JSON list of rows")

    def key(r: dict) -> tuple:
        return (r["model"], r["recipe"], r["task"], r["length"], r["sample_id"], r.get("compress", "end"))

    have = {key(r) for r in rows}
    added = 0
    for r in load_rows(config.out):
        if r["config_hash"] not in hashes:
            continue
        kept = {k: r[k] for k in KEPT_FIELDS}
        if config.compress != "end":
            kept["compress"] = config.compress
        if key(kept) not in have:
            rows.append(kept)
            have.add(key(kept))
            added += 1
    if added:
        text = json.dumps(rows, separators=(",", ":"), ensure_ascii=False) + "\n"  # one line, as committed
        write_file_atomic(committed, text, "--committed")
    return added


def tasks_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", required=True, help="comma-separated position specs; none = own RoPE")
    ap.add_argument("--tasks", default="passkey")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--recipe", default="full", help="KV recipe, e.g. snapkv:budget=4096 (default full)")
    ap.add_argument("--compress", default="end", choices=("end", "chunk"),
                    help="chunk: the recipe cuts the cache after every chunk (longlab eval --compress chunk)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap on each sample's own answer limit (longlab eval --max-new-tokens)")
    ap.add_argument("--out", default="runs/position/eval")
    ap.add_argument("--committed", default="bench/results/position/task_rows.json",
                    help="the committed rows: their cells are not run again (longlab eval --skip-rows), and "
                         "this run's rows are added to them; '' = neither")
    args = ap.parse_args()
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.recipe import split_recipes

    committed = Path(args.committed) if args.committed else None
    config = EvalConfig(
        out=args.out, model=args.model, recipes=[args.recipe], tasks=args.tasks.split(","),
        lengths=[args.length], samples=args.samples, chunk_size=1024, threads=1, report=False, progress=False,
        compress=args.compress, max_new_tokens=args.max_new_tokens,
        positions=split_recipes(args.positions), positions_only=True,
        skip_rows=str(committed) if committed is not None and committed.exists() else None,
    )
    t0 = time.perf_counter()
    summary = run_eval(config)
    print(f"{args.positions}@{args.length}: {summary.written} new rows, {summary.skipped} skipped, "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    if committed is not None:
        print(f"{export_rows(config, committed)} rows added to {committed}", flush=True)


def _run_tasks() -> object:
    tasks_main()


# ---- variants (was bench/position.py variants) ----------------------------------------

DOC_VARIANTS = """
Keep the training figures of recalibrated variants (runs/ is not committed): copy each variant's manifest,
without its weights record, into ``bench/results/position/variants.json`` keyed by the position spec the
sweep evaluates it under (``repo:weights=runs/position/repo-smollm2-s80``).

    .venv/bin/python bench/position.py variants --add runs/position/repo-smollm2-s80

``longlab report --docs --page results/position`` makes the *Recalibrated variants* table from this file.
""".lstrip("\n")

def variants_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--add", nargs="+", required=True, help="variant directories written by `longlab train`")
    ap.add_argument("--out", default="bench/results/position/variants.json")
    args = ap.parse_args()
    from longlab.position.variants import read_manifest

    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    for directory in args.add:
        manifest = read_manifest(directory)  # checked: format 2, fields present
        manifest.pop("weights_file", None)
        spec = manifest["position"]
        key = f"{spec}{',' if ':' in spec else ':'}weights={directory}"
        data[key] = manifest
        print(f"{key}: {manifest['steps']} steps x {manifest['batch']} x {manifest['seq_len']} tokens, "
              f"held-out {manifest['heldout_loss_before']:.3f} -> {manifest['heldout_loss_after']:.3f}",
              flush=True)
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def _run_variants() -> object:
    variants_main()


# ---- upi (was bench/position.py upi) ----------------------------------------

DOC_UPI = """
UPI on a small hybrid Mamba2-attention model trained on a synthetic recall task, evaluated at 1×-8× the
training length with no scaling, YaRN alone, UPI (Δ/n on the top-20% ERF heads + YaRN) and all heads scaled.

    bench/heavy.sh .venv/bin/python bench/position.py upi --task passkey --train-len 64 --steps 1000 \
        --seeds 0 1 2 --eval-n 96 --out bench/results/position/upi_passkey.json

``--task passkey`` (default; the layers lab's task, ``longlab.lab.tasks.PasskeyTask``: BOS, filler from 8
symbols, KEY and 5 digits at a random place, more filler, QUERY, the 5 digits; a sequence's score is the
fraction of the 5 digits predicted right, greedy, teacher-forced): the 2-attention-layer models of the lab
learn it at 64 tokens in a few hundred steps. Training follows the lab: AdamW (0.9, 0.95), weight decay 0.1,
lr 3e-3 with 5% linear warm-up and cosine to 10%, batch 32, clip 1. Every variant is scored on the same
``eval-n`` test sequences per length (drawn once, the same for every seed), so differences are paired.

``--task kv`` (the two earlier runs, kept to reproduce them): random filler with ``pairs`` key-value pairs,
``queries`` × (QUERY, key) each followed by its value; the hybrid never got past picking one of the planted
values there. The model: ``HybridLM`` (longlab.position.upi), layers MAMA, d_model 64, 4 heads.
""".lstrip("\n")

KEYS, VALUES, FILLER, QUERY = range(0, 16), range(16, 32), range(32, 62), 62


def batch(n: int, length: int, pairs: int = 4, queries: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FILLER.start, FILLER.stop, (n, length), generator=g)
    targets = torch.full((n, length), -100)
    body = length - 3 * queries
    for b in range(n):
        keys = torch.randperm(16, generator=g)[:pairs]
        vals = torch.randint(VALUES.start, VALUES.stop, (pairs,), generator=g)
        slots = torch.randperm(body // 2 - 1, generator=g)[:pairs] * 2
        for k, v, s in zip(keys, vals, slots):
            ids[b, s], ids[b, s + 1] = k, v
        for q in range(queries):
            i = torch.randint(0, pairs, (1,), generator=g).item()
            at = body + 3 * q
            ids[b, at], ids[b, at + 1], ids[b, at + 2] = QUERY, keys[i], vals[i]
            targets[b, at + 1] = vals[i]  # logits at the key predict the value
    return ids, targets


def accuracy(model, length: int, n: int, seed: int, pairs: int = 4, queries: int = 2) -> tuple[float, float]:
    ids, targets = batch(n, length, pairs, queries, seed=seed)
    with torch.no_grad():
        logits = model(ids)
    mask = targets != -100
    acc = (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask]).item()
    return acc, loss


VARIANTS = {
    "none": None,
    "yarn only": "upi:heads=none",
    "UPI (top 20% + YaRN)": "upi",
    "all heads + YaRN": "upi:heads=all",
}


MORE = {"top 20% Δ/n only": "upi:yarn=false", "all heads Δ/n only": "upi:heads=all,yarn=false"}


def lr_at(step: int, steps: int, lr: float) -> float:
    """The lab's schedule: linear warm-up over 5% of the steps, then cosine to 10% of ``lr``."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def passkey_scores(model, task, tokens: torch.Tensor, targets: torch.Tensor, answer: torch.Tensor,
                   chunk: int = 16) -> list[float]:
    """Per-sequence fraction of the answer digits predicted right (``tokens [N, T]``)."""
    out = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], chunk):
            logits = model(tokens[i : i + chunk])
            right = (logits.argmax(-1) == targets[i : i + chunk]) & answer[i : i + chunk]
            out += (right.sum(-1).float() / answer[i : i + chunk].sum(-1).float()).tolist()
    return out


def run_passkey(args) -> dict:
    from longlab.lab.tasks import PasskeyTask
    from longlab.position import apply_position
    from longlab.position.upi import HybridConfig, HybridLM

    task = PasskeyTask()
    variants = {**VARIANTS, **(MORE if args.more else {})}
    tests = {}
    for mult in args.mults:
        length = args.train_len * mult
        b = task.sample(args.eval_n, length, torch.Generator().manual_seed(12_345 + length), exact=False)
        tests[mult] = (b.tokens, b.targets, b.answer)
    result: dict = {"task": "passkey", "train_len": args.train_len, "steps": args.steps, "batch": args.batch,
                    "lr": args.lr, "eval_n": args.eval_n, "layers": args.layers, "seeds": [],
                    "load_start": os.getloadavg()[0]}
    for seed in args.seeds:
        torch.manual_seed(seed)
        cfg = HybridConfig(vocab_size=task.vocab_size, layers=args.layers,
                           max_position_embeddings=args.train_len)
        model = HybridLM(cfg)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        start, losses = time.perf_counter(), []
        model.train()
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
            bt = task.sample(args.batch, args.train_len, g, exact=False)
            loss = task.loss(model(bt.tokens), bt)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if (step + 1) % 100 == 0:
                print(f"seed {seed} step {step + 1} loss {sum(losses[-100:]) / 100:.4f} "
                      f"{time.perf_counter() - start:.0f}s", flush=True)
        train_s = time.perf_counter() - start
        model.eval()
        rows = []
        for mult, (tokens, targets, answer) in tests.items():
            for name, spec in variants.items():
                m = copy.deepcopy(model)
                erf = None  # the Δ divisor of every Mamba head (which heads UPI chose)
                if spec is not None and mult > 1:
                    apply_position(m, f"{spec}{',' if ':' in spec else ':'}factor={mult}")
                    erf = [float(x) for mx in m.mixers if hasattr(mx, "dt_scale") for x in mx.dt_scale]
                chunk = max(1, 16 * 512 // tokens.shape[1])  # bounds the [B, H, T, T] scan tensors
                scores = passkey_scores(m, task, tokens, targets, answer, chunk=chunk)
                rows.append({"length": args.train_len * mult, "factor": mult, "variant": name,
                             "mean": sum(scores) / len(scores), "scores": [round(x, 3) for x in scores],
                             "dt_scale": erf})
                print(f"seed {seed} {args.train_len * mult:5d} {name:22s} score {rows[-1]['mean']:.3f}",
                      flush=True)
        result["seeds"].append({"seed": seed, "train_seconds": train_s, "final_train_loss":
                                sum(losses[-50:]) / min(50, len(losses)), "load": os.getloadavg()[0],
                                "rows": rows})
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after every seed: a partial run is kept
    return result


def upi_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4, help="key-value pairs planted per sequence")
    ap.add_argument("--queries", type=int, default=2, help="queries per sequence (answers scored)")
    ap.add_argument("--out", default="bench/results/position/upi.json")
    ap.add_argument("--task", choices=("passkey", "kv"), default="passkey")
    ap.add_argument("--train-len", type=int, default=64, help="passkey: training length")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="passkey: training seeds")
    ap.add_argument("--lr", type=float, default=3e-3, help="passkey: peak learning rate")
    ap.add_argument("--layers", default="MAMA", help="passkey: M = Mamba2 mixer, A = attention")
    ap.add_argument("--mults", type=int, nargs="+", default=[1, 2, 4, 8], help="passkey: test/train length")
    ap.add_argument("--more", action="store_true", help="passkey: also the Δ/n variants without YaRN")
    args = ap.parse_args()
    if args.task == "passkey":
        if args.batch == 16:
            args.batch = 32
        run_passkey(args)
        return
    from longlab.position import apply_position
    from longlab.position.upi import HybridConfig, HybridLM

    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, layers="MAMA", max_position_embeddings=128)
    model = HybridLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    start, step, losses = time.perf_counter(), 0, []
    while step < args.steps and time.perf_counter() - start < 60 * args.minutes:
        ids, targets = batch(args.batch, 128, args.pairs, args.queries, seed=1000 + step)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 100 == 0:
            print(
                f"step {step} loss {sum(losses[-100:]) / 100:.3f} {time.perf_counter() - start:.0f}s",
                flush=True,
            )
    train_s = time.perf_counter() - start
    model.eval()
    variants = {
        "none": None,
        "yarn only": "upi:heads=none",
        "UPI (top 20% + YaRN)": "upi",
        "all heads + YaRN": "upi:heads=all",
    }
    result = {
        "train_steps": step,
        "train_seconds": train_s,
        "train_tokens": step * args.batch * 128,
        "final_train_loss": sum(losses[-100:]) / min(100, len(losses)),
        "eval_n": args.eval_n,
        "pairs": args.pairs,
        "queries": args.queries,
        "answers_per_cell": args.eval_n * args.queries,
        "load": os.getloadavg()[0],
        "rows": [],
    }
    for mult in (1, 2, 4, 8):
        length = 128 * mult
        for name, spec in variants.items():
            m = copy.deepcopy(model)
            if spec is not None and mult > 1:
                apply_position(m, f"{spec}{',' if ':' in spec else ':'}factor={mult}")
            acc, loss = accuracy(m, length, args.eval_n, seed=99, pairs=args.pairs, queries=args.queries)
            result["rows"].append(
                {"length": length, "factor": mult, "variant": name, "acc": acc, "loss": loss}
            )
            print(f"{length:5d} {name:24s} acc {acc:.3f} loss {loss:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def _run_upi() -> object:
    upi_main()


SUBCOMMANDS = {
    "ppl": _run_ppl,
    "heldout": _run_heldout,
    "longrope-search": _run_longrope_search,
    "rerotate": _run_rerotate,
    "tasks": _run_tasks,
    "variants": _run_variants,
    "upi": _run_upi,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/position.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
