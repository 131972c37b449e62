"""Quantization helpers: detecting 4-bit QAT weights (and, later, exact Q4_0 packing)."""
