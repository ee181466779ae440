"""C-DIC — Context-Driven Incremental Compression (Jung et al., arXiv 2606.12411, ICML 2026; no
code found), in
the layers lab, on :mod:`longlab.tasks.dialogue_threads`. Spec §25 [abs + recon].

Memory ``M = {(key_j ∈ R^D, S_j ∈ R^{m×D})}`` of at most ``N_max`` threads (m = 8, N_max = 16, D = 128). Turn
``t`` with tokens ``u_t: [B, L]``:

- ``e_t = normalise(W_k · mean_i embed(u_t)_i)``; retrieve the top ``r = 2`` threads by ``cos(e_t, key_j)``;
  if the best cosine is below ``θ_new = 0.5`` open a new thread (an empty slot, else the least recently used);
- revise: ``S'_j = RMSNorm(last-layer states at m memory-query tokens of LM([S_j ; embed(u_t) ; q_1..q_m]))``
  for each retrieved ``j`` (a new thread starts from the learned ``S_0``);
- write-back: only the retrieved slots are replaced; ``key_j ← normalise(key_j + e_t)`` for the
first one (a new
  thread's key is ``e_t``);
- the response (here: the answer token of a question turn) is read from ``LM([g_1 S'_1 ; g_2 S'_2 ; u_t])`` at
  the last position (tied head).

Training (ra-TBPTT): unroll the conversation, loss ``Σ_t NLL(y_t)`` over question turns, ``S`` and
keys detached
every ``K = 4`` turns (one optimizer update per window). Retrieval receives gradient through the gates
``g = softmax(cos/τ)`` over the top ``r`` (straight-through: ``g = s + (1 - s).detach()`` equals 1 forward, so
training reads what inference reads) and through an auxiliary InfoNCE term ``-log
softmax(cos/τ)[true thread]``.
Deviation [recon]: during training the revised (first) thread is the generator's true thread (teacher-forced
routing; the second is the best other by cosine); at inference routing is the learned hard top-r with
``θ_new``, and routing accuracy is reported.

Compared systems (equal memory bytes ``N_max·m·D`` fp32 = 64 KiB, except full history):

- ``full``: the token LM (same 4-layer lab LM) reads the whole history; ``lastk``: it reads the last
  ``N_max·m / L = 32`` turns (128 token embeddings of D floats);
- ``writeonce``: C-DIC with write-back only when a thread is opened (its state is never revised);
- ``addonly``: the mem0 pattern with exact extraction: every open/revise turn appends ``(topic, slot, value)``
  facts (at most ``N_max·m = 128``, FIFO beyond), never superseding; a question retrieves the fact of highest
  similarity to ``(topic, slot)`` — ties go to the earliest inserted, as a flat vector index returns them;
- ``cdic``: the system above.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LonglabError, check_range
from ..lab.model import LabConfig, LabLM
from ..tasks.dialogue_threads import VOCAB, L, Turn, conversation, probe

__all__ = [
    "CdicConfig",
    "CdicMemory",
    "CdicModel",
    "SYSTEMS",
    "TokenReader",
    "add_only_answer",
    "cdic_report",
    "load_system",
    "per_turn_latency",
    "evaluate_systems",
    "train_system",
]

SYSTEMS = ("full", "lastk", "writeonce", "addonly", "cdic")
DISTANCES = (5, 20, 50, 200)
REVISIONS = (0, 1, 2, 3)
FORMAT = "longlab-cdic/1"


@dataclass
class CdicConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    m: int = 8
    n_max: int = 16
    r: int = 2
    theta_new: float = 0.5
    tau: float = 0.1
    K: int = 4  # ra-TBPTT window (turns)

    def lab(self) -> LabConfig:
        return LabConfig(
            vocab_size=VOCAB.size, mixer="softmax", dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads
        )

    @property
    def budget_floats(self) -> int:
        """``N_max·m·D``: the state floats C-DIC may hold (and every bounded system is given)."""
        return self.n_max * self.m * self.dim


def _body(lm: LabLM, x: torch.Tensor) -> torch.Tensor:
    """The lab LM's blocks on input embeddings ``x: [B, T, D]`` -> ``[B, T, D]`` (before the final norm)."""
    for blk in lm.blocks:
        x = blk(x)
    return x


def _logits(lm: LabLM, h: torch.Tensor) -> torch.Tensor:
    """Tied head: ``h: [..., D]`` -> ``[..., V]``."""
    return lm.norm(h) @ lm.embed.weight.T


class CdicModel(nn.Module):
    """The lab LM plus C-DIC's memory-query tokens, empty state, key map and state norm."""

    def __init__(self, cfg: CdicConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.lm = LabLM(cfg.lab())
        self.memq = nn.Parameter(torch.randn(cfg.m, cfg.dim) * 0.02)  # [m, D]
        self.s0 = nn.Parameter(torch.randn(cfg.m, cfg.dim) * 0.02)  # [m, D]
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.state_norm = nn.RMSNorm(cfg.dim)

    def key(self, u: torch.Tensor) -> torch.Tensor:
        """``u: [B, L]`` -> ``e: [B, D]`` (unit norm)."""
        return F.normalize(self.wk(self.lm.embed(u).mean(1)), dim=-1)

    def compress(self, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Revise: ``s: [B, m, D]``, ``u: [B, L]`` -> ``S': [B, m, D]``."""
        q = self.memq.expand(s.shape[0], -1, -1)
        h = _body(self.lm, torch.cat([s, self.lm.embed(u), q], dim=1))
        return self.state_norm(h[:, -self.cfg.m :])

    def read(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``states: [B, r·m, D]``, ``u: [B, L]`` -> answer logits ``[B, V]`` (last position)."""
        h = _body(self.lm, torch.cat([states, self.lm.embed(u)], dim=1))
        return _logits(self.lm, h[:, -1])


class CdicMemory:
    """The per-conversation memory of a batch: ``keys [B, N, D]``, ``states [B, N, m, D]``, ``used [B, N]``,
    ``last [B, N]`` (turn of last use, for LRU). Its bytes never exceed ``N_max·(m+1)·D`` floats per row,
    whatever the number of turns."""

    def __init__(self, model: CdicModel, batch: int) -> None:
        c = model.cfg
        dev = model.s0.device
        self.model = model
        self.keys = torch.zeros(batch, c.n_max, c.dim, device=dev)
        self.states = model.s0.detach().expand(batch, c.n_max, c.m, c.dim).clone()
        self.used = torch.zeros(batch, c.n_max, dtype=torch.bool, device=dev)
        self.last = torch.zeros(batch, c.n_max, dtype=torch.long, device=dev)
        self.t = 0

    def state_bytes(self) -> int:
        return self.states.element_size() * self.states[0].numel()

    def total_bytes(self) -> int:
        return self.state_bytes() + self.keys.element_size() * self.keys[0].numel()

    def detach(self) -> None:
        self.keys, self.states = self.keys.detach(), self.states.detach()

    def route(
        self, e: torch.Tensor, thread: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which slots a turn retrieves. ``e: [B, D]``; ``thread: [B]`` (teacher-forced first slot) or None.
        Returns ``idx [B, r]`` (slot ids, most similar first), ``cos [B, r]`` (for the gates), ``new [B]``
        (the first slot is a new thread) and ``valid [B, r]`` (a real retrieved slot)."""
        c = self.model.cfg
        B = e.shape[0]
        rows = torch.arange(B, device=e.device)
        cos_all = torch.einsum("bnd,bd->bn", self.keys, e)  # [B, N]
        masked = cos_all.masked_fill(~self.used, -math.inf)
        if thread is not None:
            first = thread
            new = ~self.used[rows, first]
        else:
            best, arg = masked.max(dim=1)
            new = best < c.theta_new
            empty = (~self.used).float().argmax(dim=1)  # first empty slot
            lru = self.last.masked_fill(~self.used, 1 << 60).argmin(dim=1)
            fresh = torch.where((~self.used).any(dim=1), empty, lru)
            first = torch.where(new, fresh, arg)
        others = masked.clone()
        others[rows, first] = -math.inf
        top = others.topk(c.r - 1, dim=1) if c.r > 1 else None
        idx = torch.cat([first[:, None], top.indices], dim=1) if top is not None else first[:, None]
        valid = torch.ones_like(idx, dtype=torch.bool)
        if top is not None:
            valid[:, 1:] = torch.isfinite(top.values)
        cos = cos_all.gather(1, idx)
        cos[:, 0] = torch.where(new, torch.ones_like(cos[:, 0]), cos[:, 0])
        return idx, cos, new, valid

    def step(
        self, u: torch.Tensor, *, thread: torch.Tensor | None = None, write: str = "all"
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One turn: retrieve -> revise -> write-back. ``u: [B, L]``. ``write``: ``all`` (C-DIC), ``open``
        (write-once: only a newly opened thread is written) or ``none``. Returns answer logits ``[B, V]`` and
        routing info (``idx``, ``new``, ``aux``: the InfoNCE term when ``thread`` is given)."""
        model, c = self.model, self.model.cfg
        B = u.shape[0]
        rows = torch.arange(B, device=u.device)
        e = model.key(u)
        idx, cos, new, valid = self.route(e, thread)
        s = self.states[rows[:, None], idx]  # [B, r, m, D]
        s0 = model.s0.expand(B, c.m, c.dim)
        first = torch.where(new[:, None, None], s0, s[:, 0])
        s = torch.cat([first[:, None], s[:, 1:]], dim=1)
        revised = model.compress(s.reshape(B * c.r, c.m, c.dim), u.repeat_interleave(c.r, dim=0))
        revised = revised.view(B, c.r, c.m, c.dim)
        soft = torch.softmax((cos / c.tau).masked_fill(~valid, -math.inf), dim=1)
        gate = (soft + (1 - soft).detach()) * valid  # straight-through: 1 forward, softmax gradient
        logits = model.read((revised * gate[:, :, None, None]).reshape(B, c.r * c.m, c.dim), u)
        info: dict[str, torch.Tensor] = {"idx": idx, "new": new}
        if thread is not None:
            cos_all = torch.einsum("bnd,bd->bn", self.keys, e).masked_fill(~self.used, -math.inf)
            known = self.used[rows, thread]
            if known.any():
                lp = torch.log_softmax(cos_all[known] / c.tau, dim=1)
                info["aux"] = -lp[torch.arange(int(known.sum())), thread[known]].mean()
        if write != "none":
            w = valid.clone()
            if write == "open":
                w = torch.zeros_like(valid)
                w[:, 0] = new
            states = self.states.clone()
            keep = states[rows[:, None], idx]
            states[rows[:, None], idx] = torch.where(w[:, :, None, None], revised, keep)
            self.states = states
            k0 = self.keys[rows, idx[:, 0]]
            newkey = torch.where(new[:, None], e, F.normalize(k0 + e, dim=-1))
            keys = self.keys.clone()
            keys[rows, idx[:, 0]] = newkey if write == "all" else torch.where(new[:, None], e, k0)
            self.keys = keys
        self.used = self.used.clone()
        self.used[rows, idx[:, 0]] = True
        self.last = self.last.clone()
        self.last[rows, idx[:, 0]] = self.t
        self.t += 1
        return logits, info


# ------------------------------------------------------------------------------------------ baselines
class TokenReader:
    """``full`` / ``lastk``: the token LM reads the history (``keep_turns`` = None: all of it) and the
    question; the answer is the argmax at the question's last position."""

    def __init__(self, lm: LabLM, keep_turns: int | None) -> None:
        self.lm, self.keep = lm, keep_turns

    def tokens(self, turns: list[Turn]) -> list[int]:
        hist = turns[:-1] if self.keep is None else turns[:-1][-self.keep :] if self.keep else []
        return [t for turn in hist for t in turn.tokens] + turns[-1].tokens

    def answer(self, batch: list[list[Turn]]) -> list[int]:
        ids = torch.tensor([self.tokens(c) for c in batch])  # equal lengths within a probe cell
        with torch.no_grad():
            return self.lm(ids)[:, -1].argmax(-1).tolist()


def add_only_answer(turns: list[Turn], capacity: int) -> int:
    """The mem0 pattern with exact extraction (see the module docstring): facts ``(topic, slot, value)`` from
    open/revise turns, appended (FIFO beyond ``capacity``), never superseded; the question takes the fact of
    highest similarity (exact ``(topic, slot)`` match = 1, same topic = 0.5, else 0), ties to the earliest."""
    v = VOCAB
    facts: list[tuple[int, int, int]] = []
    for t in turns[:-1]:
        a, b, c, d = t.tokens
        if t.kind == "open":
            facts += [(a, s, val) for s, val in enumerate((b, c, d))]
        elif t.kind == "revise":
            facts.append((a, b - v.slot0, c))
        facts = facts[-capacity:]
    _, topic, slot_tok, _ = turns[-1].tokens
    slot = slot_tok - v.slot0
    best, ans = -1.0, v.PAD
    for a, s, val in facts:
        sim = 1.0 if (a, s) == (topic, slot) else 0.5 if a == topic else 0.0
        if sim > best:  # strict: ties keep the earliest fact
            best, ans = sim, val
    return ans


# ------------------------------------------------------------------------------------------ training
def _batch(rng: random.Random, n: int, n_turns: int, n_max: int) -> list[list[Turn]]:
    """Training conversations of 3-8 threads (at most ``n_max``: teacher-forced routing puts thread
    i in slot i)."""
    return [conversation(rng, n_turns, rng.randint(min(3, n_max), min(8, n_max))) for _ in range(n)]


def _token_batch(rng: random.Random, n: int, n_turns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-LM training batch: ``ids [B, n_turns·L]`` and targets (answer at a question's last position whose
    slot was set inside the window, else -100)."""
    ids, tgt = [], []
    for _ in range(n):
        conv = conversation(rng, n_turns + 32, rng.randint(3, 12))
        start = rng.randint(0, 32)
        win = conv[start : start + n_turns]
        toks, ys = [], []
        for i, t in enumerate(win):
            toks += t.tokens
            ok = t.kind == "question" and t.distance <= i
            ys += [-100] * (L - 1) + [t.answer if ok else -100]
        ids.append(toks)
        tgt.append(ys)
    return torch.tensor(ids), torch.tensor(tgt)


def _lr(step_frac: float, lr: float) -> float:
    if step_frac < 0.05:
        return lr * (step_frac / 0.05 + 1e-3)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step_frac))))


def _check_out(out: str) -> Path:
    from ..safeio import check_output_dir

    return check_output_dir(
        out, "--out", owned=lambda p: (p / "cdic.json").is_file(), what="C-DIC checkpoint"
    )


def train_system(
    system: str,
    out: str,
    *,
    minutes: float = 10.0,
    max_steps: int = 100_000,
    seed: int = 0,
    batch: int = 8,
    n_turns: int = 16,
    lr: float = 3e-3,
    cfg: CdicConfig | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train ``system`` (``cdic``: ra-TBPTT over ``n_turns``-turn conversations; ``tokens``: the LM that
    ``full``/``lastk`` read, on 64-turn windows) for ``minutes`` of wall time (the cosine schedule runs on
    elapsed time) or ``max_steps``; saves ``out/model.safetensors`` + ``out/cdic.json``."""
    from ..safeio import save_tensors

    if system not in ("cdic", "tokens"):
        raise LonglabError(f"--system must be 'cdic' or 'tokens', got {system!r}")
    check_range("--minutes", minutes, 0, 600, low_open=True)
    check_range("--max-steps", max_steps, 1, 10_000_000, integer=True)
    check_range("--seed", seed, 0, 2**31 - 1, integer=True)
    path = _check_out(out)
    cfg = cfg or CdicConfig()
    torch.manual_seed(seed)
    rng = random.Random(f"cdic-train/{system}/{seed}")
    model: nn.Module = CdicModel(cfg) if system == "cdic" else LabLM(cfg.lab())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, step, hist = time.perf_counter(), 0, []
    budget = minutes * 60
    while step < max_steps and time.perf_counter() - t0 < budget:
        frac = max(step / max_steps, (time.perf_counter() - t0) / budget)
        for g in opt.param_groups:
            g["lr"] = _lr(frac, lr)
        if system == "tokens":
            ids, tgt = _token_batch(rng, batch, 64)
            loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            acc = float("nan")
            hist.append(float(loss.detach()))
        else:
            loss, acc = _cdic_step(model, opt, _batch(rng, batch, n_turns, cfg.n_max), cfg)  # type: ignore[arg-type]
            hist.append(loss)
        step += 1
        if log and step % 10 == 0:
            log(
                f"{system} seed {seed} step {step} loss {sum(hist[-10:]) / len(hist[-10:]):.3f} "
                f"acc {acc:.3f} "
                f"{time.perf_counter() - t0:.0f}s"
            )
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
    )
    info = {
        "format": FORMAT,
        "system": system,
        "seed": seed,
        "steps": step,
        "seconds": time.perf_counter() - t0,
        "batch": batch,
        "n_turns": n_turns,
        "lr": lr,
        "config": asdict(cfg),
        "final_loss": sum(hist[-20:]) / max(1, len(hist[-20:])),
    }
    (path / "cdic.json").write_text(json.dumps(info, indent=1))
    return info


def _cdic_step(
    model: CdicModel, opt: torch.optim.Optimizer, convs: list[list[Turn]], cfg: CdicConfig
) -> tuple[float, float]:
    """One conversation batch of ra-TBPTT: an optimizer update every ``K`` turns, state detached between."""
    B, T = len(convs), len(convs[0])
    mem = CdicMemory(model, B)
    tot, n, correct = 0.0, 0, 0
    for w0 in range(0, T, cfg.K):
        mem.detach()
        losses = []
        for t in range(w0, min(T, w0 + cfg.K)):
            u = torch.tensor([c[t].tokens for c in convs])
            thread = torch.tensor([c[t].thread for c in convs])
            logits, info = mem.step(u, thread=thread)
            q = torch.tensor([c[t].kind == "question" for c in convs])
            if q.any():
                y = torch.tensor([c[t].answer for c in convs])[q]
                losses.append(F.cross_entropy(logits[q], y, reduction="sum") / B)
                correct += int((logits[q].argmax(-1) == y).sum())
                n += int(q.sum())
            if "aux" in info:
                losses.append(0.1 * info["aux"])
        if not losses:
            continue
        loss = torch.stack(losses).sum()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tot += float(loss.detach())
    return tot, correct / max(1, n)


# ------------------------------------------------------------------------------------------ evaluation
def load_system(path: str, flag: str) -> tuple[nn.Module, dict[str, Any]]:
    """A checkpoint written by :func:`train_system` (``cdic.json`` checked, tensors via safetensors only)."""
    from ..safeio import read_json

    p = Path(path)
    info = read_json(p / "cdic.json", flag, max_bytes=1 << 20)
    if (
        not isinstance(info, dict)
        or info.get("format") != FORMAT
        or info.get("system") not in ("cdic", "tokens")
    ):
        raise LonglabError(f"{flag}: {path} is not a C-DIC checkpoint (cdic.json with format {FORMAT})")
    from safetensors.torch import load_file

    try:
        cfg = CdicConfig(**info["config"])
    except TypeError as exc:
        raise LonglabError(f"{flag}: bad config in cdic.json ({exc})") from None
    model: nn.Module = CdicModel(cfg) if info["system"] == "cdic" else LabLM(cfg.lab())
    try:
        model.load_state_dict(load_file(str(p / "model.safetensors")))
    except (OSError, RuntimeError) as exc:
        raise LonglabError(f"{flag}: cannot load {p / 'model.safetensors'} ({str(exc)[:200]})") from None
    model.eval()
    return model, info


def _cdic_answers(
    model: CdicModel, convs: list[list[Turn]], write: str
) -> tuple[list[int], list[float], float]:
    """Run the memory over each conversation (batched), answer the last turn. Returns answers,
    routing accuracy
    per conversation (first retrieved slot = the slot the true thread was routed to when opened), and the
    median per-turn seconds."""
    B, T = len(convs), len(convs[0])
    mem = CdicMemory(model, B)
    slot_of: list[dict[int, int]] = [{} for _ in range(B)]
    hits, seen = [0] * B, [0] * B
    times = []
    with torch.no_grad():
        for t in range(T):
            u = torch.tensor([c[t].tokens for c in convs])
            t0 = time.perf_counter()
            logits, info = mem.step(u, write=write)
            times.append(time.perf_counter() - t0)
            first = info["idx"][:, 0].tolist()
            for b in range(B):
                th = convs[b][t].thread
                if th not in slot_of[b] and convs[b][t].kind == "open":
                    slot_of[b][th] = first[b]
                elif th in slot_of[b]:
                    seen[b] += 1
                    hits[b] += first[b] == slot_of[b][th]
    times.sort()
    return logits.argmax(-1).tolist(), [h / max(1, s) for h, s in zip(hits, seen)], times[len(times) // 2] / B


def per_turn_latency(
    cdic: CdicModel, lm: LabLM, turns_at: tuple[int, ...] = (10, 50, 100, 200, 400), repeats: int = 5
) -> list[dict[str, Any]]:
    """Seconds of one turn (batch 1) after ``t`` turns of history: C-DIC (retrieve + 2 revisions + read),
    ``full`` (re-read the whole history), ``lastk`` (read 32 turns), ``addonly`` (scan the facts). Median of
    ``repeats``."""
    rng = random.Random("cdic-latency")
    rows = []
    cfg = cdic.cfg
    for t in turns_at:
        conv = conversation(rng, t + 1, 8)
        mem = CdicMemory(cdic, 1)
        with torch.no_grad():
            for turn in conv[:-1]:
                mem.step(torch.tensor([turn.tokens]))
            res: dict[str, list[float]] = {s: [] for s in SYSTEMS if s != "writeonce"}
            conv[-1] = Turn(
                [
                    VOCAB.Q,
                    conv[-1].tokens[0] if conv[-1].tokens[0] != VOCAB.Q else conv[-1].tokens[1],
                    VOCAB.slot0,
                    VOCAB.Q,
                ],
                "question",
                0,
            )
            for _ in range(repeats):
                saved = (mem.keys, mem.states, mem.used, mem.last, mem.t)
                a = time.perf_counter()
                mem.step(torch.tensor([conv[-1].tokens]))
                res["cdic"].append(time.perf_counter() - a)
                mem.keys, mem.states, mem.used, mem.last, mem.t = saved
                for name, keep in (("full", None), ("lastk", cfg.n_max * cfg.m // L)):
                    ids = torch.tensor([TokenReader(lm, keep).tokens(conv)])
                    a = time.perf_counter()
                    lm(ids)
                    res[name].append(time.perf_counter() - a)
                a = time.perf_counter()
                add_only_answer(conv, cfg.n_max * cfg.m)
                res["addonly"].append(time.perf_counter() - a)
        for name, vals in res.items():
            vals.sort()
            rows.append({"system": name, "turn": t, "seconds": vals[len(vals) // 2]})
    return rows


def evaluate_systems(
    cdic_dir: str,
    tokens_dir: str,
    out: str,
    *,
    per_cell: int = 24,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> int:
    """Every system on the same probe conversations (``per_cell`` per distance × revisions cell) into the
    results store ``out``: task ``dialogue_threads``, recipe = system, length = distance, depth = revisions,
    seed = the training seed, sample_id = probe id; plus per-turn latency rows (task
    ``dialogue_threads/latency``)."""
    from ..eval.store import ResultStore

    check_range("--per-cell", per_cell, 1, 1000, integer=True)
    cdic, ci = load_system(cdic_dir, "--cdic")
    lm, ti = load_system(tokens_dir, "--tokens")
    if ci["system"] != "cdic" or ti["system"] != "tokens":
        raise LonglabError("--cdic must be a cdic checkpoint and --tokens a tokens checkpoint")
    cfg: CdicConfig = cdic.cfg  # type: ignore[assignment]
    train_seed = int(ci["seed"])
    budget_turns = cfg.n_max * cfg.m // L
    written = 0
    with ResultStore(out) as store:
        for d in DISTANCES:
            for r in REVISIONS:
                rng = random.Random(f"cdic-probe/{seed}/{d}/{r}")
                convs = [probe(rng, d, r) for _ in range(per_cell)]
                truth = [c[-1].answer for c in convs]
                answers: dict[str, list[int]] = {}
                extra: dict[str, dict[str, Any]] = {}
                for name, keep in (("full", None), ("lastk", budget_turns)):
                    t0 = time.perf_counter()
                    answers[name] = TokenReader(lm, keep).answer(convs)  # type: ignore[arg-type]
                    ctx = len(TokenReader(lm, keep).tokens(convs[0]))
                    extra[name] = {
                        "seconds": (time.perf_counter() - t0) / per_cell,
                        "context_tokens": ctx,
                        "memory_bytes": 4 * cfg.dim * (ctx - L),
                    }
                for name, write in (("cdic", "all"), ("writeonce", "open")):
                    ans, route, sec = _cdic_answers(cdic, convs, write)  # type: ignore[arg-type]
                    answers[name] = ans
                    extra[name] = {
                        "routing": route,
                        "seconds_per_turn": sec,
                        "memory_bytes": 4 * cfg.budget_floats,
                    }
                answers["addonly"] = [add_only_answer(c, cfg.n_max * cfg.m) for c in convs]
                extra["addonly"] = {"memory_bytes": 4 * cfg.dim * cfg.n_max * cfg.m}
                for name in SYSTEMS:
                    for i, c in enumerate(convs):
                        ex = {k: (v[i] if isinstance(v, list) else v) for k, v in extra[name].items()}
                        store.add(
                            {
                                "model": "lab-4x128",
                                "recipe": name,
                                "method": "cdic",
                                "task": "dialogue_threads",
                                "length": d,
                                "depth": float(r),
                                "seed": train_seed,
                                "sample_id": f"probe-{seed}-{d}-{r}-{i}",
                                "prediction": str(answers[name][i]),
                                "answers": [str(truth[i])],
                                "score": float(answers[name][i] == truth[i]),
                                "context_tokens": len(c) * L,
                                "eval_seed": seed,
                                **ex,
                            }
                        )
                        written += 1
                if log:
                    log(
                        f"seed {train_seed} d={d} r={r}: "
                        + " ".join(
                            f"{n}={sum(a == y for a, y in zip(answers[n], truth)) / per_cell:.2f}"
                            for n in SYSTEMS
                        )
                    )
        for row in per_turn_latency(cdic, lm):  # type: ignore[arg-type]
            store.add(
                {
                    "model": "lab-4x128",
                    "recipe": row["system"],
                    "method": "cdic",
                    "task": "dialogue_threads/latency",
                    "length": row["turn"],
                    "seed": train_seed,
                    "sample_id": f"latency-{row['turn']}",
                    "decode_s": row["seconds"],
                    "score": None,
                }
            )
            written += 1
    return written


def _unpaired_diff(
    a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` of independent samples with a percentile-bootstrap 95% interval."""
    import numpy as np

    g = np.random.default_rng(seed)
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    da = xa[g.integers(0, len(xa), (resamples, len(xa)))].mean(1)
    db = xb[g.integers(0, len(xb), (resamples, len(xb)))].mean(1)
    d = da - db
    return float(xa.mean() - xb.mean()), float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))


def cdic_report(out_dir: str) -> str:
    """Markdown tables from the ``dialogue_threads`` rows of ``out_dir``: accuracy by distance and
    by revisions
    (Wilson 95%), paired bootstrap differences on the same probes, flatness in ``d``, per-seed C-DIC accuracy,
    routing accuracy and per-turn latency."""
    from ..eval.stats import paired_difference, score_estimate
    from ..eval.store import ResultStore

    with ResultStore(out_dir, readonly=True, what="DIR") as store:
        rows = store.rows(method="cdic")
    acc = [r for r in rows if r["task"] == "dialogue_threads"]
    lat = [r for r in rows if r["task"] == "dialogue_threads/latency"]
    if not acc:
        raise LonglabError(f"DIR: {out_dir} holds no dialogue_threads rows")
    seeds = sorted({r["seed"] for r in acc})
    by: dict[str, dict[tuple[int, str], dict[str, Any]]] = {}
    for r in acc:
        by.setdefault(r["recipe"], {})[(r["seed"], r["sample_id"])] = r
    systems = [s for s in SYSTEMS if s in by]

    def est(vals: list[float]) -> str:
        e = score_estimate(vals)
        return f"{100 * e.mean:.1f} [{100 * e.low:.1f}, {100 * e.high:.1f}]"

    def sel(system: str, pred: Callable[[dict[str, Any]], bool]) -> dict[tuple[int, str], float]:
        return {k: r["score"] for k, r in by[system].items() if pred(r)}

    out = [
        f"Seeds (training runs): {', '.join(map(str, seeds))}; probes per seed per (d, revisions) cell: "
        f"{len(acc) // max(1, len(systems) * len(seeds) * len(DISTANCES) * len(REVISIONS))}.",
        "",
        "### Accuracy (%) by distance d (pooled over revisions 0-3 and seeds), 95% Wilson interval",
        "",
        "| system | " + " | ".join(f"d = {d}" for d in DISTANCES) + " |",
        "|---|" + "---|" * len(DISTANCES),
    ]
    for s in systems:
        out.append(
            f"| {s} | "
            + " | ".join(est(list(sel(s, lambda r, d=d: r["length"] == d).values())) for d in DISTANCES)
            + " |"
        )
    out += [
        "",
        "### Accuracy (%) by number of revisions of the asked slot (pooled over d and seeds)",
        "",
        "| system | " + " | ".join(f"{r} rev." for r in REVISIONS) + " |",
        "|---|" + "---|" * len(REVISIONS),
    ]
    for s in systems:
        out.append(
            f"| {s} | "
            + " | ".join(est(list(sel(s, lambda x, r=r: x["depth"] == r).values())) for r in REVISIONS)
            + " |"
        )

    def paired(a: str, b: str, pred: Callable[[dict[str, Any]], bool]) -> str:
        sa, sb = sel(a, pred), sel(b, pred)
        keys = sorted(set(sa) & set(sb))
        if not keys:
            return "n/a"
        d = paired_difference([sa[k] for k in keys], [sb[k] for k in keys])
        sig = "significant" if d.low > 0 or d.high < 0 else "not significant"
        return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] ({sig}, n = {len(keys)})"

    out += [
        "",
        "### Paired differences (percentage points, paired bootstrap 95% CI on the same probes)",
        "",
        "| comparison | subset | difference |",
        "|---|---|---|",
    ]
    for d in DISTANCES:
        out.append(f"| cdic − lastk | d = {d} | {paired('cdic', 'lastk', lambda r, d=d: r['length'] == d)} |")
    for d in DISTANCES:
        out.append(f"| cdic − full | d = {d} | {paired('cdic', 'full', lambda r, d=d: r['length'] == d)} |")
    rev = lambda r: r["depth"] >= 1  # noqa: E731
    for other in ("writeonce", "addonly"):
        out.append(f"| cdic − {other} | revised slots (1-3 rev.) | {paired('cdic', other, rev)} |")
        out.append(
            f"| cdic − {other} | unrevised slots | {paired('cdic', other, lambda r: r['depth'] == 0)} |"
        )
    out += [
        "",
        "### Flatness in d: accuracy(d = 200) − accuracy(d = 5), independent probes, bootstrap 95% CI",
        "",
        "| system | difference (pp) |",
        "|---|---|",
    ]
    for s in systems:
        a = list(sel(s, lambda r: r["length"] == 200).values())
        b = list(sel(s, lambda r: r["length"] == 5).values())
        if a and b:
            m, lo, hi = _unpaired_diff(a, b)
            sig = "significant" if lo > 0 or hi < 0 else "not significant"
            out.append(f"| {s} | {100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] ({sig}) |")
    out += [
        "",
        "### C-DIC accuracy per training seed (all cells) and routing accuracy",
        "",
        "| seed | accuracy % | mean routing accuracy (first retrieved slot = the thread's slot) |",
        "|---|---|---|",
    ]
    for sd in seeds:
        rs = [r for (k, _), r in by["cdic"].items() if k == sd]
        route = sum(r["extra"].get("routing", 0.0) for r in rs) / max(1, len(rs))
        out.append(f"| {sd} | {est([r['score'] for r in rs])} | {100 * route:.1f}% |")
    if lat:
        turns = sorted({r["length"] for r in lat})
        out += [
            "",
            "### Per-turn latency (ms, batch 1, one thread; median over seeds of the median of 5)",
            "",
            "| system | " + " | ".join(f"turn {t}" for t in turns) + " |",
            "|---|" + "---|" * len(turns),
        ]
        for s in [s for s in SYSTEMS if any(r["recipe"] == s for r in lat)]:
            cells = []
            for t in turns:
                v = sorted(r["decode_s"] for r in lat if r["recipe"] == s and r["length"] == t)
                cells.append(f"{1000 * v[len(v) // 2]:.2f}" if v else "")
            out.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(out)
