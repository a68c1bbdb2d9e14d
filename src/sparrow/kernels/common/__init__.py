"""Triton building blocks shared by several kernels."""
