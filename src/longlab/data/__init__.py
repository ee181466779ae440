"""Training-data construction (EntropyLong) and the package's bundled data files (essay, words, example)."""
