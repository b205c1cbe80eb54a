"""Omni-Flow: workflow orchestration and KV-cache sharing for multimodal inference."""

__version__ = "0.1.0"
