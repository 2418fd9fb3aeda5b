"""Analyses of STEM models (see docs/analysis.md): geometry of table rows vs dense up-projection
outputs (paper Fig. 4), test-time capacity with a Heaps'-law fit (paper §3.2; distinct n-gram keys
for n-gram layers), and slot occupancy / hash collisions of n-gram tables."""

from .capacity import HeapsFit, capacity, distinct_keys_curve, fit_heaps, plot_capacity, unique_curve
from .geometry import capture_ffn_inputs, geometry, pairwise_cos, plot_geometry, summarize
from .ngram import ngram_key_function, ngram_stats, plot_ngram, slot_sharers
from .text import token_stream, windows

__all__ = ["HeapsFit", "capacity", "capture_ffn_inputs", "distinct_keys_curve", "fit_heaps", "geometry",
           "ngram_key_function", "ngram_stats", "pairwise_cos", "plot_capacity", "plot_geometry", "plot_ngram",
           "slot_sharers", "summarize", "token_stream", "unique_curve", "windows"]
