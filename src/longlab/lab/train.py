"""CPU trainer of the layers lab: AdamW, linear warm-up then cosine decay, seeded and resumable.

One training step draws one batch and makes one optimizer update per loss the task yields
(:meth:`~longlab.lab.tasks.Task.train_losses`): one, or ``rollout`` for autoregressive rollout training
(EMFormer's accumulative-context fine-tuning). ``init``: start from another run's weights (fine-tuning).

Batch ``s`` is drawn from a generator seeded by ``(seed, s)``, so a resumed run sees exactly the
batches an uninterrupted one would. Checkpoints: ``OUT/checkpoint-<step>/`` holds
``model.safetensors`` and ``optimizer.safetensors`` (tensors only; never pickles) and
``OUT/manifest.json`` names the latest one with the full configuration, so ``train`` with the same
arguments continues where a killed run stopped. The manifest is replaced atomically (written to a
temporary name, then renamed) after the checkpoint directory is complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..recipe import LonglabError
from ..safeio import check_output_dir, os_error
from .model import LabConfig, LabLM, match_mlp_hidden
from .tasks import task_config

__all__ = ["FORMAT", "TrainConfig", "load_checkpoint", "train"]

FORMAT = "longlab-lab-checkpoint/1"


@dataclass
class TrainConfig:
    """What ``longlab lab train`` runs. ``params > 0``: set the MLP width so the model has about that
    many parameters (equal parameters across mixers)."""

    mixer: str
    task: str
    train_len: int
    steps: int
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 0  # 0 -> 5% of steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_weight: float = 1.0
    seed: int = 0
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    positions: str = ""
    params: int = 0
    ckpt_every: int = 200
    rollout: int = 0  # > 0: autoregressive rollout training, one optimizer update per rollout step
    init: str = ""  # a lab checkpoint directory whose weights start this run (fine-tuning)

    def __post_init__(self) -> None:
        for name, lo in (("train_len", 1), ("steps", 1), ("batch", 1), ("warmup", 0), ("seed", 0),
                         ("params", 0), ("ckpt_every", 1), ("rollout", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise LonglabError(f"--{name.replace('_', '-')}: must be an integer >= {lo}, got {value!r}")
        for name in ("lr", "weight_decay", "grad_clip", "aux_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise LonglabError(f"--{name.replace('_', '-')}: must be a finite number >= 0, got {value!r}")
        task = task_config(self.task, self.seed)
        task.check_length(self.train_len)
        task.check_rollout(self.train_len, self.rollout)
        if not isinstance(self.init, str):
            raise LonglabError(f"--init: expected a checkpoint directory, got {self.init!r}")
        cfg = self.model_config()
        self.mixer, self.positions = cfg.mixer, cfg.positions  # normalised spellings

    def model_config(self) -> LabConfig:
        task = task_config(self.task, self.seed)
        cfg = LabConfig(
            vocab_size=task.vocab_size, mixer=self.mixer, positions=self.positions, dim=self.dim,
            n_layers=self.n_layers, n_heads=self.n_heads, input_dim=task.input_dim,
            train_len=self.train_len if self.positions == "ropeid" else 0, output_dim=task.output_dim,
            loss_params=task.loss_params,
        )
        return match_mlp_hidden(cfg, self.params) if self.params else cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate at ``step`` (0-based): linear warm-up, then cosine to 10% of ``lr``."""
    warm = cfg.warmup or max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def batch_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def _optimizer(model: LabLM, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _save(out: Path, step: int, model: LabLM, opt: torch.optim.Optimizer, cfg: TrainConfig,
          history: list[dict[str, float]], elapsed: float) -> None:
    from ..safeio import save_tensors

    ck = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    tensors, scalars = {}, {}
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value) and value.ndim > 0:
                tensors[f"{pid}.{key}"] = value.contiguous()
            else:
                scalars[f"{pid}.{key}"] = float(value)
    save_tensors(tensors, str(tmp / "optimizer.safetensors"), metadata={"scalars": json.dumps(scalars)})
    shutil.rmtree(ck, ignore_errors=True)
    os.replace(tmp, ck)
    mcfg = cfg.model_config()
    manifest = {
        "format": FORMAT,
        "step": step,
        "checkpoint": ck.name,
        "train": cfg.to_dict(),
        "model": mcfg.to_dict(),
        "params": LabLM(mcfg).n_params(),
        "train_tokens": step * cfg.batch * cfg.train_len,
        "elapsed_s": round(elapsed, 3),
        "history": history,
    }
    mtmp = out / ".manifest.json.tmp"
    mtmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(mtmp, out / "manifest.json")
    for old in out.iterdir():  # keep only the latest of the checkpoints this trainer wrote
        if CHECKPOINT.fullmatch(old.name) and old.name != ck.name and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


CHECKPOINT = re.compile(r"checkpoint-\d+")


def _is_lab_dir(path: Path) -> bool:
    """A directory ``longlab lab train`` wrote (resumable): its manifest is a lab checkpoint manifest."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def read_manifest(out: str | os.PathLike[str], what: str = "DIR") -> dict[str, Any]:
    """The checked manifest of a lab run directory: strict JSON of format :data:`FORMAT` with ``step``,
    ``checkpoint`` (a ``checkpoint-<n>`` name inside ``out``, never a path elsewhere), ``train`` and
    ``model`` settings, ``history`` and ``elapsed_s``; else a :class:`LonglabError` naming the file."""
    path = Path(out) / "manifest.json"
    if not path.is_file():
        raise LonglabError(
            f"{what}: no lab checkpoint in {out} (expected {path}); run `longlab lab train` first"
        )
    try:
        if path.stat().st_size > 64 << 20:
            raise LonglabError(f"{what}: {path} is over 64 MiB: not a lab checkpoint manifest")
        manifest = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except LonglabError:
        raise
    except (OSError, ValueError) as err:
        raise LonglabError(f"{what}: cannot read {path}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise LonglabError(f"{what}: {path} is not a {FORMAT} manifest")
    step, ck = manifest.get("step"), manifest.get("checkpoint")
    problem = None
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        problem = f"step={step!r} is not a step count"
    elif not isinstance(ck, str) or not CHECKPOINT.fullmatch(ck) or ck != f"checkpoint-{step}":
        problem = f"checkpoint={ck!r} is not checkpoint-{step}, the directory its step names"
    elif not isinstance(manifest.get("train"), dict) or not isinstance(manifest.get("model"), dict):
        problem = "its train/model settings are not objects"
    elif not isinstance(manifest.get("history"), list):
        problem = "its history is not a list"
    elif type(manifest.get("elapsed_s")) not in (int, float):
        problem = "elapsed_s is not a number"
    if problem:
        raise LonglabError(f"{what}: {path} is not a valid {FORMAT} manifest: {problem}")
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def load_checkpoint(
    out: str | os.PathLike[str], what: str = "DIR"
) -> tuple[LabLM, TrainConfig, dict[str, Any]]:
    """The trained model (eval mode), its train config and the manifest from ``OUT``.

    Checked before anything is trusted: the manifest (:func:`read_manifest`); its ``train`` settings valid
    and the ``model`` shape they imply; the checkpoint file against the manifest's ``weights_file`` record
    (size, SHA-256, tensor list) when it has one; its tensors exactly the model's (names, shapes, dtypes,
    compared on a meta-device model, so a manifest naming a huge model allocates nothing) and finite."""
    from safetensors import SafetensorError, safe_open

    from ..safeio import read_checked_tensors

    manifest = read_manifest(out, what)
    mpath = Path(out) / "manifest.json"
    try:
        cfg = TrainConfig(**manifest["train"])
        mcfg = LabConfig(**manifest["model"])
    except (TypeError, ValueError) as err:  # unknown or missing keys; LonglabError from the checks
        raise LonglabError(f"{what}: {mpath} holds settings longlab cannot use: {err}") from None
    if mcfg.to_dict() != cfg.model_config().to_dict():
        raise LonglabError(f"{what}: {mpath}: its model settings are not the ones its train settings make")
    with torch.device("meta"):
        want = {k: (list(v.shape), v.dtype) for k, v in LabLM(mcfg).state_dict().items()}
    path = Path(out) / manifest["checkpoint"] / "model.safetensors"
    fix = "train it again with `longlab lab train` (the same arguments) into a new directory"
    if "weights_file" in manifest:
        state, _ = read_checked_tensors(path, manifest["weights_file"], what=f"{what}: {path}", fix=fix)
        shapes = {k: list(v.shape) for k, v in state.items()}
    else:  # checkpoints record no digest yet: check the file's kind, its tensor list and its values
        if not path.is_file():
            raise LonglabError(f"{what}: {path} is missing or not a regular file; {fix}")
        try:
            with safe_open(str(path), "pt") as fh:
                shapes = {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}
                fits = set(shapes) == set(want) and all(shapes[k] == want[k][0] for k in want)
                state = {k: fh.get_tensor(k) for k in fh.keys()} if fits else {}
        except (SafetensorError, OSError, RuntimeError) as err:
            raise LonglabError(f"{what}: cannot read {path} ({type(err).__name__}: {err}); {fix}") from None
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if missing or extra:
        raise LonglabError(
            f"{what}: {path} does not hold this model's tensors ({len(missing)} of {len(want)} missing, "
            f"{len(extra)} unexpected, e.g. {(missing or extra)[0]}); {fix}"
        )
    for key, (shape, dtype) in want.items():
        if shapes[key] != shape or state[key].dtype != dtype:
            got = f"{state[key].dtype} {shapes[key]}" if key in state else str(shapes[key])
            raise LonglabError(
                f"{what}: {path}: tensor {key} is {got}, the model needs {dtype} {shape}; {fix}"
            )
        if state[key].is_floating_point() and not bool(torch.isfinite(state[key]).all()):
            raise LonglabError(f"{what}: {path}: tensor {key} has non-finite values (NaN or inf); {fix}")
    model = LabLM(mcfg)
    model.load_state_dict(state)
    return model.eval(), cfg, manifest


def _load_init(model: LabLM, cfg: TrainConfig) -> None:
    """Start from the weights of the lab checkpoint ``cfg.init`` (same model shape; a fresh optimizer)."""
    init, _, manifest = load_checkpoint(cfg.init, "--init")
    if LabConfig(**manifest["model"]) != cfg.model_config():
        raise LonglabError(
            f"--init: {cfg.init} holds another model shape than this run's "
            f"({LabConfig(**manifest['model'])} vs {cfg.model_config()})"
        )
    model.load_state_dict(init.state_dict())


def train(
    cfg: TrainConfig, out: str | os.PathLike[str], *, progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Train (or resume) into ``out``; returns the final manifest."""
    from safetensors.torch import load_file

    out = check_output_dir(out, "--out", owned=_is_lab_dir, what="lab checkpoint")
    if cfg.init:  # checked before --out is created: a bad --init leaves nothing behind
        read_manifest(cfg.init, "--init")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, "--out", out) from None
    torch.manual_seed(cfg.seed)
    task = task_config(cfg.task, cfg.seed)
    model = LabLM(cfg.model_config())
    opt = _optimizer(model, cfg)
    start, history, elapsed = 0, [], 0.0
    if (out / "manifest.json").exists():
        manifest = read_manifest(out, "--out")
        # fields added since a run was written (rollout, init) hold their defaults in it
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                    if f.default is not dataclasses.MISSING}
        stored = {**defaults, **manifest["train"]}
        if stored != cfg.to_dict():
            diff = sorted(k for k in cfg.to_dict() if stored.get(k) != cfg.to_dict()[k])
            raise LonglabError(
                f"--out: {out} holds a run with other settings ({', '.join(diff)} differ); "
                "use the same arguments to resume, or another directory"
            )
        ck = out / manifest["checkpoint"]
        model.load_state_dict(load_file(str(ck / "model.safetensors")))
        from safetensors import safe_open

        state_dict = opt.state_dict()
        with safe_open(str(ck / "optimizer.safetensors"), "pt") as f:
            scalars = json.loads((f.metadata() or {}).get("scalars", "{}"))
            for pid in state_dict["param_groups"][0]["params"] + state_dict["param_groups"][1]["params"]:
                st = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    name = f"{pid}.{key}"
                    if name in f.keys():
                        st[key] = f.get_tensor(name)
                if f"{pid}.step" in scalars:
                    st["step"] = torch.tensor(scalars[f"{pid}.step"])
                if st:
                    state_dict["state"][pid] = st
        opt.load_state_dict(state_dict)
        start, history, elapsed = manifest["step"], manifest["history"], manifest["elapsed_s"]
        if start >= cfg.steps:
            if log:
                log(f"longlab lab train: {out} is complete ({start} steps)")
            return manifest
        if log:
            log(f"longlab lab train: resuming {out} at step {start}")
    elif cfg.init:
        _load_init(model, cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.mixer} {cfg.task}", unit="step")
    model.train()
    t0 = time.perf_counter()
    running = None
    for step in range(start, cfg.steps):
        batch = task.sample(cfg.batch, cfg.train_len, batch_generator(cfg.seed, step), exact=False)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        values = []
        for loss in task.train_losses(model, batch, cfg.rollout):  # one update per loss (rollout: several)
            total = loss
            aux = model.aux_loss()
            if aux is not None:
                total = total + cfg.aux_weight * aux
            opt.zero_grad(set_to_none=True)
            total.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            values.append(float(loss.detach()))
        value = sum(values) / len(values)
        running = value if running is None else 0.95 * running + 0.05 * value
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{running:.3f}")
        done = step + 1
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            history.append({"step": done, "loss": round(running, 5)})
            try:
                _save(out, done, model, opt, cfg, history, elapsed + time.perf_counter() - t0)
            except OSError as exc:  # a full disk: the last complete checkpoint stays the one to resume
                shutil.rmtree(out / f".checkpoint-{done}.tmp", ignore_errors=True)
                raise os_error(exc, "--out", out) from None
    if bar is not None:
        bar.close()
    return read_manifest(out, "--out")
