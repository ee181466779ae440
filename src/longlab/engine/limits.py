"""What the engine checks before it runs a request: the model, its attention, and every size against the
model's positions and this machine's memory (so nothing hangs or runs out of memory midway)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..errors import LonglabError

__all__ = ["check_model", "check_attention", "check_size", "kv_bytes_per_token", "cache_bytes_per_token",
           "available_bytes"]


def check_size(model: Any, request: Any, n_prompt: int) -> None:
    """The prompt + answer against the model's positions (refused unless ``strict=False``, or a
    position method extends them: then a warning) and the cache against this machine's memory."""
    config = getattr(model.config, "text_config", None) or model.config
    limit = getattr(config, "max_position_embeddings", None)
    total = n_prompt + request.max_new_tokens
    if limit and total > limit:
        message = (
            f"prompt + max_new_tokens is {total} tokens, beyond the model's max_position_embeddings="
            f"{limit}; quality will degrade"
        )
        if request.parsed.position is None:
            if request.strict:
                raise LonglabError(message + " (pass strict=False / --no-strict to run it anyway)")
        else:  # the position method is there to extend them: a note, not an alarm
            from ..registry import REGISTRY

            message = (
                f"prompt + max_new_tokens is {total} tokens, beyond the model's max_position_embeddings="
                f"{limit}, which the position method {REGISTRY.format(request.parsed.position)} extends"
            )
        warnings.warn(message, stacklevel=3)
    free = available_bytes(model)
    need = total * kv_bytes_per_token(model)
    if free is not None and need > free:
        raise LonglabError(
            f"a {total}-token prompt needs about {need / 2**30:.1f} GiB of KV cache and "
            f"{free / 2**30:.1f} "
            "GiB is free: give a shorter context or a recipe with compress='chunk' and a budget"
        )


def check_model(model: Any, tokenizer: Any) -> None:
    from ..errors import LonglabTypeError

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise LonglabTypeError(
            "model must be a transformers causal LM (e.g. from longlab.load_model), "
            f"got {model.__class__.__name__}"
        )
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise LonglabTypeError(
            "tokenizer must be the model's transformers tokenizer (e.g. from longlab.load_model), "
            f"got {tokenizer.__class__.__name__}"
        )


def check_attention(model: Any, recipe: Any) -> None:
    """A recipe acts only through the longlab attention hook: refuse up front a model that runs another
    attention implementation."""
    from ..hook import ATTN_NAME

    attn = getattr(model.config, "_attn_implementation", None)
    if attn != ATTN_NAME:
        raise LonglabError(
            f"recipe {recipe.name!r} needs a model whose attention is 'longlab', but this one runs "
            f"{attn!r}, so the recipe would compress nothing. Load the model with longlab.load_model(...) "
            "(attn_implementation='longlab', the default), or wrap your own model: "
            "`with longlab.use_longlab_attention(model): ...`"
        )


# ------------------------------------------------------------------------------------------ limits
def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token of an uncompressed cache holds (keys and values, every layer)."""
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem


def cache_bytes_per_token(model: Any) -> int:
    """Bytes one slot of a :class:`~longlab.cache.LonglabCache` holds in every layer: keys and values
    (:func:`kv_bytes_per_token`) plus the slot's position index (int32 per KV head and layer), what
    ``LonglabCache.nbytes()`` counts per uncompressed token."""
    cfg = getattr(model.config, "text_config", None) or model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return kv_bytes_per_token(model) + 4 * cfg.num_hidden_layers * kv_heads


def available_bytes(model: Any) -> int | None:
    """Free memory where the cache lives (GPU memory for a CUDA model, else RAM), None if unknown."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
