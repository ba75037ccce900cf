"""Bit-level helpers. They know bits, words and permutations; they know nothing of formats."""
