"""Paged KV cache of the Data Flow layer: layout, page keys, three tiers, one store per process."""
