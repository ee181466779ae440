"""Capture real post-RoPE ``q, k, v`` of chosen attention layers on a long input, for
``bench/prefill_attention.py --qkv``.

    python bench/capture_qkv.py --model gemma3-270m --length 32768 --out runs/qkv/gemma3_32k.safetensors
    python bench/capture_qkv.py --model smollm2-135m --length 8192 --out runs/qkv/smollm2_8k.safetensors

The input is a RULER ``niah_single_2`` prompt (essay haystack, one needle, the question at the end) of
``--length`` tokens. It is prefilled in chunks through a :class:`longlab.LonglabCache` with the
empty recipe plus an observer that records each chunk's queries, so memory stays near the size of the
captured tensors. After the prefill, the layer's cache holds every key and value (non-sliding layers
keep everything under the empty recipe). Default layers: every global-attention layer for models with
sliding-window layers (Gemma3), else the first, middle and last layer. Keys are ``<model>.L<i>.q``
etc., shaped ``[1, H, T, D]`` / ``[1, H_kv, T, D]`` in fp32; the metadata holds each group's scaling.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from common import hardware
from safetensors.torch import save_file

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.kv.base import KVPolicy
from longlab.models import load_model
from longlab.prompt import encode_prompts
from longlab.recipe import Recipe
from longlab.tasks import generate_samples as make_samples


@dataclass
class QueryRecorder(KVPolicy):
    """Observer: appends every forward's post-RoPE queries ``[B, H, T_q, D]`` of the chosen layers."""

    needs_observe = True
    layers: tuple[int, ...] = ()
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    def observe(self, ctx) -> None:
        if ctx.layer_idx in self.layers:
            self.queries.setdefault(ctx.layer_idx, []).append(ctx.q.float().clone())
            self.scaling[ctx.layer_idx] = float(ctx.scaling)


def default_layers(config) -> list[int]:
    types = getattr(config, "layer_types", None)
    if types and any(t == "sliding_attention" for t in types):
        return [i for i, t in enumerate(types) if t != "sliding_attention"]
    n = config.num_hidden_layers
    return sorted({0, n // 2, n - 1})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=8192, help="prompt tokens")
    p.add_argument("--layers", default=None, help="comma-separated layer indices (default: see above)")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(model.config)
    (sample,) = make_samples("niah_single_2", tokenizer, args.length, 1, 0)
    (ctx,), (q,) = encode_prompts(tokenizer, [sample.context], [sample.question], [sample.answer_prefix])
    ids = ctx + q
    recorder = QueryRecorder(layers=tuple(layers))
    cache = LonglabCache(Recipe(kv=[recorder]))
    stream = Stream(model, cache, 1)
    start = time.perf_counter()
    with torch.inference_mode():
        stream.feed([ids], args.chunk_size, compress="none")
    prefill_s = time.perf_counter() - start
    tensors, meta = {}, {"model": args.model, "tokens": str(len(ids)), "task": "niah_single_2"}
    for i in layers:
        layer = cache.layers[i]
        if int(layer.index.min()) < 0 or layer.keys.shape[-2] != len(ids):
            raise SystemExit(f"layer {i} does not hold the whole stream (sliding window?): pick another")
        name = f"{args.model}.L{i}"
        tensors[f"{name}.q"] = torch.cat(recorder.queries[i], dim=2).contiguous()
        tensors[f"{name}.k"] = layer.keys.float().contiguous()
        tensors[f"{name}.v"] = layer.values.float().contiguous()
        meta[f"{name}.scaling"] = repr(recorder.scaling[i])
    meta["hardware"] = repr(hardware())
    save_file(tensors, args.out, metadata=meta)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    print(f"{args.model}: {len(ids)} tokens prefilled in {prefill_s:.1f}s; layers {layers}; wrote {args.out}")
    print(shapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
