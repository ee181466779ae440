"""Kernel-only micro-benchmark of the fused decode kernels (``python bench/decode_speed.py --micro``).

Per round, interleaved: a STREAM-like copy (``b.copy_(a)``, 256 MiB; bandwidth = 2 x bytes / time, as STREAM
counts), then per context length, each over ``N_LAYERS`` layers in turn (so the bytes come from memory, not
the cache): the fused quantized decode kernel on KIVI-4 and KIVI-2 layers, the PyTorch fallback
(dequantise in chunks, ``chunked_attention``) on the KIVI-4 layers, SDPA over fp32 layers (the dense
path's attention), the paged kernel over 1/8 of the pages (Quest's selection shape) and the PyTorch gather
of the same pages (``attend_slots``). SmolLM2-135M's shapes: 9 query heads, 3 KV heads, D = 64, batch 1.

Bytes a kernel must read: the packed codes, scales and offsets, the position index and the full-precision
residual (KIVI: up to 128 tokens) of the layer; the paged kernel: the selected K and V rows per query head
and their index entries. Bound = bytes / copy bandwidth; efficiency = bound / time (1.0: as fast as the
copy moves bytes). Medians over rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import hardware

from longlab.cache import LonglabLayer
from longlab.decode.quest import attend_slots, page_slots
from longlab.ops import qdecode
from longlab.quant.storage import ChannelGroupStore, QuantizedLayer, TokenGroupStore, chunked_attention

N_LAYERS = 30  # SmolLM2's layers: the caches of one decode step
H, H_KV, D = 9, 3, 64
COPY_FLOATS = 64 * 2**20  # 256 MiB per array


def _kivi_layer(T: int, bits: int, seed: int) -> QuantizedLayer:
    g = torch.Generator().manual_seed(seed)
    layer = LonglabLayer()
    layer.update(torch.randn(1, H_KV, T, D, generator=g), torch.randn(1, H_KV, T, D, generator=g))
    ql = QuantizedLayer.from_layer(layer, ChannelGroupStore(bits, 32), TokenGroupStore(bits, 32))
    ql.quantize_keys((T - 128) // 128 * 128)  # KIVI's state: keys flushed in blocks of R = 128
    ql.quantize_values(T - 128)  # values: a window of exactly R
    return ql


def _read_bytes(ql: QuantizedLayer) -> int:
    held = ql.key_store.tensors() + ql.value_store.tensors() + [ql.index, ql.keys, ql.values]
    return sum(t.numel() * t.element_size() for t in held)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def micro(lengths: list[int], rounds: int) -> dict[str, Any]:
    if not qdecode.available():
        raise SystemExit(f"the fused kernels are not available here: {qdecode.unavailable_reason()}")
    a, b = torch.randn(COPY_FLOATS), torch.empty(COPY_FLOATS)
    q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(1))
    setups = {}
    for T in lengths:
        q4 = [_kivi_layer(T, 4, i) for i in range(N_LAYERS)]
        q2 = [_kivi_layer(T, 2, 100 + i) for i in range(N_LAYERS)]
        kv = [(torch.randn(1, H_KV, T, D), torch.randn(1, H_KV, T, D)) for _ in range(N_LAYERS)]
        index = torch.arange(T, dtype=torch.int32).expand(1, H_KV, T).contiguous()
        qpos = torch.tensor([T - 1])
        P = 16
        n_sel = max(1, T // 8 // P - 1)  # 1/8 of the pages: K - 1 selected + the last page
        g = torch.Generator().manual_seed(T)
        pages = torch.stack([torch.randperm((T - 1) // P, generator=g)[:n_sel] for _ in range(H)])[None]
        slots = page_slots(pages.sort(-1).values, P, T)  # [1, H, S]
        setups[T] = dict(q4=q4, q2=q2, kv=kv, index=index, qpos=qpos, slots=slots)

    def runs(T: int) -> dict[str, Any]:
        s = setups[T]
        qpos, index, slots = s["qpos"], s["index"], s["slots"]

        def chunked(ql):
            return chunked_attention(q, qpos[:, None], ql.index,
                                     lambda x, y: (ql.key_slice(x, y), ql.value_slice(x, y)), D**-0.5)

        return {
            "fused-kivi4": lambda: [ql.fused_decode(q, qpos, D**-0.5) for ql in s["q4"]],
            "fused-kivi2": lambda: [ql.fused_decode(q, qpos, D**-0.5) for ql in s["q2"]],
            "chunked-kivi4": lambda: [chunked(ql) for ql in s["q4"]],
            "sdpa-fp32": lambda: [F.scaled_dot_product_attention(q.reshape(1, H_KV, H // H_KV, D), k, v,
                                                                 scale=D**-0.5) for k, v in s["kv"]],
            "paged-1/8": lambda: [qdecode.paged_decode(q, k, v, index, qpos, slots, D**-0.5)
                                  for k, v in s["kv"]],
            "gather-1/8": lambda: [attend_slots(q, k, v, index, qpos[:, None], D**-0.5, slots)
                                   for k, v in s["kv"]],
        }

    def nbytes(T: int, name: str) -> int:
        s = setups[T]
        if name.endswith("kivi4"):
            return _read_bytes(s["q4"][0])
        if name.endswith("kivi2"):
            return _read_bytes(s["q2"][0])
        if name == "sdpa-fp32":
            return 2 * H_KV * T * D * 4
        n = s["slots"].shape[-1]  # per query head: its K and V rows and their index entries
        return H * n * (2 * D * 4 + 4)

    times: dict[tuple[int, str], list[float]] = {}
    copy_bw: list[float] = []
    load = [os.getloadavg()[0]]
    for fn in [runs(T)[name] for T in lengths for name in runs(T)]:
        fn()  # warm-up (builds the kernel on first use)
    for _ in range(rounds):
        t = min(_time(lambda: b.copy_(a)) for _ in range(3))
        copy_bw.append(2 * COPY_FLOATS * 4 / t)
        for T in lengths:
            for name, fn in runs(T).items():
                times.setdefault((T, name), []).append(_time(fn) / N_LAYERS)
    load.append(os.getloadavg()[0])
    bw = statistics.median(copy_bw)
    rows = []
    for (T, name), ts in times.items():
        t = statistics.median(ts)
        nb = nbytes(T, name)
        rows.append({"length": T, "kernel": name, "ms_per_layer": round(1e3 * t, 4),
                     "rounds_ms": [round(1e3 * x, 4) for x in ts], "bytes": nb,
                     "gb_per_s": round(nb / t / 1e9, 3), "bound_ms": round(1e3 * nb / bw, 4),
                     "efficiency": round(nb / bw / t, 3)})
        print(f"T={T:6d} {name:14s} {1e3 * t:8.3f} ms/layer  {nb / 2**20:7.2f} MiB  {nb / t / 1e9:6.2f} GB/s"
              f"  bound {1e3 * nb / bw:7.3f} ms  efficiency {nb / bw / t:.2f}", flush=True)
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s (rounds {[round(x / 1e9, 2) for x in copy_bw]}); load {load}")
    return {"hardware": hardware(), "copy_gb_per_s": round(bw / 1e9, 3),
            "copy_rounds_gb_per_s": [round(x / 1e9, 3) for x in copy_bw], "load_avg_1m": load,
            "threads": torch.get_num_threads(), "n_layers": N_LAYERS, "rows": rows}
