"""Benchmarks: timing harness (timing.py), roofline (roofline.py), shapes, random layers, the bench run."""
