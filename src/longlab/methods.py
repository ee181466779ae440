"""Importing this module registers every built-in method family (see ``longlab methods``)."""

from .kv import attention, simple  # noqa: F401
