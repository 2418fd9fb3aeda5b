"""What a model is: ``ModelConfig``, one frozen dataclass; every derived size is computed once, here.

Named shapes are ``presets.py``'s; a config is read from YAML and overrides by ``layered_config.py``, its values
checked by ``fields.py``; the FFN kinds it names are ``stemlm.ffn``'s; where a model's tables live is
not part of it (``stemlm.store.Placement``).

Placement rule for ratio specs (``stem_layers``):

* ``"1/k"`` or a float ``r`` in (0, 1]: ``n = floor(n_layers * r)`` layers are replaced, the
  ``j``-th (0-based) at index ``ceil((j + 1) / r) - 1``, i.e. the last layer of each block of
  ``1/r`` layers. For ``1/3`` that is layers 2, 5, 8, ...: 16 layers -> [2, 5, 8, 11, 14];
  30 layers -> [2, 5, ..., 29] (10 layers); 32 layers -> [2, 5, ..., 29] (10 layers).
  For ``1/2``: 1, 3, 5, ... (every second layer).
* ``"full"`` (or ratio 1): every layer but the first (layer 0 stays dense).
* ``"none"``: no layer.
* an explicit list ``[2, 5]`` or string ``"2,5"`` (or ``"7"``) of 0-based layer indices.

Layer 0 is never chosen by a ratio rule: the first layer has to build the contextual state the
token-indexed tables of later layers are gated by.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

from .ffn import KINDS, DenseFFN, EngramFFN, ffn_kind
from .ffn.ngram import check_ngram_fields
from .fields import ConfigError, coerce_fields

TABLE_INITS = ("xavier_normal", "matched", "normal")


def swiglu_hidden_dim(d_model: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width rule: 2/3 of 4*d, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * d_model) / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


def is_layer_list(spec) -> bool:
    """Whether a placement spec names its layers (``[2, 5]``, ``"2,5"``, ``"7"``) rather than a ratio, ``full``
    or ``none``."""
    if isinstance(spec, (list, tuple)):
        return True
    text = str(spec).strip().lower()
    return text not in ("", "none", "full") and "/" not in text and "." not in text


def resolve_stem_layers(spec: str | float | list[int] | tuple[int, ...] | None, n_layers: int) -> tuple[int, ...]:
    """Turn a placement spec (see module docstring) into sorted 0-based layer indices."""
    if spec is None:
        return ()
    if isinstance(spec, (list, tuple)):
        layers = [int(i) for i in spec]
    else:
        text = str(spec).strip().lower()
        if text == "":
            raise ConfigError("stem_layers: empty; use '1/3', '1/2', 'full', 'none' or a list like '2,5'")
        if text == "none":
            return ()
        if text == "full":
            return tuple(range(1, n_layers))
        if is_layer_list(text):  # "2,5" or a single index "7"
            try:
                layers = [int(p) for p in text.split(",") if p.strip()]
            except ValueError:
                raise ConfigError(f"stem_layers: cannot parse {spec!r}; use '1/3', '1/2', 'full', 'none' or a list like '2,5'") from None
        else:
            try:
                ratio = Fraction(text).limit_denominator(1000)
            except (ValueError, ZeroDivisionError):
                raise ConfigError(f"stem_layers: cannot parse {spec!r}; use '1/3', '1/2', 'full', 'none' or a list like '2,5'") from None
            if not 0 < ratio <= 1:
                raise ConfigError(f"stem_layers: ratio {spec!r} must be in (0, 1]")
            if ratio == 1:
                return tuple(range(1, n_layers))
            count = math.floor(n_layers * ratio)
            layers = [i for i in (math.ceil((j + 1) / ratio) - 1 for j in range(count)) if i != 0]
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"stem_layers: layer index {bad[0]} out of range for n_layers={n_layers} (valid 0..{n_layers - 1})")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"stem_layers: duplicate layer index in {sorted(layers)}")
    return tuple(sorted(layers))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a STEM (or plain Llama) decoder.

    ``ffn`` is the FFN kind used in the layers chosen by ``stem_layers``; every other layer is
    dense. Derived fields (``layer_kinds``, ``head_dim``, ``n_experts`` ...) are filled in
    ``__post_init__`` and are not constructor arguments.
    """

    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    d_ff: int | None = None  # None -> swiglu_hidden_dim(d_model)
    vocab_size: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 256
    tie_embeddings: bool = False  # the STEM paper unties input embedding and LM head
    ffn: str = "stem"
    stem_layers: str | tuple[int, ...] = "1/3"
    n_experts: int | None = None  # hash_moe only; None -> matched to the STEM parameter count
    hash_seed: int = 0  # hash_moe: seed of the fixed token -> expert hash
    init_std: float = 0.02
    table_init: str = "xavier_normal"
    # n-gram keyed rows (ffn = ngram / ngram_dagger / engram, or engram_layers; stemlm/ffn/ngram.py, docs/ngram.md)
    ngram_orders: tuple[int, ...] = (2, 3)  # hashed orders; the current token is always a key
    ngram_heads: int = 2  # hash heads per order
    ngram_slots: int | None = None  # rows of an n-gram table (>= vocab_size); None -> vocab_size (STEM's table bytes)
    ngram_seed: int = 0  # seed of the fixed hash factors
    ngram_normalize: bool = False  # hash canonical tokens (case, leading space folded; stemlm.data.codec)
    engram_layers: str | tuple[int, ...] = "none"  # layers given an Engram-style memory (kind engram), beside `ffn`

    # derived (not constructor arguments)
    head_dim: int = field(init=False)
    stem_layer_ids: tuple[int, ...] = field(init=False)
    layer_kinds: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        coerce_fields(self)  # types from the annotations: integers, finite floats, booleans
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"head_dim={self.d_model // self.n_heads} must be even for RoPE")
        if self.d_ff is None:
            set_("d_ff", swiglu_hidden_dim(self.d_model))
        if self.d_ff <= 0:
            raise ConfigError(f"d_ff must be positive, got {self.d_ff}")
        if self.ffn not in KINDS:  # the registry itself: a kind added to it is known everywhere
            raise ConfigError(f"unknown ffn kind {self.ffn!r}; choose one of {', '.join(KINDS)}")
        if self.table_init not in TABLE_INITS:
            raise ConfigError(f"unknown table_init {self.table_init!r}; choose one of {', '.join(TABLE_INITS)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.hash_seed < 0:
            raise ConfigError(f"hash_seed must be >= 0, got {self.hash_seed}")
        layers = () if self.ffn == DenseFFN.name else resolve_stem_layers(self.stem_layers, self.n_layers)
        check_ngram_fields(self)
        memory = resolve_stem_layers(self.engram_layers, self.n_layers)
        if clash := sorted(set(memory) & set(layers)):
            raise ConfigError(f"engram_layers: layer {clash[0]} is already a {self.ffn} layer (stem_layers)")
        set_("head_dim", self.d_model // self.n_heads)
        set_("stem_layer_ids", layers)
        set_("layer_kinds", tuple(self.ffn if i in layers else EngramFFN.name if i in memory else DenseFFN.name
                                  for i in range(self.n_layers)))
        for name, value in ffn_kind(self.ffn).derived_fields(self).items():  # e.g. Hash-MoE's expert count
            set_(name, value)

    # -- helpers -------------------------------------------------------------------------
    @property
    def table_layers(self) -> tuple[int, ...]:
        """Indices of layers that own a table (STEM, STEM†, gate ablation, the n-gram kinds)."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if ffn_kind(k).owns_table)

    @property
    def ngram_layers(self) -> tuple[int, ...]:
        """Indices of table layers keyed by n-grams (``stemlm.ffn.ngram``)."""
        return tuple(i for i in self.table_layers if ffn_kind(self.layer_kinds[i]).keyed_by == "ngram")

    def table_rows(self, layer: int) -> int:
        """Rows of layer ``layer``'s table (``V``, or ``ngram_slots`` for n-gram keys)."""
        return ffn_kind(self.layer_kinds[layer]).table_rows(self)

    def to_dict(self) -> dict:
        """Constructor arguments only (derived fields are recomputed on load)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in ("stem_layers", "engram_layers", "ngram_orders"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        return out

    def check_seq_len(self, seq_len: int, name: str = "seq_len") -> int:
        """``seq_len`` when the model's positions reach it; a clear error instead of a silent cap."""
        if seq_len > self.max_seq_len:
            raise ConfigError(f"{name} {seq_len} exceeds the model's max_seq_len {self.max_seq_len}; "
                              f"use {self.max_seq_len} or less")
        return seq_len

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Build from a dict, rejecting unknown keys with a clear error."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown model config field {unknown[0]!r}; valid fields: {', '.join(sorted(names))}")
        return cls(**data)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some constructor fields changed (derived fields recomputed)."""
        return ModelConfig.from_dict({**self.to_dict(), **changes})
