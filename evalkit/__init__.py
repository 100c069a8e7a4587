"""evalkit: measure what KV-cache eviction and compression policies cost on real models."""

__version__ = "0.1.0"
