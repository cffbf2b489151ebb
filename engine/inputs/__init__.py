"""Multimodal inputs: image loading, hashing, processing, and the engine's encoder cache."""
