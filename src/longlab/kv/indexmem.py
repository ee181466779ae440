"""IndexMem: a learned indexer drives eviction; evicted tokens live on in a latent memory.

Yang, Gu, et al., "IndexMem", ICML 2026, arXiv:2605.25475. No code or method text was reachable; this
follows the reconstruction in ``specs/kv-cache.md`` section 5. Per layer ``l`` and KV head ``g``:

**Indexer** (lightning-indexer style, ``n_I = 4`` heads of width ``d_I = 64``)::

    I(t, j) = sum_m w_{t,m} ReLU(q^I_{t,m} . k^I_j),   q^I = W_qI x^q_t,  k^I = W_kI x^k_j,
    w = W_w x^q_t + b_w   (the bias b_w lets w start constant)

The spec feeds the layer input ``x``; the attention hook sees only post-RoPE ``q``/``k``/``v``, and the
cache holds only keys for old tokens. So the indexer reads the layer's own projections:
``x^q_t = concat_h q_{t,h}`` ([H*D]) for the query side and ``x^k_j = concat_g k_{j,g}`` ([H_kv*D]) for
the key side. Both are linear in ``x`` (then rotated by RoPE), so the scorer keeps the lightning-indexer
form, needs no extra hook, and can re-score every held slot at any time from the cache alone.
Token importance ``r_j = max_{t in last W prompt queries} softmax_j I(t, j)`` (per-query normalised,
so queries are comparable), updated by ``r_j <- max(gamma r_j, .)`` at later compressions and decode
steps. One token set per layer (every KV head keeps the same slots): 4 sinks, the last ``W`` tokens,
and the top ``C - W - 4`` by ``r``. Trained with the backbone frozen on ``KL(p_bar_t || softmax_j I(t, j))``,
``p_bar`` the head-averaged true attention (``longlab train indexmem``), starting from the backbone's
own attention logits of KV group 0 (see :func:`init_layer`).

**Latent memory** per (layer, KV head): ``M [d_f, D]``, ``n [d_f]`` (fp32, in ``layer.state``). The
positive feature map is ``phi(x) = exp(x W + b + a ||x||^2)`` (``d_f = 64``; separate maps for queries
and keys): the query side enters the readout only as ``softmax(x W + b + a ||x||^2)`` times its
magnitude, Hedgehog-style. It is initialised at FAVOR+ positive random features (``W = sqrt(s) omega``,
``a = -s/2``), for which ``E[phi(q).phi(k)] = exp(s q.k)``, then trained by layer-wise MSE to
full-attention outputs with a random subset evicted. Max-stabilised write on evicting a set ``E``::

    M <- M + sum_{j in E} phi(k_j) v_j^T,   n <- n + sum_{j in E} phi(k_j)   (stored relative to exp(c))

Read, for a query ``q``: ``num = phi(q)^T M``, ``den = phi(q)^T n``; exact attention over the kept keys
gives ``o_kept`` and ``Z_kept = exp(lse)``; then::

    o = o_kept + rho (num/den - o_kept),   rho = sigma(w_g . q + b_g) * den / (Z_kept + den)

in fp32 with one shared max for ``log Z_kept`` and ``log den``. With an exact feature map
(``phi(q).phi(k_j) = exp(s q.k_j)``) and no gate this is full attention over kept + evicted tokens;
with an empty memory it is dense attention over the kept tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_TOKENS, param
from ..safeio import read_checked_tensors
from .base import KVPolicy, keep_top

__all__ = [
    "IndexMem",
    "IndexMemWeights",
    "N_INDEX",
    "D_INDEX",
    "D_FEATURE",
    "indexer_logits",
    "log_features",
    "memory_write",
    "residual_attention",
    "model_key",
    "default_weights_path",
    "manifest_path",
    "load_weights",
    "init_layer",
    "train_command",
]

N_INDEX = 4  # n_I indexer heads
D_INDEX = 64  # d_I indexer width
D_FEATURE = 64  # d_f feature-map width
FORMAT = "longlab-indexmem-1"
_R = "indexmem_r"  # per-slot importance, layer.extras [B, H_kv, T]
_M, _N, _C = "indexmem_M", "indexmem_n", "indexmem_c"  # layer.state: [B,H_kv,d_f,D], [B,H_kv,d_f], [B,H_kv]
LAYER_TENSORS = ("wq", "wk", "ww", "wb", "fq_w", "fq_b", "fq_a", "fk_w", "fk_b", "fk_a", "gate_w", "gate_b")


# --------------------------------------------------------------------------------------------------
# formulas (pure functions, shared by the policy, the trainer and the tests)


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    ww: torch.Tensor,
    wb: torch.Tensor | None = None,
) -> torch.Tensor:
    """``I(t, j) = sum_m w_{t,m} ReLU(q^I_{t,m} . k^I_j)``.

    q: [B, H, T_q, D]; k: [B, H_kv, T, D]; wq: [H*D, n_I*d_I]; wk: [H_kv*D, d_I]; ww: [H*D, n_I];
    wb: [n_I] optional bias of ``w`` (``w = W_w x + b_w``). Returns [B, T_q, T] (fp32)."""
    B, H, T_q, D = q.shape
    T = k.shape[2]
    xq = q.float().transpose(1, 2).reshape(B, T_q, H * D)  # [B, T_q, H*D]
    xk = k.float().transpose(1, 2).reshape(B, T, -1)  # [B, T, H_kv*D]
    n_i = ww.shape[1]
    qi = (xq @ wq).reshape(B, T_q, n_i, -1)  # [B, T_q, n_I, d_I]
    ki = xk @ wk  # [B, T, d_I]
    w = xq @ ww if wb is None else xq @ ww + wb  # [B, T_q, n_I]
    s = torch.relu(torch.einsum("bqmd,btd->bqmt", qi, ki))  # [B, T_q, n_I, T]
    return torch.einsum("bqm,bqmt->bqt", w, s)


def log_features(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``log phi(x) = x W + b + a ||x||^2`` per head. x: [B, h, T, D]; w: [h, D, d_f]; b: [h, d_f];
    a: [h]. Returns [B, h, T, d_f] (fp32)."""
    x = x.float()
    return x @ w + b[:, None, :] + a[:, None, None] * (x * x).sum(-1, keepdim=True)


def memory_write(
    M: torch.Tensor,
    n: torch.Tensor,
    c: torch.Tensor,
    logf_k: torch.Tensor,
    v: torch.Tensor,
    evict: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add the evicted entries to the memory, max-stabilised.

    M: [B, H_kv, d_f, D], n: [B, H_kv, d_f] hold ``sum phi(k) v^T`` and ``sum phi(k)`` divided by
    ``exp(c)``, c: [B, H_kv] (-inf when empty); logf_k: [B, H_kv, T, d_f] = log phi(k); v: [B, H_kv, T, D];
    evict: [B, H_kv, T] bool. Returns the new (M, n, c), fp32."""
    lf = logf_k.float().masked_fill(~evict[..., None], float("-inf"))  # [B, H_kv, T, d_f]
    c_new = torch.maximum(c, lf.amax(dim=(2, 3)))  # [B, H_kv]
    c_ref = torch.where(torch.isfinite(c_new), c_new, torch.zeros_like(c_new))
    old = torch.where(torch.isfinite(c), torch.exp(c - c_ref), torch.zeros_like(c))  # rescale what is held
    f = torch.exp(lf - c_ref[..., None, None])  # [B, H_kv, T, d_f], 0 where not evicted
    M = M * old[..., None, None] + f.transpose(-1, -2) @ v.float()  # [B, H_kv, d_f, D]
    n = n * old[..., None] + f.sum(2)  # [B, H_kv, d_f]
    return M, n, c_new


def residual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    logf_q: torch.Tensor | None = None,
    memory: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gate_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the kept keys, plus the memory's residual readout. All fp32.

    q: [B, H, T_q, D]; k, v: [B, H_kv, T, D]; mask: [B, H_kv|1, T_q, T] bool; logf_q: [B, H, T_q, d_f]
    = log phi(q); memory: (M [B, H_kv, d_f, D], n [B, H_kv, d_f], c [B, H_kv]); gate_logit: [B, H, T_q].
    Returns [B, H, T_q, D]: ``o_kept + rho (num/den - o_kept)``, ``rho = den / (Z_kept + den)``."""
    B, H, T_q, D = q.shape
    g = H // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)  # [B, H, T, D]
    vf = v.float().repeat_interleave(g, dim=1)
    logits = (q.float() @ kf.transpose(-1, -2)) * scaling  # [B, H, T_q, T]
    if mask.shape[1] not in (1, H):
        mask = mask.repeat_interleave(g, dim=1)
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, T_q]; -inf: no kept key visible
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    o_kept = probs @ vf  # [B, H, T_q, D]
    if memory is None or logf_q is None:
        return o_kept
    M, n, c = (t.float().repeat_interleave(g, dim=1) for t in memory)  # [B,H,d_f,D], [B,H,d_f], [B,H]
    lf = logf_q.float()
    mq = lf.amax(-1, keepdim=True)  # [B, H, T_q, 1] shared max of the query features
    a = torch.exp(lf - mq)  # [B, H, T_q, d_f]
    num = a @ M  # [B, H, T_q, D]
    den = (a @ n[..., None])[..., 0]  # [B, H, T_q]
    log_den = torch.log(den) + mq[..., 0] + c[..., None]  # -inf for an empty memory
    o_mem = num / den.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    top = torch.maximum(lse, log_den)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    z_kept, z_mem = torch.exp(lse - top), torch.exp(log_den - top)
    rho = z_mem / (z_kept + z_mem).clamp(min=torch.finfo(torch.float32).tiny)  # [B, H, T_q]
    if gate_logit is not None:
        rho = rho * torch.sigmoid(gate_logit.float())
    return o_kept + rho[..., None] * (o_mem - o_kept)


# --------------------------------------------------------------------------------------------------
# weights: safetensors + a JSON manifest, keyed by model


def model_key(config: Any) -> str:
    """File key of a model: its directory or hub name (``smollm2-135m``), else its architecture and shapes
    (models built in code, e.g. ``llama-2L-64x4q2kv16d``)."""
    name = str(getattr(config, "_name_or_path", "") or "").rstrip("/")
    if name:
        return re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).name)
    H = config.num_attention_heads
    H_kv = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    return f"{config.model_type}-{config.num_hidden_layers}L-{config.hidden_size}x{H}q{H_kv}kv{D}d"


def default_weights_path(key: str) -> Path:
    """``<longlab cache>/indexmem/<key>.safetensors`` (see :func:`longlab.paths.cache_dir`)."""
    from ..paths import cache_dir

    return cache_dir() / "indexmem" / f"{key}.safetensors"


def manifest_path(weights: str | Path) -> Path:
    return Path(weights).with_suffix(".json")


def train_command(key: str) -> str:
    return f"longlab train indexmem --model {key}"


@dataclass
class IndexMemWeights:
    """Trained tensors per layer (see ``LAYER_TENSORS``) and the manifest."""

    layers: list[dict[str, torch.Tensor]]
    manifest: dict[str, Any]

    def layer(self, idx: int, device: torch.device) -> dict[str, torch.Tensor]:
        out = self.layers[idx]
        if next(iter(out.values())).device != device:
            out = self.layers[idx] = {k: t.to(device) for k, t in out.items()}
        return out


_LOADED: dict[tuple[str, int, int], IndexMemWeights] = {}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def load_weights(path: str | Path) -> IndexMemWeights:
    """Read ``path`` (safetensors, never pickle) and its manifest; cached per file and mtime.

    The manifest records the file's size, SHA-256 and tensor list (``weights_file``); a file that does not
    match it (corrupt, truncated, partial, edited), a manifest that is not IndexMem's JSON or has no such
    record (written by an older longlab), missing or non-finite tensors raise :class:`LonglabError`
    naming the file and the command that writes it again."""
    path = Path(path)
    man = manifest_path(path)
    if not path.is_file() or not man.is_file():
        raise LonglabError(f"indexmem: weights not found: {path} (and manifest {man.name})")
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key in _LOADED:
        return _LOADED[key]
    manifest: Any = None

    def again() -> str:
        model = manifest.get("model") if isinstance(manifest, dict) else None
        if not (isinstance(model, str) and model):  # the default file is named by the model's key
            default = default_weights_path(path.stem)
            model = path.stem if path.resolve() == default.resolve() else "MODEL"
        return f"train them again: {train_command(model)} --out {path}"

    def unusable(reason: str) -> LonglabError:
        return LonglabError(f"indexmem: cannot use the weights {path}: {reason}; {again()}")

    if man.stat().st_size > 64 << 20:
        raise unusable(f"its manifest {man.name} is over 64 MiB")
    try:
        manifest = json.loads(man.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise unusable(f"its manifest {man.name} is not readable JSON ({exc})") from None
    except ValueError as exc:  # NaN / Infinity constants (the check above: JSON syntax)
        raise unusable(f"its manifest {man.name} is not strict JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise unusable(f"{man.name} is not an IndexMem manifest (format {got!r}, expected {FORMAT!r})")
    num_layers = manifest.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise unusable(f"{man.name} gives num_layers={num_layers!r}")
    record = manifest.get("weights_file")
    if record is None:
        raise unusable(
            f"{man.name} was written before IndexMem manifests recorded the weights' SHA-256 and tensor "
            "list, so the weights cannot be checked"
        )
    # size, SHA-256, tensor list (names, shapes, dtypes), finite values: see longlab.safeio
    flat, _ = read_checked_tensors(path, record, what=f"indexmem: cannot use the weights {path}", fix=again())
    layers = []
    for i in range(num_layers):
        try:
            layer = {name: flat[f"layers.{i}.{name}"].float() for name in LAYER_TENSORS}
        except KeyError as exc:
            raise unusable(f"it lacks tensor {exc.args[0]}") from None
        bad = [name for name, t in layer.items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise unusable(f"layer {i} has non-finite values in {', '.join(bad)}")
        layers.append(layer)
    _LOADED[key] = IndexMemWeights(layers, manifest)
    return _LOADED[key]


# --------------------------------------------------------------------------------------------------
# the policy


@register("indexmem")
@dataclass
class IndexMem(KVPolicy):
    """IndexMem (arXiv:2605.25475): learned-indexer eviction plus a latent memory of evicted tokens.

    Keeps ``sink_size`` sinks, the last ``window_size`` tokens and the top by indexer importance (one
    token set per layer); evicted entries are written into a positive-feature-map memory whose
    residual readout is merged with attention over the kept keys. ``weights``: a ``.safetensors`` file
    from ``longlab train indexmem`` (default: the trained file of the running model in the longlab
    cache). ``memory=false`` is the indexer-only ablation; ``gate=false`` drops the learned gate;
    ``decode_evict=true`` also evicts at decode steps whenever the cache exceeds the budget."""

    paper = "arXiv:2605.25475"
    reads_attention: ClassVar[bool] = True  # the hook calls attend(ctx) (see hook._kv_reader)
    acts_during_decode: ClassVar[bool] = True  # updates importance (and with decode_evict evicts) per step

    window_size: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    sink_size: int = param(4, low=0, high=MAX_TOKENS, integer=True)
    gamma: float = param(0.95, low=0, high=1, low_open=True)
    weights: str | None = None
    memory: bool = param(True, choices=(True, False))
    gate: bool = param(True, choices=(True, False))
    decode_evict: bool = param(False, choices=(True, False))

    def validate(self) -> None:
        super().validate()
        if self.weights is not None and not (isinstance(self.weights, str) and self.weights):
            raise LonglabError(
                f"indexmem: weights must be a path to a .safetensors file, got {self.weights!r}"
            )

    # ---- weights
    def weights_path(self, config: Any) -> Path:
        return Path(self.weights) if self.weights else default_weights_path(model_key(config))

    def _layer_weights(self, ctx) -> dict[str, torch.Tensor]:
        config = ctx.module.config
        path = self.weights_path(config)
        if not self.weights and not (path.is_file() and manifest_path(path).is_file()):
            key = model_key(config)
            raise LonglabError(
                f"indexmem: no trained weights for model {key!r} (looked for {path}); "
                f"train them first: {train_command(key)}"
            )
        w = load_weights(path)
        man = w.manifest
        H, D = ctx.q.shape[1], ctx.q.shape[-1]
        H_kv = ctx.key_index.shape[1]
        got = (man.get("num_layers"), man.get("num_heads"), man.get("num_kv_heads"), man.get("head_dim"))
        if got != (ctx.num_layers, H, H_kv, D):
            raise LonglabError(
                f"indexmem: {path} was trained for {man.get('model')!r} (layers, heads, KV heads, head_dim) "
                f"= "
                f"{got}; this model has {(ctx.num_layers, H, H_kv, D)}"
            )
        return w.layer(ctx.layer_idx, ctx.q.device)

    # ---- eviction
    def _importance(self, ctx, w: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
        """``max_t softmax_j I(t, j)`` over the query rows: [B, T] (0 for slots no row sees)."""
        kidx = ctx.key_index
        if kidx.shape[1] > 1 and not bool((kidx == kidx[:, :1]).all()):
            raise LonglabError(
                "indexmem: every KV head must hold the same tokens; use it as the only eviction policy"
            )
        logits = indexer_logits(ctx.q[:, :, rows], ctx.k, w["wq"], w["wk"], w["ww"], w["wb"])
        visible = ctx.mask(rows)[:, 0]  # [B, t, T]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.nan_to_num(probs, nan=0.0).amax(1)  # [B, T]

    def _update_importance(self, ctx, w: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
        layer = ctx.layer
        r_new = self._importance(ctx, w, rows)[:, None, :].expand_as(layer.index)  # [B, H_kv, T]
        old = layer.extras.get(_R)
        r = r_new if old is None else torch.maximum(self.gamma * old, r_new)
        layer.extras[_R] = r.contiguous()
        return r

    def protected(self, ctx) -> torch.Tensor:
        """[B, H_kv, T]: the last ``window_size`` tokens and the first ``sink_size``."""
        idx = ctx.key_index
        prot = idx >= (ctx.n_real - self.window_size)[:, None, None]
        return prot | ((idx >= 0) & (idx < self.sink_size))

    def _evict(self, ctx, w: dict[str, torch.Tensor], r: torch.Tensor) -> torch.Tensor | None:
        n_keep = self.target(ctx)  # [B]
        valid = ctx.layer.valid
        if bool((valid.sum(-1) <= n_keep[:, None]).all()):
            return None
        keep = keep_top(r, n_keep, valid, self.protected(ctx))  # [B, H_kv, T]
        if self.memory:
            self._write(ctx, w, valid & ~keep)
        return keep

    def _write(self, ctx, w: dict[str, torch.Tensor], evict: torch.Tensor) -> None:
        state = ctx.layer.state
        B, H_kv, _, D = ctx.k.shape
        d_f = w["fk_w"].shape[-1]
        dev = ctx.k.device
        M = state.get(_M, torch.zeros(B, H_kv, d_f, D, device=dev))
        n = state.get(_N, torch.zeros(B, H_kv, d_f, device=dev))
        c = state.get(_C, torch.full((B, H_kv), float("-inf"), device=dev))
        logf_k = log_features(ctx.k, w["fk_w"], w["fk_b"], w["fk_a"])  # [B, H_kv, T, d_f]
        state[_M], state[_N], state[_C] = memory_write(M, n, c, logf_k, ctx.v, evict)

    def select(self, ctx) -> torch.Tensor | None:
        w = self._layer_weights(ctx)
        T_q = ctx.q.shape[2]
        r = self._update_importance(ctx, w, slice(max(0, T_q - self.window_size), T_q))
        return self._evict(ctx, w, r)

    def select_decode(self, ctx) -> torch.Tensor | None:
        """Update ``r_j <- max(gamma r_j, softmax_j I(t, j))``; evict only with ``decode_evict``.

        The harness learns that decoding is not plain attention from ``acts_during_decode`` and
        ``reads_attention``."""
        if not self.decode_evict:
            return None
        w = self._layer_weights(ctx)
        return self._evict(ctx, w, self._update_importance(ctx, w, slice(None)))

    # ---- reading
    def attend(self, ctx) -> torch.Tensor:
        """Attention output [B, H, T_q, D]: exact over the kept keys, plus the memory's residual readout."""
        from ..attention import dense_attention

        state = ctx.layer.state if ctx.layer is not None else {}
        blocks = ctx.query_blocks()
        if not self.memory or _M not in state:
            outs = [
                dense_attention(ctx.q[:, :, rows], ctx.k, ctx.v, ctx.mask(rows), ctx.scaling)
                for rows in blocks
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        w = self._layer_weights(ctx)
        memory = (state[_M], state[_N], state[_C])
        outs = []
        for rows in blocks:
            q = ctx.q[:, :, rows]  # [B, H, t, D]
            logf_q = log_features(q, w["fq_w"], w["fq_b"], w["fq_a"])  # [B, H, t, d_f]
            gate = None
            if self.gate:
                gate = (q.float() * w["gate_w"][None, :, None, :]).sum(-1) + w["gate_b"][None, :, None]
            out = residual_attention(q, ctx.k, ctx.v, ctx.mask(rows), ctx.scaling, logf_q, memory, gate)
            outs.append(out.to(ctx.q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def init_layer(H: int, H_kv: int, D: int, scaling: float, generator: torch.Generator | None = None) -> dict:
    """Initial tensors of one layer (see ``LAYER_TENSORS``), fp32.

    Indexer: starts as the backbone's own attention logits of KV group 0 (indexer head ``m`` reads
    query head ``m mod (H/H_kv)``, ``q^I_m = sqrt(s) q_h``, ``k^I = sqrt(s) k_0``, ``w = 1/n_I``), plus
    small noise; training then fits the head-averaged attention of the whole layer. Feature maps: FAVOR+
    positive random features (``log phi(x) = sqrt(s) omega.x - s/2 ||x||^2 - log(d_f)/2``, so
    ``E[phi(q).phi(k)] = exp(s q.k)``). Gate: ``sigma(1)``."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    root = math.sqrt(scaling)
    g, d = H // H_kv, min(D, D_INDEX)
    wq = 0.01 * randn(H * D, N_INDEX * D_INDEX) / math.sqrt(H * D)
    for m in range(N_INDEX):
        h = m % g
        wq[h * D : h * D + d, m * D_INDEX : m * D_INDEX + d] += root * torch.eye(d)
    wk = 0.01 * randn(H_kv * D, D_INDEX) / math.sqrt(H_kv * D)
    wk[:d, :d] += root * torch.eye(d)
    omega = randn(H_kv, D, D_FEATURE)  # one draw per KV head, shared by its query heads
    return {
        "wq": wq,
        "wk": wk,
        "ww": 0.01 * randn(H * D, N_INDEX) / math.sqrt(H * D),
        "wb": torch.full((N_INDEX,), 1.0 / N_INDEX),
        "fq_w": (root * omega).repeat_interleave(g, dim=0),
        "fq_b": torch.full((H, D_FEATURE), -0.5 * math.log(D_FEATURE)),
        "fq_a": torch.full((H,), -0.5 * scaling),
        "fk_w": root * omega,
        "fk_b": torch.full((H_kv, D_FEATURE), -0.5 * math.log(D_FEATURE)),
        "fk_a": torch.full((H_kv,), -0.5 * scaling),
        "gate_w": torch.zeros(H, D),
        "gate_b": torch.ones(H),
    }
