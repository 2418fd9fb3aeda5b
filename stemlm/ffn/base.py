"""What every FFN kind is: a module computing its layer, and the facts about it that the rest of stemlm asks.

A kind is one class. Its ``forward(x, rows=None, ids=None)`` computes the layer from the normed
hidden state ``x (B, T, d)``, the layer's table rows ``rows (B, T, d_ff)`` (``U_l[t]``, table kinds
only) and the token ids. Its class attributes and class methods answer, without building it:

* accounting (``stemlm.accounting``, ``stemlm.planner``): ``weights``, ``active_weights``,
  ``macs_per_token``, ``weights_read``, and whether it ``owns_table``;
* configuration: ``derived_fields`` (sizes it fills into ``ModelConfig``, e.g. Hash-MoE's experts);
* its projections (``holds``; a STEM kind holds two of ``w_gate``, ``w_up``, ``w_down``);
* conversion from a dense Llama (``stemlm.interop.convert``): ``from_dense``, the projection its rows
  take the place of (``table_from``, also the projection ``project`` initialises them from) and the one
  it drops (``replaces``, the one of ``w_gate``/``w_up`` it does not hold);
* calibration (``stemlm.insert``): ``calibration_target``, ``hidden`` and ``gate_of_rows`` computed
  from a dense FFN's weights, and ``zero_rows_are_dense``;
* decoding: ``routes_by_data`` (the step depends on the ids' values: no CUDA graph);
* the fused table kernels: ``fuses_row_gather`` (its ``hidden`` takes ``IndexedRows`` and gathers the
  rows inside the kernel; other kinds get the rows expanded per position);
* gradual insertion (``stemlm.insert.anneal``): ``anneals_to``, the kind it becomes once its
  ``up_scale`` reaches 0 (None: it does not anneal);
* its keys (``keyed_by``): ``"token"``, one row ``U_l[t]`` per position (``rows (B, T, d_ff)``), or
  ``"ngram"``, the K rows of the position's token and hashed n-grams (``rows (B, T, K, d_ff)``,
  ``stemlm.ffn.ngram``); ``table_rows`` is the number of rows of its table, ``rows_per_token`` the rows
  a position reads (1 or K) and ``row_sum_adds_per_token`` the additions that sum them.

Sizes come from a ``ModelConfig`` (``d_model``, ``d_ff``, ``vocab_size``, ``n_experts``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn


def linear(d_in: int, d_out: int) -> nn.Linear:
    """A projection without bias, as every FFN kind uses."""
    return nn.Linear(d_in, d_out, bias=False)


class FFNKind(nn.Module):
    """The base of every FFN kind (see the module docstring); the defaults are a dense SwiGLU's."""

    name: ClassVar[str]
    holds: ClassVar[tuple[str, ...]] = ("w_gate", "w_up", "w_down")  # its projections (per expert)
    replaces: ClassVar[str | None] = None  # the dense projection it drops (set from ``holds``)
    owns_table: ClassVar[bool] = False  # reads a token-indexed table row U_l[t]
    table_from: ClassVar[str | None] = None  # the dense projection ("w_up", "w_gate") whose activation its rows stand for
    from_dense: ClassVar[bool] = True  # a dense Llama layer converts into this kind
    zero_rows_are_dense: ClassVar[bool] = False  # with all-zero rows the layer is exactly the dense layer
    routes_by_data: ClassVar[bool] = False  # the computation depends on the ids' values
    fuses_row_gather: ClassVar[bool] = False  # takes ``IndexedRows`` (rows not expanded per position) in forward
    anneals_to: ClassVar[str | None] = None  # the kind gradual insertion turns it into (its up_scale/row_scale), if any
    keyed_by: ClassVar[str] = "token"  # "token": U_l[t]; "ngram": the rows of t and its hashed n-grams
    is_dense: ClassVar[bool] = False  # the plain SwiGLU: a converted Llama layer, the baseline the others replace

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.replaces = next((w for w in ("w_gate", "w_up") if w not in cls.holds), None)

    def __init__(self, cfg):
        super().__init__()
        for name in self.holds:  # (d -> d_ff) gate and up, (d_ff -> d) down, in this order
            setattr(self, name, linear(cfg.d_ff, cfg.d_model) if name == "w_down" else linear(cfg.d_model, cfg.d_ff))

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        """``W_d`` of the kind's activation (``hidden``) with its own projections."""
        return self.w_down(self.hidden(self, x, rows))

    def init_weights_(self, cfg, init) -> None:
        """Initialise the kind's own parameters that are not ``nn.Linear``s (``StemLM`` initialises those);
        ``init`` supplies ``normal_``/``ones_``/``copy_`` (see ``stemlm.model.decoder.init_module_``)."""

    # -- accounting ---------------------------------------------------------------------------
    @classmethod
    def weights(cls, cfg) -> int:
        """Parameters of the layer's projections (experts), its table not counted."""
        return len(cls.holds) * cfg.d_model * cfg.d_ff

    @classmethod
    def active_weights(cls, cfg) -> int:
        """Projection parameters one token uses."""
        return cls.weights(cfg)

    @classmethod
    def macs_per_token(cls, cfg) -> int:
        """Multiply-accumulates of the layer per token (a table lookup is free)."""
        return cls.active_weights(cfg)

    @classmethod
    def weights_read(cls, cfg, n_tokens: float) -> float:
        """Projection parameters a step over ``n_tokens`` tokens reads."""
        return cls.weights(cfg)

    @classmethod
    def table_rows(cls, cfg) -> int:
        """Rows of the layer's table: ``V`` for token keys (``ngram_slots`` for n-gram keys,
        ``stemlm.ffn.ngram.NgramKeyed``), 0 without one."""
        return cfg.vocab_size if cls.owns_table else 0

    @classmethod
    def rows_per_token(cls, cfg) -> int:
        """Table rows one position reads: 1 for token keys (``K = 1 + |orders| · heads`` for n-gram keys,
        ``stemlm.ffn.ngram.NgramKeyed``), 0 without a table."""
        return int(cls.owns_table)

    @classmethod
    def row_sum_adds_per_token(cls, cfg) -> int:
        """Additions that sum a position's rows to one (``(K - 1) · d_ff``; 0 for token keys). Not FLOPs
        in ``stemlm.accounting`` (matmuls only), reported beside them."""
        return max(cls.rows_per_token(cfg) - 1, 0) * cfg.d_ff

    @classmethod
    def table_params(cls, cfg) -> int:
        """Parameters of the layer's table (``table_rows × d_ff``), 0 without one."""
        return cls.table_rows(cfg) * cfg.d_ff

    # -- configuration ------------------------------------------------------------------------
    @classmethod
    def derived_fields(cls, cfg) -> dict:
        """``ModelConfig`` fields this kind fills in (``ConfigError`` for values it cannot take)."""
        return {}

    # -- calibration from a dense FFN (``w_gate``, ``w_up``, ``w_down``) ------------------------
    @staticmethod
    def calibration_target(dense, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target, weight)`` at inputs ``x (N, d)``: the activation a row replaces and its
        per-coordinate least-squares weight."""
        raise ValueError("this FFN kind has no table rows to calibrate")

    @staticmethod
    def hidden(dense, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The layer's activation before ``W_d`` with ``dense``'s projections and the rows ``rows``."""
        raise ValueError("this FFN kind has no table rows")

    @staticmethod
    def gate_of_rows(dense, x: torch.Tensor) -> torch.Tensor | None:
        """``g`` when the rows enter the layer as ``W_d (g ⊙ rows)`` (a fit through ``W_d`` applies), else None."""
        return None
