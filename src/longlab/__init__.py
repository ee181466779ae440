"""longlab: long-context inference methods on one spine, measured side by side.

from longlab import load_model, generate, LonglabCache
"""

from . import methods  # noqa: F401  (registers every built-in method family)
from .cache import LonglabCache
from .engine import Engine, Result
from .errors import LonglabError, LonglabTypeError
from .generation import GenerationResult, generate
from .hook import use_longlab_attention
from .models import load_model
from .paths import __version__
from .recipe import Recipe, parse_recipe
from .request import Request

__all__ = [
    "Engine",
    "Request",
    "Result",
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
