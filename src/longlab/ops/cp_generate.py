"""Context-parallel prefill: the context's forward pass split over processes, then ordinary decoding.

``longlab generate --context-parallel N`` (and :func:`generate_context_parallel`): this process is rank 0
and forks ``N - 1`` workers that inherit the loaded model. The first ``n_cp`` context tokens (a multiple of
``2N``) are sharded with the head/tail :class:`~longlab.ops.context_parallel.Layout`; every rank runs the
whole model on its tokens at their true positions, and each attention layer runs
:func:`~longlab.ops.context_parallel.context_parallel_attention` (Ring-P2P by default; causal, or causal
sliding-window for sliding layers). The layers' post-RoPE K/V are then all-gathered into rank 0's
:class:`~longlab.cache.LonglabCache` in position order; the remaining context tokens, the question and
greedy decoding run on rank 0 exactly as :func:`longlab.generation.generate` does with the ``full`` recipe,
so the answer is token-identical up to floating-point reassociation in attention.

Only the ``full`` recipe (no compression, no sparse prefill), batch 1, no softcapped attention.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..attention import sliding_window_of
from ..cache import LonglabCache
from ..engine.stream import Stream, eos_token_ids
from ..generation import GenerationResult
from ..prompt import encode_prompts
from ..recipe import LonglabError
from .context_parallel import (
    STRATEGIES,
    Layout,
    MaskTable,
    Mesh,
    _all_gather_seq,
    _free_port,
    context_parallel_attention,
)
from .masks import make_mask

__all__ = ["generate_context_parallel", "context_parallel_prefill", "cli_generate"]

_ATTN = "longlab-cp"
_TIMEOUT = timedelta(seconds=300)


def _cp_attention_fn(layout: Layout, strategy: str, mesh: Mesh, store: dict[int, tuple]):
    tables: dict[int | None, MaskTable] = {}

    def attn(module: Any, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
        # query: [B, H, t, D], key/value: [B, H_kv, t, D] post-RoPE, this rank's -> ([B, t, H, D], None)
        if kwargs.get("softcap") is not None:
            raise LonglabError("context-parallel prefill does not support softcapped attention")
        window = sliding_window_of(module, kwargs)
        if window not in tables:
            mask = make_mask("CAUSAL", layout.T) if window is None else \
                make_mask("SLIDING_WINDOW_CAUSAL", layout.T, window=window)
            tables[window] = MaskTable(mask)
        out = context_parallel_attention(query, key, value, tables[window], layout, strategy, mesh=mesh,
                                         scaling=scaling, head_fallback="pad")
        store[module.layer_idx] = (key, value)
        return out.transpose(1, 2).contiguous(), None

    return attn


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _rank_forward(rank: int, world: int, model: Any, ids: list[int], strategy: str) -> list[tuple]:
    """Run the model on this rank's shard; return every layer's full K/V [1, H_kv, n, D] in position order."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    n = len(ids)
    layout = Layout(n, world)
    u = 1 if strategy.startswith("ring") else world if strategy == "ulysses" else 2 if world >= 4 else 1
    mesh = Mesh.build(u, world)
    store: dict[int, tuple] = {}
    AttentionInterface.register(_ATTN, _cp_attention_fn(layout, strategy, mesh, store))
    AttentionMaskInterface.register(_ATTN, _no_mask)
    previous = model.config._attn_implementation
    device = next(model.parameters()).device
    pos = layout.positions(rank)
    try:
        model.set_attn_implementation(_ATTN)
        with torch.inference_mode():
            model(input_ids=torch.tensor(ids, device=device)[pos][None], position_ids=pos[None].to(device),
                  use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(_ATTN, None)
        AttentionMaskInterface._global_mapping.pop(_ATTN, None)
    order = torch.argsort(torch.cat([layout.positions(r) for r in range(world)])).to(device)
    out = []
    for layer in sorted(store):
        k, v = store[layer]
        kg = _all_gather_seq(k.contiguous(), world, None, None, "gather")  # [1, H_kv, n, D], rank order
        vg = _all_gather_seq(v.contiguous(), world, None, None, "gather")
        out.append((kg.index_select(2, order), vg.index_select(2, order)))
    return out


def _child(rank: int, world: int, port: int, model: Any, ids: list[int], strategy: str) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=_TIMEOUT)
        _rank_forward(rank, world, model, ids, strategy)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)  # a forked child leaves without running the parent's exit handlers


def context_parallel_prefill(model: Any, ids: list[int], world: int,
                             strategy: str = "ring-p2p") -> list[tuple]:
    """Prefill ``ids`` (length a multiple of ``2 * world``) over ``world`` processes; this one is rank 0.
    Returns each layer's ``(k, v)`` ``[1, H_kv, len(ids), D]`` in position order."""
    import multiprocessing as mp

    if dist.is_initialized():
        raise LonglabError("context_parallel_prefill starts its own process group; one is already running")
    ctx = mp.get_context("fork")
    port = _free_port()
    children = [ctx.Process(target=_child, args=(r, world, port, model, ids, strategy))
                for r in range(1, world)]
    for c in children:
        c.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=_TIMEOUT)
        try:
            return _rank_forward(0, world, model, ids, strategy)
        finally:
            dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)
        for c in children:
            c.join(timeout=60)
            if c.exitcode is None:  # stuck after a failure elsewhere: stop it
                c.terminate()
                c.join()
        bad = [c.exitcode for c in children if c.exitcode != 0]
        if bad:
            raise LonglabError(f"a context-parallel worker failed (exit codes {bad})")


def generate_context_parallel(
    model: Any,
    tokenizer: Any,
    context: str,
    question: str | None,
    world: int = 2,
    *,
    strategy: str = "ring-p2p",
    max_new_tokens: int = 32,
    chunk_size: int = 1024,
    answer_prefix: str = "",
    chat_template: bool = True,
) -> GenerationResult:
    """:func:`longlab.generation.generate` with the ``full`` recipe, greedy, its context prefilled over
    ``world`` processes (see the module docstring). Returns the same :class:`GenerationResult`."""
    if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= 64:
        raise LonglabError(f"context_parallel (world size) must be an integer in [2, 64], got {world!r}")
    if strategy not in STRATEGIES:
        raise LonglabError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if not isinstance(context, str) or not context.strip():
        raise LonglabError("context is empty: give a non-empty context string")
    if next(model.parameters()).device.type != "cpu":
        raise LonglabError("context-parallel prefill forks CPU worker processes (gloo); a CUDA model would "
                           "need one process per GPU under torchrun with NCCL, which this entry point lacks")
    ctx_ids, q_ids = encode_prompts(tokenizer, [context], [question], [answer_prefix], chat_template)
    ids, q = ctx_ids[0], q_ids[0]
    step = 2 * world
    n_cp = (len(ids) // step) * step
    if not q and n_cp == len(ids):
        n_cp -= step  # keep at least one token for the last-position logits
    if n_cp < step:
        raise LonglabError(f"context of {len(ids)} tokens is too short for {world} processes "
                           f"(need >= {step})")
    start = time.perf_counter()
    kv = context_parallel_prefill(model, ids[:n_cp], world, strategy)
    cache = LonglabCache("full")
    stream = Stream(model, cache, 1)
    stream.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    stream.seen_mask = torch.ones(1, n_cp, dtype=torch.bool, device=stream.device)
    stream.next_pos = torch.tensor([n_cp], device=stream.device)
    logits = stream.feed([ids[n_cp:]], chunk_size, compress="none") if n_cp < len(ids) else None
    prefill_s = time.perf_counter() - start
    before, after = cache.full_nbytes(), cache.nbytes()
    if q:
        logits = stream.feed([q], chunk_size, compress="none")
    start = time.perf_counter()
    tokens = stream.decode(logits, max_new_tokens, eos_token_ids(model, tokenizer))
    decode_s = time.perf_counter() - start
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    return GenerationResult(texts, tokens, [len(ids)], before, after, prefill_s, 0.0, decode_s,
                            f"full (context-parallel {world}, {strategy})", cache)


def cli_generate(args: Any, request: Any) -> int:
    """``longlab generate --context-parallel N``: checks, loads the model, prints like the plain command.
    ``request``: the checked :class:`~longlab.request.Request` (a context, the full recipe, greedy)."""
    import sys

    from ..models import load_model

    if not request.parsed.recipe.is_empty:
        raise LonglabError(f"--context-parallel runs the full recipe only (no compression yet); pass "
                           f"--recipe full (got --recipe {args.recipe})")
    others = [flag for flag, on in (
        ("--docs", request.documents is not None), ("--speculative", request.parsed.draft is not None),
        ("--position", request.parsed.position is not None), ("--query-aware", request.query_aware),
        ("--temperature", request.temperature != 0.0)) if on]
    if others:
        raise LonglabError(f"--context-parallel decodes greedily a context under the full recipe: "
                           f"{', '.join(others)} cannot be combined with it")
    context = request.context
    n = args.context_parallel
    if isinstance(n, bool) or not 2 <= n <= 64:
        raise LonglabError(f"--context-parallel must be in [2, 64], got {n}")
    model, tokenizer = load_model(args.model)
    result = generate_context_parallel(model, tokenizer, context, args.question, n,
                                       max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size)
    print(result.text)
    print(result.summary(), file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0
