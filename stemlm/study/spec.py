"""Study specifications: a YAML file in ``studies/`` expanded into an ordered list of runs.

A spec names backbone sizes, a token budget, the optimizer setting (``optim: paper`` is Table 2's:
one lr and one weight decay for every parameter, tables included) and the training stages:

* ``sweep``: every variant at several peak lrs (the tuning grid; one seed, shorter runs), plus the
  higher lrs of ``stability`` for the variants it names (the stress test shares the sweep's runs);
* ``compare``: every variant at its best sweep lr (``lr: tuned``), several seeds, each seed fixing
  both the model init (``run.seed``) and the data order (``data.seed``);
* ``context``: comparison runs continued at a longer context; ``controls``: the probes' positive
  controls; ``midtrain``: insertion into a pretrained model (its arms may live in another spec,
  ``midtrain: {from: NAME}``).

``plan(spec, tuned)`` turns a spec into ``RunSpec``s, parents before children. ``tuned`` maps a
variant to the lr the sweep picked; without it, runs that need it are returned as ``pending``.
Every run has a ``spec_hash`` over all that determines its result (training overrides, measures,
the hash of the run it continues and ``STUDY_VERSION``): a run is finished when its result JSON
carries the same hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from ..config import ConfigError
from .runspec import STUDY_VERSION, RunSpec, slug  # noqa: F401  (re-exported: the study's vocabulary)

STAGES = ("sweep", "compare", "context", "controls", "midtrain")
SPEC_KEYS = {"name", "description", "skipped", "data_dir", "optim", "train", "sizes", "budget", "eval", "timing",
             "stability", "probes", "keep_checkpoints", "quick", "compare_with", *STAGES}
CORPORA = ("default", "wide")  # data_dir values that name an offline corpus (stemlm data prepare --corpus)
STUDIES_DIR = Path(__file__).resolve().parents[2] / "studies"


def load_spec(path_or_name: str | Path, quick: bool = False) -> dict:
    """A study spec from a YAML path, or by name from the repo's ``studies/`` (``quick``, ``full``, ``gpu``).

    ``quick``: the spec's own ``quick`` section merged over it (one level deep: ``budget``, ``sweep``…
    keep their other keys; ``sizes`` is replaced), named ``<name>-quick`` — the same study at a tiny size, for the
    CPU and CI. ``data_dir`` may name an offline corpus (``CORPORA``: ``wide`` is built on first use).

    ``midtrain: {from: NAME}`` takes the ``midtrain`` section of another spec (a name in ``studies/``
    or a path); when that spec does not exist the stage is skipped with a note."""
    path = _find(path_or_name)
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ConfigError(f"study spec {path}: unknown keys {sorted(unknown)}; allowed: {sorted(SPEC_KEYS)}")
    for key in ("sizes", "budget"):
        if key not in spec:
            raise ConfigError(f"study spec {path}: missing '{key}'")
    if spec.get("optim") not in (None, "paper") and not isinstance(spec.get("optim"), list):
        raise ConfigError(f"study spec {path}: optim must be 'paper' or a list of optim.* overrides, got {spec['optim']!r}")
    spec.setdefault("name", path.stem)
    small = spec.pop("quick", None)
    if quick:
        if not isinstance(small, dict):
            raise ConfigError(f"study spec {path} has no 'quick' section: run `stemlm study run --quick` for the "
                              "quick spec, or add one")
        for key, value in small.items():
            merge = key != "sizes" and isinstance(value, dict) and isinstance(spec.get(key), dict)
            spec[key] = {**spec[key], **value} if merge else value
        spec["name"] = f"{spec['name']}-quick"
    _include_midtrain(spec, path)
    _check_eval_tasks(spec, path)
    _check_needle_key(spec, path)
    return spec


def _check_needle_key(spec: dict, path: Path) -> None:
    from .probes import KEY_KINDS

    key = ((spec.get("probes") or {}).get("needle") or {}).get("key", "number")
    if key not in KEY_KINDS:
        raise ConfigError(f"study spec {path}: probes.needle.key={key!r}; choose one of {', '.join(KEY_KINDS)}")


def _find(path_or_name: str | Path) -> Path:
    path = Path(path_or_name)
    if not path.exists() and (STUDIES_DIR / f"{path_or_name}.yaml").exists():
        path = STUDIES_DIR / f"{path_or_name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"study spec {path_or_name} not found (a YAML file, or one of "
                                f"{', '.join(sorted(p.stem for p in STUDIES_DIR.glob('*.yaml')))})")
    return path


def _include_midtrain(spec: dict, path: Path) -> None:
    """Replace ``midtrain: {from: NAME}`` by that spec's ``midtrain`` section (or skip the stage)."""
    m = spec.get("midtrain")
    if not isinstance(m, dict) or "from" not in m:
        return
    try:
        other = yaml.safe_load(_find(m["from"]).read_text()) or {}
    except FileNotFoundError:
        spec["midtrain"] = None
        spec.setdefault("skipped", {})["midtrain"] = (f"its arms come from the spec {m['from']!r}, which does not "
                                                      "exist yet (the insertion study fills it in)")
        return
    if not isinstance(other.get("midtrain"), dict):
        raise ConfigError(f"study spec {path}: midtrain.from={m['from']!r} names a spec without a midtrain section")
    spec["midtrain"] = {**other["midtrain"], **{k: v for k, v in m.items() if k != "from"}}


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


def plan(spec: dict, tuned: dict[str, float] | None = None, extra: dict[str, list] | None = None) -> list[RunSpec]:
    """Every run of ``spec`` in execution order (parents first), with ``spec_hash`` filled in.

    ``tuned``: ``{variant: lr}`` picked by the sweep (``tuning.best_lrs``); runs that need a tuned lr
    it does not hold come back with ``pending`` set and no hash. ``extra``: ``{variant: [(lr, seed, role)]}``,
    sweep runs beyond the grid that the sweep's resolution asks for (``tuning.resolve``)."""
    from . import stages

    runs: list[RunSpec] = []
    runs += stages.sweep_runs(spec, extra or {})
    runs += stages.compare_runs(spec, tuned or {})
    runs += stages.context_runs(spec, runs)
    runs += stages.control_runs(spec, runs)
    if (m := spec.get("midtrain")):
        from .midtrain import midtrain_runs
        runs += midtrain_runs(spec, m)
    for r in runs:
        r.data = r.data or {"dir": spec.get("data_dir")}
    by_name = {r.name: r for r in runs}
    if len(by_name) != len(runs):
        raise ConfigError("study spec: two runs share a name (a variant, size, seed or lr listed twice?)")
    for r in runs:
        parent = by_name[r.parent] if r.parent else None
        if parent is not None and parent.pending:
            r.pending = r.pending or f"continues {parent.name}, which waits for the sweep"
        if r.pending:
            continue
        blob = json.dumps(r.hash_input(parent.spec_hash if parent else None), sort_keys=True)
        r.spec_hash = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return runs
