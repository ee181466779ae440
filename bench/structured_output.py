"""Structured output on CPU: xgrammar vs llguidance with the tokenizers longlab ships.

For each tokenizer (tiny byte-level, SmolLM2-135M, Gemma-3-270M, Qwen2.5-Coder-0.5B; tokenizers only, no
weights) and each library: the one-off tokenizer preparation, the cold compile of three grammars (a flat
schema, a nested schema, ``json_object``: schema -> a fresh matcher's first mask, best of ``--repeats``,
compiler caches off), and the per-token mask time while the matcher walks a valid
document token by token (the document's own tokenization must be accepted at every step, and EOS only at
its end). Vocab handling: the mask is sized to the *model's* vocab (embedding rows, padded past the
tokenizer's ids for tiny-llama); ids no tokenizer string maps to must be masked off. A random walk (random
logits under the mask, 40 seeds) must end in JSON that validates against the schema (95% Wilson interval).
Masks are applied the engine's way for both (:func:`longlab.grammar.unpack_bits`, then
``masked_fill``; llguidance.torch's ``torch.compile``'d apply costs seconds to import).

    bench/heavy.sh python bench/structured_output.py        # -> bench/results/structured_output.json

``--e2e MODEL`` instead decodes with the real model through the engine (longlab's own path: llguidance):
the same chat requests with and without ``response_format``, greedy, their decode seconds per token and
whether the constrained answers validate (-> bench/results/structured_output_e2e.json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import ROOT, best_of, hardware, timed, write_json  # noqa: E402

TOKENIZERS = ("tiny-llama", "smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")
FLAT = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "unknown"]},
        "confident": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "confident", "count"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string",
                                                                                  "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCS = {
    "flat": {"answer": "yes", "confident": True, "count": 7},
    "nested": {"name": "Ada", "age": 36, "tags": ["a", "b"], "address": {"city": "Paris", "zip": "75001"}},
}
DOCS["json_object"] = DOCS["nested"]
SCHEMAS = {"flat": FLAT, "nested": NESTED, "json_object": {"type": "object"}}
WALK_SCHEMAS = ("flat", "nested")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _version("xgrammar")

    def compile(self, schema: dict) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def matcher(self, grammar: Any) -> Any:
        return _XM(self.xgr, grammar, self.vocab)


class _XM:
    def __init__(self, xgr: Any, grammar: Any, vocab: int) -> None:
        self.m, self.vocab = xgr.GrammarMatcher(grammar), vocab
        self.bits = xgr.allocate_token_bitmask(1, vocab)

    def fill(self) -> torch.Tensor:
        self.m.fill_next_token_bitmask(self.bits)
        return self.bits

    def apply(self, logits: torch.Tensor) -> None:
        apply_mask(logits, self.bits, self.vocab)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def done(self) -> bool:
        return self.m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg, self.vocab = llguidance, vocab
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.version = _version("llguidance")

    def compile(self, schema: dict) -> Any:
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, grammar: Any) -> Any:
        return _LM(self.llg, self.tok, grammar, self.vocab)


class _LM:
    def __init__(self, llg: Any, tok: Any, grammar: str, vocab: int) -> None:
        self.m, self.vocab = llg.LLMatcher(tok, grammar), vocab
        self.bits = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def fill(self) -> torch.Tensor:  # what llguidance.torch.fill_next_token_bitmask does
        self.m.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        return self.bits

    def apply(self, logits: torch.Tensor) -> None:
        apply_mask(logits, self.bits, self.vocab)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def done(self) -> bool:
        return self.m.is_stopped()


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The allowed ids of a packed int32 bitmask ``[1, ceil(V/32)]`` -> bool ``[V]``."""
    from longlab.grammar import unpack_bits

    return unpack_bits(bits[0], vocab)


def apply_mask(logits: torch.Tensor, bits: torch.Tensor, vocab: int) -> None:
    """What the engine does with a mask (both libraries write the same packed layout): ``logits [1, V]``."""
    logits.masked_fill_(~allowed(bits, vocab)[None], float("-inf"))


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    z, p = 1.959964, k / n
    den = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / den, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def walk_document(lib: Any, grammar: Any, ids: list[int], eos: int, vocab: int, n_tok: int) -> dict[str, Any]:
    """Feed ``ids`` (a valid document) then EOS; time each mask; check each token is allowed."""
    m = lib.matcher(grammar)
    fill_s, apply_s, rejected, eos_early, padded_allowed = [], [], 0, 0, 0
    logits = torch.zeros(1, vocab)
    for i, t in enumerate([*ids, eos]):
        wall, _cpu, bits = timed(m.fill)
        fill_s.append(wall)
        lg = logits.clone()
        wall, _cpu, _ = timed(partial(m.apply, lg))
        apply_s.append(wall)
        ok = allowed(bits, vocab)
        padded_allowed += int(ok[n_tok:].sum())
        if i < len(ids) and bool(ok[eos]):
            eos_early += 1
        if not bool(ok[t]):
            rejected += 1
        if not m.accept(t):
            rejected += 1
            break
    return {
        "steps": len(fill_s),
        "mask_ms_median": 1e3 * statistics.median(fill_s),
        "mask_ms_p95": 1e3 * sorted(fill_s)[int(0.95 * (len(fill_s) - 1))],
        "mask_ms_first": 1e3 * fill_s[0],
        "apply_ms_median": 1e3 * statistics.median(apply_s),
        "rejected_valid_tokens": rejected,
        "eos_allowed_before_end": eos_early,
        "padded_ids_allowed": padded_allowed,
        "terminated": m.done(),
    }


def random_walks(lib: Any, grammar: Any, schema: dict, tok: Any, eos: int, vocab: int, seeds: int,
                 max_steps: int) -> dict[str, Any]:
    """Sample from random logits under the mask until EOS or ``max_steps``; count valid documents."""
    import jsonschema

    valid, finished, example = 0, 0, None
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        m, out = lib.matcher(grammar), []
        for _ in range(max_steps):
            m.fill()
            logits = torch.randn(1, vocab, generator=g)
            m.apply(logits)
            t = int(logits.argmax())
            if t == eos:
                finished += 1
                break
            out.append(t)
            if not m.accept(t):
                break
        try:
            jsonschema.validate(json.loads(tok.decode(out)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            if example is None:
                example = {"seed": seed, "text": ascii(tok.decode(out))[:300], "error": str(exc)[:200]}
    lo, hi = wilson(valid, seeds)
    return {"seeds": seeds, "finished": finished, "valid": valid, "valid_rate": valid / seeds,
            "valid_ci95": [lo, hi], "first_invalid": example}


def run(names: tuple[str, ...], seeds: int, repeats: int) -> dict[str, Any]:
    from longlab.models import load_tokenizer

    rows = []
    for name in names:
        load_s, _cpu, (tok, vocab) = timed(partial(load_tokenizer, name))
        n_tok = len(tok)  # ids >= this map to no string (a padded model vocab)
        eos = tok.eos_token_id
        print(f"{name}: tokenizer {n_tok} ids, model vocab {vocab}, eos {eos} (loaded in {load_s:.1f} s)",
              flush=True)
        for cls in (XGrammar, LLGuidance):
            row: dict[str, Any] = {"tokenizer": name, "library": cls.name, "tokenizer_ids": n_tok,
                                   "model_vocab": vocab}
            try:
                prepare_s, _cpu, lib = timed(partial(cls, tok, vocab))
            except Exception as exc:  # noqa: BLE001  a library that cannot read this tokenizer: recorded
                row["error"] = f"{exc.__class__.__name__}: {exc}"
                rows.append(row)
                print(f"  {cls.name}: FAILED {row['error']}", flush=True)
                continue
            row["version"] = lib.version
            row["prepare_s"] = prepare_s
            for sname, schema in SCHEMAS.items():

                def compile_first_mask(lib=lib, schema=schema) -> Any:
                    grammar = lib.compile(schema)
                    lib.matcher(grammar).fill()
                    return grammar

                # schema -> a matcher's first mask (what a new request waits), best of the repeats
                best, grammar = best_of(compile_first_mask, repeats)
                row[f"compile_ms_{sname}"] = 1e3 * best
                ids = tok(json.dumps(DOCS[sname]), add_special_tokens=False)["input_ids"]
                row[f"walk_{sname}"] = walk_document(lib, grammar, ids, eos, vocab, n_tok)
                if sname in WALK_SCHEMAS:
                    row[f"random_{sname}"] = random_walks(lib, grammar, schema, tok, eos, vocab, seeds, 200)
            rows.append(row)
            w = row["walk_nested"]
            print(f"  {cls.name}: prepare {row['prepare_s']:.2f} s, compile nested "
                  f"{row['compile_ms_nested']:.1f} ms, mask median {w['mask_ms_median']:.3f} ms "
                  f"(p95 {w['mask_ms_p95']:.3f}), rejected "
                  f"{w['rejected_valid_tokens']}, padded allowed {w['padded_ids_allowed']}, random valid "
                  f"{row['random_nested']['valid']}/{seeds}", flush=True)
    return {"hardware": hardware(), "seeds": seeds, "repeats": repeats, "rows": rows,
            "schemas": SCHEMAS, "documents": DOCS}


E2E_PEOPLE = [
    "Ada Lovelace, 36, lives in London (postcode 10001) and likes tags a and b.",
    "Grace Hopper, 85, lives in Arlington (postcode 22201); her tag is c.",
    "Alan Turing, 41, lives in Wilmslow (postcode 09625) and has no tags.",
    "Katherine Johnson, 101, lives in Newport (postcode 23601) with tags a and c.",
]


def _person(text: str) -> list[dict[str, str]]:
    ask = "Write this person as JSON with name, age, tags, address (city, zip): "
    return [{"role": "user", "content": ask + text}]


def run_e2e(name: str, max_new_tokens: int) -> dict[str, Any]:
    """Constrained vs free decoding with the real model, one request at a time (so the decode seconds
    are the request's own), then all constrained and free requests in one batch (equal to alone?)."""
    import jsonschema

    from longlab import Engine, Request
    from longlab.models import load_model

    model, tok = load_model(name)
    engine = Engine(model, tok)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED}}
    rows, alone = [], {}
    for i, text in enumerate(E2E_PEOPLE):
        msgs = _person(text)
        for constrained in (False, True):
            req = Request(messages=msgs, max_new_tokens=max_new_tokens,
                          response_format=fmt if constrained else None)
            (res,) = engine.run([req])
            alone[(i, constrained)] = res.token_ids
            try:
                jsonschema.validate(json.loads(res.text), NESTED)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            n = max(len(res.token_ids), 1)
            rows.append({"prompt": i, "constrained": constrained, "tokens": len(res.token_ids),
                         "finish": res.finish_reason, "decode_s": res.decode_s,
                         "decode_ms_per_token": 1e3 * res.decode_s / n, "valid": valid, "text": res.text})
            mode = "json_schema" if constrained else "free"
            print(f"  prompt {i} {mode:11s}: {len(res.token_ids)} tokens, {1e3 * res.decode_s / n:.1f} "
                  f"ms/token, valid {valid}: {res.text[:90]!r}", flush=True)
    keys = [(i, c) for i in range(len(E2E_PEOPLE)) for c in (False, True)]
    batch = [Request(messages=_person(E2E_PEOPLE[i]), max_new_tokens=max_new_tokens,
                     response_format=fmt if c else None) for i, c in keys]
    together = engine.run(batch)
    same = sum(r.token_ids == alone[k] for r, k in zip(together, keys))
    return {"hardware": hardware(), "model": name, "max_new_tokens": max_new_tokens, "rows": rows,
            "batched_equal_alone": same, "batched_rows": len(batch)}


def table_e2e(result: dict[str, Any]) -> str:
    """Per mode: decode ms/token (mean over prompts, paired difference with a 95% t interval), validity."""
    from scipy import stats

    lines = ["| mode | prompts | tokens (mean) | decode ms/token (mean) | valid JSON for the schema |",
             "|---|---|---|---|---|"]
    by = {c: [r for r in result["rows"] if r["constrained"] == c] for c in (False, True)}
    for c, rows in by.items():
        k = sum(r["valid"] for r in rows)
        lo, hi = wilson(k, len(rows))
        lines.append(f"| {'json_schema' if c else 'free'} | {len(rows)} | "
                     f"{statistics.mean(r['tokens'] for r in rows):.1f} | "
                     f"{statistics.mean(r['decode_ms_per_token'] for r in rows):.1f} | "
                     f"{k}/{len(rows)} [{lo:.2f}, {hi:.2f}] |")
    diffs = [b["decode_ms_per_token"] - a["decode_ms_per_token"] for a, b in zip(by[False], by[True])]
    if len(diffs) > 1:
        mean, sem = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
        half = stats.t.ppf(0.975, len(diffs) - 1) * sem
        p = stats.ttest_rel([r["decode_ms_per_token"] for r in by[True]],
                            [r["decode_ms_per_token"] for r in by[False]]).pvalue
        lines.append(f"\nConstrained minus free, ms/token, paired over {len(diffs)} prompts: {mean:+.2f} "
                     f"[{mean - half:+.2f}, {mean + half:+.2f}] (paired t-test p = {p:.2g}). Batched "
                     f"(all {result['batched_rows']} rows at once) equal to alone: "
                     f"{result['batched_equal_alone']}/{result['batched_rows']}.")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table (docs/results/serve-load.md shows it, generated by
    longlab.eval.pages.serve_load)."""
    head = ("| tokenizer | ids / model vocab | library | prepare s | compile ms flat / nested / "
            "json_object | mask ms median (p95), nested | mask ms median, json_object | valid tokens "
            "rejected | padded ids allowed | random walks valid (95% CI) |")
    lines = [head, "|" + "---|" * 10]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['tokenizer']} | {r['tokenizer_ids']} / {r['model_vocab']} | {r['library']} | "
                         f"failed: {r['error']} ||||||| |")
            continue
        rej = sum(r[f"walk_{s}"]["rejected_valid_tokens"] + r[f"walk_{s}"]["eos_allowed_before_end"]
                  for s in SCHEMAS)
        pad = sum(r[f"walk_{s}"]["padded_ids_allowed"] for s in SCHEMAS)
        valid = sum(r[f"random_{s}"]["valid"] for s in WALK_SCHEMAS)
        n = sum(r[f"random_{s}"]["seeds"] for s in WALK_SCHEMAS)
        lo, hi = wilson(valid, n)
        w, j = r["walk_nested"], r["walk_json_object"]
        lines.append(
            f"| {r['tokenizer']} | {r['tokenizer_ids']} / {r['model_vocab']} | "
            f"{r['library']} {r['version']} | "
            f"{r['prepare_s']:.2f} | {r['compile_ms_flat']:.1f} / {r['compile_ms_nested']:.1f} / "
            f"{r['compile_ms_json_object']:.1f} | {w['mask_ms_median']:.3f} ({w['mask_ms_p95']:.3f}) | "
            f"{j['mask_ms_median']:.3f} | {rej} | {pad} | {valid}/{n} [{lo:.2f}, {hi:.2f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS))
    ap.add_argument("--seeds", type=int, default=40, help="random walks per schema (1-1000)")
    ap.add_argument("--repeats", type=int, default=3, help="compiles per grammar, best taken (1-20)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench/results/structured_output.json"))
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--e2e", default=None, help="decode with this model instead (e.g. smollm2-135m)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="--e2e tokens per answer (1-512)")
    args = ap.parse_args()
    if args.table:
        result = json.loads(Path(args.out).read_text())
        print(table_e2e(result) if "batched_rows" in result else table(result))
        return
    if args.e2e is not None:
        if args.e2e not in TOKENIZERS[1:] or not 1 <= args.max_new_tokens <= 512:
            ap.error(f"--e2e takes one of {','.join(TOKENIZERS[1:])}; --max-new-tokens in [1, 512]")
        torch.set_num_threads(args.threads)
        out = args.out if args.out != ap.get_default("out") else str(
            ROOT / "bench/results/structured_output_e2e.json")
        result = run_e2e(args.e2e, args.max_new_tokens)
        write_json(out, result)
        print(table_e2e(result))
        return
    names = tuple(n for n in args.tokenizers.split(",") if n)
    bad = [n for n in names if n not in TOKENIZERS]
    if bad or not names or not 1 <= args.seeds <= 1000 or not 1 <= args.repeats <= 20:
        ap.error(f"--tokenizers from {','.join(TOKENIZERS)}; --seeds in [1, 1000]; --repeats in [1, 20]")
    torch.set_num_threads(args.threads)
    result = run(names, args.seeds, args.repeats)
    write_json(args.out, result)
    print(table(result))


if __name__ == "__main__":
    main()
