"""Training checkpoints: model files + optimizer state + trainer state, written atomically.

``run_dir/checkpoints/step_XXXXXXXX/`` holds

* ``config.json`` + ``model.safetensors``: a normal stemlm checkpoint (``stemlm.store.open_model`` loads it);
* ``optimizer.safetensors`` (all optimizer tensors) + ``optimizer.json`` (groups, scalars);
* ``trainer_state.json``: step (= data position), tokens/FLOPs seen, spike counter, RNG states,
  the hash of the resume-checked config sections;
* ``config.yaml`` (the run's ``TrainConfig``) and the tokenizer files of the data dir;
* ``manifest.json``: size and sha256 of every other file (``stemlm.checkpoint.integrity``), written last.

Everything loads without executing code (safetensors and json). NaN/inf weights or optimizer
state are never written; ``resume_checkpoint`` picks the newest checkpoint whose files match their
manifest and moves damaged newer ones aside; rotation never deletes the checkpoint being resumed.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..checkpoint import rundir
from ..checkpoint.directory import CheckpointError, copy_tokenizer_files, read_json, save_pause, write_model_files
from ..checkpoint.integrity import check_finite, write_manifest
from ..checkpoint.rundir import CheckpointWarning, RunDir  # noqa: F401  (CheckpointWarning: re-exported)
from ..runtime.files import atomic_directory, remove_directory
from .sparse_adam import SparseRowAdamW

OPT_TENSORS, OPT_META = "optimizer.safetensors", "optimizer.json"
TRAINER_STATE, RUN_CONFIG = rundir.TRAINER_STATE, rundir.TRAIN_CONFIG


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written (``RunDir.checkpoint``)."""
    return RunDir(run_dir).checkpoint(step)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete training checkpoints of a run, oldest first (``RunDir.checkpoints``)."""
    return RunDir(run_dir).checkpoints()


@dataclass
class SaveState:
    """What a checkpoint is written from: a model (``state_dict``), the backbone optimizer and the table
    optimizer (``state_dict``s), and the trainer's counters and RNG (``Trainer.gathered_state``)."""

    model: object
    opt: object
    table_opt: object
    trainer: dict


def save_checkpoint(run_dir: Path, step: int, model, opt, table_opt: SparseRowAdamW | None, trainer_state: dict,
                    config_yaml: str, tokenizer_dir: Path | None, keep_last: int) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep_last``.

    Raises ``CheckpointError`` (and writes nothing) when the weights or optimizer state hold NaN/inf.
    The rotation never deletes the checkpoint just written (its manifest hashes the bytes on disk:
    it is the last verified one), even when checkpoints of later steps exist.
    """
    final = checkpoint_dir(run_dir, step)
    tensors, meta = optimizer_state(opt, table_opt)
    check_finite(tensors.items(), f"the optimizer state at step {step}", "checkpoint not written (training diverged)")
    with atomic_directory(final) as tmp:
        write_model_files(model, tmp)
        save_pause()
        save_file(tensors, str(tmp / OPT_TENSORS))
        (tmp / OPT_META).write_text(json.dumps(meta))
        save_pause()
        (tmp / RUN_CONFIG).write_text(config_yaml)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state))
        write_manifest(tmp)
        save_pause()
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old != final:
            remove_directory(old)
    return final


def resume_checkpoint(run_dir: Path, verify: bool = True) -> Path | None:
    """The newest checkpoint of a run to resume from, or None when there is none: ``RunDir.newest_good``,
    which moves damaged checkpoints aside to ``checkpoints/corrupt-step_XXXXXXXX`` (so neither a later
    resume nor the rotation mistakes them for good ones) and raises ``CheckpointError`` when
    checkpoints exist but none verifies."""
    return RunDir(run_dir).newest_good(verify, move_aside=True)


def optimizer_state(opt: torch.optim.Optimizer, table_opt: SparseRowAdamW | None) -> tuple[dict, dict]:
    """Flatten the torch and sparse optimizer states into ``(tensors, json meta)``."""
    sd = opt.state_dict()
    tensors, keys = {}, {}
    for idx, st in sd["state"].items():
        keys[str(idx)] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"dense.{idx}.{k}"] = v.detach().to("cpu").contiguous()
            keys[str(idx)][k] = None if isinstance(v, torch.Tensor) else v
    meta = {"param_groups": sd["param_groups"], "state_keys": keys, "sparse": None}
    if table_opt is not None:
        t_tensors, meta["sparse"] = table_opt.state_dict()
        tensors.update({f"tables.{k}": v.detach().to("cpu").contiguous() for k, v in t_tensors.items()})
    return tensors, meta


def load_optimizer_state(ckpt: Path, opt: torch.optim.Optimizer, table_opt: SparseRowAdamW | None,
                         table_rows=None) -> None:
    """Restore what ``optimizer_state`` wrote into freshly built optimizers of the same run.

    ``table_rows`` (optional) maps each stored per-row table tensor to the rows this process keeps
    (a distributed rank's shard).
    """
    try:
        tensors = load_file(str(Path(ckpt) / OPT_TENSORS))
        meta = json.loads((Path(ckpt) / OPT_META).read_text())
        state = {int(idx): {k: tensors[f"dense.{idx}.{k}"] if v is None else v for k, v in keys.items()}
                 for idx, keys in meta["state_keys"].items()}
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"corrupt optimizer state in {ckpt}: {type(e).__name__}: {e}") from None
    check_finite(tensors.items(), f"{Path(ckpt) / OPT_TENSORS}", "refusing to resume a diverged run")
    # Hyperparameters come from the optimizers as built from the config (they differ from the
    # checkpoint's only when a change was allowed on resume); moments and counters from the checkpoint.
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    table_hyper = _table_hyperparameters(table_opt)
    try:
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt}: optimizer state does not match the model: {e}") from None
    for group, built in zip(opt.param_groups, groups):
        group.update(built)
    if (meta["sparse"] is None) != (table_opt is None):
        raise CheckpointError(f"{ckpt}: table optimizer kind differs from the checkpoint's")
    if table_opt is not None:
        prefix = "tables."
        select = table_rows or (lambda t: t)
        try:
            table_opt.load_state_dict({k[len(prefix):]: select(v) for k, v in tensors.items() if k.startswith(prefix)},
                                      meta["sparse"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"corrupt table optimizer state in {ckpt}: {type(e).__name__}: {e}") from None
        for name, value in table_hyper.items():
            setattr(table_opt, name, value)


def _table_hyperparameters(table_opt: SparseRowAdamW | None) -> dict:
    names = ("lr", "betas", "eps", "weight_decay", "decay_untouched")
    return {} if table_opt is None else {n: getattr(table_opt, n) for n in names}


# -- RNG -----------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """torch (CPU and CUDA), numpy and python RNG states as json-able values."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def read_trainer_state(ckpt: Path) -> dict:
    """``trainer_state.json`` of a training checkpoint (clear error if missing or corrupt)."""
    return read_json(Path(ckpt) / TRAINER_STATE, f"{ckpt} is not a training checkpoint (no {TRAINER_STATE})")
