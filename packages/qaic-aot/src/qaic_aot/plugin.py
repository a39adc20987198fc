"""Registers the AOT session backend and model loader."""
