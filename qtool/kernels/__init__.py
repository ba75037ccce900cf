"""Kernels that multiply activations by packed quantized weights (base.py: the interface and registry)."""
