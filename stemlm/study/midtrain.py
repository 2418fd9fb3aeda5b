"""Mid-training insertion on a real model: its arms, the converted checkpoints, a corpus in their tokenizer.

The arms (``midtrain.arms``: name -> {ffn, init, stem_layers, dagger_rows, calibration, anneal, anneal_ratio,
distill, train}) all start from the same converted source and train on the same tokens, lr and schedule, for each
of ``midtrain.seeds`` (default: ``[midtrain.seed]``, 0); the claim reads arms by their labels
(``ffn``, ``init``, ``anneal``) and compares each STEM arm with the dense one. An arm's own ``train``
overrides (e.g. ``[optim.table_lr=3e-2]``: a knob only STEM has) come after the shared ones, and its own
``calibration`` settings over the stage's (e.g. ``{layer_choice: cheapest}``). An arm with
``distill: {weight, temperature, top_k}`` trains against the dense conversion of the same source as a
frozen teacher (``run.distill``; the dense arm's own starting checkpoint, converted once).

A converted model keeps its own vocabulary (SmolLM2: 49,152 ids), so it cannot train on the
default corpus as prepared for the 4,096-id BPE: the same documents are tokenized again with the
model's own ``tokenizer.json`` (``prepare_default_corpus(tokenizer=...)``), once per source.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

from ..config import ConfigError
from ..ffn import KINDS, ffn_kind
from .runspec import RunSpec, slug

MIDTRAIN_ARM_KEYS = {"ffn", "init", "stem_layers", "dagger_rows", "calibration", "calib_data", "anneal", "anneal_ratio",
                     "distill", "train"}
DISTILL_KEYS = {"weight", "temperature", "top_k", "schedule"}


def _anneals(ffn: str | None) -> bool:
    """Whether ``ffn`` is a kind gradual insertion turns into another (``FFNKind.anneals_to``)."""
    return ffn in KINDS and ffn_kind(ffn).anneals_to is not None


def midtrain_arms(m: dict) -> dict[str, dict]:
    """The arms of a ``midtrain`` stage: ``m["arms"]`` (name -> {ffn, init, stem_layers, dagger_rows,
    calibration, calib_data, anneal, anneal_ratio, distill, train}; ``calib_data`` overrides the stage's), or the legacy pair ``dense`` + ``m.ffn`` converted with ``m.init``."""
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
        if (arm or {}).get("anneal", "off") != "off" and not _anneals((arm or {}).get("ffn")):
            raise ConfigError(f"study spec: midtrain arm {name!r} anneals, which needs an ffn that gradual insertion "
                              f"turns into another ({', '.join(k for k, c in KINDS.items() if c.anneals_to)})")
        distill = (arm or {}).get("distill")
        if distill is not None and (not isinstance(distill, dict) or set(distill) - DISTILL_KEYS):
            raise ConfigError(f"study spec: midtrain arm {name!r}: distill must be a mapping with keys from "
                              f"{sorted(DISTILL_KEYS)}, got {distill!r}")
        calibration = (arm or {}).get("calibration", {})
        if not isinstance(calibration, dict):
            raise ConfigError(f"study spec: midtrain arm {name!r}: calibration must be a mapping of CalibrationConfig "
                              f"settings, got {calibration!r}")
        train = (arm or {}).get("train", [])
        if not isinstance(train, list) or not all(isinstance(o, str) and "=" in o for o in train):
            raise ConfigError(f"study spec: midtrain arm {name!r}: train must be a list of key=value overrides, "
                              f"got {train!r}")
    return arms


def midtrain_runs(spec: dict, m: dict) -> list[RunSpec]:
    """The converted real model in every arm (dense continued, STEM with each table init, gradual
    insertion) and seed, all on the same tokens, lr and schedule."""
    from .stages import _eval_tasks, budget, seeded

    out = []
    data = {"dir": m["data_dir"]} if m.get("data_dir") else {"tokenizer_of_init": True}
    source = str(m.get("source", "smollm2"))
    seeds = m.get("seeds", [m.get("seed", 0)])
    for seed in seeds:
        for name, arm in midtrain_arms(m).items():
            ffn = arm.get("ffn", "stem")
            dense = ffn_kind(ffn).is_dense
            layers = None if dense else arm.get("stem_layers", m.get("stem_layers", "1/3"))
            init = "zero" if dense else arm.get("init", m.get("init", "project"))
            convert = {"source": source, "ffn": ffn, "stem_layers": layers, "init": init}
            if init == "calibrate":
                convert["calibration"] = {**(m.get("calibration") or {}), **(arm.get("calibration") or {}),
                                          **({"dagger_rows": arm["dagger_rows"]} if "dagger_rows" in arm else {})}
                convert["calib_data"] = arm.get("calib_data", m.get("calib_data"))
            anneal = arm.get("anneal", "off")
            distill = arm.get("distill")
            ov = (budget(spec, m) + seeded(seed)  # the stage's own settings: the same runs whichever spec includes it
                  + ["run.stage=midtrain", f"optim.lr={m.get('lr', 3e-4)}"] + list(m.get("train") or [])
                  + ([f"run.anneal={anneal}", f"run.anneal_ratio={arm.get('anneal_ratio', 0.5)}"] if anneal != "off" else [])
                  + [f"run.distill_{k}={v}" for k, v in sorted((distill or {}).items())]
                  + list(arm.get("train") or []))
            suffix = f"-seed{seed}" if len(seeds) > 1 else ""
            out.append(RunSpec(f"midtrain-{slug(Path(source).name)}-{slug(name)}{suffix}", "midtrain", ov,
                               {"source": source, "variant": name, "ffn": ffn, "init": init, "anneal": anneal,
                                "seed": seed, **({"distill": "dense"} if distill is not None else {})},
                               convert=convert, data=data, eval_tasks=_eval_tasks(spec), eval_init=anneal == "off",
                               measures={"val_batches": True}, teacher=teacher_of(source) if distill is not None else None))
    return out


def teacher_of(source: str) -> dict:
    """The conversion of a distilled arm's teacher: the dense model of ``source`` (the dense arm's start)."""
    return {"source": source, "ffn": "dense", "stem_layers": None, "init": "zero"}


def distill_overrides(run: RunSpec, root: Path, log: Callable[[str], None] = print) -> list[str]:
    """``["run.distill=<the teacher's converted checkpoint>"]`` for a distilled arm, else ``[]``."""
    if not run.teacher:
        return []
    return [f"run.distill={converted_model(run.teacher, root, log)}"]


# A study's conversion is what its spec names on these calibration settings, not on the CLI's defaults of
# the day: its runs' hashes and cached conversions cover only what the spec names, so a new default of
# `stemlm convert` (shrink 1024 since issue 37, 4096 since 2026-11-28) must not change what an unchanged spec computes. A spec
# that wants the new setting names it (calibration: {shrink: 1024}), which changes its hash. The same holds for
# the layers converted (layer_choice cheapest since issue 37: calibration: {layer_choice: cheapest}).
# the calibration the study's arms were measured with, under what each arm's spec sets (distillation as it ran
# before its row update and precision became settings: every row each step, fp32)
STUDY_CALIBRATION = {"shrink": 0.0, "layer_choice": "uniform", "distill_rows": "dense", "distill_precision": "fp32"}


def converted_model(convert: dict, root: Path, log: Callable[[str], None] = print) -> Path:
    """``convert_from_hf`` of ``convert`` into ``root`` (once: a complete output dir is reused)."""
    from ..interop.convert import convert_from_hf

    key = hashlib.sha256(json.dumps(convert, sort_keys=True).encode()).hexdigest()[:8]
    out = Path(root) / f"{slug(Path(convert['source']).name)}-{convert['ffn']}-{key}"
    if (out / "config.json").exists():
        return out
    log(f"converting {convert['source']} to {convert['ffn']} {convert.get('stem_layers') or ''} "
        f"(init {convert['init']}) -> {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration = None
    if convert["init"] == "calibrate":
        from ..insert.calibrate import CalibrationConfig
        calibration = CalibrationConfig(**{**STUDY_CALIBRATION, **(convert.get("calibration") or {})})
    convert_from_hf(convert["source"], out, ffn=convert["ffn"], stem_layers=convert.get("stem_layers") or "1/3",
                    init=convert["init"], calibration=calibration, calib_data=convert.get("calib_data"), log=log)
    return out


def corpus_for_tokenizer(model_dir: Path, root: Path, source: str, log: Callable[[str], None] = print) -> Path:
    """The default corpus tokenized with ``model_dir``'s ``tokenizer.json`` (built once per source)."""
    from ..data import is_complete, prepare_default_corpus

    tok = Path(model_dir) / "tokenizer.json"
    if not tok.exists():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; give midtrain.data_dir (a prepared data dir "
                                "in the model's vocabulary) instead")
    home = Path(root) / slug(Path(source).name)
    home.mkdir(parents=True, exist_ok=True)
    kept = home / "tokenizer.json"  # one path for every conversion of the source: one corpus
    if not kept.exists():
        shutil.copyfile(tok, kept)
    elif kept.read_bytes() != tok.read_bytes():
        raise ValueError(f"{model_dir}/tokenizer.json differs from the one the corpus in {home} was built with")
    out = home / "corpus"
    if not is_complete(out):
        log(f"tokenizing the default corpus with {source}'s tokenizer -> {out}")
    return prepare_default_corpus(out, tokenizer=kept, progress=False)
