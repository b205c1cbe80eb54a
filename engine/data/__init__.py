"""Data Flow: wire messages, channels, tensor store and the paged KV cache.

This package is the floor of the engine: it imports nothing else of `engine`.
"""
