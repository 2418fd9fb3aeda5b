"""Training configuration: one nested dataclass, resolved as defaults -> YAML -> ``section.field=value``.

Sections: ``model`` (a preset name plus ``ModelConfig`` overrides), ``data``, ``optim``, ``run``.
Every field carries a ``help`` string in its metadata; ``describe_fields()`` turns them into the
``--help`` text of ``stemlm train``, so the documentation cannot drift from the code.

The dataclass defaults are the default run of ``stemlm train`` with no arguments (a small STEM
model on the default corpus, a few minutes on 2 CPU cores). ``train_defaults("debug")`` gives the
seconds-long debug run used by the tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import yaml

from ..layered_config import dataclass_to_dict, resolve_config, yaml_mapping
from ..config import ConfigError, ModelConfig
from ..fields import field_types
from ..insert.anneal import ANNEAL_MODES
from ..kernels import TABLE_KERNELS
from ..runtime.matmul import BACKENDS as MATMUL_BACKENDS
from ..presets import PRESETS, model_config
from ..store.tiers import TIER_CLASSES

STAGES = ("pretrain", "midtrain", "context_extend")
DECAYS = ("cosine", "linear")
TABLE_OPTIMIZERS = ("sparse", "dense")
TABLE_PATHS = ("auto", "fused", "reference")
STEP_GRAPH_MODES = ("eager", "static", "graph", "auto")  # run.step_graph (stemlm.train.captured)
DTYPES = ("float32", "bfloat16")
# Default table lr = TABLE_LR_SCALE x lr: a table row is updated only in the steps its token occurs
# (the backbone in every step); the scale was chosen on the default run (docs/training.md).
TABLE_LR_SCALE = 10.0
# Sections whose change makes a resumed run a different run (run.* may change, e.g. run.steps).
RESUME_CHECKED = ("model", "data", "optim")
# Of those, the sections whose fields may change on resume when named (``allow_changes``); model
# fields fix the tensor shapes and the meaning of the weights: a new run with run.init_from changes them.
RESUME_ALLOWED = ("data", "optim")


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


def _model_section_cls():
    """``ModelSection``: ``preset`` plus every ``ModelConfig`` constructor field, default None."""
    fields = [("preset", str, _f("tiny", f"model shape preset: {', '.join(PRESETS)}"))]
    types = field_types(ModelConfig)  # model.* values are type-checked as ModelConfig declares them
    for f in dataclasses.fields(ModelConfig):
        if f.init:
            fields.append((f.name, Optional[types[f.name]], _f(None, f"ModelConfig.{f.name} (None = preset / ModelConfig default)")))

    def build(self, vocab_size: int | None = None) -> ModelConfig:
        """The ``ModelConfig``: preset, then the non-None overrides; vocab from the data if unset."""
        overrides = {k: v for k, v in dataclass_to_dict(self).items() if k != "preset" and v is not None}
        if "vocab_size" not in overrides and vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return model_config(self.preset, **overrides)

    def overrides(self) -> dict:
        """The explicitly set ModelConfig fields (used on top of an ``init_from`` checkpoint)."""
        return {k: v for k, v in dataclass_to_dict(self).items() if k != "preset" and v is not None}

    def check(self):
        if self.preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")

    return dataclasses.make_dataclass(
        "ModelSection", fields,
        namespace={"__doc__": "Model section: a preset plus ModelConfig field overrides (None = keep).",
                   "__post_init__": check, "build": build, "overrides": overrides, "__module__": __name__})


ModelSection = _model_section_cls()


@dataclass
class DataSection:
    """Where the tokens come from and how batches are cut."""

    dir: Optional[str] = _f(None, "prepared data dir (stemlm data); None = default corpus, built on first use")
    batch_size: int = _f(16, "sequences per micro-batch")
    seq_len: int = _f(128, "tokens per sequence")
    doc_masking: bool = _f(False, "mask attention across document boundaries inside a sequence")
    seed: int = _f(0, "seed of the batch offsets (get_batch is a pure function of seed and step)")

    def __post_init__(self):
        _positive(self, "data", ("batch_size", "seq_len"))
        _non_negative(self, "data", ("seed",))


@dataclass
class OptimSection:
    """AdamW for the backbone, a table optimizer for the STEM tables, a warmup + decay schedule."""

    lr: float = _f(3e-3, "peak learning rate of the backbone")
    table_lr: Optional[float] = _f(None, f"peak learning rate of the STEM tables (None = {TABLE_LR_SCALE:g} x lr, see docs/training.md)")
    embed_lr: Optional[float] = _f(None, "peak learning rate of the input embedding (None = lr; 0 = frozen at its init; with tied embeddings also the LM head's)")
    betas: tuple[float, ...] = _f((0.9, 0.95), "AdamW betas (beta1, beta2) for backbone and tables")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay of backbone matrices (norm gains are never decayed)")
    table_weight_decay: float = _f(0.0, "decoupled weight decay of the STEM tables (see docs/training.md)")
    warmup_ratio: float = _f(0.05, "fraction of run.steps with linear warmup from 0 to the peak")
    decay: str = _f("cosine", f"decay after warmup: {', '.join(DECAYS)}")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak")
    grad_clip: float = _f(1.0, "clip the global gradient norm (tables included); 0 disables")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    table_optimizer: str = _f("sparse", f"{' | '.join(TABLE_OPTIMIZERS)}: row-sparse AdamW, or torch AdamW on whole tables")
    decay_untouched: str = _f("lazy", "sparse tables: 'lazy' (decay touched rows only) or 'catchup' (apply missed decay on next touch)")
    table_compile: bool = _f(False, "sparse tables: torch.compile the row update (one fused kernel; compiled at the "
                                    "first step, eager with a warning if compiling fails; the fused path on CUDA always compiles)")

    def __post_init__(self):
        if isinstance(self.betas, (list, tuple)) and len(self.betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in self.betas):
            self.betas = (float(self.betas[0]), float(self.betas[1]))
        else:
            raise ConfigError(f"optim.betas must be two numbers, got {self.betas!r}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must lie in [0, 1), got {self.betas}")
        _choice(self.decay, "optim.decay", DECAYS)
        _choice(self.table_optimizer, "optim.table_optimizer", TABLE_OPTIMIZERS)
        _choice(self.decay_untouched, "optim.decay_untouched", ("lazy", "catchup"))
        _positive(self, "optim", ("lr", "grad_accum", "eps"))
        if self.table_lr is not None and self.table_lr <= 0:
            raise ConfigError(f"optim.table_lr must be positive, got {self.table_lr}")
        if self.embed_lr is not None and (isinstance(self.embed_lr, bool) or self.embed_lr < 0):
            raise ConfigError(f"optim.embed_lr must be >= 0 (0 = frozen), got {self.embed_lr}")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optim.warmup_ratio must be in [0, 1) and optim.min_lr_ratio in [0, 1]")
        if self.weight_decay < 0 or self.table_weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("optim.weight_decay, optim.table_weight_decay and optim.grad_clip must be >= 0")

    @property
    def embed_peak_lr(self) -> float:
        return self.lr if self.embed_lr is None else float(self.embed_lr)

    @property
    def table_peak_lr(self) -> float:
        return TABLE_LR_SCALE * self.lr if self.table_lr is None else self.table_lr


@dataclass
class RunSection:
    """Length, output, checkpoints, evaluation, logging and numerics of a run."""

    steps: int = _f(300, "optimizer steps")
    out: str = _f("runs/default", "run directory (metrics, plots, checkpoints/step_XXXXXXXX)")
    ckpt_every: int = _f(100, "write a checkpoint every N steps (and always at the end)")
    keep_last: int = _f(2, "checkpoints kept on disk (older ones are deleted)")
    eval_every: int = _f(100, "validation loss every N steps (and at the end); 0 = only at the end")
    eval_batches: int = _f(8, "validation batches per evaluation")
    log_every: int = _f(10, "progress-bar refresh every N steps (metrics.jsonl gets every step)")
    seed: int = _f(0, "seed of the model initialisation")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = _f("float32", f"compute dtype: {' | '.join(DTYPES)} (bfloat16 = autocast, fp32 weights)")
    compile: Union[bool, str] = _f("auto", "torch.compile each transformer block (lookups and loss stay eager): true | false | "
                                   "auto (true on CUDA unless run.anneal is on, false on the CPU)")
    matmul: str = _f("auto", "GEMMs of linears and loss: auto (on a CPU in fp32, the faster of aten and onednn at "
                     "this run's shapes, timed once per machine and cached: stemlm/runtime/matmul_probe.py; aten "
                     "elsewhere) | aten (PyTorch's own) | onednn (oneDNN kernels, CPU only)")
    keep_freed_memory: bool = _f(True, "CPU: keep freed memory in the glibc heap between steps instead of returning "
                                 "it to the OS (no page faults on the next step; RSS stays at its peak)")
    stage: str = _f("pretrain", f"{' | '.join(STAGES)}; midtrain and context_extend need init_from")
    init_from: Optional[str] = _f(None, "checkpoint (or run dir) whose weights start the run (midtrain, context_extend)")
    peak_flops: Optional[float] = _f(None, "peak FLOP/s for MFU; None = the compute dtype's peak: bf16 on a known GPU its "
                                  "spec-sheet dense bf16 peak, else a bf16 matmul probe (GPU or CPU); fp32 a fp32 "
                                  "matmul probe")
    spike_factor: float = _f(3.0, "a step is a loss spike when loss > spike_factor x running median")
    spike_window: int = _f(50, "steps in the running median of the spike detector")
    progress: bool = _f(True, "show a tqdm progress bar")
    plots: bool = _f(True, "write loss-vs-tokens and loss-vs-FLOPs PNGs at the end")
    parallel: str = _f("ddp", "under torchrun: backbone wrapper ddp | fsdp (FSDP2 fully_shard); tables are always sharded by row")
    verify_checkpoints: bool = _f(True, "on resume, check checkpoint checksums and fall back to the newest intact one")
    anneal: str = _f("off", "gradual insertion of a stem_dagger model: off | dagger (tables start at zero) | blend "
                     "(tables start calibrated); the up-projection is annealed out (docs/insertion.md)")
    anneal_ratio: float = _f(0.5, "fraction of run.steps over which run.anneal takes the up-projection from 1 to 0")
    distill: Optional[str] = _f(None, "teacher checkpoint (or run dir), e.g. the dense model a STEM model was converted "
                                "from: the loss adds the KL to its next-token distribution (docs/insertion.md)")
    distill_weight: float = _f(0.5, "run.distill: weight w of the KL; loss = (1 - w) CE + w T^2 KL")
    distill_temperature: float = _f(1.0, "run.distill: temperature T of both distributions")
    distill_top_k: int = _f(0, "run.distill: 0 = the teacher's full distribution, k = its k most likely tokens (renormalised)")
    distill_schedule: str = _f("constant", "run.distill: constant (w every step) | linear (w down to 0 over run.steps: the "
                                           "teacher guides the start, the data alone the end)")
    distill_cache: bool = _f(False, "run.distill: write the teacher's top-k of every micro-batch to <run.out>/distill_topk "
                                    "before training (needs run.distill_top_k > 0), so training holds only the student")
    table_path: str = _f("auto", "sparse tables: fused (all tables stacked, one gather and one row update per step, no host "
                                 "syncs; docs/gpu.md) | reference (one table at a time) | auto (fused on CUDA, reference on CPU); "
                                 "both compute the same steps, so it may change on resume")
    step_graph: str = _f("auto", "the whole step (micro-batches, clipping, both optimizers): eager (the loop as it is) | "
                         "static (on fixed buffers, run eagerly, any device) | graph (on fixed buffers, captured once as a "
                         "CUDA graph and replayed; fused device tables, tables in the dense optimizer, or host tables through a "
                         "fixed device slab (run.table_slab_rows), "
                         "no anneal, not distributed; a diverged step is reported after its update; docs/gpu.md) | "
                         "auto (graph on CUDA where the step allows it, eager elsewhere)")
    table_kernels: str = _f("auto", "fused table path: triton (the row gather fused into the STEM product, a segmented-sum "
                            "backward, a one-pass row AdamW; stemlm/kernels, docs/gpu.md) | triton-gemm (the same work in the epilogues of "
                            "the gate's GEMM and of the down projection's backward GEMM; slower than triton on an H200) | torch | auto (triton on CUDA "
                            "when it imports, torch elsewhere; triton on the CPU runs under the Triton interpreter, slowly)")
    table_cache_rows: int = _f(0, "run.tables=host: rows per table kept on the accelerator in every step's window (the "
                               "most frequent ids of the training data; they never cross the bus again); size it with "
                               "stemlm plan --train --cache-frac")
    table_slab_rows: int = _f(0, "run.tables=host with run.step_graph=static or graph: slots of the fixed device slab the "
                              "rows train through (SlabTables, docs/gpu.md); 0 = the keys of two steps plus the hot-row "
                              "cache; at least one step's distinct keys plus the cache")
    tables: str = _f("device", "where the STEM tables live while training: device | host | disk (or any tier registered in "
                     "stemlm.store.tiers); host on the fused path (auto picks it) = the rows and their optimizer state "
                     "in pinned host RAM, the accelerator holds those of the current and next step (docs/gpu.md); with "
                     "run.table_path=reference (disk: always) the tier's own TableStore serves the rows, as in stemlm "
                     "serve, and the row-sparse optimizer writes them back (disk: <run.out>/tables.safetensors)")

    def compile_blocks(self, device) -> bool:
        """Whether to compile the blocks on ``device``: ``run.compile``, with ``auto`` = on CUDA (not
        under ``run.anneal``, which changes the layers' scales every step)."""
        if self.compile == "auto":
            return torch.device(device).type == "cuda" and self.anneal == "off"
        return bool(self.compile)

    def __post_init__(self):
        _positive(self, "run", ("steps", "ckpt_every", "keep_last", "eval_batches", "log_every", "spike_window"))
        _choice(self.dtype, "run.dtype", DTYPES)
        _choice(self.stage, "run.stage", STAGES)
        _choice(self.parallel, "run.parallel", ("ddp", "fsdp"))
        _choice(self.matmul, "run.matmul", MATMUL_BACKENDS)
        _choice(self.anneal, "run.anneal", ANNEAL_MODES)
        if not 0 < self.anneal_ratio <= 1:
            raise ConfigError(f"run.anneal_ratio must be in (0, 1], got {self.anneal_ratio!r}")
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ConfigError(f"run.compile must be true, false or auto, got {self.compile!r}")
        if self.anneal != "off" and self.compile is True:
            raise ConfigError("run.anneal changes the layers' scales every step; it cannot be combined with run.compile")
        if self.distill is not None:
            from .distill import distill_config
            try:
                distill_config(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.distill_cache and not self.distill_top_k:
                raise ConfigError("run.distill_cache stores the teacher's top-k: set run.distill_top_k > 0")
        _choice(self.tables, "run.tables", tuple(TIER_CLASSES))
        _choice(self.table_path, "run.table_path", TABLE_PATHS)
        _choice(self.table_kernels, "run.table_kernels", TABLE_KERNELS)
        _choice(self.step_graph, "run.step_graph", STEP_GRAPH_MODES)
        _non_negative(self, "run", ("table_cache_rows", "table_slab_rows"))
        if self.table_slab_rows and not (self.tables == "host" and self.step_graph in ("static", "graph")):
            raise ConfigError("run.table_slab_rows sizes the device slab of host-RAM tables under a fixed-buffer step: "
                              "it needs run.tables=host and run.step_graph=static or graph")
        if self.table_cache_rows and self.tables != "host":
            raise ConfigError("run.table_cache_rows keeps host-RAM rows on the accelerator: it needs run.tables=host")
        _positive(self, "run", ("spike_factor",) + (("peak_flops",) if self.peak_flops is not None else ()))
        _non_negative(self, "run", ("eval_every", "seed"))
        if not self.out.strip():
            raise ConfigError("run.out must name a directory, got ''")
        if self.stage != "pretrain" and not self.init_from:
            raise ConfigError(f"run.stage={self.stage} needs run.init_from (a checkpoint to continue from)")


@dataclass
class TrainConfig:
    """Everything a training run needs; written to ``<run.out>/config.yaml``."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self):
        if not self.run.init_from:  # a bad model.* value fails here, not after the data is prepared
            try:
                self.model.build()
            except ConfigError as e:
                raise ConfigError(f"model: {e}") from None

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def resume_hash(self) -> str:
        """sha256 of the sections that must not change on resume."""
        data = {k: v for k, v in self.to_dict().items() if k in RESUME_CHECKED}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# Recommended settings per model preset; the CLI resolves defaults -> YAML -> overrides on top.
PRESET_DEFAULTS: dict[str, dict] = {
    "debug": {"data": {"batch_size": 4, "seq_len": 32},
              "run": {"steps": 20, "ckpt_every": 10, "eval_every": 10, "eval_batches": 2, "log_every": 5}},
    "tiny": {},
}


def train_defaults(preset: str | None = None) -> dict:
    """Defaults dict for ``resolve_config``: the dataclass defaults plus the preset's run settings."""
    preset = preset or ModelSection().preset
    base = {"model": {"preset": preset}}
    extra = PRESET_DEFAULTS.get(preset, {})
    return {k: {**base.get(k, {}), **extra.get(k, {})} for k in set(base) | set(extra)}


def load_train_config(preset: str | None = None, yaml_file: str | None = None,
                      overrides: list[str] | None = None) -> TrainConfig:
    """Resolve a ``TrainConfig``: preset defaults, then a YAML file, then dotted overrides."""
    return resolve_config(TrainConfig, train_defaults(preset), yaml_file, overrides)


def config_from_yaml_text(text: str) -> TrainConfig:
    """A ``TrainConfig`` from the ``config.yaml`` written into a run or checkpoint."""
    return resolve_config(TrainConfig, yaml_mapping(text, "a run's config.yaml"))


def config_differences(old: TrainConfig, new: TrainConfig) -> dict[str, tuple]:
    """``{dotted name: (old value, new value)}`` of the resume-checked fields that differ."""
    out = {}
    a, b = old.to_dict(), new.to_dict()
    for section in RESUME_CHECKED:
        for key in sorted(set(a[section]) | set(b[section])):
            if a[section].get(key) != b[section].get(key):
                out[f"{section}.{key}"] = (a[section].get(key), b[section].get(key))
    return out


def resume_changes(old: TrainConfig, new: TrainConfig, allowed: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """The changes of a resumed run, ``[{"field", "old", "new"}]``; ``ConfigError`` unless each is named.

    ``allowed`` names the resume-checked fields that may differ (``data.*`` and ``optim.*`` only);
    a named field that did not change is accepted (a repeated command stays valid).
    """
    fields = {f"{s}.{f.name}" for s in RESUME_CHECKED for f in dataclasses.fields(type(getattr(new, s)))}
    for name in allowed:
        if name not in fields:
            raise ConfigError(f"--allow-change {name}: not a data.*, optim.* or model.* field")
        if name.split(".")[0] not in RESUME_ALLOWED:
            raise ConfigError(f"--allow-change {name}: model.* fields cannot change on resume; start a new run.out "
                              "with run.init_from=<this run> instead")
    diffs = config_differences(old, new)
    unnamed = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items() if k not in allowed]
    if unnamed:
        names = " ".join(f"--allow-change {k}" for k in diffs if k not in allowed)
        raise ConfigError(f"config changed on resume ({'; '.join(unnamed)}); only run.* fields may change unless "
                          f"named ({names}), else undo the change or start a new run.out")
    return [{"field": k, "old": a, "new": b} for k, (a, b) in diffs.items()]


def describe_fields() -> str:
    """Every configurable field with its default and help, grouped by section (for ``--help``)."""
    lines = []
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        lines.append(f"{section.name}.*  ({cls.__doc__.strip().splitlines()[0]})")
        for f in dataclasses.fields(cls):
            if cls is ModelSection and f.name != "preset":
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"  {f'{section.name}.{f.name}={default}':<28} {f.metadata.get('help', '')}")
        if cls is ModelSection:
            names = [f.name for f in dataclasses.fields(ModelConfig) if f.init]
            lines.append(f"  {'model.FIELD=VALUE':<28} override a ModelConfig field of the preset: {', '.join(names)}")
    return "\n".join(lines)


def _positive(obj, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{section}.{name} must be a positive number, got {value!r}")


def _non_negative(obj, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ConfigError(f"{section}.{name} must be >= 0, got {value!r}")


def _choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(choices)}")
