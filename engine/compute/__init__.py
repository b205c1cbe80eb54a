"""Compute Flow: the units that run node operations (Python functions, models)."""
