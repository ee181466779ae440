"""Mutation check: every selective method's tests must fail when its selection rule is inverted (issue 28).

Each :class:`Mutation` names a file (relative to ``src/longlab``), a source snippet that occurs in it
exactly once, the inverted replacement (keep the *least* relevant tokens/pages/heads/rows, or ignore a
parameter) and the tests expected to catch it. For each mutation the runner copies ``src/`` to a temporary
directory, applies that one edit there, runs the named tests against the copy (``PYTHONPATH`` pointing at
it; the repository's own sources are never touched) and expects them to fail. A snippet that is missing or
not unique is an error, not a pass: when code moves, the error says where the snippet is now, so updating
the table is a one-line change of ``module`` (or of the snippet).

Usage (from the repository root)::

    python -m tests.mutation                # every mutation; exit status 0 iff all are caught
    python -m tests.mutation --list         # the table
    python -m tests.mutation --only prophetkv dustin --jobs 2
    pytest -m mutation tests/test_mutations.py   # the same, as tests (kept out of the default run)

Statuses: ``caught`` (the tests failed), ``MISSED`` (they passed: the rule is not pinned), ``ERROR`` (they
could not run: a syntax error in the replacement, a collection error, or a timeout; not a catch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (tests/ and src/ live here)
PACKAGE = "longlab"

__all__ = ["Mutation", "MUTATIONS", "TableError", "check_table", "apply", "run", "main"]


@dataclass(frozen=True)
class Mutation:
    """One inverted selection rule. ``module``: path under ``src/longlab``; ``old``: a snippet occurring
    there exactly once; ``new``: its replacement; ``tests``: pytest files or node ids (relative to the
    repository) expected to fail; ``issue``: one of the inversions listed in issue 28."""

    name: str
    module: str
    old: str
    new: str
    tests: tuple[str, ...]
    issue: bool = False


def M(name: str, module: str, old: str, new: str, *tests: str, issue: bool = False) -> Mutation:
    return Mutation(name, module, old, new, tuple(tests), issue)


KV = "tests/test_selection_rules_kv.py"
REUSE = "tests/test_selection_rules_reuse.py"
SPEC = "tests/test_selection_rules_spec.py"
DECODE = "tests/test_selection_rules_decode.py"
SPARSE = "tests/test_selection_rules_sparse.py"
POSITION = "tests/test_selection_rules_position.py"
COMPRESS = "tests/test_selection_rules_compress.py"
LAB = "tests/test_selection_rules_lab.py"

# fmt: off
MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------------------------ KV eviction policies
    M("kv-keep-top", "kv/base.py",
      "order = scores.argsort(dim=-1, descending=True, stable=True)",
      "order = scores.argsort(dim=-1, descending=False, stable=True)",
      KV, "tests/test_kv_baselines.py"),
    M("snapkv", "kv/attention_scores.py",
      'return snapkv_scores(ctx, self.window_size, self.kernel_size, self.pooling, "sum")',
      'return -snapkv_scores(ctx, self.window_size, self.kernel_size, self.pooling, "sum")',
      "tests/test_kept_indices.py", "tests/test_kv_baselines.py"),
    M("h2o", "kv/attention_scores.py",
      "return ctx.layer.extras[_H2O_STATE]",
      "return -ctx.layer.extras[_H2O_STATE]",
      "tests/test_kv_baselines.py", KV),
    M("tova", "kv/attention_scores.py",
      "shared = probs.mean(1, keepdim=True)  # [B, 1, T]",
      "shared = -probs.mean(1, keepdim=True)  # [B, 1, T]",
      "tests/test_kv_baselines.py", KV),
    M("knorm", "kv/simple.py",
      "return -ctx.k.float().norm(dim=-1)  # [B, H_kv, T]",
      "return ctx.k.float().norm(dim=-1)  # [B, H_kv, T]",
      "tests/test_kept_indices.py", "tests/test_kv_baselines.py"),
    M("streaming", "kv/simple.py",
      "return ctx.key_index.float()",
      "return -ctx.key_index.float()",
      "tests/test_kv_baselines.py"),
    M("random", "kv/simple.py",
      "return torch.rand(ctx.key_index.shape, generator=gen).to(ctx.k.device)",
      "return -ctx.key_index.float()",
      KV),
    M("pyramidkv-budgets", "kv/attention_scores.py",
      "return hi - layer_idx * step + W",
      "return lo + layer_idx * step + W",
      "tests/test_pyramidkv.py", "tests/test_kv_baselines.py"),
    M("pyramidkv-maxpool", "kv/base.py",
      "y = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)",
      "y = -F.max_pool1d(-x, kernel_size, stride=1, padding=kernel_size // 2)",
      KV),
    M("adakv", "kv/attention_scores.py",
      "raw = (1 - self.alpha) * share + self.alpha * per_head",
      "raw = (1 - self.alpha) * (2 * per_head - share) + self.alpha * per_head",
      KV),
    M("snapkv-obc", "kv/obcache.py",
      "return pool_scores(s, self.kernel_size, self.pooling, region).masked_fill(~region, 0.0)",
      "return pool_scores(-s, self.kernel_size, self.pooling, region).masked_fill(~region, 0.0)",
      KV),
    M("tova-obc", "kv/obcache.py",
      "s = self.obc_block(ctx, slice(T_q - 1, T_q))  # [B, H_kv, T]",
      "s = -self.obc_block(ctx, slice(T_q - 1, T_q))  # [B, H_kv, T]",
      KV),
    M("h2o-obc", "kv/obcache.py",
      "acc = acc + self.obc_block(ctx, rows)",
      "acc = acc - self.obc_block(ctx, rows)",
      KV),
    M("restkv", "kv/restkv.py",
      "return s.masked_fill(~cand, 0.0)",
      "return (-s).masked_fill(~cand, 0.0)",
      KV),
    M("indexmem", "kv/indexmem.py",
      "keep = keep_top(r, n_keep, valid, self.protected(ctx))  # [B, H_kv, T]",
      "keep = keep_top(-r, n_keep, valid, self.protected(ctx))  # [B, H_kv, T]",
      "tests/test_indexmem.py::test_keeps_sinks_window_and_top_by_importance"),
    M("decoding-window", "kv/decoding.py",
      "state[kq] = q[:, :, -self.window_size :].contiguous()",
      "state[kq] = q[:, :, : self.window_size].contiguous()",
      KV),
    # ------------------------------------------------------------------------- KV reuse recompute selectors
    M("prophetkv", "reuse/policies.py",
      "job, relevance.topk(budget).indices if budget else torch.zeros(0, dtype=torch.long)",
      "job, (-relevance).topk(budget).indices if budget else torch.zeros(0, dtype=torch.long)",
      REUSE, issue=True),
    M("prophetkv-dual", "reuse/policies.py",
      "top = fused[job.ctx[rows[doc_local]]].topk(count).indices",
      "top = (-fused[job.ctx[rows[doc_local]]]).topk(count).indices",
      REUSE),
    M("cacheblend", "reuse/policies.py",
      "top = dev.topk(count).indices.cpu()",
      "top = (-dev).topk(count).indices.cpu()",
      "tests/test_reuse.py::test_cacheblend_selects_top_value_deviation"),
    M("epic", "reuse/policies.py",
      "chosen = [torch.arange(s, s + k) for (s, _), k in zip(job.doc_spans, ks)]",
      "chosen = [torch.arange(s + n - k, s + n) for (s, n), k in zip(job.doc_spans, ks)]",
      REUSE),
    # ------------------------------------------------------------------------- speculative decoding
    M("dustin", "spec/dustin.py",
      "top = pages.topk(k, dim=-1)\n",
      'top = pages.masked_fill(covered, float("inf")).topk(k, dim=-1, largest=False)\n',
      SPEC, issue=True),
    M("dustin-heads", "spec/dustin.py",
      "for (layer, head), _ in sorted(recall.items(), key=lambda kv: -kv[1]):",
      "for (layer, head), _ in sorted(recall.items(), key=lambda kv: kv[1]):",
      SPEC),
    M("dustin-recall", "spec/dustin.py",
      "top = pages.topk(k, dim=-1).indices  # [B, H, k]",
      "top = (-pages).topk(k, dim=-1).indices  # [B, H, k]",
      "tests/test_spec_decode.py::test_head_recall_by_hand_and_head_file"),
    M("lookup", "spec/drafts.py",
      "j = int(hits[-1])  # the most recent occurrence",
      "j = int(hits[0])  # the most recent occurrence",
      "tests/test_spec_decode.py::test_lookup_proposal_by_hand"),
    M("self-draft", "spec/drafts.py",
      "take = layer.index[..., :base] >= 0 if keep is None else keep[..., :base]",
      "take = layer.index[..., :base] >= 0 if keep is None else ~keep[..., :base]",
      "tests/test_spec_decode.py::test_self_draft_view_is_the_policys_selection"),
    # ------------------------------------------------------------------------- decode-time page selectors
    M("quest", "decode/quest.py",
      "pages = u.topk(k, dim=-1).indices.sort(dim=-1).values  # [B, H, k]",
      "pages = (-u).topk(k, dim=-1).indices.sort(dim=-1).values  # [B, H, k]",
      "tests/test_kv_seeds.py::test_quest_small_budget_reads_top_pages_plus_the_last"),
    M("retro", "decode/retro.py",
      "new = loaded[:, :, None, :] & (st.last[:, :, None, :] < st.pos[:, None, :, None])",
      "new = loaded[:, :, None, :] & (st.last[:, :, None, :] >= st.pos[:, None, :, None])",
      DECODE),
    M("losa-pages", "decode/losa.py",
      "chosen.scatter_(-1, u.topk(k_sel, dim=-1).indices, True)",
      "chosen.scatter_(-1, (-u).topk(k_sel, dim=-1).indices, True)",
      DECODE),
    M("losa-active", "decode/losa.py",
      "active.scatter_(1, delta.topk(n_act, dim=-1).indices, True)",
      "active.scatter_(1, (-delta).topk(n_act, dim=-1).indices, True)",
      "tests/test_spec_losa.py::test_reuse_is_exact_when_the_input_is_unchanged"),
    # ------------------------------------------------------------------------- sparse prefill selectors
    M("cumulative-mass", "sparse/base.py",
      "vals, idx = torch.sort(values, dim=-1, descending=True)",
      "vals, idx = torch.sort(values, dim=-1, descending=False)",
      SPARSE),
    M("blocktopk", "sparse/minference.py",
      "top = s.topk(min(self.top_k, s.shape[-1]), dim=-1).indices",
      'top = s.masked_fill(~allowed, float("inf"))'
      ".topk(min(self.top_k, s.shape[-1]), dim=-1, largest=False).indices",
      SPARSE),
    M("vslash", "sparse/minference.py",
      "v_top = vertical.topk(min(self.vertical_size, T_k), dim=-1).indices",
      "v_top = (-vertical).topk(min(self.vertical_size, T_k), dim=-1).indices",
      "tests/test_sparse_selectors.py::test_vslash_finds_planted_vertical_and_slash"),
    M("ashape", "sparse/minference.py",
      "local = g.k_last[None, :] >= g.q_first[:, None] - self.n_local + 1  # [n_qb, n_kb]",
      "local = g.k_last[None, :] < g.q_first[:, None] - self.n_local + 1  # [n_qb, n_kb]",
      "tests/test_sparse_selectors.py"),
    M("flexprefill-vertical", "sparse/flexprefill.py",
      "v_blocks = _top_n_per_head(_sum_pool(a_v, self.bk), n_v)  # [B, H, n_kb]",
      "v_blocks = _top_n_per_head(-_sum_pool(a_v, self.bk), n_v)  # [B, H, n_kb]",
      SPARSE),
    M("flexprefill-query-aware", "sparse/flexprefill.py",
      "a_bar = torch.softmax(logits, dim=-1).flatten(2)",
      'a_bar = torch.softmax((-logits).masked_fill(~allowed, float("-inf")), dim=-1).flatten(2)',
      SPARSE),
    M("xattention", "sparse/xattention.py",
      "logits = (qr[:, :, m0:m1] @ kr.transpose(-1, -2)) * (scaling / S)  # [B, H, rows, mk]",
      "logits = -(qr[:, :, m0:m1] @ kr.transpose(-1, -2)) * (scaling / S)  # [B, H, rows, mk]",
      "tests/test_sparse_selectors.py::test_xattention_scores_match_brute_force", SPARSE),
    M("prism", "sparse/prism.py",
      "logits = (qb @ kb.transpose(-1, -2)) / (d_x**0.5 * t)  # [B, H, n_qb, n_kb]",
      "logits = -(qb @ kb.transpose(-1, -2)) / (d_x**0.5 * t)  # [B, H, n_qb, n_kb]",
      SPARSE, "tests/test_sparse_selectors.py::test_prism_band_split_rotate_half"),
    M("sale", "sparse/sale.py",
      "blocks = est.view(B, H, i1 - i0, bq, n_kb_hi, bk).amax(dim=(3, 5)) > 0",
      "blocks = est.view(B, H, i1 - i0, bq, n_kb_hi, bk).amax(dim=(3, 5)) < 0",
      "tests/test_sparse_selectors.py::test_sale_matches_brute_force_relative_attention_score"),
    # ------------------------------------------------------------------------- position methods
    M("upi", "position/upi.py",
      "chosen = set(torch.topk(flat, k).indices.tolist())",
      "chosen = set(torch.topk(-flat, k).indices.tolist())",
      POSITION, issue=True),
    M("longrope-search", "position/search.py",
      "key=lambda k: scores[k])",
      "key=lambda k: -scores[k])",
      POSITION),
    # ------------------------------------------------------------------------- context compressors, droppers
    M("hico-drop", "compress/drop.py",
      "top = sc.topk(min(k, int(ok.sum()))).indices",
      'top = sc.masked_fill(~ok, float("inf")).topk(min(k, int(ok.sum())), largest=False).indices',
      COMPRESS, issue=True),
    M("hico-forward", "compress/hico_forward.py",
      "pick = body.topk(k, dim=-1).indices.sort(-1).values if k > 0 else body[:, :0].long()",
      "pick = (-body).topk(k, dim=-1).indices.sort(-1).values if k > 0 else body[:, :0].long()",
      COMPRESS, issue=True),
    M("select-units", "compress/base.py",
      "for k in sorted(range(len(unit_list)), key=lambda k: (-scores[k], k)):",
      "for k in sorted(range(len(unit_list)), key=lambda k: (scores[k], k)):",
      "tests/test_compress.py::test_select_units_keeps_the_best_within_budget", COMPRESS),
    M("llmlingua-tokens", "compress/lingua.py",
      "scores = [math.inf if u.text is None else float(f.mean()) for u, f in zip(seg_units, flat)]",
      "scores = [math.inf if u.text is None else -float(f.mean()) for u, f in zip(seg_units, flat)]",
      COMPRESS),
    M("llmlingua-documents", "compress/lingua.py",
      "order = sorted(range(len(docs)), key=lambda k: -ppl[k])",
      "order = sorted(range(len(docs)), key=lambda k: ppl[k])",
      COMPRESS),
    M("longllmlingua-documents", "compress/lingua.py",
      "rank_order = sorted(range(len(docs)), key=lambda k: relevance[k])",
      "rank_order = sorted(range(len(docs)), key=lambda k: -relevance[k])",
      COMPRESS),
    M("longllmlingua-contrastive", "compress/lingua.py",
      "s = plain[k].exp() - cond[k].exp()  # contrastive perplexity [len(doc)]",
      "s = cond[k].exp() - plain[k].exp()  # contrastive perplexity [len(doc)]",
      COMPRESS),
    M("comi-coarse", "compress/comi.py",
      "pi = torch.softmax(-mig, dim=0)",
      "pi = torch.softmax(mig, dim=0)",
      "tests/test_compress.py::test_comi_mig_formulas_by_hand"),
    M("comi-fine", "compress/comi.py",
      "return torch.softmax(alpha * rel - beta * sim.max(-1).values, dim=0)",
      "return torch.softmax(-(alpha * rel - beta * sim.max(-1).values), dim=0)",
      "tests/test_compress.py::test_comi_mig_formulas_by_hand"),
    M("hico-tome", "compress/merge.py",
      "merged_a = best.argsort(descending=True)[:r]  # A rows that merge into B",
      "merged_a = best.argsort(descending=False)[:r]  # A rows that merge into B",
      COMPRESS),
    M("tpp", "compress/merge.py",
      "if _jaccard(token_sets[i], token_sets[ref]) >= tau:",
      "if _jaccard(token_sets[i], token_sets[ref]) < tau:",
      "tests/test_compress.py::test_tpp_backward_builder_hand_example"),
    M("guidance", "compress/guidance.py",
      "if f1 >= self.threshold and f1 > best:",
      "if f1 >= self.threshold and (where is None or f1 < best):",
      COMPRESS),
    # ------------------------------------------------------------------------- layers lab
    M("ultramem", "lab/mixers/ultramem.py",
      "ri = row_approx.topk(self.pre, dim=-1).indices  # [B, T, h, h, pre]",
      "ri = (-row_approx).topk(self.pre, dim=-1).indices  # [B, T, h, h, pre]",
      LAB, issue=True),
    M("mtd-lambda", "lab/tasks/mtd.py",
      "lag = torch.multinomial(lam, 1, generator=gen)[:, 0] + 1  # [B]",
      "lag = torch.multinomial(torch.ones_like(lam), 1, generator=gen)[:, 0] + 1  # [B]",
      LAB, issue=True),
    M("l2a", "lab/mixers/l2a.py",
      "hard = (g > self.tau).to(g.dtype)",
      "hard = (g <= self.tau).to(g.dtype)",
      "tests/test_lab_mixers.py::test_l2a_gate_one_everywhere_is_global_attention"),
    # ------------------------------------------------------------------------- KV quantization bit allocation
    M("pmkvq-allocation", "quant/calibrate.py",
      "(cost / scale).reshape(-1), constraints=constraints",
      "(-cost / scale).reshape(-1), constraints=constraints",
      "tests/test_quant_calibrate.py::test_integer_program_spends_memory_where_sensitivity_is_highest"),
]
# fmt: on


# ------------------------------------------------------------------------------------------------ the table
class TableError(Exception):
    """The table does not match the source: a missing file or snippet, a repeated snippet, a missing test."""


def _where(src: Path, snippet: str) -> list[str]:
    """Files under ``src`` (relative to the package) that contain ``snippet``."""
    pkg = src / PACKAGE
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if snippet in p.read_text())


def _locate(src: Path, m: Mutation) -> tuple[Path, str]:
    path = src / PACKAGE / m.module
    if not path.is_file():
        moved = _where(src, m.old)
        hint = f"; the snippet is now in {', '.join(moved)}: update `module`" if moved else ""
        raise TableError(f"{m.name}: no file src/{PACKAGE}/{m.module}{hint}")
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        if count == 0:
            moved = [f for f in _where(src, m.old) if f != m.module]
            hint = (f"; it is now in {', '.join(moved)}: update `module`" if moved
                    else "; the code changed: update the snippet and its inverted replacement")
        else:
            hint = "; make the snippet longer so it is unique"
        where = f"src/{PACKAGE}/{m.module}"
        raise TableError(f"{m.name}: snippet found {count} times in {where}{hint}:\n  {m.old}")
    if m.new == m.old:
        raise TableError(f"{m.name}: the replacement equals the snippet")
    return path, text


def check_table(mutations: Iterable[Mutation] = MUTATIONS, root: Path = ROOT) -> None:
    """Raise :class:`TableError` unless every snippet occurs exactly once and every named test file exists."""
    errors, names = [], set()
    for m in mutations:
        if m.name in names:
            errors.append(f"{m.name}: duplicate name")
        names.add(m.name)
        if not m.tests:
            errors.append(f"{m.name}: names no test")
        for t in m.tests:
            if not (root / t.split("::")[0]).is_file():
                errors.append(f"{m.name}: no test file {t.split('::')[0]}")
        try:
            _locate(root / "src", m)
        except TableError as exc:
            errors.append(str(exc))
    if errors:
        raise TableError("mutation table out of date:\n" + "\n".join(errors))


def apply(src: Path, m: Mutation) -> None:
    """Apply ``m`` to the copy of the sources at ``src`` (a ``src`` directory holding the package)."""
    path, text = _locate(src, m)
    path.write_text(text.replace(m.old, m.new))


# ------------------------------------------------------------------------------------------------ running
@dataclass
class Result:
    mutation: Mutation
    status: str  # "caught" | "MISSED" | "ERROR"
    seconds: float
    detail: str = ""


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def _pytest(src: Path, tests: Sequence[str], timeout: float, root: Path) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
           "--no-header", "-m", "not slow and not mutation", *tests]
    try:
        done = subprocess.run(cmd, cwd=root, env=_env(src), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def _copy(root: Path, into: Path) -> Path:
    src = into / "src"
    shutil.copytree(root / "src" / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _check_copy_is_used(src: Path, root: Path) -> None:
    probe = [sys.executable, "-c", f"import {PACKAGE}, sys; sys.stdout.write({PACKAGE}.__file__)"]
    out = subprocess.run(probe, cwd=root, env=_env(src), capture_output=True, text=True, timeout=300)
    where = Path(out.stdout.strip() or "?").resolve()
    if src.resolve() not in where.parents:
        raise TableError(f"the tests would import {PACKAGE} from {where}, not from the mutated copy {src}: "
                         f"{out.stderr[-500:]}")


def baseline(mutations: Sequence[Mutation], root: Path = ROOT, timeout: float = 1800) -> None:
    """The named tests must pass on an unmutated copy (else every mutation would look caught)."""
    tests = sorted({t for m in mutations for t in m.tests})
    with tempfile.TemporaryDirectory(prefix="longlab-mutation-") as tmp:
        src = _copy(root, Path(tmp))
        _check_copy_is_used(src, root)
        rc, out = _pytest(src, tests, timeout, root)
    if rc != 0:
        raise TableError(f"the named tests fail without any mutation (exit {rc}):\n{out}")


def run_one(m: Mutation, root: Path = ROOT, timeout: float = 600) -> Result:
    """Copy the sources, apply ``m``, run its tests against the copy."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"longlab-mutation-{m.name}-") as tmp:
        src = _copy(root, Path(tmp))
        apply(src, m)
        rc, out = _pytest(src, m.tests, timeout, root)
    seconds = time.perf_counter() - start
    if rc == 1:  # pytest: tests ran and some failed
        failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        return Result(m, "caught", seconds, failed[0] if failed else "")
    if rc == 0:
        return Result(m, "MISSED", seconds, "the tests passed with the rule inverted")
    return Result(m, "ERROR", seconds, f"exit {rc}: {out[-600:]}")


def _log(line: str) -> None:
    print(line, flush=True)


def run(mutations: Sequence[Mutation] = MUTATIONS, root: Path = ROOT, jobs: int = 1, timeout: float = 600,
        log=_log) -> list[Result]:
    """Check the table, run the baseline, then every mutation; returns the results in table order."""
    check_table(mutations, root)
    t0 = time.perf_counter()
    baseline(mutations, root)
    log(f"baseline: the named tests pass on an unmutated copy ({time.perf_counter() - t0:.0f} s)")

    def one(m: Mutation) -> Result:
        r = run_one(m, root, timeout)
        log(f"{r.status:7s} {m.name:26s} {m.module:28s} {r.seconds:6.1f} s  {r.detail.splitlines()[0][:90]}"
            if r.detail else f"{r.status:7s} {m.name:26s} {m.module:28s} {r.seconds:6.1f} s")
        return r

    if jobs > 1:
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(one, mutations))
    return [one(m) for m in mutations]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations (names or prefixes)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run in parallel (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutation's test run")
    args = parser.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        chosen = [m for m in MUTATIONS if any(m.name == o or m.name.startswith(o) for o in args.only)]
        if not chosen:
            parser.error(f"no mutation named {' '.join(args.only)}; see --list")
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs must be >= 1 and --timeout > 0")
    if args.list:
        for m in chosen:
            mark = " [issue 28]" if m.issue else ""
            print(f"{m.name}{mark}: src/{PACKAGE}/{m.module}\n  - {m.old}\n  + {m.new}")
            print(f"  tests: {', '.join(m.tests)}")
        return 0
    try:
        results = run(chosen, jobs=args.jobs, timeout=args.timeout)
    except TableError as exc:
        print(f"mutation check: {exc}", file=sys.stderr)
        return 2
    caught = sum(r.status == "caught" for r in results)
    issue = [r for r in results if r.mutation.issue]
    n_issue = sum(r.status == "caught" for r in issue)
    listed = f" ({n_issue} of {len(issue)} listed in issue 28)" if issue else ""
    print(f"\ncaught {caught} of {len(results)} mutations{listed}")
    for r in results:
        if r.status != "caught":
            print(f"  {r.status}: {r.mutation.name} ({r.mutation.module}): {r.detail[:300]}")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
