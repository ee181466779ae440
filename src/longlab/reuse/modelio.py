"""What KV reuse needs from a transformers decoder: its layers one by one, its RoPE, fingerprints.

:class:`Runner` drives a Llama-, Qwen2- or Gemma3-style causal LM (``model.model.layers`` of decoder layers
with ``self_attn.{k_proj, v_proj}``, ``input_layernorm``, a ``rotary_emb``) layer by layer on any subset of
token rows, so a selective recompute propagates only the selected rows (its cost scales with them).

:func:`encode_document` prefills one document alone (optionally after a shared prefix, for APE) and keeps
its keys **pre-RoPE** (captured at the output of ``k_proj``, or of ``k_norm`` where the model has one) and its
values, per layer: a :class:`DocKV`. :meth:`Runner.rotate` applies the model's own RoPE of a layer at any
absolute positions, so a stored document is placed anywhere exactly as a prefill would have rotated it.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..recipe import LonglabError

__all__ = ["DocKV", "Runner", "encode_document", "model_fingerprint", "tokenizer_fingerprint"]


@dataclass
class DocKV:
    """One document prefilled alone: per layer ``keys[l]``/``values[l]`` ``[H_kv, n, D]``, keys pre-RoPE;
    ``token_ids`` ``[n]``; ``start`` the position of its first token when it was encoded (0, or the shared
    prefix length for APE entries)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: torch.Tensor
    start: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _digest(parts: list[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def model_fingerprint(model: Any) -> str:
    """Hash of the model's config and of every weight's bytes (cached on the model object: ~1 s for 135M
    parameters the first time). A store entry is valid only for the model with this fingerprint."""
    cached = getattr(model, "_longlab_reuse_fingerprint", None)
    if cached is not None:
        return cached
    parts = [model.config.to_json_string(use_diff=False).encode()]
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        parts.append(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    fp = _digest(parts)
    model._longlab_reuse_fingerprint = fp
    return fp


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the tokenizer's full definition (fast tokenizers: ``backend_tokenizer.to_str()``)."""
    cached = getattr(tokenizer, "_longlab_reuse_fingerprint", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        vocab = tokenizer.get_vocab()
        text = repr(sorted(vocab.items()))
    special = repr(sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items()))
    fp = _digest([text.encode(), special.encode(), str(getattr(tokenizer, "chat_template", "")).encode()])
    try:
        tokenizer._longlab_reuse_fingerprint = fp
    except AttributeError:  # pragma: no cover - tokenizers that refuse new attributes
        pass
    return fp


class Runner:
    """Layer-by-layer forward of a decoder on a subset of rows. Shapes: ``ids, pos [1, R]``, hidden
    ``h [1, R, hidden]``; one batch row (reuse assembles one prompt at a time)."""

    def __init__(self, model: Any) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
            raise LonglabError(
                f"KV reuse needs a Llama-, Qwen2- or Gemma3-style causal LM (model.model.layers, rotary_emb, "
                f"lm_head); {type(model).__name__} is not one"
            )
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            if (
                attn is None
                or not hasattr(attn, "k_proj")
                or not hasattr(attn, "v_proj")
                or not hasattr(layer, "input_layernorm")
            ):
                raise LonglabError(
                    f"KV reuse needs decoder layers with self_attn.k_proj/v_proj and input_layernorm; "
                    f"{type(layer).__name__} has not"
                )
        self.model = model
        self.inner = inner
        self.config = model.config
        self.layers = list(inner.layers)
        self.num_layers = len(self.layers)
        types = getattr(self.config, "layer_types", None)
        self.layer_types: list[str] = list(types) if types else ["full_attention"] * self.num_layers
        # Gemma3's rotary embedding takes the layer type (local and global RoPE bases differ)
        self._typed_rope = "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters
        self.H_kv = int(getattr(self.config, "num_key_value_heads", self.config.num_attention_heads))
        self.head_dim = int(
            getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads
        )
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        module = sys.modules.get(type(self.layers[0].self_attn).__module__)
        self._apply_rope = getattr(module, "apply_rotary_pos_emb", None)

    # ---------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [1, R] -> [1, R, hidden]
        return self.inner.embed_tokens(ids)

    def position_embeddings(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
        """``layer type -> (cos, sin)`` each ``[1, R, D]`` for positions ``pos [1, R]``."""
        out = {}
        for t in dict.fromkeys(self.layer_types):
            out[t] = self.inner.rotary_emb(h, pos, t) if self._typed_rope else self.inner.rotary_emb(h, pos)
        return out

    def rotate(self, k: torch.Tensor, pos: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Pre-RoPE keys ``k [1, H_kv, n, D]`` rotated for absolute positions ``pos [n]`` with the model's
        own RoPE of layer ``layer_idx`` (the same cos/sin and formula a prefill applies)."""
        dummy = k.new_empty(1, 1, 1)
        cos, sin = self.position_embeddings(dummy, pos[None].to(k.device))[self.layer_types[layer_idx]]
        cos, sin = cos.to(k.dtype), sin.to(k.dtype)
        if self._apply_rope is not None:
            return self._apply_rope(k, k, cos, sin)[1]
        half = k.shape[-1] // 2
        rot = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return k * cos[:, None] + rot * sin[:, None]

    def layer(self, i: int, h: torch.Tensor, pos: torch.Tensor, pe: dict, cache: Any) -> torch.Tensor:
        """Decoder layer ``i`` on rows ``h [1, R, hidden]`` at positions ``pos [1, R]``."""
        out = self.layers[i](
            h,
            attention_mask=None,
            position_embeddings=pe[self.layer_types[i]],
            position_ids=pos,
            cache=cache,
            use_cache=cache is not None,
        )
        return out[0] if isinstance(out, tuple) else out

    def fresh_values(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Values layer ``i`` would write for hidden rows ``h [1, R, hidden]``: ``[1, H_kv, R, D]``
        (``v_proj(input_layernorm(h))``; CacheBlend's deviation check)."""
        layer = self.layers[i]
        v = layer.self_attn.v_proj(layer.input_layernorm(h))
        v = v.view(1, h.shape[1], -1, self.head_dim).transpose(1, 2)
        v_norm = getattr(layer.self_attn, "v_norm", None)
        return v_norm(v) if v_norm is not None else v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[1, V]`` from the last row of ``h [1, R, hidden]``."""
        out = self.model.lm_head(self.inner.norm(h[:, -1:]))[:, -1]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            out = torch.tanh(out / cap) * cap
        return out


@torch.inference_mode()
def encode_document(model: Any, token_ids: list[int], prefix_ids: list[int] | tuple = ()) -> DocKV:
    """Prefill ``prefix_ids + token_ids`` alone (no cache) and return the document rows' pre-RoPE keys and
    values per layer (:class:`DocKV`, ``start = len(prefix_ids)``)."""
    runner = Runner(model)
    n, P = len(token_ids), len(prefix_ids)
    if n == 0:
        raise LonglabError("a document must have at least one token")
    if runner.max_positions and P + n > runner.max_positions:
        raise LonglabError(
            f"document of {n} tokens (after a prefix of {P}) is longer than the model's "
            f"max_position_embeddings={runner.max_positions}"
        )
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    handles = []

    def grab(store: dict, i: int, heads_first: bool):
        def hook(_module, _inputs, output):
            t = output
            if t.dim() == 3:  # [1, T, H_kv * D]
                t = t.view(t.shape[0], t.shape[1], -1, runner.head_dim).transpose(1, 2)
            elif not heads_first:  # [1, T, H_kv, D]
                t = t.transpose(1, 2)
            store[i] = t[0, :, P:].detach().clone()  # [H_kv, n, D]

        return hook

    for i, layer in enumerate(runner.layers):
        attn = layer.self_attn
        k_src = getattr(attn, "k_norm", None) or attn.k_proj
        v_src = getattr(attn, "v_norm", None) or attn.v_proj
        # Gemma3 normalises keys after the [B, H, T, D] transpose; a k_proj output is 3-D
        heads_first = k_src is not attn.k_proj and _norm_after_transpose(attn)
        handles.append(k_src.register_forward_hook(grab(keys, i, heads_first)))
        handles.append(v_src.register_forward_hook(grab(values, i, heads_first and v_src is not attn.v_proj)))
    try:
        ids = torch.tensor([list(prefix_ids) + list(token_ids)], dtype=torch.long, device=runner.device)
        pos = torch.arange(P + n, device=runner.device)[None]
        model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    L = runner.num_layers
    return DocKV(
        [keys[i] for i in range(L)],
        [values[i] for i in range(L)],
        torch.tensor(list(token_ids), dtype=torch.long),
        P,
    )


def _norm_after_transpose(attn: Any) -> bool:
    """Gemma3-style attention applies ``k_norm`` to ``[B, H, T, D]`` (after the transpose)."""
    return "gemma" in type(attn).__module__
