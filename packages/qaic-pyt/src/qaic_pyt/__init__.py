"""Eager path: vLLM model classes run through PyTorch with the qaic attention backend."""

__version__ = "0.1.0"
