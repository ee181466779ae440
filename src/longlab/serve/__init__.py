"""``longlab serve``: an OpenAI-compatible server on the one engine, a recipe per request.

:func:`create_app` (``app.py``) builds the FastAPI app; :class:`Scheduler` (``scheduler.py``) drives the
engine in one thread under a KV byte budget; ``protocol.py`` maps OpenAI bodies to requests and results
to responses. Needs the ``serve`` extra: ``pip install 'longlab[serve]'``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "run_server"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    from .app import create_app as _create

    return _create(*args, **kwargs)


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
