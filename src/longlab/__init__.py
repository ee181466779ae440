"""longlab: long-context inference methods on one spine, measured side by side.

from longlab import load_model, generate, LonglabCache
"""

from .cache import LonglabCache
from .models import load_model
from .pipeline import GenerationResult, generate
from .recipe import LonglabError, Recipe, parse_recipe

__all__ = [
    "LonglabCache",
    "load_model",
    "generate",
    "GenerationResult",
    "LonglabError",
    "Recipe",
    "parse_recipe",
]
__version__ = "0.1.0"
