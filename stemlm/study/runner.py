"""Executing a study: every run through the trainer's library API, one result JSON per run.

A run trains only from a clean checkout (``check_clean``): no change to tracked files and no
untracked file in the code or the study specs, so that its recorded ``git_commit`` reproduces it.
``allow_dirty`` (``stemlm study run --allow-dirty``, or ``STEMLM_ALLOW_DIRTY=1`` as the test suite
sets) trains anyway and records ``git_dirty: true``.

Resumable at two levels: a run whose result JSON exists with the same ``spec_hash`` is skipped;
a run that was stopped mid-way continues from its newest checkpoint (its run directory, named
after the spec hash, lives in the scratch dir). A run that diverges (the trainer stops on a
non-finite loss or gradient) is recorded as ``diverged`` and the study goes on.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..runtime.files import atomic_write_text
from ..version import code_dirty, git_head, untracked
from .measures import accounting_summary, capacity_summary, curves, geometry_summary, run_probes, val_batch_losses
from .spec import CORPORA, STAGES, RunSpec, plan

Log = Callable[[str], None]
REPO = Path(__file__).resolve().parents[2]


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` to ``path`` as JSON through the one atomic writer (``runtime.files``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, default=str))
    return path


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None if it is missing or unreadable (a run to redo)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


SOURCE_DIRS = ("stemlm", "studies", "benchmarks")  # untracked files here change what a run does


class DirtyTree(RuntimeError):
    """The checkout has uncommitted changes, so a run's recorded commit would not reproduce it."""


def allow_dirty_from_env() -> bool:
    """Whether ``STEMLM_ALLOW_DIRTY`` asks to train from a dirty checkout (``1``, ``true``, ``yes``)."""
    return os.environ.get("STEMLM_ALLOW_DIRTY", "").strip().lower() in ("1", "true", "yes")


def check_clean(repo: Path) -> None:
    """Raise ``DirtyTree`` when the checkout holding ``repo`` has changed tracked files (results folders
    aside: a study rewrites its own result JSON) or untracked files in ``SOURCE_DIRS``; outside a git
    checkout there is nothing to check."""
    head = git_head(repo)
    if head is None:
        return
    new, changed = untracked(repo, *SOURCE_DIRS), code_dirty(repo)
    if changed or new:
        what = "changes to tracked files" if changed else f"untracked files ({', '.join(new[:3])})"
        raise DirtyTree(f"the checkout at {head[:10]} has {what}: commit them so that each run's recorded commit "
                        "reproduces it, or pass --allow-dirty (the runs then record git_dirty: true)")


def provenance() -> dict:
    """Git commit (and whether the tree had changes), library versions and the machine."""
    return {"git_commit": git_head(REPO), "git_dirty": code_dirty(REPO) or bool(untracked(REPO, *SOURCE_DIRS)),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version()}


class Study:
    """A planned study with its results dir (committed JSON) and scratch dir (runs, checkpoints)."""

    def __init__(self, spec: dict, results_dir: str | Path, scratch_dir: str | Path, log: Log = print,
                 allow_dirty: bool | None = None):
        self.spec, self.log = spec, log
        self.allow_dirty = allow_dirty_from_env() if allow_dirty is None else allow_dirty
        self.results, self.scratch = Path(results_dir), Path(scratch_dir)
        self.runs = plan(spec)
        self.by_name = {r.name: r for r in self.runs}
        self.tuned: dict = {}
        self.replan()

    def replan(self) -> None:
        """Plan again with the lrs the finished sweep runs pick, and the extra sweep runs the sweep's
        resolution asks for (``tuning.pick``)."""
        from .tuning import pick

        results = [res for r in self.runs if r.stage == "sweep" and (res := self.result(r)) is not None]
        self.tuned, extra = pick(results, self.spec.get("sweep") or {}) if self.spec.get("sweep") else ({}, {})
        self.runs = plan(self.spec, {v: b["lr"] for v, b in self.tuned.items()}, extra)
        runs = [r for r in self.runs if r.stage == "sweep"]
        if len(runs) > len(results):  # the extra runs just planned may have results already: pick again
            results = [res for r in runs if (res := self.result(r)) is not None]
            self.tuned, extra = pick(results, self.spec.get("sweep") or {})
            self.runs = plan(self.spec, {v: b["lr"] for v, b in self.tuned.items()}, extra)
        self.by_name = {r.name: r for r in self.runs}

    # -- paths ------------------------------------------------------------------------------
    def result_path(self, run: RunSpec) -> Path:
        return self.results / "runs" / f"{run.name}.json"

    def run_dir(self, run: RunSpec) -> Path:
        return self.scratch / "runs" / f"{run.name}-{run.spec_hash[:8]}"

    def result(self, run: RunSpec) -> dict | None:
        """The stored result of ``run`` if it is finished (same spec hash), else None."""
        data = read_json(self.result_path(run))
        return data if data and data.get("spec_hash") == run.spec_hash else None

    def checkpoint(self, run: RunSpec, result: dict) -> str | None:
        """Where ``run``'s final checkpoint is: in this study's scratch dir when it is there (a result
        written from another working directory records a path relative to that one), else the
        path the result records."""
        stored = result.get("checkpoint")
        if not stored:
            return None
        here = self.run_dir(run) / "checkpoints" / Path(stored).name
        return str(here) if here.exists() else stored

    # -- the study --------------------------------------------------------------------------
    def run(self, stages: tuple[str, ...] = STAGES, poll: float = 10.0) -> dict:
        """Train every run of the selected stages (and the runs they continue); returns counts.

        The sweep goes first; the study is planned again with the lrs it picked after every run. A
        selected run that waits for the sweep has its sweep runs trained first. Each run is claimed
        before training (``workers.RunClaims``), so other processes on the same results/scratch
        dirs train other runs meanwhile; a run held by another process is waited for (every
        ``poll`` seconds) only when nothing else is left to do."""
        from .workers import RunClaims

        counts = {"trained": 0, "skipped": 0, "diverged": 0, "pending": 0}
        for stage in STAGES:
            if stage in stages and not any(r.stage == stage for r in self.runs):
                why = (self.spec.get("skipped") or {}).get(stage, "")
                self.log(f"stage {stage}: not in study spec {self.spec['name']!r}, skipped" + (f": {why}" if why else ""))
        waiting = any(r.pending for r in self.runs if r.stage in stages)
        if waiting and "sweep" not in stages:
            self.log("the runs selected wait for the sweep's lrs: training the sweep first")
        wanted = lambda r: r.stage in stages or (r.stage == "sweep" and waiting)  # noqa: E731
        for r in self.runs:
            if wanted(r) and (done := self.result(r)) is not None:
                counts["skipped"] += 1
                self.log(f"{r.name}: finished earlier ({done['status']}), skipped")
        claims, given_up = RunClaims(self.scratch), set()
        while True:
            self.replan()
            need = {r.name for r in self.runs if wanted(r)}
            for r in reversed(self.runs):  # the runs they continue (parents come first in the plan)
                if r.name in need and r.parent:
                    need.add(r.parent)
            sweep_left = any(r.stage == "sweep" and r.name in need and self.result(r) is None for r in self.runs)
            busy, picked = False, None
            for r in self.runs:
                if r.name not in need or r.name in given_up or self.result(r) is not None:
                    continue
                if r.pending:
                    busy |= sweep_left
                    if not sweep_left:
                        given_up.add(r.name)
                        counts["pending"] += 1
                        self.log(f"{r.name}: not trained, it {r.pending}")
                    continue
                if r.parent and (parent := self.result(self.by_name[r.parent])) is None:
                    busy = True  # its parent is being trained, here or by another process
                    continue
                if r.parent and parent["status"] != "finished":
                    given_up.add(r.name)
                    self.log(f"{r.name}: not trained, the run it continues ({r.parent}) diverged")
                    continue
                key = self.run_dir(r).name
                if not claims.take(key):
                    busy = True
                    continue
                picked = r
                break
            if picked is None:
                if not busy:
                    break
                time.sleep(poll)
                continue
            try:
                self.train(picked, counts)
            finally:
                claims.release(key)
        self.replan()
        write_json(self.results / "study.json", {"name": self.spec["name"], "spec": self.spec,
                                                 "runs": [r.name for r in self.runs], "tuned": self.tuned, **provenance()})
        return counts

    def ensure(self, run: RunSpec, counts: dict, as_parent: bool = False) -> dict:
        """The result of ``run``: the stored one, or train it now (its parent first; a run whose
        parent diverged is not run and has no result)."""
        if (done := self.result(run)) is not None:
            if not as_parent:
                counts["skipped"] += 1
                self.log(f"{run.name}: finished earlier ({done['status']}), skipped")
            return done
        if run.parent and self.ensure(self.by_name[run.parent], counts, as_parent=True)["status"] != "finished":
            self.log(f"{run.name}: not trained, the run it continues ({run.parent}) diverged")
            return {"status": "not run"}
        return self.train(run, counts)

    def train(self, run: RunSpec, counts: dict) -> dict:
        """Train ``run`` now (``execute``), count it and log its start and outcome; refuses a dirty checkout
        unless ``allow_dirty``."""
        if not self.allow_dirty:
            check_clean(REPO)
        self.log(f"{run.name}: training")
        result = self.execute(run)
        counts["trained"] += 1
        counts["diverged"] += result["status"] == "diverged"
        self.log(f"{run.name}: {result['status']}, val loss {result['metrics']['final_val_loss']}, "
                 f"{result['timings']['total_seconds']:.0f}s")
        return result

    # -- one run ----------------------------------------------------------------------------
    def init_from(self, run: RunSpec) -> str | None:
        """The checkpoint a run starts from: its parent's newest one, or the converted model."""
        if run.parent:
            parent = self.result(self.by_name[run.parent])
            if parent is None or not parent.get("checkpoint"):
                raise ValueError(f"{run.name} continues {run.parent}, which has no checkpoint (did it diverge?)")
            return self.checkpoint(self.by_name[run.parent], parent)
        if run.convert:
            from .midtrain import converted_model
            return str(converted_model(run.convert, self.scratch / "convert", self.log))
        return None

    def data_dir(self, run: RunSpec, init: str | None) -> str | None:
        """The run's data: the spec's, a corpus in a converted model's tokenizer, or a control's corpus."""
        if run.data.get("control"):
            from .controls import control_corpus
            return str(control_corpus(run.data, self.spec.get("data_dir"), self.scratch / "data", self.log))
        if run.data.get("tokenizer_of_init"):
            from .midtrain import corpus_for_tokenizer
            return str(corpus_for_tokenizer(Path(init), self.scratch / "data", run.convert["source"], self.log))
        if run.data.get("dir") in CORPORA:  # a named offline corpus (stemlm data prepare --corpus NAME), built once
            from .controls import study_corpus
            return str(study_corpus(run.data["dir"]))
        return run.data.get("dir")

    def train_config(self, run: RunSpec, init: str | None, data_dir: str | None, out_dir: Path | None = None):
        from ..train import load_train_config

        extra = [f"run.out={out_dir or self.run_dir(run)}", "run.progress=false", "run.plots=false"]
        extra += [f"data.dir={data_dir}"] if data_dir else []
        extra += [f"run.init_from={init}"] if init else []
        if run.teacher:
            from .midtrain import distill_overrides
            extra += distill_overrides(run, self.scratch / "convert", self.log)
        preset = next((o.split("=", 1)[1] for o in run.overrides if o.startswith("model.preset=")), None)
        return load_train_config(preset, None, run.overrides + extra)

    def execute(self, run: RunSpec) -> dict:
        """Train ``run`` (resuming its run dir), measure it and write its result JSON."""
        from ..train import Trainer, TrainingDiverged
        from ..train.metrics import read_metrics
        from ..train.report import unigram_entropy

        t0, started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
        init = self.init_from(run)
        cfg = self.train_config(run, init, self.data_dir(run, init))
        trainer = Trainer(cfg, resume=True)
        init_file = self.run_dir(run) / "study_init.json"
        if trainer.step == 0:
            write_json(init_file, {"val_loss": trainer.evaluate()["loss"]})
        status, message = "finished", None
        try:
            res = trainer.fit()
            final_val, ckpt = res.val_loss, res.export or res.checkpoint  # an annealed run: its pure STEM model
        except TrainingDiverged as e:
            status, message, final_val, ckpt = "diverged", str(e), None, None
        train_seconds = time.perf_counter() - t0
        records = read_metrics(self.run_dir(run) / "metrics.jsonl")
        model_cfg = trainer.model.cfg
        result = {
            "name": run.name, "stage": run.stage, "spec_hash": run.spec_hash, "labels": run.labels,
            "spec": asdict(run), "config": cfg.to_dict(), "status": status, "diverged_message": message,
            "seeds": {"run.seed": cfg.run.seed, "data.seed": cfg.data.seed},
            "data": {"dir": str(trainer.data_dir), "unigram_entropy": unigram_entropy(trainer.data_dir),
                     "vocab_size": trainer.train_ds.vocab_size, "train_tokens": int(trainer.train_ds.n_tokens),
                     "epochs": trainer.tokens_seen / max(1, int(trainer.train_ds.n_tokens))},
            "init_from": init, "run_dir": str(self.run_dir(run)), "checkpoint": str(ckpt) if ckpt else None,
            "accounting": accounting_summary(model_cfg, cfg.data.seq_len),
            "metrics": {"val_loss_init": (read_json(init_file) or {}).get("val_loss"), "final_val_loss": final_val,
                        "final_train_loss": records[-1]["loss"] if records else None, "steps": trainer.step,
                        "tokens_seen": trainer.tokens_seen, "flops_seen": trainer.flops_seen,
                        "loss_spikes": trainer.spikes.count, **curves(records)},
        }
        if status == "finished":
            result.update(self.measure(run, trainer))
        result["timings"] = {"started": started, "total_seconds": time.perf_counter() - t0,
                             "train_and_measure_seconds": train_seconds}
        result.update(provenance())
        if ckpt and not self.keeps_checkpoint(run):
            for path in {self.run_dir(run) / "checkpoints", Path(ckpt)}:
                shutil.rmtree(path, ignore_errors=True)
            result["checkpoint_removed"] = True
        write_json(self.result_path(run), result)
        return result

    def keeps_checkpoint(self, run: RunSpec) -> bool:
        """Whether ``run``'s checkpoints stay on disk: always, unless the spec says ``keep_checkpoints: false``
        (large models on a small disk); then only where a later run continues it or the eval stage reads it."""
        if self.spec.get("keep_checkpoints", True):
            return True
        return bool(run.eval_tasks) or any(r.parent == run.name for r in self.runs)

    def measure(self, run: RunSpec, trainer) -> dict:
        """The run's optional measures: loss by position (also of the model it started from), the
        final eval batches' losses, geometry and capacity of its tables, the probes."""
        from ..data import iter_eval_batches
        from ..train.evaluate import loss_by_position
        from ..train.build import build_model

        out, cfg, m = {}, trainer.cfg, run.measures
        if (pos := m.get("position_loss")):
            args = (trainer.val_ds, cfg.data.batch_size, pos["seq_len"], pos["batches"], cfg.run.dtype)
            out["position_loss"] = {"seq_len": pos["seq_len"], "final": loss_by_position(trainer.model, *args)}
            if m.get("position_loss_parent"):
                start = build_model(cfg, trainer.train_ds.vocab_size, trainer.data_dir).to(trainer.device)
                out["position_loss"]["init"] = loss_by_position(start, *args)
        if m.get("val_batches"):
            out["val_batches"] = val_batch_losses(trainer.model, trainer.val_ds, cfg.data.batch_size, cfg.data.seq_len,
                                                  cfg.run.eval_batches, cfg.run.dtype, cfg.data.doc_masking)
        if m.get("geometry"):
            ids = next(iter(iter_eval_batches(trainer.val_ds, 2, cfg.data.seq_len, 1))).inputs.to(trainer.device)
            out["geometry"] = geometry_summary(trainer.model, ids)
            stream = np.asarray(trainer.val_ds.tokens[:50_000], dtype=np.int64)
            out["capacity"] = capacity_summary(stream, trainer.model.cfg, cfg.data.seq_len,
                                               getattr(trainer.model, "ngram_keys", None))
        if m.get("probes"):
            t0 = time.perf_counter()
            out["probes"] = run_probes(trainer.model, trainer.data_dir, m["probes"], self.log)
            out["probes"]["seconds"] = time.perf_counter() - t0
        return out
