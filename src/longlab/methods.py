"""Importing this module registers every built-in method family (see ``longlab methods``)."""

from .compress import comi, drop, guidance, inftythink, lingua, merge  # noqa: F401  (context compressors, before prefill)
from .decode import losa, quest, retro  # noqa: F401
from .kv import attention, decoding, indexmem, obcache, restkv, simple  # noqa: F401
from .quant import kivi, pmkvq  # noqa: F401
from .sparse import prefill  # noqa: F401
