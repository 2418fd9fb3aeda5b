"""Study specifications: a YAML file in ``studies/`` expanded into an ordered list of runs.

A spec names backbone sizes, a shared token budget and four training stages (``compare``,
``stability``, ``context``, ``midtrain``) plus the optional ``eval`` stage; ``plan(spec)``
turns it into ``RunSpec``s, parents before children. Every run has a ``spec_hash`` over all
that determines its result (its training overrides, measures, the hash of the run it continues
and ``STUDY_VERSION``): a run is finished when its result JSON carries the same hash.

Variants are named ``KIND`` or ``KIND-PLACEMENT`` (``dense``, ``stem-1/3``, ``stem_dagger-1/3``,
``hash_moe-1/3``), plus ``dense-wide``: a dense model whose FFN width is chosen so that its total
parameters match ``stem-1/3`` of the same size (``stemlm.study.variants``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError

STUDY_VERSION = 1
STAGES = ("compare", "stability", "context", "midtrain")
SPEC_KEYS = {"name", "description", "skipped", "data_dir", "train", "sizes", "budget", "eval", "timing", *STAGES}
STUDIES_DIR = Path(__file__).resolve().parents[2] / "studies"


@dataclass
class RunSpec:
    """One training run of a study: what to train, from what, and what to measure afterwards."""

    name: str
    stage: str
    overrides: list[str]                          # train config overrides (run.out/data.dir/init_from added at run time)
    labels: dict[str, Any]                        # size, variant, seed, lr, ... (for the report)
    parent: str | None = None                     # run whose newest checkpoint starts this one (run.init_from)
    convert: dict | None = None                   # midtrain: convert_from_hf arguments for run.init_from
    data: dict = field(default_factory=dict)      # {"dir": path} or {"tokenizer_of_init": True}; {} = the spec's data
    measures: dict = field(default_factory=dict)  # position_loss: {seq_len, batches}; geometry: bool
    eval_tasks: list[str] = field(default_factory=list)
    eval_init: bool = False                       # also evaluate the model the run starts from (step 0)
    spec_hash: str = ""

    def hash_input(self, parent_hash: str | None) -> dict:
        return {"version": STUDY_VERSION, "stage": self.stage, "overrides": sorted(self.overrides),
                "parent": parent_hash, "convert": self.convert, "data": self.data, "measures": self.measures}


def load_spec(path_or_name: str | Path) -> dict:
    """A study spec from a YAML path, or by name from the repo's ``studies/`` (``quick``, ``full``)."""
    path = Path(path_or_name)
    if not path.exists() and (STUDIES_DIR / f"{path_or_name}.yaml").exists():
        path = STUDIES_DIR / f"{path_or_name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"study spec {path_or_name} not found (a YAML file, or one of "
                                f"{', '.join(sorted(p.stem for p in STUDIES_DIR.glob('*.yaml')))})")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ConfigError(f"study spec {path}: unknown keys {sorted(unknown)}; allowed: {sorted(SPEC_KEYS)}")
    for key in ("sizes", "budget"):
        if key not in spec:
            raise ConfigError(f"study spec {path}: missing '{key}'")
    spec.setdefault("name", path.stem)
    _check_eval_tasks(spec, path)
    return spec


def _check_eval_tasks(spec: dict, path: Path) -> None:
    """``ConfigError`` naming an eval task ``stemlm eval`` does not know (a spec with its own
    ``eval.command`` is not checked: that command decides)."""
    ev = spec.get("eval") or {}
    if ev.get("command"):
        return
    from ..eval.tasks import GROUPS, TASKS

    for key in ("tasks", "niah_tasks"):
        unknown = [t for t in ev.get(key) or [] if t not in TASKS and t not in GROUPS]
        if unknown:
            raise ConfigError(f"study spec {path}: unknown eval.{key} {unknown} (`stemlm eval --help` lists the tasks)")


def slug(text: str) -> str:
    """A file-name-safe form of a label (``stem-1/3`` -> ``stem-1_3``)."""
    return str(text).replace("/", "_").replace(",", "+").replace("=", "")


def _size_overrides(spec: dict, size: str) -> list[str]:
    sizes = spec["sizes"]
    if size not in sizes:
        raise ConfigError(f"study spec: unknown size {size!r}; defined: {', '.join(sizes)}")
    s = sizes[size]
    return [f"model.preset={s.get('preset', 'tiny')}"] + [f"model.{k}={v}" for k, v in (s.get("model") or {}).items()]


def _budget(spec: dict, stage: dict) -> list[str]:
    b = {**spec["budget"], **{k: stage[k] for k in ("steps", "batch_size", "seq_len") if k in stage}}
    return [f"run.steps={b['steps']}", f"data.batch_size={b['batch_size']}", f"data.seq_len={b['seq_len']}"]


def _base(spec: dict, stage: dict, size: str, seed: int) -> list[str]:
    return (list(spec.get("train") or []) + _size_overrides(spec, size) + _budget(spec, stage)
            + [f"run.seed={seed}", f"data.seed={spec['budget'].get('data_seed', 0)}"])


def _eval_tasks(spec: dict, key: str = "tasks") -> list[str]:
    return list((spec.get("eval") or {}).get(key) or [])


def plan(spec: dict) -> list[RunSpec]:
    """Every run of ``spec`` in execution order (parents first), with ``spec_hash`` filled in."""
    from .variants import parameter_match, size_config, variant_overrides

    runs: list[RunSpec] = []
    geometry = bool((spec.get("compare") or {}).get("geometry", True))
    if (c := spec.get("compare")):
        lr = c.get("lr")
        for size in c["sizes"]:
            for seed in _compare_seeds(c, size):
                for variant in c["variants"]:
                    ov = _base(spec, c, size, seed) + variant_overrides(spec, size, variant) + ([f"optim.lr={lr}"] if lr else [])
                    match = parameter_match(size_config(spec, size), variant)
                    runs.append(RunSpec(f"compare-{size}-{slug(variant)}-seed{seed}", "compare", ov,
                                        {"size": size, "variant": variant, "seed": seed, "match": match},
                                        measures={"geometry": geometry}, eval_tasks=_eval_tasks(spec)))
    if (s := spec.get("stability")):
        for variant in s["variants"]:
            for lr in map(float, s["lrs"]):  # YAML reads 1e-3 (no dot) as a string
                ov = (_base(spec, s, s["size"], s.get("seed", 0)) + variant_overrides(spec, s["size"], variant)
                      + [f"optim.lr={lr}", f"optim.warmup_ratio={s.get('warmup_ratio', 0.05)}"])
                runs.append(RunSpec(f"stability-{s['size']}-{slug(variant)}-lr{lr:g}", "stability", ov,
                                    {"size": s["size"], "variant": variant, "seed": s.get("seed", 0), "lr": lr}))
    if (x := spec.get("context")):
        runs += _context_runs(spec, x, runs)
    if (m := spec.get("midtrain")):
        runs += _midtrain_runs(spec, m)
    for r in runs:
        r.data = r.data or {"dir": spec.get("data_dir")}
    by_name = {r.name: r for r in runs}
    if len(by_name) != len(runs):
        raise ConfigError("study spec: two runs share a name (a variant, size, seed or lr listed twice?)")
    for r in runs:
        parent_hash = by_name[r.parent].spec_hash if r.parent else None
        r.spec_hash = hashlib.sha256(json.dumps(r.hash_input(parent_hash), sort_keys=True).encode()).hexdigest()[:16]
    return runs


def _compare_seeds(c: dict, size: str) -> list[int]:
    """``compare.seeds`` is one list for every size, or a mapping size -> list (fewer seeds where runs cost more)."""
    seeds = c["seeds"]
    if isinstance(seeds, dict):
        if size not in seeds:
            raise ConfigError(f"study spec: compare.seeds gives no seeds for size {size!r} (it lists {sorted(seeds)})")
        seeds = seeds[size]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"study spec: compare.seeds must be a non-empty list of integers (or size -> list), got {seeds!r}")
    return seeds


def _context_runs(spec: dict, x: dict, runs: list[RunSpec]) -> list[RunSpec]:
    """Continue the ``compare`` runs of ``x.variants`` (size ``x.size``, seed ``x.seed``) at ``x.seq_len``."""
    out, names = [], {r.name for r in runs}
    pos = {"seq_len": x["seq_len"], "batches": x.get("position_batches", 4)}
    for variant in x["variants"]:
        parent = f"compare-{x['size']}-{slug(variant)}-seed{x.get('seed', 0)}"
        if parent not in names:
            raise ConfigError(f"study spec: context continues {parent}, which compare does not train "
                              "(list its size, seed and variant under compare)")
        ov = (list(spec.get("train") or []) + _budget(spec, x)
              + [f"model.max_seq_len={x['seq_len']}", "run.stage=context_extend", "data.doc_masking=true",
                 f"optim.lr={x.get('lr', 1e-3)}", f"run.seed={x.get('seed', 0)}",
                 f"data.seed={spec['budget'].get('data_seed', 0)}"])
        out.append(RunSpec(f"context-{x['size']}-{slug(variant)}-L{x['seq_len']}", "context", ov,
                           {"size": x["size"], "variant": variant, "seed": x.get("seed", 0), "seq_len": x["seq_len"]},
                           parent=parent, measures={"position_loss": pos, "position_loss_parent": True},
                           eval_tasks=_eval_tasks(spec, "niah_tasks")))
    return out


MIDTRAIN_ARM_KEYS = {"ffn", "init", "stem_layers", "dagger_rows", "anneal", "anneal_ratio"}


def midtrain_arms(m: dict) -> dict[str, dict]:
    """The arms of a ``midtrain`` stage: ``m["arms"]`` (name -> {ffn, init, stem_layers, dagger_rows,
    anneal, anneal_ratio}), or the legacy pair ``dense`` + ``m.ffn`` converted with ``m.init``."""
    if "arms" not in m:
        ffn, layers = m.get("ffn", "stem"), m.get("stem_layers", "1/3")
        return {"dense": {"ffn": "dense"}, f"{ffn}-{layers}": {"ffn": ffn, "init": m.get("init", "project")}}
    arms = m["arms"]
    if not isinstance(arms, dict) or not arms:
        raise ConfigError("study spec: midtrain.arms must map arm names to {ffn, init, ...}")
    for name, arm in arms.items():
        unknown = set(arm or {}) - MIDTRAIN_ARM_KEYS
        if unknown:
            raise ConfigError(f"study spec: midtrain arm {name!r} has unknown keys {sorted(unknown)}; "
                              f"allowed: {sorted(MIDTRAIN_ARM_KEYS)}")
        if (arm or {}).get("anneal", "off") != "off" and arm.get("ffn") != "stem_dagger":
            raise ConfigError(f"study spec: midtrain arm {name!r} anneals, which needs ffn: stem_dagger")
    return arms


def _midtrain_runs(spec: dict, m: dict) -> list[RunSpec]:
    """The converted real model in every arm (dense continued, STEM with each table init, gradual
    insertion), all on the same tokens, lr and schedule."""
    out = []
    data = {"dir": m["data_dir"]} if m.get("data_dir") else {"tokenizer_of_init": True}
    source = str(m.get("source", "smollm2"))
    for name, arm in midtrain_arms(m).items():
        ffn = arm.get("ffn", "stem")
        layers = None if ffn == "dense" else arm.get("stem_layers", m.get("stem_layers", "1/3"))
        init = "zero" if ffn == "dense" else arm.get("init", m.get("init", "project"))
        convert = {"source": source, "ffn": ffn, "stem_layers": layers, "init": init}
        if init == "calibrate":
            convert["calibration"] = {**(m.get("calibration") or {}),
                                      **({"dagger_rows": arm["dagger_rows"]} if "dagger_rows" in arm else {})}
            convert["calib_data"] = m.get("calib_data")
        anneal = arm.get("anneal", "off")
        ov = (list(spec.get("train") or []) + _budget(spec, m)
              + ["run.stage=midtrain", f"optim.lr={m.get('lr', 3e-4)}", f"run.seed={m.get('seed', 0)}",
                 f"data.seed={spec['budget'].get('data_seed', 0)}"] + list(m.get("train") or [])
              + ([f"run.anneal={anneal}", f"run.anneal_ratio={arm.get('anneal_ratio', 0.5)}"] if anneal != "off" else []))
        out.append(RunSpec(f"midtrain-{slug(Path(source).name)}-{slug(name)}", "midtrain", ov,
                           {"source": source, "variant": name, "ffn": ffn, "init": init, "anneal": anneal,
                            "seed": m.get("seed", 0)},
                           convert=convert, data=data, eval_tasks=_eval_tasks(spec), eval_init=anneal == "off"))
    return out
