"""Ahead-of-time path: Hugging Face model to ONNX to a cached QPC to an inference session."""

__version__ = "0.1.0"
