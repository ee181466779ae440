"""Memory systems over long interactions (issue #31): one chat backend, HGMem and its baselines.

    from longlab.memory import LocalBackend, OpenAIBackend, HGMem, DocumentIndex, make_embedder
    backend = LocalBackend.load("qwen2.5-0.5b")                   # or OpenAIBackend(base_url, model)
    index = DocumentIndex.build(backend, document, make_embedder(), tokenizer=backend.tokenizer)
    text, record = HGMem(backend, index, tokenizer=backend.tokenizer).answer("Who ...?")

:mod:`.backend` (the :class:`ChatBackend` protocol, local engine / OpenAI-compatible endpoint, JSON-schema
output), :mod:`.embed` (MiniLM embeddings, a vector index), :mod:`.hypergraph` (knowledge graph and the
hypergraph memory), :mod:`.hgmem` (HGMem, arXiv 2512.23959), :mod:`.rag` (top-k RAG, whole document under a
KV recipe, the document KV store with reuse), :mod:`.runner` (systems x samples -> results rows).
"""

from .backend import (
    BackendStats,
    ChatBackend,
    LocalBackend,
    OpenAIBackend,
    chat_json,
    check_schema,
    extract_json,
    validate_json,
)
from .embed import HashEmbedder, VectorIndex, make_embedder
from .hgmem import DocumentIndex, HGMem, HGMemConfig, chunk_text
from .hypergraph import HypergraphMemory, KnowledgeGraph, MemoryPoint

__all__ = [
    "BackendStats",
    "ChatBackend",
    "DocumentIndex",
    "HGMem",
    "HGMemConfig",
    "HashEmbedder",
    "HypergraphMemory",
    "KnowledgeGraph",
    "LocalBackend",
    "MemoryPoint",
    "OpenAIBackend",
    "VectorIndex",
    "chat_json",
    "check_schema",
    "chunk_text",
    "extract_json",
    "make_embedder",
    "validate_json",
]
