"""KV reuse for retrieval-augmented prompts (issue #11): a per-document KV store, assembly of stored documents
into one cache with RoPE fixed for their new positions, and reuse methods (full prefill, no recompute, EPIC,
CacheBlend, ProphetKV, APE) compared against full prefill.

    from longlab.reuse import DocStore, reuse_prefill
    store = DocStore("~/.cache/longlab/docstore")
    pre = reuse_prefill(model, tokenizer, docs, question, "prophetkv:recompute=0.2", store=store)
    # then a KV recipe compresses the assembled cache (query-aware, at the end of the prompt):
    pre = reuse_prefill(model, tokenizer, docs, question, "cacheblend:recompute=0.15", store=store,
                        recipe="snapkv@0.5")
"""

from .api import ReusePrefill, doc_segment, open_store, reuse_prefill, split_prompt
from .assemble import ReuseCache, ReuseJob, ReuseLayer, build_job
from .compose import reuse_recipe
from .docstore import DocEntry, DocStore, MemoryStore, doc_id_for
from .modelio import DocKV, Runner, encode_document, model_fingerprint, tokenizer_fingerprint
from .policies import (
    APE,
    EPIC,
    REUSE_METHODS,
    CacheBlend,
    FullPrefill,
    NoRecompute,
    ProphetKV,
    ReuseMethod,
    format_reuse,
    parse_reuse,
    register_reuse,
)

__all__ = [
    "APE",
    "EPIC",
    "REUSE_METHODS",
    "CacheBlend",
    "DocEntry",
    "DocKV",
    "DocStore",
    "FullPrefill",
    "MemoryStore",
    "NoRecompute",
    "ProphetKV",
    "ReuseCache",
    "ReuseJob",
    "ReuseLayer",
    "ReuseMethod",
    "ReusePrefill",
    "Runner",
    "build_job",
    "doc_id_for",
    "doc_segment",
    "encode_document",
    "format_reuse",
    "model_fingerprint",
    "open_store",
    "parse_reuse",
    "register_reuse",
    "reuse_prefill",
    "reuse_recipe",
    "split_prompt",
    "tokenizer_fingerprint",
]
