"""Model checkpoints: a Hugging Face-style directory written atomically, loaded without executing code.

Layout of a checkpoint directory (also loadable by ``AutoModelForCausalLM.from_pretrained`` after
``import stemlm.interop.hf``)::

    config.json          {"model_type": "stemlm", "architectures": [...], <ModelConfig fields>}
    model.safetensors    keys "model.<StemLM parameter name>" (a tied LM head is not stored); quantized
                         tables add "model.tables.<layer>.scale" and name their codec in the metadata
    tokenizer.json ...   optional, copied in by the caller

A training run directory holds ``checkpoints/step_XXXXXXXX/`` (``rundir.RunDir``, the one place that
knows that layout); ``resolve_checkpoint`` picks the newest one whose files verify, so every command
taking ``--ckpt`` accepts a run or a checkpoint.

Every writer also puts a ``manifest.json`` of checksums into the directory (``stemlm.checkpoint.integrity``),
refuses to write NaN/inf weights, and ``load_in_memory`` (the in-memory tier of ``stemlm.store.open_model``,
the one public loader) verifies the checksums (``verify=False`` skips that) and refuses NaN/inf
weights with a one-line ``CheckpointError``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open

from ..config import ConfigError, ModelConfig
from .integrity import CheckpointError, check_finite, verify_checkpoint, write_manifest
from .rundir import CONFIG_FILE, resolve_checkpoint  # noqa: F401  (the one rule, re-exported)
from ..model.decoder import StemLM
from ..model.quant import RowCodec, codec_of, quantized_tables
from ..runtime.files import atomic_directory, atomic_write_text
from .safetensors_io import write_safetensors

WEIGHTS_FILE, KEY_PREFIX = "model.safetensors", "model."
# Test-only: seconds to sleep between the files of a checkpoint save, so a test can kill a process
# inside the save window reliably (benchmarks/robustness_kill_resume.py). Never set it otherwise.
SAVE_PAUSE_ENV = "STEMLM_TEST_SAVE_PAUSE"


def save_pause() -> None:
    """The test-only pause between checkpoint files (``SAVE_PAUSE_ENV``); nothing when unset."""
    seconds = float(os.environ.get(SAVE_PAUSE_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The ``config.json`` content for a model config."""
    return {"model_type": "stemlm", "architectures": ["StemForCausalLM"], **cfg.to_dict()}


def model_state_for_save(model: StemLM) -> dict[str, torch.Tensor]:
    """State dict with the ``model.`` prefix, tied LM head dropped, tensors contiguous on CPU."""
    state = {}
    for name, tensor in model.state_dict().items():
        if model.cfg.tie_embeddings and name == "lm_head.weight":
            continue
        state[KEY_PREFIX + name] = tensor.detach().to("cpu").contiguous()
    return state


def write_model_files(model: StemLM, directory: Path, extra_config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` into an existing directory (not atomic).

    Refuses (``CheckpointError``) a model holding NaN/inf weights: a diverged model is never saved.
    """
    state = model_state_for_save(model)
    check_finite(state.items(), "the model to save", "not saved (the model diverged)")
    (directory / CONFIG_FILE).write_text(json.dumps({**hf_config_dict(model.cfg), **(extra_config or {})}, indent=2))
    metadata = {"format": "pt", **codec_of(model.tables).metadata()}
    # streamed tensor by tensor, 64 MB at a time: no second copy of the weights in memory
    write_safetensors(directory / WEIGHTS_FILE, [(k, t.dtype, tuple(t.shape), _rows_of(t)) for k, t in state.items()],
                      metadata=metadata)


def _rows_of(t: torch.Tensor):
    if t.dim() == 0:
        raise ValueError("write_model_files streams tensors by rows; a 0-dim weight cannot be written")
    return lambda a, b: t[a:b]


def save_model(model: StemLM, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Atomically write a checkpoint directory (weights, config, optional tokenizer files, checksums)."""
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_model_files(model, tmp)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        write_manifest(tmp)
    return out_dir


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` ...) from ``src``."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def write_run_config(run_dir: str | os.PathLike, cfg: ModelConfig) -> Path:
    """Write ``<run_dir>/config.json`` (atomically), so that ``AutoConfig`` and
    ``AutoModelForCausalLM.from_pretrained(run_dir)`` recognise a training run directory; the
    model then loads from the run's newest checkpoint (``resolve_checkpoint``)."""
    file = Path(run_dir) / CONFIG_FILE
    atomic_write_text(file, json.dumps(hf_config_dict(cfg), indent=2))
    return file


def read_json(path: str | os.PathLike, missing: str | None = None) -> dict:
    """A JSON file of a checkpoint; ``CheckpointError`` when it is absent (``missing``, else "missing
    PATH") or not valid JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(missing or f"missing {path}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {path}: {e}") from None


def read_config_extras(ckpt_dir: str | os.PathLike) -> dict:
    """The entries of a checkpoint's ``config.json`` beyond its model config: a converted model's
    generation token ids (``eos_token_id`` ...) and its provenance (``stemlm_conversion``)."""
    data = read_json(Path(ckpt_dir) / CONFIG_FILE)
    return {k: v for k, v in data.items() if k not in hf_config_dict(read_config(ckpt_dir))}


def read_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` stored in a checkpoint directory."""
    file = Path(ckpt_dir) / CONFIG_FILE
    data = read_json(Path(ckpt_dir) / CONFIG_FILE)
    if data.get("model_type") != "stemlm":
        raise CheckpointError(f"{file} has model_type={data.get('model_type')!r}, expected 'stemlm' "
                              "(convert a Llama checkpoint with `stemlm convert --from-hf`)")
    fields = {k: v for k, v in data.items() if k in ModelConfig.__dataclass_fields__ and ModelConfig.__dataclass_fields__[k].init}
    try:
        return ModelConfig.from_dict(fields)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None


def stored_codec(weights_file: str | os.PathLike) -> RowCodec:
    """How a checkpoint's ``model.safetensors`` stores its tables (``CheckpointError`` if unreadable)."""
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            return RowCodec.from_metadata(f.metadata())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt weights file {weights_file}: {e}") from None


def load_state_into(model: StemLM, weights_file: str | os.PathLike, skip_tables: bool = False) -> None:
    """Load a ``model.safetensors`` into ``model`` with key and shape checks (clear errors)."""
    weights_file = Path(weights_file)
    if not weights_file.exists():
        raise CheckpointError(f"missing weights file {weights_file}")
    expected = {KEY_PREFIX + k: v for k, v in model.state_dict().items()
                if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    if skip_tables:
        expected = {k: v for k, v in expected.items() if not k.startswith(KEY_PREFIX + "tables.")}
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            missing = sorted(set(expected) - keys)
            if missing:
                raise CheckpointError(f"{weights_file} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
            extra = sorted(k for k in keys - set(expected) if not (skip_tables and k.startswith(KEY_PREFIX + "tables.")))
            if extra:
                raise CheckpointError(f"{weights_file} has unexpected tensor {extra[0]!r} for this config")
            loaded = {}
            for key, ref in expected.items():
                t = f.get_tensor(key)
                if t.shape != ref.shape:
                    raise CheckpointError(f"{weights_file}: {key} has shape {tuple(t.shape)}, model expects {tuple(ref.shape)}")
                loaded[key[len(KEY_PREFIX):]] = t
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"corrupt weights file {weights_file}: {e}") from None
    check_finite(loaded.items(), str(weights_file), "refusing to load a diverged model; use an earlier checkpoint")
    model.load_state_dict(loaded, strict=False, assign=False)


def load_in_memory(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               skip_tables: bool = False, verify: bool = True) -> StemLM:
    """Load a checkpoint (or a run's newest checkpoint) into a new ``StemLM``.

    ``skip_tables`` leaves the tables uninitialised, for callers that serve them from another
    tier (host, disk) straight from the checkpoint file. ``verify`` first checks the files against
    the checkpoint's checksum manifest (``stemlm.checkpoint.integrity``).
    """
    ckpt = resolve_checkpoint(path, verify)
    if verify:
        verify_checkpoint(ckpt)
    cfg = read_config(ckpt)
    model = StemLM(cfg)
    if cfg.table_layers and not skip_tables and (ckpt / WEIGHTS_FILE).exists():
        codec = stored_codec(ckpt / WEIGHTS_FILE)
        if codec.quantized:  # tables stored quantized load as QuantizedTables (stemlm.model.quant)
            model.tables = quantized_tables({i: cfg.table_rows(i) for i in cfg.table_layers}, cfg.d_ff, codec)
    load_state_into(model, ckpt / WEIGHTS_FILE, skip_tables=skip_tables)
    model.eval()
    return model.to(device=device, dtype=dtype) if dtype else model.to(device)


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> StemLM:
    """A StemLM holding exactly ``state``, tensors shared (built on the meta device: no throw-away
    init); a tied LM head may be absent from ``state``."""
    with torch.device("meta"):
        model = StemLM(cfg)
    if cfg.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        raise ValueError(f"converted weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    return model.eval()
