"""The one engine: requests of every family in, results out (:class:`Engine`, :class:`Result`).

- :mod:`longlab.engine.stream`: :class:`Stream`, token streams into one cache (chunked prefill, fork);
- :mod:`longlab.engine.planner` and :mod:`longlab.engine.prefill`: requests sharing a prompt prefill it once;
- :mod:`longlab.engine.decode`: lanes of rows advanced one step at a time (one batch; own lanes);
- :mod:`longlab.engine.core`: :class:`Engine` (submit / step / run) and :class:`Result`.
"""

from .core import Engine, Result
from .limits import available_bytes, kv_bytes_per_token
from .stream import Stream

__all__ = ["Engine", "Result", "Stream", "available_bytes", "kv_bytes_per_token"]
