"""The runs of each training stage of a spec (``spec.plan`` puts them together).

Naming: ``sweep-SIZE-VARIANT-lrLR-seedS``, ``compare-SIZE-VARIANT-seedS``, ``context-SIZE-VARIANT-LLEN-seedS``,
``control-KIND``. Seed ``S`` sets both ``run.seed`` (model init) and ``data.seed`` (data order).
"""

from __future__ import annotations

from ..config import ConfigError
from .runspec import RunSpec, slug

DEFAULT_PROBES = {"knowledge": {"limit": None}, "needle": {"trials": 4}}


def _size_overrides(spec: dict, size: str) -> list[str]:
    sizes = spec["sizes"]
    if size not in sizes:
        raise ConfigError(f"study spec: unknown size {size!r}; defined: {', '.join(sizes)}")
    s = sizes[size]
    return [f"model.preset={s.get('preset', 'tiny')}"] + [f"model.{k}={v}" for k, v in (s.get("model") or {}).items()]


def budget(spec: dict, stage: dict) -> list[str]:
    """``run.steps``, ``data.batch_size`` and ``data.seq_len`` of a stage (its own keys over ``budget``)."""
    b = {**spec["budget"], **{k: stage[k] for k in ("steps", "batch_size", "seq_len") if k in stage}}
    return [f"run.steps={b['steps']}", f"data.batch_size={b['batch_size']}", f"data.seq_len={b['seq_len']}"]


def seeded(seed: int) -> list[str]:
    """A seed fixes both the model init and the data order."""
    return [f"run.seed={seed}", f"data.seed={seed}"]


def _trained(spec: dict, stage: dict, size: str, variant: str, seed: int, lr: float) -> list[str]:
    from .variants import optim_overrides, variant_overrides

    return (list(spec.get("train") or []) + _size_overrides(spec, size) + budget(spec, stage) + seeded(seed)
            + variant_overrides(spec, size, variant) + optim_overrides(spec.get("optim"), variant, lr)
            + list(stage.get("train") or []))


def _seeds(c: dict, size: str, key: str = "seeds") -> list[int]:
    """``c[key]`` is one list for every size, or a mapping size -> list."""
    seeds = c.get(key, [0])
    if isinstance(seeds, dict):
        if size not in seeds:
            raise ConfigError(f"study spec: {key} gives no seeds for size {size!r} (it lists {sorted(seeds)})")
        seeds = seeds[size]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"study spec: {key} must be a non-empty list of integers (or size -> list), got {seeds!r}")
    return seeds


def need(section: dict, name: str, *keys: str) -> None:
    """A one-line ``ConfigError`` when the spec section ``name`` lacks one of ``keys``."""
    if not isinstance(section, dict):
        raise ConfigError(f"study spec: {name} must be a mapping, got {section!r}")
    missing = [k for k in keys if k not in section or section[k] in (None, [], "")]
    if missing:
        raise ConfigError(f"study spec: {name} needs {', '.join(missing)}")


def _lrs(values, name: str) -> list[float]:
    try:
        lrs = [float(x) for x in values]  # YAML reads 1e-3 (no dot) as a string
    except (TypeError, ValueError):
        raise ConfigError(f"study spec: {name} must be a list of numbers, got {values!r}") from None
    if not lrs or any(x <= 0 for x in lrs):
        raise ConfigError(f"study spec: {name} must be a non-empty list of positive numbers, got {values!r}")
    return lrs


def probe_settings(spec: dict, kind: str) -> dict:
    """The settings of probe ``kind`` (``knowledge``, ``needle``): the spec's ``probes`` over the defaults."""
    return {**DEFAULT_PROBES[kind], **((spec.get("probes") or {}).get(kind) or {})}


def sweep_runs(spec: dict, extra: dict[str, list] | None = None) -> list[RunSpec]:
    """The tuning grid (every ``sweep.variants`` × ``sweep.lrs``) and the stress lrs of ``stability``
    (its variants × its lrs), on the sweep's size, seeds and steps; a (variant, lr) in both is one run.
    ``extra``: ``{variant: [(lr, seed, role)]}`` of the sweep's resolution (``tuning.resolve``); a run
    already planned gets the role added."""
    s = spec.get("sweep")
    if not s:
        if spec.get("stability"):
            raise ConfigError("study spec: stability adds lrs to the sweep; give a sweep section too")
        return []
    need(s, "sweep", "size", "lrs", "variants")
    st = spec.get("stability") or {}
    cells: dict[tuple[str, float], set[str]] = {}
    stress = (st.get("variants") or [], _lrs(st["lrs"], "stability.lrs") if st.get("lrs") else [], "stress")
    for variants, lrs, role in ((s["variants"], _lrs(s["lrs"], "sweep.lrs"), "tune"), stress):
        for variant in variants:
            for lr in lrs:
                cells.setdefault((variant, lr), set()).add(role)
    runs = []
    for (variant, lr), roles in cells.items():
        for seed in _seeds(s, s["size"]):
            runs.append(RunSpec(f"sweep-{s['size']}-{slug(variant)}-lr{lr:g}-seed{seed}", "sweep",
                                _trained(spec, s, s["size"], variant, seed, lr),
                                {"size": s["size"], "variant": variant, "seed": seed, "lr": lr, "roles": sorted(roles)},
                                measures={"val_batches": True}))
    by_name = {r.name: r for r in runs}
    confirm_steps = (s.get("resolve") or {}).get("confirm_steps")
    for variant, cells in (extra or {}).items():
        for lr, seed, role in cells:
            stage, name = s, f"sweep-{s['size']}-{slug(variant)}-lr{lr:g}-seed{seed}"
            if role == "confirm":  # the same run at the comparison's length (tuning.resolve)
                stage, name = {**s, "steps": int(confirm_steps)}, f"{name}-steps{int(confirm_steps)}"
            if name in by_name:
                by_name[name].labels["roles"] = sorted({*by_name[name].labels["roles"], role})
                continue
            labels = {"size": s["size"], "variant": variant, "seed": seed, "lr": lr, "roles": [role]}
            if role == "confirm":
                labels["steps"] = int(confirm_steps)
            by_name[name] = RunSpec(name, "sweep", _trained(spec, stage, s["size"], variant, seed, lr), labels,
                                    measures={"val_batches": True})
            runs.append(by_name[name])
    return runs


def compare_runs(spec: dict, tuned: dict[str, float]) -> list[RunSpec]:
    """Every variant at every size and seed, at ``compare.lr``: a number, or ``tuned`` (the default
    with a sweep): each variant at the lr its sweep picked."""
    from .variants import parameter_match, size_config

    c = spec.get("compare")
    if not c:
        return []
    need(c, "compare", "sizes", "variants")
    lr_setting = c.get("lr", "tuned" if spec.get("sweep") else 3e-3)
    if lr_setting == "tuned" and not spec.get("sweep"):
        raise ConfigError("study spec: compare.lr=tuned needs a sweep section")
    sweep_variants = set((spec.get("sweep") or {}).get("variants") or [])
    runs = []
    for size in c["sizes"]:
        for seed in _seeds(c, size):
            for variant in c["variants"]:
                pending = None
                if lr_setting == "tuned":
                    if variant not in sweep_variants:
                        raise ConfigError(f"study spec: compare variant {variant!r} is not in the sweep, so it has no tuned lr")
                    lr = tuned.get(variant)
                    pending = None if lr is not None else "waits for the sweep to pick its lr"
                else:
                    lr = _lrs([lr_setting], "compare.lr (a number or 'tuned')")[0]
                measures = {"geometry": bool(c.get("geometry", True)), "val_batches": True,
                            "probes": {"knowledge": probe_settings(spec, "knowledge")}}
                runs.append(RunSpec(f"compare-{size}-{slug(variant)}-seed{seed}", "compare",
                                    _trained(spec, c, size, variant, seed, lr or 0.0),
                                    {"size": size, "variant": variant, "seed": seed, "lr": lr,
                                     "lr_source": "sweep" if lr_setting == "tuned" else "spec",
                                     "match": parameter_match(size_config(spec, size), variant)},
                                    measures=measures, eval_tasks=_eval_tasks(spec), pending=pending))
    return runs


def _eval_tasks(spec: dict, key: str = "tasks") -> list[str]:
    return list((spec.get("eval") or {}).get(key) or [])


def context_runs(spec: dict, runs: list[RunSpec]) -> list[RunSpec]:
    """Continue the ``compare`` runs of ``context.variants`` (size ``context.size``, each of its seeds) at
    ``context.seq_len`` with document masking; measured by loss by position and the needle probe."""
    x = spec.get("context")
    if not x:
        return []
    need(x, "context", "size", "variants", "seq_len")
    out, names = [], {r.name for r in runs}
    pos = {"seq_len": x["seq_len"], "batches": x.get("position_batches", 4)}
    seeds = x["seeds"] if "seeds" in x else [x.get("seed", 0)]
    for seed in seeds:
        for variant in x["variants"]:
            parent = f"compare-{x['size']}-{slug(variant)}-seed{seed}"
            if parent not in names:
                raise ConfigError(f"study spec: context continues {parent}, which compare does not train "
                                  "(list its size, seed and variant under compare)")
            ov = (list(spec.get("train") or []) + budget(spec, x) + seeded(seed)
                  + [f"model.max_seq_len={x['seq_len']}", "run.stage=context_extend", "data.doc_masking=true",
                     f"optim.lr={x.get('lr', 1e-3)}", f"optim.table_lr={x.get('lr', 1e-3)}"])
            out.append(RunSpec(f"context-{x['size']}-{slug(variant)}-L{x['seq_len']}-seed{seed}", "context", ov,
                               {"size": x["size"], "variant": variant, "seed": seed, "seq_len": x["seq_len"]},
                               parent=parent, eval_tasks=_eval_tasks(spec, "niah_tasks"),
                               measures={"position_loss": pos, "position_loss_parent": True, "val_batches": True,
                                         "probes": {"needle": probe_settings(spec, "needle")}}))
    return out


def control_runs(spec: dict, runs: list[RunSpec]) -> list[RunSpec]:
    """The probes' positive controls: ``knowledge`` (a model trained on the facts alone, in the default
    corpus's tokenizer: the knowledge probe must find its facts) and ``needle`` (a comparison model
    continued on pass-key retrieval documents: the needle probe must find the key)."""
    ctl = spec.get("controls") or {}
    unknown = set(ctl) - {"knowledge", "needle"}
    if unknown:
        raise ConfigError(f"study spec: unknown controls {sorted(unknown)}; choose knowledge, needle")
    out, names = [], {r.name for r in runs}
    if (k := ctl.get("knowledge")):
        need(k, "controls.knowledge", "size")
        seed, variant = k.get("seed", 0), k.get("variant", "dense")
        out.append(RunSpec(f"control-knowledge-{slug(variant)}", "controls",
                           _trained(spec, k, k["size"], variant, seed, float(k.get("lr", 3e-3))),
                           {"size": k["size"], "variant": variant, "seed": seed, "control": "knowledge"},
                           data={"control": "facts"}, measures={"probes": {"knowledge": probe_settings(spec, "knowledge")}}))
    if (n := ctl.get("needle")):
        need(n, "controls.needle", "continues", "seq_len")
        parent = n["continues"]
        if parent not in names:
            raise ConfigError(f"study spec: controls.needle continues {parent!r}, which the spec does not train")
        ov = (list(spec.get("train") or []) + budget(spec, n) + seeded(n.get("seed", 0))
              + [f"model.max_seq_len={n['seq_len']}", "run.stage=context_extend", "data.doc_masking=true",
                 f"optim.lr={n.get('lr', 1e-3)}", f"optim.table_lr={n.get('lr', 1e-3)}"])
        out.append(RunSpec("control-needle", "controls", ov, {"control": "needle", "continues": parent,
                                                               "seq_len": n["seq_len"]},
                           parent=parent, data={"control": "passkey", "seq_len": n["seq_len"],
                                                **({"key": key} if (key := probe_settings(spec, "needle").get("key"))
                                                   not in (None, "number") else {})},
                           measures={"probes": {"needle": probe_settings(spec, "needle")}}))
    return out
