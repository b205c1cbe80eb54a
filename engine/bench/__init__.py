"""Benchmarks run by `omniflow bench NAME`; each module NAME exposes `run(args) -> dict`."""
