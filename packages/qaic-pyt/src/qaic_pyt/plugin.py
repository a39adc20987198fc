"""Registers the eager path with qaic-core (attention backends arrive with the eager runner)."""
