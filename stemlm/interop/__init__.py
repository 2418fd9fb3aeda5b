"""Interop: Hugging Face / GGUF conversion and the transformers wrapper (``import stemlm.interop.hf``
registers it with the Auto classes). The checkpoint format itself is ``stemlm.checkpoint``."""
