"""The layers-lab language model: embedding, N blocks of (RMSNorm → mixer) + (RMSNorm → SwiGLU MLP
[+ the mixer's parallel memory]), final RMSNorm and a head tied to the embedding.

``LabConfig`` names the mixer (a registered :class:`~longlab.lab.mixers.MixerConfig`, given as
``"name"`` or ``"name:k=v"``) and the positions (``rope``/``nope``/``alibi``/``nape``) separately.
``forward(tokens: [B, T]) -> logits [B, T, V]`` is the causal full-sequence form; ``init_state`` /
``step(token: [B, 1])`` is the recurrent/decode form, available when every mixer has one.
With ``input_dim = D > 0`` (continuous tasks: ``lcube``) the embedding is a linear map of ``x: [B, T, D]``
and the head (untied) outputs ``[B, T, 2D]``: a diagonal Gaussian's mean and log-variance.
With ``output_dim = O > 0`` the head is instead an untied linear map to ``[B, T, O]`` that the task reads
(a forecast, a tracking query, class logits). ``loss_params``: initial values of learnable scalars of the
task's loss (``model.loss_params``, e.g. EMFormer's θ), trained and saved with the model.
A mixer whose ``block`` is ``"plain"`` (the spiking layers) makes every block the mixer alone and the
final norm the identity: input map → mixer → ... → mixer → head.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..recipe import LonglabError
from .mixers import MixerConfig, mixer_config
from .positions import LAB_POSITIONS, Positions

__all__ = ["LabConfig", "LabLM", "match_mlp_hidden"]


@dataclass
class LabConfig:
    """Shape of a lab model. ``mlp_hidden = 0`` means ``round(8·dim/3)`` (SwiGLU's usual width)."""

    vocab_size: int
    mixer: str = "softmax"
    positions: str = ""  # "" -> the mixer's default
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_hidden: int = 0
    rope_theta: float = 10000.0
    input_dim: int = 0  # > 0: continuous inputs [B, T, D] and a Gaussian head (vocab_size unused)
    train_len: int = 0  # positions "ropeid": the training length its frequencies are set for
    output_dim: int = 0  # > 0: an untied linear head to [B, T, output_dim] (the task reads it)
    loss_params: tuple[float, ...] = ()  # initial values of the task loss's learnable scalars

    def __post_init__(self) -> None:
        for name in ("input_dim", "output_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LonglabError(f"lab model: {name} must be an integer >= 0, got {value!r}")
        params = self.loss_params
        ok = isinstance(params, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in params)
        if not ok:
            raise LonglabError(f"lab model: loss_params must be a list of finite numbers, got {params!r}")
        self.loss_params = tuple(float(v) for v in params)
        names = ("dim", "n_layers", "n_heads") + (() if self.input_dim else ("vocab_size",))
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LonglabError(f"lab model: {name} must be an integer >= 1, got {value!r}")
        if self.dim % self.n_heads:
            raise LonglabError(f"lab model: dim {self.dim} must be a multiple of n_heads {self.n_heads}")
        if isinstance(self.mlp_hidden, bool) or not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 0:
            raise LonglabError(f"lab model: mlp_hidden must be an integer >= 0, got {self.mlp_hidden!r}")
        cfg = self.mixer_config()  # validates the mixer name and parameters
        self.mixer = cfg.spec()
        if not self.positions:
            self.positions = cfg.default_positions
        if self.positions not in LAB_POSITIONS:
            raise LonglabError(
                f"--positions: unknown {self.positions!r}; choose one of {', '.join(LAB_POSITIONS)}"
            )
        if self.positions not in cfg.positions_allowed:
            raise LonglabError(
                f"--positions: mixer {cfg.name!r} takes {', '.join(cfg.positions_allowed)}, "
                f"not {self.positions!r}"
            )

    def mixer_config(self) -> MixerConfig:
        return mixer_config(self.mixer)

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or max(1, round(8 * self.dim / 3))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, cfg: LabConfig) -> None:
        super().__init__()
        pos = Positions(cfg.positions, cfg.n_heads, cfg.dim // cfg.n_heads, cfg.rope_theta, cfg.train_len)
        mcfg = cfg.mixer_config()
        self.plain = mcfg.block == "plain"
        if self.plain:
            self.mixer = mcfg.build(cfg.dim, cfg.n_heads, pos)
            return
        # this order (norm1, mixer, norm2, mlp) fixes the parameter order: initialisation and checkpoints
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.mixer = mcfg.build(cfg.dim, cfg.n_heads, pos)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg.dim, cfg.hidden)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm2(x)
        out = self.mlp(h)
        if self.mixer.parallel_ffn is not None:
            out = out + self.mixer.parallel_ffn(h)
        return x + out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return self.mixer(x)
        return self.ffn(x + self.mixer(self.norm1(x)))

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        if self.plain:
            return self.mixer.step(x, state)
        y, state = self.mixer.step(self.norm1(x), state)
        return self.ffn(x + y), state


class LabLM(nn.Module):
    """Decoder LM of the lab (see the module docstring)."""

    def __init__(self, cfg: LabConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.input_dim:
            self.inp = nn.Linear(cfg.input_dim, cfg.dim)
        else:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            nn.init.normal_(self.embed.weight, std=0.02 * cfg.dim**0.5)  # tied head: logits of order 1
        if cfg.output_dim:
            self.head = nn.Linear(cfg.dim, cfg.output_dim)
        elif cfg.input_dim:
            self.head = nn.Linear(cfg.dim, 2 * cfg.input_dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        plain = cfg.mixer_config().block == "plain"
        self.norm = nn.Identity() if plain else nn.RMSNorm(cfg.dim)
        if cfg.loss_params:
            self.loss_params = nn.Parameter(torch.tensor(cfg.loss_params))  # [P] the task loss's scalars

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inp(tokens) if self.cfg.input_dim else self.embed(tokens)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if self.cfg.input_dim or self.cfg.output_dim:
            return self.head(x)
        return x @ self.embed.weight.T  # tied head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens: [B, T]`` -> ``logits: [B, T, V]`` (continuous: ``[B, T, D]`` -> ``[B, T, 2D]``; with
        ``output_dim = O``: ``[B, T, O]``)."""
        x = self._embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self._head(x)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream after the embedding and after each block: ``[n_layers + 1, B, T, D]``
        (what the PCFG probes read; the head applies the final norm to the last one)."""
        x = self._embed(tokens)
        out = [x]
        for blk in self.blocks:
            x = blk(x)
            out.append(x)
        return torch.stack(out)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the mixers' auxiliary losses from the last forward (L2A's gate rate), or ``None``."""
        terms = [b.mixer.aux_loss for b in self.blocks if b.mixer.aux_loss is not None]
        return torch.stack(terms).sum() if terms else None

    def init_state(self, batch: int) -> list[Any]:
        states = [b.mixer.init_state(batch) for b in self.blocks]
        if any(s is None for s in states):
            raise LonglabError(f"mixer {self.cfg.mixer!r} has no recurrent/decode form")
        return states

    def step(self, token: torch.Tensor, states: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        """``token: [B, 1]`` -> ``logits [B, 1, V]`` and the new states."""
        x = self._embed(token)
        new = []
        for blk, st in zip(self.blocks, states):
            x, st = blk.step(x, st)
            new.append(st)
        return self._head(x), new

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def match_mlp_hidden(cfg: LabConfig, target: int) -> LabConfig:
    """The config with the MLP width whose model has the parameter count closest to ``target``
    (how the lab gives every mixer equal parameters)."""
    def count(hidden: int) -> int:
        return LabLM(dataclasses.replace(cfg, mlp_hidden=hidden)).n_params()

    base = count(1)
    per = count(2) - base  # parameters per unit of MLP width
    hidden = max(1, round((target - base) / per) + 1) if per > 0 else cfg.hidden
    return dataclasses.replace(cfg, mlp_hidden=hidden)



