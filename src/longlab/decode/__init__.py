"""Decode policies: what each generated token reads from the cache (Quest pages, RetroAttention)."""
