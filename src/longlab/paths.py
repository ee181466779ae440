"""Where longlab keeps files it derives (dequantised weights, trained method weights). A leaf module."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "__version__"]

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where dequantised weights are cached (``$LONGLAB_CACHE`` or ``~/.cache/longlab``)."""
    return Path(os.environ.get("LONGLAB_CACHE", Path.home() / ".cache" / "longlab"))
