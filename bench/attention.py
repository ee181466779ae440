"""Attention kernels: LongCA-bench (kernels x masks, context parallel) and the CPU flash kernel's per-pair
cost
by tile.

Subcommands (``python bench/attention.py SUB --help`` for each one's options):

- ``bench``: LongCA-bench on this machine: attention kernels x masks, and context-parallel strategies x
  world sizes.
- ``tile``: Per-pair cost of aten's fused CPU flash kernel by query rows per call (issue 16, executor
  efficiency).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import hardware, run_subcommand, write_json

from longlab.ops.context_parallel import (
    STRATEGIES,
    CommStats,
    Layout,
    Mesh,
    context_parallel_attention,
    spawn,
    theoretical_bytes,
)
from longlab.ops.kernels import KERNELS, backward_unsupported_reason, flops, prepare, run, unavailable_reason
from longlab.ops.masks import MASKS, SliceMask, make_mask

# ---- bench (was bench/attention.py bench) ----------------------------------------

DOC_BENCH = """
LongCA-bench on this machine: attention kernels x masks, and context-parallel strategies x world sizes.

    python bench/attention.py bench --quick                       # a few minutes on 2 cores
    python bench/attention.py bench                               # kernels at 1k-32k, CP at ws 1/2/4
    python bench/attention.py bench --part kernels --lengths 8192,16384 --masks CAUSAL,RANDOM_BLOCK_0.5
    python bench/attention.py bench --device cuda --dtype bfloat16 --cp-backend nccl   # GPU machine
    python bench/attention.py bench --report bench/results/attention_bench_quick.json  # tables of a saved run
    torchrun --nproc-per-node 4 bench/attention.py bench --part cp --cp-backend nccl   # one world, torchrun

Part ``kernels`` (Bu et al., arXiv 2510.17896, section "dense/sparse kernels"): for each head shape (SmolLM2
GQA 9:3 and MHA 9:9, D = 64), length and mask, every available kernel of :mod:`longlab.ops.kernels` is timed
with interleaved repeats (the kernels take turns inside each repeat; medians reported): mask generation
(slices), mask construction for the kernel (dense bool / BlockMask / gather plan), forward, backward where
the kernel has one. FLOPs are LongCA's ``4 * area * H * D`` (backward 2.5x), peak memory is the growth of the
process's peak RSS during the call (``/proc/self/clear_refs``; CUDA: ``max_memory_allocated``), and every
output is checked against an fp64 reference on sampled query rows. Kernels that would materialise more
than ``--mem-cap-gb`` (naive, SDPA with a dense mask) are skipped with the reason, as are unavailable ones.

Part ``cp``: Ulysses, Ring-P2P, Ring-AllGather and USP at world sizes 1/2/4 (processes on one machine,
gloo; each rank one thread), FULL / CAUSAL / CAUSAL_DOCUMENT masks: forward and backward time (median,
slowest rank), bytes each rank sent next to the paper's volume formula, and the max error of outputs and
gradients against one process's fp64 attention (lengths up to ``--cp-check-max``).

Writes ``--out`` (JSON, with a hardware header) and PNGs beside it, and prints Markdown tables.
""".lstrip("\n")

SHAPES = {"gqa": (9, 3, 64), "mha": (9, 9, 64)}  # SmolLM2-135M heads: 9 query heads, 3 KV heads, D = 64


DEFAULT_KERNELS = ["naive", "sdpa-math", "sdpa", "flex", "gather", "grouped", "executor-gather",
                   "executor-flex", "executor-split", "executor-grouped", "flash-attn", "flashinfer"]


CP_MASKS = ["FULL", "CAUSAL", "CAUSAL_DOCUMENT"]


def _rss_kb(field: str = "VmRSS") -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mb(fn, device: torch.device) -> tuple[float | None, Any]:
    """Growth of peak memory during ``fn()`` in MiB (CPU: peak RSS over the RSS before; CUDA: allocator)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, out
    if not _reset_peak():
        return None, fn()
    base = _rss_kb()
    out = fn()
    return (_rss_kb("VmHWM") - base) / 1024, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _dense_bytes(kernel: str, mask: SliceMask, H: int, elem: int) -> int:
    """What a kernel materialises beyond q, k, v: the dense mask and, for naive / math, the score matrix."""
    TT = mask.q_len * mask.k_len
    if kernel in ("naive", "sdpa-math"):
        return TT * (1 + 3 * H * 4)  # mask + fp32 logits, probs, and a copy
    if kernel == "sdpa" and not (len(mask) == 1 and int(mask.types[0]) in (0, 1)):
        return TT * (1 + 4)  # bool mask (+ the float mask SDPA's CPU kernel builds)
    return 0


def _ref_rows(q, k, v, mask: SliceMask, rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp64 attention for some query rows. -> [B, H, R, D]"""
    lay = mask.to_block_layout(128, 128)
    m = lay.element_mask(rows, torch.arange(mask.k_len))  # [R, T_k]
    g = q.shape[1] // k.shape[1]
    qr = q[:, :, rows.to(q.device)].double().cpu()
    kr = k.double().cpu().repeat_interleave(g, 1)
    vr = v.double().cpu().repeat_interleave(g, 1)
    s = (qr @ kr.transpose(-1, -2)) * scaling
    p = torch.softmax(s.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)
    return p @ vr


def bench_kernels(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows_out: list[dict] = []
    kernels = args.kernels.split(",")
    masks = list(MASKS) if args.masks == "all" else args.masks.split(",")
    elem = torch.tensor([], dtype=dtype).element_size()
    cap = args.mem_cap_gb * 2**30
    for shape in args.shapes.split(","):
        H, H_kv, D = SHAPES[shape]
        for T in [int(x) for x in args.lengths.split(",")]:
            g = torch.Generator(device="cpu").manual_seed(args.seed)
            q = torch.randn(1, H, T, D, generator=g).to(device, dtype)
            k = torch.randn(1, H_kv, T, D, generator=g).to(device, dtype)
            v = torch.randn(1, H_kv, T, D, generator=g).to(device, dtype)
            dout = torch.randn(1, H, T, D, generator=g).to(device, dtype)
            scaling = 1.0 / math.sqrt(D)
            check_rows = torch.linspace(0, T - 1, min(T, args.check_rows)).long()
            for mname in masks:
                t0 = time.perf_counter()
                mask = make_mask(mname, T, seed=args.seed) if "DOCUMENT" in mname or "RANDOM" in mname \
                    else make_mask(mname, T)
                gen_s = time.perf_counter() - t0
                area = mask.area()
                ref = _ref_rows(q, k, v, mask, check_rows, scaling)
                base = {"shape": shape, "H": H, "H_kv": H_kv, "D": D, "T": T, "mask": mname,
                        "density": area / (T * T), "area": area, "mask_gen_s": gen_s,
                        "flops_fwd": flops(mask, H, D), "flops_bwd": flops(mask, H, D, backward=True),
                        "dtype": str(dtype).removeprefix("torch.")}
                live: dict[str, dict] = {}
                for kern in kernels:
                    reason = unavailable_reason(kern, mask, device, args.block)
                    if reason is None and _dense_bytes(kern, mask, H, elem) > cap:
                        reason = (f"would materialise {_dense_bytes(kern, mask, H, elem) / 2**30:.1f} GiB "
                                  f"(> --mem-cap-gb {args.mem_cap_gb})")
                    if reason is None and kern in ("flex", "executor-flex") and T > args.flex_max:
                        reason = f"T > --flex-max {args.flex_max}"
                    if reason is not None:
                        rows_out.append({**base, "kernel": kern, "skipped": reason})
                        continue
                    try:
                        build_s, prep = _timed(partial(prepare, kern, mask, device, args.block, H // H_kv),
                                               device)
                        first_s, out = _timed(partial(run, q, k, v, prep, scaling), device)  # compiles flex
                    except Exception as exc:  # noqa: BLE001 - a kernel that fails is reported, not fatal
                        why = f"{type(exc).__name__}: {exc}"[:300]
                        rows_out.append({**base, "kernel": kern, "skipped": why})
                        continue
                    err = float((out[:, :, check_rows.to(device)].double().cpu() - ref).abs().max())
                    bwd_reason = backward_unsupported_reason(kern, device)
                    if bwd_reason is None and T > args.bwd_max:
                        bwd_reason = f"T > --bwd-max {args.bwd_max}"
                    live[kern] = {"prep": prep, "build": [build_s], "fwd": [], "bwd": [], "first_s": first_s,
                                  "err": err, "bwd_reason": bwd_reason, "peak_fwd": None, "peak_bwd": None}
                    del out
                for rep in range(args.repeats):  # interleaved: every kernel once per repeat
                    for kern, st in live.items():
                        if rep > 0:
                            rebuild = partial(prepare, kern, mask, device, args.block, H // H_kv)
                            st["build"].append(_timed(rebuild, device)[0])
                        fwd_call = partial(run, q, k, v, st["prep"], scaling)
                        if rep == 0:
                            st["peak_fwd"], _ = _peak_mb(fwd_call, device)
                        st["fwd"].append(_timed(fwd_call, device)[0])
                        if st["bwd_reason"] is None:
                            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                            out = run(qg, kg, vg, st["prep"], scaling)
                            if rep == 0:
                                bwd_call = partial(out.backward, dout, retain_graph=True)
                                st["peak_bwd"], _ = _peak_mb(bwd_call, device)
                            st["bwd"].append(_timed(partial(out.backward, dout), device)[0])
                            del out, qg, kg, vg
                for kern, st in live.items():
                    fwd = statistics.median(st["fwd"])
                    row = {**base, "kernel": kern, "fwd_s": fwd, "fwd_q20_s": _q(st["fwd"], 0.2),
                           "fwd_q80_s": _q(st["fwd"], 0.8), "mask_build_s": statistics.median(st["build"]),
                           "first_call_s": st["first_s"], "tflops_fwd": base["flops_fwd"] / fwd / 1e12,
                           "max_abs_err": st["err"], "peak_fwd_mb": st["peak_fwd"], "repeats": args.repeats}
                    if st["bwd"]:
                        bwd = statistics.median(st["bwd"])
                        row.update(bwd_s=bwd, tflops_bwd=base["flops_bwd"] / bwd / 1e12,
                                   peak_bwd_mb=st["peak_bwd"])
                    else:
                        row["bwd_skipped"] = st["bwd_reason"]
                    rows_out.append(row)
                    print(f"[{shape} T={T} {mname}] {kern}: fwd {fwd * 1e3:.1f} ms "
                          f"({row['tflops_fwd'] * 1e3:.1f} GFLOP/s) build {row['mask_build_s'] * 1e3:.1f} ms "
                          f"err {st['err']:.1e}" + (f" bwd {row['bwd_s'] * 1e3:.1f} ms" if st["bwd"] else ""),
                          file=sys.stderr, flush=True)
    return rows_out


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def _exec_call(backend: str, q, k, v, m, scaling: float):
    from longlab.ops.kernels import split_block_sparse_attention
    from longlab.sparse.executor import block_sparse_attention

    if backend == "sdpa-causal":  # queries are the last T_q keys (a prefill chunk when T_q < T_k)
        from longlab.sparse.executor import dense_causal_attention

        return dense_causal_attention(q, k, v, scaling)
    if backend == "split":
        return split_block_sparse_attention(q, k, v, m, scaling)
    if backend.startswith("grouped-common"):  # grouped with split_common=N (the common blocks packed)
        from longlab.sparse.executor import grouped_block_sparse_attention

        return grouped_block_sparse_attention(q, k, v, m, scaling, split_common=int(backend[14:] or 1))
    if backend == "flex-prebuilt":  # the flex kernel alone: its BlockMask built before the timed call
        from longlab.attention import compiled_flex

        bm = _PREBUILT.get(id(m))
        if bm is None or bm[0] is not m:
            from longlab.sparse.executor import to_flex_block_mask

            bm = _PREBUILT[id(m)] = (m, to_flex_block_mask(m, compute_q_blocks=False))
        with torch._dynamo.config.patch(recompile_limit=64):
            return compiled_flex()(q, k, v, block_mask=bm[1], scale=scaling, enable_gqa=True)
    return block_sparse_attention(q, k, v, m, scaling, backend=backend)


_PREBUILT: dict[int, tuple[Any, Any]] = {}


def _profile_call(call) -> list[dict]:
    """Self CPU time per op of one call (torch.profiler), the 12 largest: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev)
    return [{"op": e.key[:80], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count,
             "share": e.self_cpu_time_total / max(total, 1)} for e in ev[:12]]


def pair_density(m) -> float:
    """Visible (query, key) pairs inside the selected blocks / visible pairs of the causal mask, over all
    batches and heads: the fraction of the work dense causal attention does (a diagonal block counts its
    causal half, not a whole block). ``ideal = pair_density x dense time``."""
    from longlab.sparse.blockmask import block_geometry

    geo = block_geometry(m.q_len, m.k_len, m.bq, m.bk, m.mask.device)
    qpos = torch.arange(m.q_len, device=m.mask.device) + m.q_offset  # [T_q]
    k_len = geo.k_last - geo.k_first + 1  # [n_kb] (the last block clipped to T_k)
    per_row = (qpos[:, None] - geo.k_first[None, :] + 1).clamp(min=0)
    per_row = torch.minimum(per_row, k_len[None, :])  # [T_q, n_kb]: visible keys of each block per row
    pad = m.n_qb * m.bq - m.q_len
    pairs = torch.nn.functional.pad(per_row, (0, 0, 0, pad)).view(m.n_qb, m.bq, m.n_kb).sum(1)  # [n_qb, n_kb]
    kept = (m.mask.double() * pairs.double()).sum()
    return float(kept / (pairs.double().sum() * m.mask.shape[0] * m.mask.shape[1]))


def median_ci(xs: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the median: order statistics ``(x_(k), x_(n+1-k))`` with the largest
    ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) < k)`` is at least ``confidence`` (None below 6 values)."""
    n = len(xs)
    s = sorted(xs)
    cdf = [sum(math.comb(n, i) for i in range(j + 1)) / 2**n for j in range(n)]  # P(Bin <= j)
    ks = [k for k in range(1, n // 2 + 1) if 1 - 2 * cdf[k - 1] >= confidence]
    if not ks or n < 6:
        return None
    k = max(ks)
    return s[k - 1], s[n - k]


def bench_executor(args: argparse.Namespace) -> list[dict]:
    """Per-head random causal block masks (what selectors hand the executor) at several densities, and a
    head-shared sink + 2k-window mask: each backend's time next to the ideal ``density x`` SDPA causal
    time, interleaved repeats, medians."""
    from longlab.sparse.blockmask import BlockSparseMask, causal_allowed, density, enforce_required

    H, H_kv, D = SHAPES["gqa"]
    rows: list[dict] = []
    backends = ["sdpa-causal", *args.exec_backends.split(",")]
    bs = args.block
    for T in [int(x) for x in args.exec_lengths.split(",")]:
        T_q = min(T, args.exec_chunk) if args.exec_chunk else T  # a chunk of queries at the end of T keys
        g = torch.Generator().manual_seed(args.seed)
        dev, dt = torch.device(args.device), getattr(torch, args.dtype)
        q = torch.randn(1, H, T_q, D, generator=g).to(dev, dt)
        k, v = (torch.randn(1, H_kv, T, D, generator=g).to(dev, dt) for _ in range(2))
        scaling = 1.0 / math.sqrt(D)
        n_q, n_k = -(-T_q // bs), -(-T // bs)
        allowed = causal_allowed(T_q, T, bs, bs)
        masks = {}
        kinds = args.exec_masks.split(",")
        for keep in [float(x) for x in args.exec_keep.split(",")] if "random" in kinds else []:
            raw = (torch.rand(1, H, n_q, n_k, generator=g) < keep) & allowed
            masks[f"random-per-head keep={keep:g}"] = enforce_required(BlockSparseMask(raw.to(dev), bs, bs,
                                                                                       T_q, T))
        band = allowed & ~allowed.tril(T // bs - T_q // bs - (2048 // bs) - 1)
        band[:, 0] = True
        if "window" in kinds:
            masks["sink+2k window"] = enforce_required(BlockSparseMask(band.expand(1, H, -1, -1).to(dev), bs,
                                                                       bs, T_q, T))
        for name, m in masks.items():
            times: dict[str, list[float]] = {c: [] for c in backends}
            for c in backends:  # warm-up (flex compiles here)
                _exec_call(c, q, k, v, m, scaling)
            for _ in range(args.repeats):
                for c in backends:
                    call = partial(_exec_call, c, q, k, v, m, scaling)
                    times[c].append(_timed(call, dev)[0])
            dens_blocks = density(m)
            dens = pair_density(m)  # the efficiency's density: pairs, over the area dense causal computes
            dense_s = statistics.median(times["sdpa-causal"])
            from longlab.sparse.executor import to_flex_block_mask

            build = statistics.median(_timed(partial(to_flex_block_mask, enforce_required(m), False),
                                             dev)[0] for _ in range(3))
            enforce_s = statistics.median(_timed(partial(enforce_required, m), dev)[0]
                                          for _ in range(3))
            profiles = {}
            if args.exec_profile:
                for c in backends[1:]:
                    profiles[c] = _profile_call(partial(_exec_call, c, q, k, v, m, scaling))
            for c in backends:
                t = statistics.median(times[c])
                # per repeat: density x that repeat's dense time / that repeat's time (dense ran just before)
                paired = [dens * d / x for d, x in zip(times["sdpa-causal"], times[c])]
                rows.append({"eff_paired": paired, "eff_paired_median": statistics.median(paired),
                             "eff_paired_ci95": median_ci(paired), "T": T, "T_q": T_q, "mask": name,
                             "backend": c, "density": dens,
                             "block_density": dens_blocks, "efficiency_blocks": dens_blocks * dense_s / t,
                             "s": t, "s_all": times[c], "uptime": os.popen("uptime").read().strip(),
                             "dense_s": dense_s, "ideal_s": dens * dense_s, "efficiency": dens * dense_s / t,
                             "speedup_vs_dense": dense_s / t,
                             "flex_block_mask_build_s": build if c == "flex" else None,
                             "enforce_required_s": enforce_s, "profile": profiles.get(c),
                             "repeats": args.repeats, "threads": torch.get_num_threads()})
                print(f"[executor T={T} T_q={T_q} {name} rho={dens:.3f}] {c}: {t * 1e3:.0f} ms "
                      f"(ideal {dens * dense_s * 1e3:.0f} ms, efficiency {dens * dense_s / t:.2f}; paired "
                      f"median {statistics.median(paired):.2f}, 95% CI {median_ci(paired)})",
                      file=sys.stderr, flush=True)
    return rows


def _cp_worker(rank: int, world: int, cfg: dict) -> dict:
    device = torch.device("cuda", rank) if cfg["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, cfg["dtype"])
    out: dict[str, Any] = {}
    meshes: dict[int, Mesh] = {}
    for shape in cfg["shapes"]:
        H, H_kv, D = SHAPES[shape]
        for T in cfg["lengths"]:
            g = torch.Generator().manual_seed(cfg["seed"])
            q = torch.randn(1, H, T, D, generator=g)
            k = torch.randn(1, H_kv, T, D, generator=g)
            v = torch.randn(1, H_kv, T, D, generator=g)
            dout = torch.randn(1, H, T, D, generator=g)
            lay = Layout(T, world)
            for mname in cfg["masks"]:
                mask = make_mask(mname, T, seed=cfg["seed"]) if "DOCUMENT" in mname else make_mask(mname, T)
                ref = None
                if T <= cfg["check_max"]:
                    ref = _cp_reference(q, k, v, dout, mask)
                for strategy in cfg["strategies"]:
                    u = world if strategy == "ulysses" else 1 if strategy.startswith("ring") else \
                        (2 if world >= 4 else 1)
                    if strategy == "usp" and world < 4:
                        continue  # USP needs a 2-D mesh: u >= 2 and a ring >= 2
                    if world == 1 and strategy != "ring-p2p":
                        continue  # one process: every strategy is the same local attention
                    if u not in meshes:
                        meshes[u] = Mesh.build(u, world) if world > 1 else Mesh(1, 1, (0,), (0,), None, None)
                    ql, kl, vl, dl = (lay.shard(x, rank).to(device, dtype) for x in (q, k, v, dout))
                    key = f"{shape}/{T}/{mname}/{strategy}"
                    fwd, bwd = [], []
                    stats = CommStats()
                    errs = None
                    for rep in range(cfg["repeats"] + 1):
                        qg, kg, vg = (x.detach().requires_grad_() for x in (ql, kl, vl))
                        st = CommStats()
                        if world > 1:
                            torch.distributed.barrier()
                        t0 = time.perf_counter()
                        o = context_parallel_attention(qg, kg, vg, mask, lay, strategy, ulysses_size=u,
                                                       mesh=meshes[u], stats=st, head_fallback="pad")
                        _sync(device)
                        t1 = time.perf_counter()
                        o.backward(dl)
                        _sync(device)
                        t2 = time.perf_counter()
                        if rep > 0:  # the first is a warm-up
                            fwd.append(t1 - t0)
                            bwd.append(t2 - t1)
                        stats = st
                        if rep == 0 and ref is not None:
                            got = (o, qg.grad, kg.grad, vg.grad)
                            errs = {n: float((a.detach().double().cpu() - lay.shard(b, rank)).abs().max())
                                    for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
                    elem = torch.tensor([], dtype=dtype).element_size()
                    out[key] = {"shape": shape, "T": T, "mask": mname, "strategy": strategy, "world": world,
                                "u": u, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd),
                                "fwd_bytes": stats.total("fwd"), "bwd_bytes": stats.total("bwd"),
                                "fwd_bytes_theory": theoretical_bytes(strategy, T, world, H, H_kv, D, elem,
                                                                      u),
                                "bwd_bytes_theory": theoretical_bytes(strategy, T, world, H, H_kv, D, elem,
                                                                      u, backward=True),
                                "errors": errs, "heads_padded": strategy in ("ulysses", "usp") and
                                (H % u != 0 or (H_kv % u != 0 and u % H_kv != 0))}
    return out


def _cp_reference(q, k, v, dout, mask: SliceMask):
    """fp64 single-process attention and its gradients, one query head at a time (bounded memory)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    lay = mask.to_block_layout(128, 128)
    ar = torch.arange(mask.q_len)
    m = lay.element_mask(ar, ar)
    outs = []
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // g].transpose(-1, -2) / q.shape[-1] ** 0.5
        o = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v[:, h // g]
        o.backward(dout[:, h].double())
        outs.append(o.detach())
    return torch.stack(outs, 1), q.grad, k.grad, v.grad


def bench_cp(args: argparse.Namespace) -> list[dict]:
    cfg = {"shapes": args.cp_shapes.split(","), "lengths": [int(x) for x in args.cp_lengths.split(",")],
           "masks": CP_MASKS, "strategies": list(STRATEGIES), "repeats": args.cp_repeats, "seed": args.seed,
           "check_max": args.cp_check_max, "backend": args.cp_backend, "dtype": args.cp_dtype}
    rows: list[dict] = []
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # under torchrun: one world, this process
    for world in [int(os.environ["WORLD_SIZE"])] if launched else [int(x) for x in args.cp_worlds.split(",")]:
        t0 = time.perf_counter()
        if launched:
            per_rank = _torchrun_ranks(cfg, args)
            if per_rank is None:  # not rank 0
                return []
        else:
            per_rank = spawn(_cp_worker, world, (cfg,), backend=args.cp_backend,
                             start_method="spawn" if args.cp_backend == "nccl" else "fork")
        for key in per_rank[0]:
            rs = [r[key] for r in per_rank]
            row = dict(rs[0])
            row["fwd_s"] = max(r["fwd_s"] for r in rs)  # the slowest rank sets the pace
            row["bwd_s"] = max(r["bwd_s"] for r in rs)
            row["fwd_bytes"] = max(r["fwd_bytes"] for r in rs)
            row["bwd_bytes"] = max(r["bwd_bytes"] for r in rs)
            if rs[0]["errors"] is not None:
                row["errors"] = {n: max(r["errors"][n] for r in rs) for n in rs[0]["errors"]}
            rows.append(row)
            e = row["errors"]
            print(f"[cp ws={world}] {key}: fwd {row['fwd_s'] * 1e3:.1f} ms bwd {row['bwd_s'] * 1e3:.1f} ms "
                  f"sent {row['fwd_bytes'] / 2**20:.2f} MiB (theory {row['fwd_bytes_theory'] / 2**20:.2f})"
                  + (f" err {max(e.values()):.1e}" if e else ""), file=sys.stderr, flush=True)
        print(f"[cp ws={world}] {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def _torchrun_ranks(cfg: dict, args: argparse.Namespace) -> list[dict] | None:
    """``torchrun --nproc-per-node N bench/attention.py bench --part cp``: every rank runs the worker and
    writes its JSON beside ``--out`` (a file system all ranks see); rank 0 reads them all after a barrier."""
    import json

    dist = torch.distributed
    dist.init_process_group(args.cp_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cp_backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    base = Path(args.out or "bench/results/attention_bench.json")
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(f".rank{rank}.json").write_text(json.dumps(_cp_worker(rank, world, cfg)))
    dist.barrier()
    out = None
    if rank == 0:
        out = [json.loads(base.with_suffix(f".rank{r}.json").read_text()) for r in range(world)]
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        for r in range(world):
            base.with_suffix(f".rank{r}.json").unlink()
    return out


def print_tables(result: dict) -> None:
    m = result["meta"]
    print(f"# LongCA-bench here: torch {m['torch']}, {m['cpu']}, {m['threads']} threads, "
          f"load {m['load_avg_1m']}, device {m['device']}, dtype {m['dtype']}, "
          f"median of {m['repeats']} interleaved repeats\n")
    krows = [r for r in result.get("kernels", []) if "fwd_s" in r]
    if krows:
        kern_order = [k for k in KERNELS if any(r["kernel"] == k for r in krows)]
        for shape in sorted({r["shape"] for r in krows}):
            for T in sorted({r["T"] for r in krows if r["shape"] == shape}):
                sub = [r for r in krows if r["shape"] == shape and r["T"] == T]
                head = f"H={sub[0]['H']}, H_kv={sub[0]['H_kv']}, D={sub[0]['D']}"
                print(f"## kernels, {shape} ({head}), T={T}: forward ms (GFLOP/s) [mask build ms]\n")
                print("| mask | density | " + " | ".join(kern_order) + " | fastest |")
                print("|---|---|" + "---|" * (len(kern_order) + 1))
                for mname in dict.fromkeys(r["mask"] for r in sub):
                    cells, best = [], None
                    for kern in kern_order:
                        r = next((x for x in sub if x["mask"] == mname and x["kernel"] == kern), None)
                        if r is None:
                            cells.append("-")
                            continue
                        cells.append(f"{r['fwd_s'] * 1e3:.1f} ({r['tflops_fwd'] * 1e3:.0f}) "
                                     f"[{r['mask_build_s'] * 1e3:.1f}]")
                        if best is None or r["fwd_s"] < best["fwd_s"]:
                            best = r
                    dens = next(x["density"] for x in sub if x["mask"] == mname)
                    print(f"| {mname} | {dens:.3f} | " + " | ".join(cells) + f" | {best['kernel']} |")
                print()
        eff = _efficiency(krows)
        if eff:
            print("## block-sparse efficiency: (area / causal area) x SDPA causal time / kernel time "
                  "(goal >= 0.8)\n")
            print("| shape | T | mask | rel. density | kernel | ms | ideal ms | efficiency |")
            print("|---|---|---|---|---|---|---|---|")
            for e in eff:
                print(f"| {e['shape']} | {e['T']} | {e['mask']} | {e['rho']:.3f} | {e['kernel']} | "
                      f"{e['ms']:.1f} | {e['ideal_ms']:.1f} | {e['efficiency']:.2f} |")
            print()
        brows = [r for r in krows if "bwd_s" in r]
        if brows:
            print("## backward ms (GFLOP/s), kernels with a CPU backward\n")
            print("| shape | T | mask | kernel | bwd ms | GFLOP/s | peak fwd MiB | peak bwd MiB |")
            print("|---|---|---|---|---|---|---|---|")
            for r in brows:
                print(f"| {r['shape']} | {r['T']} | {r['mask']} | {r['kernel']} | {r['bwd_s'] * 1e3:.1f} | "
                      f"{r['tflops_bwd'] * 1e3:.0f} | {_mb(r['peak_fwd_mb'])} | {_mb(r['peak_bwd_mb'])} |")
            print()
            bk = [k for k in KERNELS if any(r["kernel"] == k for r in brows)]
            for shape, T in dict.fromkeys((r["shape"], r["T"]) for r in brows):
                print(f"## backward, {shape}, T={T}: bwd ms (GFLOP/s, backward FLOPs = 2.5 x forward)\n")
                print("| mask | " + " | ".join(bk) + " | fastest |")
                print("|---|" + "---|" * (len(bk) + 1))
                sub = [r for r in brows if (r["shape"], r["T"]) == (shape, T)]
                for mname in dict.fromkeys(r["mask"] for r in sub):
                    got = {r["kernel"]: r for r in sub if r["mask"] == mname}
                    cells = [f"{got[k]['bwd_s'] * 1e3:.1f} ({got[k]['tflops_bwd'] * 1e3:.0f})" if k in got
                             else "-" for k in bk]
                    best = min(got.values(), key=lambda r: r["bwd_s"])["kernel"]
                    print(f"| {mname} | " + " | ".join(cells) + f" | {best} |")
                print()
        skipped = {(r["kernel"], r["skipped"].split(";")[0][:90]) for r in result["kernels"]
                   if "skipped" in r}
        if skipped:
            print("skipped: " + "; ".join(f"{k}: {why}" for k, why in sorted(skipped)) + "\n")
    erows = result.get("executor", [])
    if erows:
        print("## sparse-prefill executor: per-head causal block masks, time vs density x SDPA causal\n")
        print("| T | T_q | mask | density | backend | ms | ideal ms | efficiency | speedup vs dense | "
              "of which BlockMask build ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in erows:
            print(f"| {r['T']} | {r.get('T_q', r['T'])} | {r['mask']} | {r['density']:.3f} | "
                  f"{r['backend']} | {r['s'] * 1e3:.0f} | "
                  f"{r['ideal_s'] * 1e3:.0f} | {r['efficiency']:.2f} | {r['speedup_vs_dense']:.2f} | "
                  f"{_ms(r.get('flex_block_mask_build_s'))} |")
        print()
        _executor_compact(erows)
    crows = result.get("cp", [])
    if crows:
        print("## context parallel (processes on this machine, 1 thread each; slowest rank)\n")
        print("| shape | T | mask | strategy | ws | u | fwd ms | bwd ms | fwd MiB sent | theory | "
              "bwd MiB sent | theory | max err |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in crows:
            e = r.get("errors")
            err = f"{max(e.values()):.1e}" if e else "-"
            pad = " (pad)" if r["heads_padded"] else ""
            name = "single process" if r["world"] == 1 else r["strategy"]
            print(f"| {r['shape']} | {r['T']} | {r['mask']} | {name}{pad} | {r['world']} | "
                  f"{r['u']} | {r['fwd_s'] * 1e3:.1f} | {r['bwd_s'] * 1e3:.1f} | "
                  f"{r['fwd_bytes'] / 2**20:.2f} | "
                  f"{r['fwd_bytes_theory'] / 2**20:.2f} | {r['bwd_bytes'] / 2**20:.2f} | "
                  f"{r['bwd_bytes_theory'] / 2**20:.2f} | {err} |")
        print()


def _eff_cell(r: dict) -> str:
    """``ms (efficiency)``; with per-repeat pairs: ``ms (paired median [95% CI of the median])``."""
    if r.get("eff_paired_ci95"):
        lo, hi = r["eff_paired_ci95"]
        return f"{r['s'] * 1e3:.0f} ({r['eff_paired_median']:.2f} [{lo:.2f}, {hi:.2f}])"
    return f"{r['s'] * 1e3:.0f} ({r['efficiency']:.2f})"


def _executor_compact(erows: list[dict]) -> None:
    """One row per (T, T_q, mask): each backend's ms and efficiency side by side, the BlockMask build apart,
    and where the time of each profiled call went (share of the attention op: aten's fused op, or bmm for
    the ``folded`` backend of the 02:00 runs, removed: commit b53c584; gather = index_select / index)."""
    backs = [b for b in dict.fromkeys(r["backend"] for r in erows) if b != "sdpa-causal"]
    print("## executor, side by side: ms (efficiency = density x dense / time; density = visible pairs "
          "computed / causal pairs, block density in brackets where recorded)\n")
    print("| T | T_q | mask | density | dense ms | " + " | ".join(backs) +
          " | BlockMask build ms | attention op / gather share |")
    print("|---|---|---|---|---|" + "---|" * len(backs) + "---|---|")
    for key in dict.fromkeys((r["T"], r.get("T_q", r["T"]), r["mask"]) for r in erows):
        sub = {r["backend"]: r for r in erows if (r["T"], r.get("T_q", r["T"]), r["mask"]) == key}
        cells = [_eff_cell(sub[b]) if b in sub else "-" for b in backs]
        any_row = next(iter(sub.values()))
        build = _ms(sub["flex"].get("flex_block_mask_build_s")) if "flex" in sub else ""
        shares = []
        for b in backs:
            prof = sub.get(b, {}).get("profile")
            if prof and b not in ("flex", "flex-prebuilt"):
                att = sum(p["share"] for p in prof if "flash_attention" in p["op"] or p["op"] == "aten::bmm")
                gat = sum(p["share"] for p in prof if p["op"] in ("aten::index_select", "aten::index"))
                shares.append(f"{b} {att:.2f} / {gat:.2f}")
        dens = f"{any_row['density']:.3f}"
        if any_row.get("block_density") is not None:
            dens += f" ({any_row['block_density']:.3f})"
        tail = f" | {build} | {'; '.join(shares)} |"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {dens} | "
              f"{any_row['dense_s'] * 1e3:.0f} | " + " | ".join(cells) + tail)
    print()


def _merge(runs: list[dict], names: list[str]) -> dict:
    """Several saved runs as one result: rows concatenated, each run's meta kept (with its file name)."""
    out: dict[str, Any] = {"meta": {**runs[0]["meta"], "merged_from": [
        {"file": n, "argv": r["meta"].get("argv"), "uptime": r["meta"].get("uptime"),
         "uptime_end": r["meta"].get("uptime_end"), "threads": r["meta"].get("threads")}
        for n, r in zip(names, runs)]}}
    for part in ("kernels", "executor", "cp"):
        rows = [row for r in runs for row in r.get(part, [])]
        if rows:
            out[part] = rows
    return out


def _efficiency(krows: list[dict]) -> list[dict]:
    """For causal-subset masks: ideal time = (area / causal area) x the SDPA causal time at the same T."""
    out = []
    for r in krows:
        if not (r["mask"].startswith("RANDOM_BLOCK") or r["mask"] in ("CAUSAL", "SLIDING_WINDOW_CAUSAL",
                                                                     "CAUSAL_DOCUMENT")):
            continue
        dense = next((x for x in krows if x["shape"] == r["shape"] and x["T"] == r["T"]
                      and x["mask"] == "CAUSAL" and x["kernel"] == "sdpa"), None)
        if dense is None or r["kernel"] in ("naive", "sdpa-math"):
            continue
        rho = r["area"] / dense["area"]
        ideal = rho * dense["fwd_s"]
        out.append({"shape": r["shape"], "T": r["T"], "mask": r["mask"], "kernel": r["kernel"], "rho": rho,
                    "ms": r["fwd_s"] * 1e3, "ideal_ms": ideal * 1e3, "efficiency": ideal / r["fwd_s"]})
    return out


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def plot(result: dict, path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    krows = [r for r in result.get("kernels", []) if "fwd_s" in r]
    kern_all = [k for k in KERNELS if any(r["kernel"] == k for r in krows)]
    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + ["black", "gold", "navy"]
    colour = {k: palette[KERNELS.index(k) % len(palette)] for k in kern_all}  # one fixed colour per kernel
    for shape in sorted({r["shape"] for r in krows}):
        masks = list(dict.fromkeys(r["mask"] for r in krows if r["shape"] == shape))
        cols = 5
        nrow = math.ceil(len(masks) / cols)
        fig, axes = plt.subplots(nrow, cols, figsize=(3.4 * cols, 2.6 * nrow + 0.9), squeeze=False)
        for ax, mname in zip(axes.flat, masks):
            for kern in kern_all:
                pts = sorted((r["T"], r["tflops_fwd"] * 1e3) for r in krows
                             if r["mask"] == mname and r["kernel"] == kern and r["shape"] == shape)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, color=colour[kern], label=kern)
            ax.set_xscale("log", base=2)
            ax.set_title(mname, fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(masks):]:
            ax.axis("off")
        for r in range(nrow):
            axes[r][0].set_ylabel("forward GFLOP/s", fontsize=7)
        handles = [plt.Line2D([], [], color=colour[k], marker="o", ms=3, label=k) for k in kern_all]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
        fig.suptitle(f"kernels x masks, {shape}, forward GFLOP/s (from the unmasked area) vs T", fontsize=9)
        fig.tight_layout(rect=(0, 0.35 / (2.6 * nrow + 0.9), 1, 1))  # legend below the panels, off the curves
        p = path.with_name(path.stem + f"_kernels_{shape}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    erows = result.get("executor", [])
    if erows:
        modes = sorted({"chunk" if r.get("T_q", r["T"]) < r["T"] else "one-shot" for r in erows})
        emasks = list(dict.fromkeys(r["mask"] for r in erows))
        backs = [b for b in dict.fromkeys(r["backend"] for r in erows) if b != "sdpa-causal"]
        bcol = {b: plt.get_cmap("tab10")(i) for i, b in enumerate(backs)}
        fig, axes = plt.subplots(len(modes), len(emasks), figsize=(3.3 * len(emasks), 2.7 * len(modes) + 0.8),
                                 squeeze=False)
        for r_i, mode in enumerate(modes):
            for c_i, mname in enumerate(emasks):
                ax = axes[r_i][c_i]
                for b in backs:
                    pts = sorted((r["T"], r["efficiency"]) for r in erows if r["mask"] == mname and
                                 r["backend"] == b and (r.get("T_q", r["T"]) < r["T"]) == (mode == "chunk"))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", ms=3, color=bcol[b])
                ax.axhline(0.8, color="grey", ls="--", lw=0.8)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{mode}: {mname}", fontsize=8)
                ax.tick_params(labelsize=7)
            axes[r_i][0].set_ylabel("efficiency = rho x dense / time", fontsize=7)
        handles = [plt.Line2D([], [], color=bcol[b], marker="o", ms=3, label=b) for b in backs]
        handles.append(plt.Line2D([], [], color="grey", ls="--", label="goal 0.8"))
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
        fig.suptitle("sparse-prefill executor: efficiency vs T (SmolLM2 GQA heads)", fontsize=9)
        fig.tight_layout(rect=(0, 0.35 / (2.7 * len(modes) + 0.8), 1, 1))
        p = path.with_name(path.stem + "_executor.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    crows = result.get("cp", [])
    if crows:
        T = max(r["T"] for r in crows)
        shape = crows[0]["shape"]
        sub = [r for r in crows if r["T"] == T and r["shape"] == shape]
        masks = list(dict.fromkeys(r["mask"] for r in sub))
        fig, axes = plt.subplots(2, len(masks), figsize=(4 * len(masks), 6), squeeze=False)
        for c, mname in enumerate(masks):
            single = next((r for r in sub if r["mask"] == mname and r["world"] == 1), None)
            for strategy in STRATEGIES:
                pts = sorted((r["world"], r) for r in sub if r["mask"] == mname and r["strategy"] == strategy
                             and r["world"] > 1)
                if single is not None:
                    pts = [(1, single)] + pts
                if len(pts) < 2:
                    continue
                ws = [w for w, _ in pts]
                line = axes[0][c].plot(ws, [(r["fwd_s"] + r["bwd_s"]) * 1e3 for _, r in pts], marker="o",
                                       label=strategy)[0]
                axes[1][c].plot(ws, [r["fwd_bytes"] / 2**20 for _, r in pts], marker="o",
                                color=line.get_color())
                axes[1][c].plot(ws, [r["fwd_bytes_theory"] / 2**20 for _, r in pts], ls="--",
                                color=line.get_color())
            axes[0][c].set_title(mname, fontsize=9)
            for ax in (axes[0][c], axes[1][c]):
                ax.set_xticks([1, 2, 4])
                ax.set_xlabel("world size")
        axes[0][0].set_ylabel("fwd + bwd ms (slowest rank)")
        axes[1][0].set_ylabel("fwd MiB sent per rank (-- theory)")
        fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(STRATEGIES),
                   fontsize=7, frameon=False)
        fig.suptitle(f"context parallel, {shape}, T={T}, processes on this machine (gloo)", fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        p = path.with_name(path.stem + "_cp.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def bench_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=DOC_BENCH.split("\n", 1)[0])
    p.add_argument("--part", default="all", choices=["all", "kernels", "cp", "executor"])
    p.add_argument("--quick", action="store_true", help="lengths 1024,2048 (kernels) and 2048 (cp)")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--shapes", default="gqa,mha", help=f"head shapes: {','.join(SHAPES)}")
    p.add_argument("--masks", default="all", help=f"comma list of {','.join(MASKS)} or 'all'")
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS))
    p.add_argument("--block", type=int, default=128, help="block size of flex / gather / executor")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check-rows", type=int, default=32, help="query rows checked against fp64")
    p.add_argument("--mem-cap-gb", type=float, default=3.0)
    p.add_argument("--bwd-max", type=int, default=4096, help="longest T timed backward")
    p.add_argument("--flex-max", type=int, default=1 << 20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the kernels part")
    p.add_argument("--cp-worlds", default="1,2,4")
    p.add_argument("--cp-lengths", default="2048,4096")
    p.add_argument("--cp-shapes", default="gqa")
    p.add_argument("--cp-repeats", type=int, default=2)
    p.add_argument("--cp-check-max", type=int, default=2048)
    p.add_argument("--cp-backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--cp-dtype", default="float32")
    p.add_argument("--exec-lengths", default="8192,16384,32768")
    p.add_argument("--exec-keep", default="0.2,0.5,0.8", help="fraction of causal blocks each head keeps")
    p.add_argument("--exec-backends", default="gather,flex,flex-prebuilt,split,grouped")
    p.add_argument("--exec-profile", action="store_true", help="store one profiled call per backend")
    p.add_argument("--exec-chunk", type=int, default=0, help="queries per call (chunked prefill); 0 = T")
    p.add_argument("--exec-masks", default="random,window", help="random (per-head, --exec-keep), window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default bench/results/attention_bench[_quick].json")
    p.add_argument("--report", metavar="JSON", nargs="+",
                   help="print the tables and redraw the plots of saved runs (several: merged into --out)")
    args = p.parse_args(argv)
    if args.report:
        import json

        runs = [json.loads(Path(f).read_text()) for f in args.report]
        saved = runs[0] if len(runs) == 1 else _merge(runs, args.report)
        base = Path(args.report[0])
        if len(runs) > 1:
            base = Path(args.out or "bench/results/attention_bench_merged.json")
            write_json(base, saved)
        pngs = plot(saved, base)
        print_tables(saved)
        print("wrote " + ", ".join(str(x) for x in pngs))
        return
    if args.quick:
        args.lengths, args.cp_lengths, args.repeats, args.cp_repeats = "1024,2048", "2048", 3, 2
        args.exec_lengths = "4096"
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out_path = Path(args.out or f"bench/results/attention_bench{'_quick' if args.quick else ''}.json")
    meta = {**hardware(), "device": str(device), "dtype": args.dtype, "repeats": args.repeats,
            "argv": sys.argv[1:] if argv is None else argv, "uptime": os.popen("uptime").read().strip()}
    result: dict[str, Any] = {"meta": meta}
    if args.part in ("all", "kernels"):
        result["kernels"] = bench_kernels(args, device, dtype)
    if args.part in ("all", "executor"):
        result["executor"] = bench_executor(args)
    if args.part in ("all", "cp"):
        result["cp"] = bench_cp(args)
        if "RANK" in os.environ and os.environ["RANK"] != "0":
            return
    result["meta"]["uptime_end"] = os.popen("uptime").read().strip()
    write_json(out_path, result)
    pngs = plot(result, out_path)
    print_tables(result)
    print(f"wrote {out_path}" + "".join(f", {p}" for p in pngs))


def _run_bench() -> object:
    bench_main()


# ---- tile (was bench/attention.py tile) ----------------------------------------

DOC_TILE = """
Per-pair cost of aten's fused CPU flash kernel by query rows per call (issue 16, executor efficiency).

    bench/heavy.sh .venv/bin/python bench/attention.py tile [T] [--grid]

Times, at SmolLM2's GQA heads (9 q / 3 KV, D = 64) and T = 8192 by default: dense ``is_causal`` SDPA
(GQA native, and with K/V repeated), then batches of mask-free units of R query rows x L keys holding a
quarter of the causal work, for R in 128..1024. The kernel tiles queries by 32 rows below 192 queries,
64 below 768 and 256 above, so a 128-row unit (one q-block of a per-head block mask) pays more per pair
than dense causal prefill. Prints ns per computed pair (dense: per causal pair) and the ratio to dense;
median of 3 calls after one warm-up.
""".lstrip("\n")

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _median_s(fn, n: int = 3) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def tile_main(T: int = 8192) -> None:
    torch.manual_seed(0)
    H, H_kv, D = 9, 3, 64
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, H_kv, T, D), torch.randn(1, H_kv, T, D)
    causal_pairs = H * T * (T + 1) / 2
    res = {"dense is_causal (GQA)": _median_s(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)) / causal_pairs}
    kr, vr = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
    rep = _median_s(lambda: OP(q, kr, vr, 0.0, True, scale=0.125))
    res["dense is_causal (K/V repeated)"] = rep / causal_pairs
    shapes = [(128, 4096), (256, 4096), (384, 4096), (768, 4096), (1024, 4096), (128, 1024), (128, 2048)]
    if "--grid" in sys.argv:  # short key sets (what random masks at keep 0.2 give) and key-block-major units
        shapes += [(128, 128), (128, 256), (128, 512), (256, 512), (256, 1024), (384, 512), (384, 1024),
                   (768, 1024), (4096, 128), (4096, 512), (1024, 128)]
    for rows, keys in shapes:
        G = max(1, int(0.25 * causal_pairs / (rows * keys)))
        qs, ks, vs = torch.randn(G, 1, rows, D), torch.randn(G, 1, keys, D), torch.randn(G, 1, keys, D)
        res[f"units {rows} rows x {keys} keys"] = _median_s(
            lambda qs=qs, ks=ks, vs=vs: OP(qs, ks, vs, 0.0, False, scale=0.125)) / (G * rows * keys)
    if "--grid" in sys.argv:
        # the diagonal part: G square 128 x 128 causal problems in one is_causal call (per causal pair)
        n = 64 * H
        qd, kd = torch.randn(n, 1, 128, D), torch.randn(n, 1, 128, D)
        res["diag 128x128 is_causal (per causal pair)"] = _median_s(
            lambda: OP(qd, kd, kd, 0.0, True, scale=0.125)) / (n * 128 * 129 / 2)
        # K/V gather of 128-key blocks (index_select of 32 KiB rows) and one lse merge pass, per pair of a
        # 128 x 128 block pair they serve
        kb = torch.randn(H_kv * 64, 128 * D)
        idx = torch.randint(0, H_kv * 64, (2048,))
        ws = torch.empty(2048, 128 * D)
        res["gather K+V per block pair"] = 2 * _median_s(
            lambda: torch.index_select(kb, 0, idx, out=ws)) / (2048 * 128 * 128)
        o1, o2 = torch.randn(H, T, D), torch.randn(H, T, D)
        l1, l2 = torch.randn(H, T), torch.randn(H, T)

        def merge() -> None:
            new = torch.logaddexp(l1, l2)
            o1.mul_(torch.exp(l1 - new)[..., None]).addcmul_(o2, torch.exp(l2 - new)[..., None])
        res["merge pass per 128-key block row"] = _median_s(merge) / (H * T * 128)
    base = res["dense is_causal (GQA)"]
    print(f"T={T}, {torch.get_num_threads()} thread(s)")
    for name, s in res.items():
        print(f"{name:32s} {s * 1e9:7.3f} ns/pair  x{s / base:5.2f}")


def _run_tile() -> object:
    ap = argparse.ArgumentParser(description=DOC_TILE.split("\n\n")[0])
    ap.add_argument("T", type=int, nargs="?", default=8192, help="keys per head (default 8192)")
    ap.add_argument("--grid", action="store_true", help="also short key sets, the diagonal call, gather")
    args = ap.parse_args()  # tile_main reads --grid from sys.argv itself
    tile_main(args.T)


SUBCOMMANDS = {
    "bench": _run_bench,
    "tile": _run_tile,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/attention.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
