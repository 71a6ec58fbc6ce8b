"""Models hpcrl can make itself: a tiny causal LM for CPU runs and tests (no hub downloads)."""
