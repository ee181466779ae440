"""longlab: long-context inference methods on one spine, measured side by side.

from longlab import load_model, generate, LonglabCache
"""

from . import methods  # noqa: F401  (registers every built-in method family)
from .cache import LonglabCache
from .hook import use_longlab_attention
from .models import load_model
from .paths import __version__
from .pipeline import GenerationResult, generate
from .recipe import LonglabError, LonglabTypeError, Recipe, parse_recipe

__all__ = [
    "LonglabCache",
    "load_model",
    "generate",
    "GenerationResult",
    "LonglabError",
    "LonglabTypeError",
    "Recipe",
    "parse_recipe",
    "use_longlab_attention",
    "__version__",
]
