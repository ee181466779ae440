"""Memory systems over long interactions (issue #31): C-DIC (:mod:`.cdic`), PersistBench and the judge-free
``memory_safety`` generator (:mod:`.persist`)."""
