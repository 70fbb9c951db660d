"""Triton kernels for the fast path. Each entry point returns None for inputs it does not
support, and the caller falls back to the exact torch composition."""
