"""KV policies: what to keep in the cache. One file per method family."""
