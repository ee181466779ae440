"""The one list of built-in method modules: importing this registers every family in the one registry
(:data:`longlab.registry.REGISTRY`; ``longlab methods`` lists them). The package face imports it, so every
name is registered before any is looked up. A new method file is added here, and nowhere else."""

# recipe: context compressors, prefill attention, KV policies, quantizers, decode attention
from .compress import comi, drop, guidance, inftythink, lingua, merge  # noqa: F401
from .decode import losa, quest, retro  # noqa: F401
from .kv import attention_scores, decoding, indexmem, obcache, restkv, simple  # noqa: F401

# lab mixers (the layers lab's token mixers)
from .lab.mixers import (  # noqa: F401
    crisscross,
    ema,
    emformer,
    l2a,
    lact,
    lssa,
    race,
    recurrent,
    softmax,
    spiking,
    ultramem,
    vlta,
)

# position methods (applied at model load)
from .position import repo, rope, upi, variants  # noqa: F401
from .quant import kivi, pmkvq  # noqa: F401

# reuse methods (KV reuse over stored documents)
from .reuse import policies as reuse_policies  # noqa: F401
from .sparse import prefill  # noqa: F401

# speculative decoding: drafts and verifiers
from .spec import drafts, dustin, verify  # noqa: F401
