"""Analyses of STEM models (see docs/analysis.md): geometry of table rows vs dense up-projection
outputs (paper Fig. 4) and test-time capacity with a Heaps'-law fit (paper §3.2)."""

from .capacity import HeapsFit, capacity, fit_heaps, plot_capacity, unique_curve
from .geometry import capture_ffn_inputs, geometry, pairwise_cos, plot_geometry, summarize
from .text import token_stream, windows

__all__ = ["HeapsFit", "capacity", "capture_ffn_inputs", "fit_heaps", "geometry", "pairwise_cos", "plot_capacity",
           "plot_geometry", "summarize", "token_stream", "unique_curve", "windows"]
