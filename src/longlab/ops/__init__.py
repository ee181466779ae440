"""The attention-kernel lab and the compiled kernels, with the builder they share.

- :mod:`~longlab.ops.masks`: LongCA-bench's slice masks (any mask as slices of key ranges per query range);
- :mod:`~longlab.ops.kernels`: every attention kernel behind one call for any slice mask (LongCA-bench's
  kernel axis; it runs the sparse executor, so it sits with the method families);
- :mod:`~longlab.ops.context_parallel`: context-parallel attention over ``torch.distributed`` (ring P2P,
  all-gather), and :mod:`~longlab.ops.cp_generate`, the prefill that drives it (a tool: it loads models);

- :mod:`~longlab.ops.build`: compile-on-first-use of every C++ kernel (bounded lock wait, stale-lock
  take-over, size/digest-checked libraries imported in a subprocess before first use, compiler
  processes cleaned up);
- :mod:`~longlab.ops.block_flash`: block-sparse causal flash attention for prefill (``block_flash.cpp``);
- :mod:`~longlab.ops.qdecode`: fused decode attention over the packed KIVI / PM-KVQ layouts and paged
  sparse decode over selected pages (``qdecode.cpp``), each with a pure-PyTorch fallback.

Apart from ``kernels`` and ``cp_generate`` (named above), nothing here imports a method family: the families
(``sparse``, ``quant``, ``decode``) import these.
"""
