"""Backends that ship inside qaic-core."""
