"""Context compression: shorten the prompt before prefill (issue #13).

**The shape.** A fourth kind of recipe part, ``kind = "context"``, next to prefill, KV and decode
policies. A context compressor is a transform of one row's prompt::

    ContextCompressor.compress(Prompt(ids, question, question_ids, tokenizer), scorer) -> Compressed
    Compressed(ids [T'], source [T'] (original index of each token, -1 inserted), embeds [T', D] | None,
               sizes [T'] | None, seconds, info)

It runs once per row, after tokenization and before the first prefill chunk; the KV recipe then sees an
ordinary (shorter) context, so every KV recipe composes with every compressor:
``llmlingua@0.5+snapkv@0.5`` removes half the context tokens, then SnapKV removes half of the KV
entries of what is left (kept memory ``(1 - 0.5)(1 - 0.5) = 1/4``). The number after ``@`` is the
fraction removed, as for KV policies; ``r = 0`` returns the prompt unchanged (the identity tests).

Deleting methods (LLMLingua, LongLLMLingua, TPP) return token ids; merging methods (HiCo/ToMe) return
input embeddings too, which the model reads at consecutive positions through
:meth:`~longlab.compress.api.Squeeze.applied` (a forward pre-hook, only inside the ``with`` block).
The question part is never compressed. ``generate`` and the eval harness call
:func:`~longlab.compress.api.compress_prompts`; a result row stores the record in ``extra["context"]``
(original and kept tokens, kept spans, ``context_s``: the compression's own time, not in ``prefill_s``).

Methods: ``llmlingua@r``, ``longllmlingua@r`` (:mod:`.lingua`), ``hico@r``, ``tpp@r`` (:mod:`.merge`),
``comi@r`` (:mod:`.comi`, the training-free hard variant: merged input embeddings; ``comi@r:fusion=PATH``
the soft variant with a trained fusion layer), the KV policy ``hico-drop@r`` (:mod:`.drop`: HiCo's
layer-wise hierarchical token dropping on the cache) and its in-forward form
``hico-forward@r`` (:class:`~longlab.compress.hico_forward.HiCoForward`: later layers of the prefill run
on fewer tokens; a context part that ``transforms_prefill``, run by
:meth:`~longlab.compress.api.Squeeze.feed`),
``inftythink`` (:mod:`.inftythink`: segment-and-summarise reasoning in a bounded cache) and
``guidance`` (:mod:`.guidance`), a context part that removes nothing but builds a sentence pool
from the context and replaces greedy decoding with prefix-tail guided decoding and citations
(``guides_decoding``; :meth:`~longlab.compress.api.Squeeze.decode`).
Deletion never splits a word, a number or a UTF-8 character (:func:`~longlab.compress.base.units`).
"""

from . import comi, drop, guidance, hico_forward, inftythink, lingua, merge  # noqa: F401  (registers them)
from .base import Compressed, ContextCompressor, Prompt, units

__all__ = ["Compressed", "ContextCompressor", "Prompt", "units"]
