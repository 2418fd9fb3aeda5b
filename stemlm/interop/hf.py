"""Hugging Face interop: ``StemConfig`` and ``StemForCausalLM``, registered with the Auto classes.

After ``import stemlm.interop.hf`` (which calls ``register()``), a stemlm checkpoint directory
(``checkpoint.save_model``) loads with ``AutoModelForCausalLM.from_pretrained(dir)``, no
``trust_remote_code``: its ``config.json`` has
``model_type: "stemlm"`` and its weights are named ``model.<StemLM parameter>``, which is exactly
the state dict of ``StemForCausalLM`` (whose ``model`` attribute is a ``StemLM``).

``generate()`` works with transformers' ``DynamicCache``, adapted to stemlm's cache protocol by
``HFCacheAdapter``. Padded batches work: ``attention_mask`` and ``position_ids`` become per-row
positions and a mask (``positions_and_mask``), so ``generate()`` on left-padded prompts gives each
prompt what it gives alone. ``inputs_embeds`` are refused: STEM layers look their table rows up by
token id.

A model with n-gram layers (``ngram``, ``ngram_dagger``, ``engram``: ``stemlm.ffn.ngram``) hashes the
tokens before each position, which a cached step does not feed again: ``forward`` then takes
``ngram_context (B, c)``, the tokens just before ``input_ids[:, 0]`` (``-1`` for padding or before the
start), and ``prepare_inputs_for_generation`` passes it, so ``generate()`` (greedy, sampling, beam
search) decodes such a model exactly as ``stemlm generate`` does. A cached call without it is refused
in one line. Padding inside ``attention_mask`` hashes as before the start (``ngram_keys``'s ``real``).
Such a model has no transformers Llama counterpart (``stemlm.interop.convert.check_exportable``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..checkpoint.directory import WEIGHTS_FILE, resolve_checkpoint, stored_codec
from ..config import ModelConfig
from ..ffn.ngram import context_reach
from ..runtime.matmul import apply_matmul
from ..model.decoder import StemLM, init_module_, padding_mask
from ..store import Placement, open_model, placement_of
from ..checkpoint.rundir import RunDir

def _mirrored_fields() -> dict:
    """Class namespace holding every ``ModelConfig`` constructor field with its default.

    The fields are annotated ``Any``: ``StemConfig.__post_init__`` checks the values through
    ``ModelConfig`` (one validator, stemlm's one-line errors), and JSON gives lists where
    ``ModelConfig`` declares tuples.
    """
    namespace = {"__annotations__": {}, "__module__": __name__,
                 "__doc__": "The ``ModelConfig`` constructor fields as transformers config fields."}
    for f in dataclasses.fields(ModelConfig):
        if f.init:
            namespace["__annotations__"][f.name] = Any
            namespace[f.name] = f.default if f.default_factory is dataclasses.MISSING \
                else dataclasses.field(default_factory=f.default_factory)
    return namespace


# Generated from ModelConfig, so a field added there needs no edit here.
_ModelFields = type("_ModelFields", (PreTrainedConfig,), _mirrored_fields())


class StemConfig(_ModelFields):
    """A ``ModelConfig`` as a transformers config (same field names, same defaults).

    The usual transformers names (``hidden_size``, ``num_hidden_layers`` ...) are aliases of the
    stemlm fields. ``model_config()`` returns the validated ``ModelConfig``.
    """

    model_type = "stemlm"
    attribute_map = {
        "hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff", "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings", "initializer_range": "init_std",
    }

    # generation metadata (not part of the architecture)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.model_config()  # fail at construction with stemlm's own one-line error

    @staticmethod
    def model_field_names() -> tuple[str, ...]:
        """Names of the ``ModelConfig`` constructor fields mirrored by this config."""
        return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.init)

    def model_config(self) -> ModelConfig:
        """The ``ModelConfig`` these fields describe (validated; derived sizes filled in)."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in self.model_field_names()})

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **generation) -> "StemConfig":
        """A ``StemConfig`` holding ``cfg`` (plus token ids such as ``eos_token_id``)."""
        return cls(**cfg.to_dict(), **generation)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_diff_dict(self) -> dict:
        # config.json always carries every architecture field: checkpoint.read_config fills
        # missing ones with ModelConfig defaults, which may change between versions.
        out = super().to_diff_dict()
        out.update(self.model_config().to_dict())
        return out


class HFCacheAdapter:
    """Presents a growing transformers ``Cache`` as stemlm's ``update(layer, k, v, start_pos)``."""

    splits_attention = False  # attention over the keys update returns (stemlm.inference.kv_cache)

    def __init__(self, cache: Cache):
        self.cache = cache

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        """Append ``k, v (B, nkv, T, hd)`` at ``start_pos``; return all keys/values ``(B, nkv, S, hd)``."""
        held = self.cache.get_seq_length(layer_idx)
        if held != start_pos:
            raise ValueError(f"the cache holds {held} positions of layer {layer_idx}, but the input starts at {start_pos}")
        k_all, v_all = self.cache.update(k, v, layer_idx)
        if k_all.shape[2] != start_pos + k.shape[2]:  # static or sliding caches pad or drop positions
            raise ValueError(f"{type(self.cache).__name__} is not supported by StemForCausalLM; use DynamicCache "
                             "(the default of generate())")
        return k_all, v_all


def positions_and_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, start_pos: int,
                       q_len: int, device=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(positions (B, T), attn_mask (B, 1, T, S))`` for ``StemLM.forward`` from transformers' inputs.

    ``attention_mask (B, start_pos + T)`` marks real tokens (1) and padding (0) anywhere (left
    padding in batched generation); ``position_ids (B|1, T)`` default to the count of real tokens
    before each one. ``(None, None)`` when neither differs from plain causal attention at
    ``start_pos, ...``. A padding slot attends to itself only, so no row of the mask is empty.
    """
    S = start_pos + q_len
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[1] != S):
        raise ValueError(f"attention_mask must have shape (batch, {S}), got {tuple(attention_mask.shape)}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != q_len):
        raise ValueError(f"position_ids must have shape (batch, {q_len}), got {tuple(position_ids.shape)}")
    real = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.bool()  # (B, S)
    if position_ids is None and real is not None:
        position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, start_pos:]  # (B, T)
    plain = torch.arange(start_pos, S, device=device)
    if real is None and (position_ids is None or bool((position_ids == plain).all())):
        return None, None
    B = max(position_ids.shape[0], 1 if real is None else real.shape[0])
    if real is None:
        real = torch.ones(B, S, dtype=torch.bool, device=device)
    return position_ids.expand(B, q_len), padding_mask(real, start_pos, q_len)


class StemForCausalLM(PreTrainedModel, GenerationMixin):
    """A ``StemLM`` (attribute ``model``) behind the transformers causal-LM interface.

    Like ``stemlm generate``, its linears compute fp32 CPU products with oneDNN where available
    (``run.matmul=auto``; other devices and dtypes fall back to ATen per call, and the state dict
    is unchanged). ``stemlm.runtime.matmul.use_matmul_backend(model, "aten")`` switches back.
    """

    config_class = StemConfig
    config: StemConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_embeddings.weight"}  # when tie_embeddings
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.model = StemLM(config.model_config())
        apply_matmul(self.model, "auto")
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; a stemlm training run directory loads its newest
        checkpoint (``checkpoint.resolve_checkpoint``), so ``from_pretrained("runs/default")`` works.

        The tables go where ``stemlm.store.Placement`` says: ``placement=Placement(...)``, or its fields
        as keywords, ``tables="host"`` (the tier), ``cache_rows``, ``tables_file``, ``table_dtype``,
        ``prefetch`` ...; ``dtype`` is the compute dtype. Off the model's memory (or re-encoded) the
        model is opened by ``stemlm.store.open_model`` (a disk tier's rows never enter RAM whole) and
        ``model.model.tables`` is the tier's handle (``stats``, ``close`` ...).
        """
        path = Path(str(pretrained_model_name_or_path))
        if path.is_dir() and RunDir.holds_run(path):
            path = resolve_checkpoint(path)
            pretrained_model_name_or_path = str(path)
        placement = _placement_of_kwargs(kwargs)
        if placement is not None:
            return cls._placed(path, placement, kwargs)
        weights = path / WEIGHTS_FILE
        if weights.is_file() and (codec := stored_codec(weights)).quantized:
            raise ValueError(f"{path} stores its STEM tables as {codec.name}, which transformers cannot load: use "
                             f"stemlm.store.open_model, or write fp32 tables with `stemlm convert --ckpt {path} "
                             "--table-dtype fp32 --out DIR`")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _placed(cls, path: Path, placement: Placement, kwargs: dict) -> "StemForCausalLM":
        """The model of checkpoint ``path`` opened by ``open_model`` with its tables placed."""
        unsupported = sorted(k for k, v in kwargs.items() if v not in (None, False, {}) and k not in _HUB_KWARGS)
        if unsupported:
            raise ValueError(f"from_pretrained with a table placement takes no {', '.join(unsupported)}")
        model = open_model(path, placement)
        config = kwargs.get("config") or StemConfig.from_pretrained(str(path))
        with torch.device("meta"):
            hf = cls(config)
        hf.model = model
        apply_matmul(model, "auto")
        return hf.eval()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        init_module_(module, self.model.cfg, hf_init)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok_embeddings

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """transformers' inputs of the next step, plus ``ngram_context`` for a model with n-gram layers:
        the tokens of ``input_ids`` before the ones fed (``ngram_context_of``)."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        fed = inputs.get("input_ids")
        if self.model.ngram_keys is not None and fed is not None and fed.shape[1] < input_ids.shape[1]:
            inputs["ngram_context"] = ngram_context_of(self.model.cfg, input_ids, fed.shape[1],
                                                       kwargs.get("attention_mask"))
        return inputs

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                past_key_values: Cache | None = None, ngram_context: torch.LongTensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits (and ``loss`` when ``labels`` are given) for ``input_ids (B, T)``.

        The KV cache comes as ``cache`` (transformers >= 5.24) or ``past_key_values`` (older 5.x);
        it is returned under the name the installed transformers uses. Positions continue from
        the cache: ``start_pos`` is the number of slots it holds (``cache_position``, when passed,
        must agree). ``attention_mask (B, start_pos + T)`` and ``position_ids (B, T)`` give padded
        rows their own positions and hide the padding (left padding in batched ``generate()``).
        ``ngram_context (B, c)``: for a model with n-gram layers, the tokens just before ``input_ids``
        (``-1`` = none; required once the cache holds positions, ``generate()`` passes it).
        """
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the KV cache as `cache` or as `past_key_values`, not both")
        past_key_values = cache if cache is not None else past_key_values
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("StemForCausalLM needs input_ids: STEM layers look table rows up by token id, "
                             "so inputs_embeds are not supported")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ValueError("StemForCausalLM does not return attentions or per-layer hidden states")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        start_pos = past_key_values.get_seq_length() if past_key_values is not None else 0
        T = input_ids.shape[1]
        _check_cache_position(kwargs.get("cache_position"), start_pos, T)
        positions, mask = positions_and_mask(attention_mask, position_ids, start_pos, T, input_ids.device)
        rows = self._ngram_rows(input_ids, attention_mask, start_pos, ngram_context)
        cache = HFCacheAdapter(past_key_values) if past_key_values is not None else None
        hidden = self.model(input_ids, start_pos=start_pos, cache=cache, return_hidden=True, positions=positions,
                            attn_mask=mask, table_rows=rows)  # (B, T, d)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.lm_head(hidden[:, keep])  # (B, T_keep, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        out_cache = {_OUTPUT_CACHE_FIELD: past_key_values if use_cache else None}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **out_cache)


    def _ngram_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, start_pos: int,
                    context: torch.Tensor | None):
        """The table rows of a model with n-gram layers (keys after ``context``, padding hashed as before
        the start); None for other models (``StemLM.forward`` gathers them itself)."""
        if self.model.ngram_keys is None:
            if context is not None:
                raise ValueError("ngram_context applies to a model with n-gram layers (ffn ngram, ngram_dagger, engram)")
            return None
        kinds = sorted({self.model.cfg.layer_kinds[i] for i in self.model.cfg.ngram_layers})
        if start_pos > 0 and context is None:
            raise ValueError(f"this model has {'/'.join(kinds)} layers, whose keys hash the tokens before input_ids: "
                             "pass ngram_context (B, c), the tokens just before input_ids, when continuing from a cache "
                             "(generate() does)")
        if context is not None and (context.dim() != 2 or context.shape[0] != input_ids.shape[0]):
            raise ValueError(f"ngram_context must have shape (batch={input_ids.shape[0]}, c), got {tuple(context.shape)}")
        real = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            real = attention_mask[:, start_pos:start_pos + input_ids.shape[1]].bool()
        return self.model.table_rows(input_ids, context, real=real)


def ngram_context_of(cfg: ModelConfig, input_ids: torch.Tensor, fed: int,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, reach)`` tokens of ``input_ids (B, S)`` just before its last ``fed`` (those fed to the model),
    ``reach = max(ngram_orders) - 1``: padding (``attention_mask`` 0) and positions before the start are ``-1``."""
    reach = context_reach(cfg)
    end = input_ids.shape[1] - fed
    before = input_ids[:, max(end - reach, 0):end].clone()
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= end:
        before[~attention_mask[:, max(end - reach, 0):end].bool()] = -1
    if before.shape[1] < reach:
        before = torch.cat([before.new_full((before.shape[0], reach - before.shape[1]), -1), before], 1)
    return before


# what the Auto classes pass along to from_pretrained about finding files (a local checkpoint needs none)
_HUB_KWARGS = {"config", "cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
               "trust_remote_code", "adapter_kwargs", "_from_auto", "_commit_hash", "code_revision"}


def _placement_of_kwargs(kwargs: dict) -> Placement | None:
    """The ``Placement`` that ``from_pretrained``'s keywords ask for (taken out of ``kwargs``), or None
    for the default (tables in memory as stored, loaded by transformers)."""
    fields = {f.name for f in dataclasses.fields(Placement)} - {"tier", "device", "dtype"}
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    placement, tables = kwargs.pop("placement", None), kwargs.pop("tables", None)
    if placement is None and tables is None and not given:
        return None
    dtype = kwargs.pop("dtype", None)
    dtype = None if dtype in (None, "auto") else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    placement = placement_of(placement if placement is not None else tables, dtype=dtype, **given)
    return None if placement == Placement() else placement


# transformers 5.24 renamed the output's `past_key_values` field to `cache` (the old name is kept for
# a while as an alias); use whichever field the installed release declares.
_OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _check_cache_position(cache_position, start_pos: int, q_len: int) -> None:
    """Refuse cache slots other than ``start_pos, ..., start_pos + q_len - 1`` (the cache only appends)."""
    if cache_position is None:
        return
    expected = torch.arange(start_pos, start_pos + q_len, device=cache_position.device)
    if cache_position.shape[-1] != q_len or not bool((cache_position == expected).all()):
        raise ValueError(f"cache_position must be consecutive slots starting at {start_pos} (the cache length)")


def register() -> None:
    """Register ``StemConfig``/``StemForCausalLM`` with ``AutoConfig``/``AutoModelForCausalLM``
    (idempotent). Importing this module calls it: ``import stemlm.interop.hf`` is how a user opts in."""
    AutoConfig.register(StemConfig.model_type, StemConfig, exist_ok=True)
    AutoModelForCausalLM.register(StemConfig, StemForCausalLM, exist_ok=True)


register()
