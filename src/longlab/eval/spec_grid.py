"""``longlab eval --speculative D1 D2 --verify V1 V2``: speculative decoding as a grid axis, rows in the
results database.

Each sample is prefilled once per recipe (context, then the question, query-agnostic); the stream is forked
for plain greedy decoding (the reference, recipe label = the recipe) and for every draft x verifier pair
(label ``RECIPE~DRAFT|VERIFY|gamma=G``), in a rotating order. Every row's ``extra`` holds the acceptance rate,
tokens per target forward, decode tokens/s and its ratio to the plain row of the same sample, K/V bytes
read per generated token (and the ratio to plain) and whether the tokens equal plain decoding's. Re-runs
skip stored rows. :func:`spec_table` summarises a results directory (printed at the end of the run).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..cache import LonglabCache
from ..recipe import LonglabError, parse_recipe
from ..spec.api import SpecConfig, prepare
from ..spec.kernels import kv_slot_bytes
from ..tasks import Sample, score_sample
from .stats import bootstrap_ci, paired_difference, score_estimate
from .store import ResultStore, config_hash, make_run_key

__all__ = [
    "run_spec_eval",
    "spec_table",
    "spec_markdown",
    "spec_configs",
    "mean_ci_cell",
    "score_ci_cell",
    "median_cell",
    "paired_cell",
]

SPEC_HARNESS_VERSION = 1


def spec_configs(
    drafts: Sequence[str], verifiers: Sequence[str] | None, gamma: int | None
) -> list[SpecConfig]:
    """Every draft x verifier pair, checked before any model loads."""
    if not drafts:
        raise LonglabError(
            "--speculative is empty: name at least one draft (lookup, self:KVRECIPE, model:NAME)"
        )
    return [prepare(d, v, gamma) for d in drafts for v in (verifiers or ["full"])]


def _plain_bytes(cache: Any, n_tokens: int) -> float:
    """K/V bytes plain decoding reads for ``n_tokens`` tokens (every held slot of every layer per step)."""
    total = 0.0
    for layer in cache.layers:
        if layer.is_initialized:
            T0, slot = layer.index.shape[-1], kv_slot_bytes(layer)
            total += sum((T0 + i + 1) * slot for i in range(n_tokens - 1))
    return total


@torch.inference_mode()
def run_spec_eval(
    out: str,
    model_name: str,
    recipes: Sequence[str],
    specs: Sequence[SpecConfig],
    samples: Sequence[Sample],
    *,
    seed: int = 0,
    max_new_tokens: int | None = None,
    chunk_size: int = 1024,
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
) -> tuple[int, int]:
    """Evaluate plain + every speculative config on every sample x recipe into ``out``; returns
    (rows written, rows skipped)."""
    from ..models import load_model
    from ..pipeline import Stream, encode_prompts, eos_token_ids
    from ..spec.rollback import check_target_recipe

    parsed = [parse_recipe(r) for r in recipes]
    for r in parsed:
        check_target_recipe(r)
    if model is None:
        model, tokenizer = load_model(model_name)
    eos = eos_token_ids(model, tokenizer)
    chash = config_hash(
        {"spec_harness": SPEC_HARNESS_VERSION, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size}
    )
    store = ResultStore(out)
    written = skipped = turn = 0
    try:
        done = store.done_keys()
        for i, s in enumerate(samples):
            for recipe in parsed:
                labels = [recipe.name] + [f"{recipe.name}~{c.name}" for c in specs]
                keys = {
                    lab: make_run_key(
                        model=model_name,
                        recipe=lab,
                        task=s.task,
                        length=s.length,
                        sample_id=s.sample_id,
                        query_aware=False,
                        seed=seed,
                        config_hash=chash,
                    )
                    for lab in labels
                }
                if all(k in done for k in keys.values()):
                    skipped += len(keys)
                    continue
                ctx_ids, q_ids = encode_prompts(tokenizer, [s.context], [s.question], [s.answer_prefix])
                base = Stream(model, LonglabCache(recipe), 1)
                base.pad_id = tokenizer.pad_token_id or 0
                t0 = time.perf_counter()
                logits = base.feed(ctx_ids, chunk_size)
                logits = base.feed(q_ids, chunk_size, compress="none") if q_ids[0] else logits
                prefill_s = time.perf_counter() - t0
                max_new = min(s.max_new_tokens, max_new_tokens or s.max_new_tokens)
                runs: list[tuple[str, SpecConfig | None]] = [(recipe.name, None)] + list(
                    zip(labels[1:], specs)
                )
                shift = turn % len(runs)
                turn += 1
                results = {}
                for label, cfg in runs[shift:] + runs[:shift]:  # interleaved order
                    stream = base.fork()
                    t0 = time.perf_counter()
                    if cfg is None:
                        tokens, info = stream.decode(logits, max_new, eos), {}
                    else:
                        tokens, info = cfg.run(
                            model,
                            tokenizer,
                            stream,
                            logits,
                            [ctx_ids[0] + q_ids[0]],
                            max_new,
                            eos,
                            0.0,
                            1.0,
                            seed,
                        )
                    decode_s = time.perf_counter() - t0
                    n = len(tokens[0])
                    read = (
                        _plain_bytes(base.cache, n)
                        if cfg is None
                        else info["target_kv_bytes"] + info["draft_kv_bytes"]
                    )
                    results[label] = (cfg, tokens[0], decode_s, read, info)
                plain = results[recipe.name]
                load_1m = os.getloadavg()[0]  # the machine's load next to every timing
                rows = []
                for label, (cfg, toks, decode_s, read, info) in results.items():
                    if keys[label] in done:
                        skipped += 1
                        continue
                    prediction = tokenizer.decode(toks, skip_special_tokens=True).strip()
                    speed = (len(toks) / decode_s) / (len(plain[1]) / plain[2])
                    rows.append(
                        {
                            "run_key": keys[label],
                            "model": model_name,
                            "recipe": label,
                            "method": recipe.name,
                            "task": s.task,
                            "length": s.length,
                            "sample_id": s.sample_id,
                            "depth": s.depth,
                            "query_aware": False,
                            "seed": seed,
                            "prediction": prediction,
                            "answers": list(s.answers),
                            "score": score_sample(s, prediction),
                            "prefill_s": prefill_s,
                            "compress_s": 0.0,
                            "decode_s": decode_s,
                            "context_tokens": len(ctx_ids[0]),
                            "config_hash": chash,
                            "kv_bytes_after": base.cache.nbytes(),
                            "recipe_repr": repr(cfg) if cfg else repr(recipe),
                            "spec": cfg.name if cfg else "plain",
                            "acceptance_rate": info.get("acceptance_rate"),
                            "tokens_per_forward": info.get("tokens_per_forward", 1.0),
                            "decode_tokens_per_s": len(toks) / decode_s,
                            "speed_vs_plain": speed,
                            "kv_bytes_read_per_token": read / len(toks),
                            "bytes_vs_plain": (read / len(toks)) / max(1e-9, plain[3] / len(plain[1])),
                            "same_as_plain": toks == plain[1],
                            "generated_tokens": len(toks),
                            "drafted": info.get("drafted", 0),
                            "accepted": info.get("accepted", 0),
                            "target_forwards": info.get("steps", len(toks)),
                            "draft_forwards": info.get("draft_forwards", 0),
                            "load_1m": load_1m,
                        }
                    )
                written += store.add_many(rows)
                if log:
                    log(
                        f"[{i + 1}/{len(samples)}] {s.sample_id} {recipe.name}: "
                        + " ".join(
                            f"{r['spec']}: acc {r['acceptance_rate'] or 0:.2f} x{r['speed_vs_plain']:.2f}"
                            for r in rows
                        )
                    )
    finally:
        store.close()
    return written, skipped


def spec_table(out: str) -> str:
    """Markdown summary of the speculative rows of a results directory (see :func:`spec_markdown`)."""
    store = ResultStore(out)
    try:
        return spec_markdown(store.rows()) or "(no speculative-decoding rows)"
    finally:
        store.close()


def mean_ci_cell(values: Sequence[float], digits: int = 2) -> str:
    """``mean [low, high]``: the mean over samples with its 95% percentile-bootstrap CI (resampling samples;
    :func:`longlab.eval.stats.bootstrap_ci`)."""
    if not values:
        return "—"
    mean, low, high = bootstrap_ci([list(values)])
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def score_ci_cell(values: Sequence[float]) -> str:
    """Mean score with its 95% CI (Wilson for pass/fail scores, else bootstrap over samples)."""
    e = score_estimate(list(values))
    return f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}]"


def median_cell(values: Sequence[float]) -> str:
    """``median (q1-q3)`` of per-sample ratios (each measured side by side with plain decoding)."""
    if not values:
        return "—"
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.2f} ({q[0]:.2f}-{q[2]:.2f})"


def paired_cell(a: Sequence[float], b: Sequence[float], same: int) -> str:
    """Paired bootstrap of ``mean(a - b)`` over the same samples; identical outputs are said so."""
    if not a:
        return "—"
    if same == len(a):
        return f"identical tokens ({same}/{len(a)})"
    d = paired_difference(list(a), list(b))
    verdict = "" if d.significant else ", n.s."
    return f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{verdict} ({same}/{len(a)} identical)"


def load_cell(extras: Sequence[dict[str, Any]]) -> str:
    loads = [e["load_1m"] for e in extras if e.get("load_1m") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "—"


def spec_markdown(rows: Sequence[dict[str, Any]]) -> str | None:
    """Two markdown tables of the rows of ``longlab eval --speculative`` (None when there are none).

    Per (task, length, config): samples, score with its 95% CI, the paired difference to plain decoding on
    the same samples (paired bootstrap; "identical tokens (k/n)" when every sample's tokens equal plain
    decoding's), acceptance rate and tokens per target forward (means of per-sample values, bootstrap CI
    over samples). Per (length, config), all tasks pooled: acceptance and tokens per forward with CIs, the
    tokens/s ratio to plain decoding (median and quartiles of the per-sample ratios, each config decoded
    side by side with plain on the same prefilled prompt in a rotating order), K/V bytes read per token vs
    plain (median), identical-token count and the 1-minute load average while the rows were measured."""
    rows = [r for r in rows if "spec" in (r.get("extra") or {})]
    if not rows:
        return None
    plain = {
        (r["method"], r["task"], r["length"], r["sample_id"], r["seed"]): r
        for r in rows
        if r["extra"]["spec"] == "plain"
    }

    def paired(sel: list[dict]) -> list[tuple[dict, dict]]:
        out = []
        for r in sel:
            p = plain.get((r["method"], r["task"], r["length"], r["sample_id"], r["seed"]))
            if p is not None:
                out.append((r, p))
        return out

    by_task: dict[tuple[str, int, str], list[dict]] = {}
    by_length: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        by_task.setdefault((r["task"], r["length"], r["recipe"]), []).append(r)
        by_length.setdefault((r["length"], r["recipe"]), []).append(r)

    def order(label: str) -> tuple[int, str]:
        return ("~" in label, label)

    lines = [
        "| task | length | config | n | score [95% CI] | score - plain [paired 95% CI] | acceptance [95% CI] "
        "| tokens / target forward [95% CI] |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (task, length, label), sel in sorted(
        by_task.items(), key=lambda kv: (kv[0][1], kv[0][0], order(kv[0][2]))
    ):
        pairs = paired(sel)
        ex = [r["extra"] for r in sel]
        acc = [e["acceptance_rate"] for e in ex if e.get("acceptance_rate") is not None]
        is_plain = ex[0]["spec"] == "plain"
        diff = "—" if is_plain else paired_cell(
            [r["score"] for r, _ in pairs],
            [p["score"] for _, p in pairs],
            sum(bool(r["extra"]["same_as_plain"]) for r, _ in pairs),
        )
        tpf = "1.00" if is_plain else mean_ci_cell([e["tokens_per_forward"] for e in ex])
        lines.append(
            f"| {task} | {length} | {label} | {len(sel)} | {score_ci_cell([r['score'] for r in sel])} |"
            f" {diff} |"
            f" {mean_ci_cell(acc)} | {tpf} |"
        )
    lines += [
        "",
        "| length | config | n | acceptance [95% CI] | tokens / target forward [95% CI] | tok/s vs plain "
        "(median, quartiles) | KV bytes read per token vs plain (median) | tokens = plain | load (1 min) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (length, label), sel in sorted(by_length.items(), key=lambda kv: (kv[0][0], order(kv[0][1]))):
        ex = [r["extra"] for r in sel]
        acc = [e["acceptance_rate"] for e in ex if e.get("acceptance_rate") is not None]
        is_plain = ex[0]["spec"] == "plain"
        lines.append(
            f"| {length} | {label} | {len(sel)} | {mean_ci_cell(acc)} |"
            f" {'1.00' if is_plain else mean_ci_cell([e['tokens_per_forward'] for e in ex])} |"
            f" {median_cell([e['speed_vs_plain'] for e in ex])} |"
            f" {statistics.median(e['bytes_vs_plain'] for e in ex):.2f} |"
            f" {sum(bool(e['same_as_plain']) for e in ex)}/{len(sel)} | {load_cell(ex)} |"
        )
    return "\n".join(lines)
