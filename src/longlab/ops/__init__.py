"""Compiled kernels and the builder they share.

- :mod:`~longlab.ops.build`: compile-on-first-use of every C++ kernel (bounded lock wait, stale-lock
  take-over, size/digest-checked libraries imported in a subprocess before first use, compiler
  processes cleaned up);
- :mod:`~longlab.ops.block_flash`: block-sparse causal flash attention for prefill (``block_flash.cpp``);
- :mod:`~longlab.ops.qdecode`: fused decode attention over the packed KIVI / PM-KVQ layouts and paged
  sparse decode over selected pages (``qdecode.cpp``), each with a pure-PyTorch fallback.

Nothing here imports a method family: the families (``sparse``, ``quant``, ``decode``) import these.
"""
