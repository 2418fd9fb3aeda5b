"""A plain key/value cache for the tests: every row at the same position (``StemLM.forward``'s ``cache``)."""

from __future__ import annotations

import torch

from stemlm.config import ModelConfig


class KVCache:
    """Keys and values of every layer; ``update`` writes new positions and returns the prefix.

    Any object with the same ``update(layer_idx, k, v, start_pos)`` method can be passed to
    ``StemLM.forward`` (the Hugging Face wrapper adapts ``DynamicCache`` this way), with ``splits_attention``.
    """

    splits_attention = False

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None, device=None,
                 dtype: torch.dtype = torch.float32):
        self.max_len = max_len or cfg.max_seq_len
        shape = (batch_size, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        """Store ``k, v (B, nkv, T, hd)`` at ``start_pos`` and return all keys/values so far."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: position {end} exceeds its length {self.max_len}")
        self.k[layer_idx][:, :, start_pos:end] = k
        self.v[layer_idx][:, :, start_pos:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]
