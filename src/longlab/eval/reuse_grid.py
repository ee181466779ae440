"""``longlab eval --reuse ...``: KV-reuse methods as a grid axis, rows in the results database.

Each multi-document sample (``metadata["documents"]``: the ``multidoc_qa_*`` tasks or
:func:`~longlab.tasks.multidoc.load_multidoc_jsonl` files) is prefilled once per reuse method, all methods
reading the same per-sample store (each document encoded once), and scored against its exact answer.
Rows go to ``DIR/results.sqlite`` like any eval row: ``recipe`` is the reuse label (``full`` for the
full-prefill reference, so the report's paired differences vs ``full`` apply; ``cacheblend@0.2``: ratio
0.2 recomputed), ``extra`` holds the recompute and cost fractions, the TTFT split and the fidelity (share of
answer positions whose argmax equals the full prefill's). Re-runs skip stored rows.

Scoring (``score_mode``): ``"decode"`` greedy-decodes ``max_new_tokens`` and applies the task's metric;
``"forced"`` (default, one forward) feeds the answer's tokens after the prompt and scores 1 when the
model's argmax is the answer token at every position, i.e. when greedy decoding would emit exactly the
answer first — stricter than ``string_match_all`` and ~``max_new_tokens`` times cheaper.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..recipe import LonglabError, parse_recipe
from ..reuse import MemoryStore, ReuseMethod, parse_reuse, reuse_prefill, split_prompt
from ..reuse.compose import reuse_recipe
from ..tasks import Sample, score_sample
from .store import ResultStore, config_hash, make_run_key

__all__ = ["reuse_label", "ReuseEvalSummary", "run_reuse_eval", "evaluate_sample", "answer_ids"]

REUSE_HARNESS_VERSION = 1


def reuse_label(method: ReuseMethod, recipe: str | None = None) -> str:
    """``full`` for the reference, ``name@ratio[:other=...]`` for methods with a ratio, else the spec; with
    a KV ``recipe`` (not ``full``) the label is ``<reuse label>+<recipe>``, and the full prefill + recipe is
    the recipe's own name (what a plain query-aware prefill + recipe is called)."""
    kv = parse_recipe(recipe).name if recipe is not None and not parse_recipe(recipe).is_empty else None
    if kv is not None:
        return kv if method.name == "full-prefill" else f"{reuse_label(method)}+{kv}"
    if method.name == "full-prefill":
        return "full"
    return method.spec


def answer_ids(tokenizer: Any, sample: Sample, chat_template: bool = True) -> list[int]:
    """Tokens of ``" " + answer`` as they continue the question part (tokenized together, then split)."""
    _, q_ids = split_prompt(tokenizer, sample.question, sample.answer_prefix, chat_template)
    joined = split_prompt(
        tokenizer, sample.question, sample.answer_prefix + " " + sample.answers[0], chat_template
    )[1]
    if joined[: len(q_ids)] == q_ids and len(joined) > len(q_ids):
        return joined[len(q_ids) :]
    return list(tokenizer(" " + sample.answers[0], add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def _forced_argmax(model: Any, pre: Any, cont: list[int]) -> list[int]:
    """Argmax at each answer position when the answer's tokens are fed after the prompt."""
    preds = [int(pre.logits[0].argmax())]
    if len(cont) > 1:
        ids = torch.tensor([cont[:-1]], device=pre.logits.device)
        pos = (pre.n_positions + torch.arange(len(cont) - 1, device=ids.device))[None]
        out = model(input_ids=ids, position_ids=pos, cache=pre.cache, use_cache=True)
        preds += out.logits[0].argmax(-1).tolist()
    return preds


def evaluate_sample(
    model: Any,
    tokenizer: Any,
    sample: Sample,
    methods: Sequence[ReuseMethod],
    *,
    score_mode: str = "forced",
    max_new_tokens: int | None = None,
    recipes: Sequence[str | None] = (None,),
) -> list[dict[str, Any]]:
    """One result dict per method x KV recipe for ``sample`` (documents encoded once, shared by all; the
    recipe compresses the assembled cache, :mod:`longlab.reuse.compose`). Fidelity is measured against the
    full prefill without a recipe, computed first."""
    from ..pipeline import generate

    docs = sample.metadata.get("documents")
    if not docs:
        raise LonglabError(
            f"sample {sample.sample_id or sample.task}: no metadata['documents'] (not multi-document)"
        )
    store = MemoryStore()
    cont = answer_ids(tokenizer, sample)
    full_preds: list[int] | None = None
    out = []
    kv = [None if r is None or parse_recipe(r).is_empty else parse_recipe(r).name for r in recipes]
    pairs = [(m, r) for r in dict.fromkeys(kv) for m in methods]
    pairs.sort(key=lambda p: (p[0].name != "full-prefill" or p[1] is not None))  # the reference first
    for method, recipe in pairs:
        if score_mode == "forced":
            pre = reuse_prefill(
                model,
                tokenizer,
                docs,
                sample.question,
                method,
                store=store,
                answer_prefix=sample.answer_prefix,
                recipe=recipe,
            )
            preds = _forced_argmax(model, pre, cont)
            score = float(preds == cont)
            prediction = tokenizer.decode(preds, skip_special_tokens=True)
            if method.name == "full-prefill" and recipe is None:
                full_preds = preds
            fidelity = (
                sum(a == b for a, b in zip(preds, full_preds)) / len(preds)
                if full_preds is not None
                else None
            )
        else:
            result = generate(
                model,
                tokenizer,
                docs=docs,
                question=sample.question,
                reuse=method,
                store=store,
                answer_prefix=sample.answer_prefix,
                max_new_tokens=min(sample.max_new_tokens, max_new_tokens or sample.max_new_tokens),
                recipe=recipe,
            )
            pre, prediction = result.reuse, result.text
            score, fidelity = float(score_sample(sample, prediction)), None
        out.append(
            {
                "label": reuse_label(method, recipe),
                "method": method.name,
                "kv_recipe": recipe or "full",
                "spec": method.spec,
                "repr": repr(method),
                "prediction": prediction,
                "score": score,
                "ttft_s": pre.ttft_s,
                "fetch_s": pre.fetch_s,
                "assemble_s": pre.assemble_s,
                "compute_s": pre.compute_s,
                "recompute_fraction": pre.recompute_fraction,
                "cost_fraction": pre.cost_fraction,
                "prompt_tokens": pre.prompt_tokens,
                "fidelity": fidelity,
                "kv_bytes": pre.cache.nbytes(),
            }
        )
    return out


@dataclass
class ReuseEvalSummary:
    written: int
    skipped: int
    total: int
    seconds: float


def run_reuse_eval(
    out: str,
    model_name: str,
    reuse: Sequence[str],
    samples: Sequence[Sample],
    *,
    seed: int = 0,
    score_mode: str = "forced",
    max_new_tokens: int | None = None,
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
    recipes: Sequence[str] = ("full",),
) -> ReuseEvalSummary:
    """Evaluate every reuse method x KV recipe (``recipes``: ``full`` = none) on every sample into ``out``;
    rows already there are skipped."""
    from ..models import load_model

    if score_mode not in ("forced", "decode"):
        raise LonglabError(f"score_mode must be 'forced' or 'decode', got {score_mode!r}")
    methods = [parse_reuse(r) for r in reuse]  # every spec checked before the model loads
    if not methods:
        raise LonglabError("--reuse is empty: name at least one reuse method")
    if not recipes:
        raise LonglabError("--recipes is empty: name at least one recipe (full: none)")
    for r in recipes:
        for m in methods:
            reuse_recipe(r, m)  # every combination checked before the model loads
    kv = list(dict.fromkeys(None if parse_recipe(r).is_empty else parse_recipe(r).name for r in recipes))
    grid = [(m, r) for r in kv for m in methods]
    for s in samples:
        if not s.metadata.get("documents"):
            raise LonglabError(f"--reuse needs multi-document samples (multidoc_qa_1/2); {s.task} has none")
    start = time.perf_counter()
    store = ResultStore(out)
    if model is None:
        model, tokenizer = load_model(model_name)
    chash = config_hash(
        {"reuse_harness": REUSE_HARNESS_VERSION, "score_mode": score_mode, "max_new_tokens": max_new_tokens}
    )
    written = skipped = 0
    try:
        done = store.done_keys()
        for i, s in enumerate(samples):

            def key(m: ReuseMethod, r: str | None, s: Sample = s) -> str:
                return make_run_key(
                    model=model_name,
                    recipe=reuse_label(m, r),
                    task=s.task,
                    length=s.length,
                    sample_id=s.sample_id,
                    query_aware=True,
                    seed=seed,
                    config_hash=chash,
                )

            todo = [(m, r) for m, r in grid if key(m, r) not in done]
            skipped += len(grid) - len(todo)
            if not todo:
                continue
            todo_methods = list({m.spec: m for m, _ in todo}.values())
            todo_recipes = list(dict.fromkeys(r for _, r in todo))
            need = (  # the reference (full prefill, no recipe) gives the fidelity of every row
                todo_methods
                if any(m.name == "full-prefill" for m in todo_methods)
                else [parse_reuse("full-prefill"), *todo_methods]
            )
            need_recipes = todo_recipes if None in todo_recipes else [None, *todo_recipes]
            results = {
                r["label"]: r
                for r in evaluate_sample(
                    model, tokenizer, s, need, score_mode=score_mode, max_new_tokens=max_new_tokens,
                    recipes=need_recipes,
                )
            }
            rows = []
            for m, kv_recipe in todo:
                r = results[reuse_label(m, kv_recipe)]
                rows.append(
                    {
                        "run_key": key(m, kv_recipe),
                        "model": model_name,
                        "recipe": r["label"],
                        "method": m.name,
                        "task": s.task,
                        "length": s.length,
                        "sample_id": s.sample_id,
                        "query_aware": True,
                        "seed": seed,
                        "prediction": r["prediction"],
                        "answers": list(s.answers),
                        "score": r["score"],
                        "prefill_s": r["ttft_s"],
                        "compress_s": 0.0,
                        "decode_s": 0.0,
                        "kv_bytes_after": r["kv_bytes"],
                        "context_tokens": r["prompt_tokens"],
                        "config_hash": chash,
                        "recipe_repr": r["repr"],
                        "reuse": r["spec"],
                        "kv_recipe": r["kv_recipe"],
                        "recompute_fraction": r["recompute_fraction"],
                        "cost_fraction": r["cost_fraction"],
                        "fetch_s": r["fetch_s"],
                        "assemble_s": r["assemble_s"],
                        "compute_s": r["compute_s"],
                        "fidelity": r["fidelity"],
                        "score_mode": score_mode,
                        "num_docs": len(s.metadata["documents"]),
                    }
                )
            written += store.add_many(rows)
            if log:
                log(
                    f"[{i + 1}/{len(samples)}] {s.sample_id}: "
                    + " ".join(f"{r['recipe']}={r['score']:.0f}" for r in rows)
                )
    finally:
        store.close()
    return ReuseEvalSummary(written, skipped, len(samples) * len(grid), time.perf_counter() - start)
