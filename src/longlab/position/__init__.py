"""Position methods (context extension beyond the trained length).

``load_model(name, position="yarn:factor=4")``, ``generate(..., position=...)``, ``longlab eval --positions``.

Registered names: ``pi``, ``ntk``, ``dynamic-ntk``, ``yarn``, ``longrope`` (RoPE scaling, no training),
``drope``, ``ropeid`` (RoPE replaced, then recalibrated with ``longlab train``), ``repo`` (learned
positions). See :mod:`longlab.position.base` for how a method reaches the model.
"""

from .base import (
    POSITIONS,
    PositionMethod,
    apply_position,
    find_rotary,
    format_position,
    parse_position,
    remove_position,
    rope_tables,
    use_position,
)
from .variants import variant_of

__all__ = [
    "POSITIONS",
    "PositionMethod",
    "apply_position",
    "find_rotary",
    "format_position",
    "parse_position",
    "remove_position",
    "rope_tables",
    "use_position",
    "variant_of",
]
