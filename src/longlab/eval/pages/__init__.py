"""Page generators of the documentation site (:mod:`longlab.eval.docs_tables` runs them).

One module per results page (its tables and plots from ``bench/results/``) and :mod:`.methods` (each family
page's parameter table from the registry). :data:`GENERATORS` lists them in page order; ``longlab report
--docs`` (``make results``) rewrites every block, ``longlab report --docs --check`` only compares.
"""

from __future__ import annotations

from . import (
    attention_bench,
    compression,
    decode_speed,
    entropylong,
    kv_eviction,
    kv_quant,
    layers_lab,
    modalities,
    models,
    position,
    rag_reuse,
    results_index,
    serve_load,
    sparse_prefill,
    spec_decode,
    vs_kvpress,
)
from .generator import Generator
from .memory import MEMORY_GENERATORS
from .methods import FAMILY_METHODS, render_family

__all__ = ["GENERATORS"]

GENERATORS: tuple[Generator, ...] = (
    *(Generator(f"docs/families/{page}.md", render_family(page)) for page in FAMILY_METHODS),
    Generator("docs/results/attention-bench.md", attention_bench.render),
    Generator("docs/results/compression.md", compression.render),
    Generator("docs/results/decode-speed.md", decode_speed.render),
    Generator("docs/results/entropylong.md", entropylong.render),
    Generator("docs/results/index.md", results_index.render),
    Generator("docs/results/kv-eviction.md", kv_eviction.render),
    Generator("docs/results/kv-quant.md", kv_quant.render),
    Generator("docs/results/layers-lab.md", layers_lab.render),
    Generator("docs/results/modalities.md", modalities.render),
    Generator("docs/results/models.md", models.render),
    Generator("docs/results/position.md", position.render),
    Generator("docs/results/rag-reuse.md", rag_reuse.render),
    Generator("docs/results/serve-load.md", serve_load.render),
    Generator("docs/results/sparse-prefill.md", sparse_prefill.render),
    Generator("docs/results/spec-decode.md", spec_decode.render),
    Generator("docs/results/vs-kvpress.md", vs_kvpress.render),
    *MEMORY_GENERATORS,
)
