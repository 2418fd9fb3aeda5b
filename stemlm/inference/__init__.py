"""Inference: the KV cache, single and batched generation, and text in / text out."""
