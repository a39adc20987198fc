"""Registers the simulator as the ``sim`` device backend."""
