"""The training loop: one loop for every FFN kind; tables are reached only through ``model.tables``.

Per optimizer step: ``grad_accum`` micro-batches from ``get_batch(ds, step·accum + i)`` (stateless,
so the data position is the step), backward, then the table optimizer coalesces the sparse table
gradients, the global norm over backbone *and* table gradients is clipped, and both optimizers
step. The loop never asks where table rows live: ``SparseRowAdamW`` talks to every table object
through the lookup protocol, so host/disk tables installed in ``model.tables`` train unchanged.

The table path (``run.table_path``, ``run.tables``; ``stemlm.train.fused``) is applied to the built model
from outside; ``model.tables`` may take each step's ids ahead (``begin_step``, ``prefetch_step``).
A step reads back from the device once (the losses and the gradient norm, after backward).

Everything that depends on where the model runs is a seam a subclass overrides, so the loop is
written once: ``prepare_model`` (install sharded or off-device tables before the optimizers are
built), ``wrap_forward`` (DDP/FSDP), ``host_batch`` (a rank's slice of ``get_batch``), ``step_values``
and ``clip_gradients`` (cross-process reductions), ``is_main`` (who writes files), and on resume
``load_weights`` / ``load_optimizer_state`` / ``rng_of`` (a rank's share of a checkpoint). See
``stemlm.train.distributed.trainer`` for the torchrun implementation; ``stemlm.train.run.train`` picks it.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ..accounting import train_flops_per_token
from ..checkpoint.directory import WEIGHTS_FILE, CheckpointError, load_state_into, write_run_config
from ..config import ConfigError
from ..data import TokenDataset, get_batch
from ..runtime.devices import resolve_device
from ..runtime.files import atomic_write_text, clean_interrupted_saves
from ..runtime.malloc import keep_freed_memory
from ..runtime.matmul_probe import apply_training_matmul
from .fused.apply import apply_table_path, hot_ids, resolve_table_path, slab_rows_for
from ..model.decoder import StemLM
from ..insert.anneal import apply_schedule, check_annealable, export_stem
from ..model.tables import check_ids, ids_checked
from . import evaluate as evaluate_mod
from . import state as ckpt_io
from .build import build_model, compile_blocks, resolve_data_dir
from .captured import CapturedStep, check_step_graph
from .config import TrainConfig, config_from_yaml_text, resume_changes
from .distill import teacher_for_run
from .lock import RunLock
from .metrics import MetricsLog, SpikeDetector, is_finite, peak_flops_for_run
from .optim import build_optimizers, clip_grad_norm, set_lr
from .result import TrainResult, finished_result
from .schedule import lr_factor
from ..checkpoint.rundir import METRICS, STEP_PREFIX, RunDir


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; training stopped before updating the weights."""


class Trainer:
    """Holds the model, optimizers, data and counters of one run; ``fit()`` runs it."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, allow_changes: tuple[str, ...] = ()):
        self.cfg, self.run_dir = cfg, Path(cfg.run.out)
        self.lock = RunLock(self.run_dir) if self.is_main else None  # one writer per run dir
        try:
            self._setup(resume, tuple(allow_changes))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory's lock (``fit`` and ``train`` do; idempotent)."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self, resume: bool, allow_changes: tuple[str, ...]) -> None:
        cfg = self.cfg
        if self.is_main:  # under the lock: what a killed save left behind is no one's work in progress
            clean_interrupted_saves(self.run_dir, (ckpt_io.RUN_CONFIG, METRICS))
            clean_interrupted_saves(RunDir(self.run_dir).checkpoints_dir, (f"{STEP_PREFIX}*",))
        self.device = resolve_device(cfg.run.device, "run.device")
        if cfg.run.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()  # process-wide, see stemlm/runtime/malloc.py
        self.config_changes: list[dict] = []  # every change allowed on resume so far: {step, field, old, new}
        self._new_changes: list[dict] = []  # those of this resume, until the first metrics record carries them
        resume_from = self._check_resume(resume, allow_changes)
        self.data_dir = resolve_data_dir(cfg)
        self.train_ds = TokenDataset.open(self.data_dir, "train")
        self.val_ds = TokenDataset.open(self.data_dir, "val")
        self.model = self.prepare_model(build_model(cfg, self.train_ds.vocab_size, self.data_dir).to(self.device).train())
        self._check_shapes()
        if cfg.run.anneal != "off":
            try:
                check_annealable(self.model.cfg)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.table_path = resolve_table_path(cfg.run.table_path, cfg.run.tables, cfg.optim.table_optimizer,
                                             self.device, self.model)
        cache = (hot_ids(self.train_ds.tokens, self.model.cfg.vocab_size, cfg.run.table_cache_rows)
                 if cfg.run.table_cache_rows else None)
        self.table_kernels = apply_table_path(self.model, self.table_path, cfg.run.tables, self.device,
                                              cfg.run.table_kernels, cache, RunDir(self.run_dir).tables_file,
                                              slab_rows_for(cfg, self.model, self.device, cache))
        try:
            self.teacher = teacher_for_run(cfg.run, self.device, self.model, self.host_batch,  # None without run.distill
                                           cfg.run.steps * cfg.optim.grad_accum, self.run_dir / "distill_topk",
                                           cfg.run.progress and self.is_main)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.opt, self.table_opt = build_optimizers(self.model, cfg.optim)
        try:
            self.matmul_backend = self.resolve_matmul()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.compiled = cfg.run.compile_blocks(self.device)
        if self.compiled:
            compile_blocks(self.model)
        self.forward_model = self.wrap_forward(self.model)
        self.step_graph = check_step_graph(self)  # run.step_graph resolved: eager | static | graph
        self.captured = None  # the CapturedStep of run.step_graph, built at the first step (after a restore)
        self._table_ticket = None  # what model.tables.prefetch_step staged for the next step
        self.step, self.tokens_seen, self.flops_seen = 0, 0, 0.0
        self.spikes = SpikeDetector(cfg.run.spike_factor, cfg.run.spike_window)
        self.flops_per_token = train_flops_per_token(self.model.cfg, cfg.data.seq_len)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.optim.grad_accum
        self.last_ckpt: Path | None = None
        self.peak_flops: float | None = None  # measured in fit(); MFU is None until then
        if resume_from is not None:
            self.restore(resume_from)

    # -- setup -----------------------------------------------------------------------------
    def _check_resume(self, resume: bool, allow_changes: tuple[str, ...]) -> Path | None:
        """The checkpoint to resume (None: a fresh run); the config changes it allows are kept for ``restore``."""
        if not ckpt_io.list_checkpoints(self.run_dir):
            return None
        if not resume:
            raise FileExistsError(f"{self.run_dir} already holds checkpoints; pass --resume to continue it "
                                  "or choose another run.out")
        ckpt = self.find_resume_checkpoint()
        if ckpt is None:
            return None
        try:
            old = config_from_yaml_text((ckpt / ckpt_io.RUN_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unreadable {ckpt / ckpt_io.RUN_CONFIG}: {e}") from None
        self._new_changes = resume_changes(old, self.cfg, allow_changes)
        return ckpt

    def find_resume_checkpoint(self) -> Path | None:
        """The newest intact checkpoint (seam: under torchrun rank 0 picks it for every rank)."""
        return ckpt_io.resume_checkpoint(self.run_dir, self.cfg.run.verify_checkpoints)

    def _check_shapes(self) -> None:
        mcfg, data = self.model.cfg, self.cfg.data
        if self.train_ds.vocab_size > mcfg.vocab_size:
            raise ValueError(f"the data's vocab_size {self.train_ds.vocab_size} exceeds model.vocab_size "
                             f"{mcfg.vocab_size}: token ids would be out of range")
        if data.seq_len > mcfg.max_seq_len:
            raise ConfigError(f"data.seq_len={data.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")

    def restore(self, ckpt: Path) -> None:
        """Resume from ``ckpt``: weights, optimizer state, then counters and RNG (``restore_trainer_state``)."""
        self.load_weights(ckpt)
        self.load_optimizer_state(ckpt)
        self.restore_trainer_state(ckpt)

    def load_weights(self, ckpt: Path) -> None:
        """The weights of ``ckpt`` into ``self.model`` (seam: a rank keeps its own table rows)."""
        load_state_into(self.model, ckpt / WEIGHTS_FILE)

    def load_optimizer_state(self, ckpt: Path) -> None:
        """The optimizer state of ``ckpt`` into the optimizers (seam: a rank keeps its rows' table moments)."""
        ckpt_io.load_optimizer_state(ckpt, self.opt, self.table_opt)

    def restore_trainer_state(self, ckpt: Path) -> None:
        """Counters, spike window, RNG state and the history of allowed config changes of ``ckpt``."""
        st = ckpt_io.read_trainer_state(ckpt)
        try:
            self.step, self.tokens_seen, self.flops_seen = st["step"], st["tokens_seen"], st["flops_seen"]
            self.spikes.load_state_dict(st["spikes"])
            ckpt_io.set_rng_state(self.rng_of(st))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"corrupt {ckpt / ckpt_io.TRAINER_STATE}: {type(e).__name__}: {e}") from None
        self._new_changes = [{"step": self.step, **c} for c in self._new_changes]
        self.config_changes = list(st.get("config_changes", [])) + self._new_changes
        self.last_ckpt = ckpt

    def resolve_matmul(self) -> str:
        """``run.matmul`` applied to the model (``auto`` on a CPU measures, ``stemlm.runtime.matmul_probe``);
        the backend in use (seam: under torchrun rank 0 measures and every rank uses its pick)."""
        r, d = self.cfg.run, self.cfg.data
        return apply_training_matmul(self.model, r.matmul, self.device, r.dtype, d.batch_size * d.seq_len)

    def rng_of(self, state: dict) -> dict:
        """The RNG state this process restores from a trainer state (seam: one per rank under torchrun)."""
        return state["rng"]

    # -- seams for distribution applied from outside (stemlm.train.distributed.trainer overrides these) ---
    is_main = True  # the process that writes logs, plots and checkpoints

    def prepare_model(self, model: StemLM) -> StemLM:
        """Hook before the optimizers are built (e.g. install sharded tables); identity here."""
        return model

    def wrap_forward(self, model):
        """The module used for forward/backward (e.g. a DDP wrapper); ``model`` itself here."""
        return model

    def reduce_loss(self, loss: torch.Tensor) -> float:
        """The loss value to log and check (the mean over processes when distributed)."""
        return loss.item()

    def step_values(self, losses: list[torch.Tensor], norm: torch.Tensor) -> tuple[list[float], float]:
        """The micro-batch losses and the gradient norm as numbers: one read back from the device."""
        values = torch.stack([*(l.float() for l in losses), norm.to(losses[0].device, torch.float32)]).tolist()
        return values[:-1], values[-1]

    def clip_gradients(self, params: list[torch.Tensor], table_grads: list[torch.Tensor]) -> torch.Tensor:
        """Global gradient norm over backbone and table gradients, clipped in place."""
        return clip_grad_norm(params, table_grads, self.cfg.optim.grad_clip)

    # -- one step --------------------------------------------------------------------------
    def host_batch(self, micro_step: int):
        """Micro-batch number ``micro_step`` of the run in host memory (the seam for a rank/world_size slice)."""
        d = self.cfg.data
        return get_batch(self.train_ds, micro_step, d.batch_size, d.seq_len, seed=d.seed)

    def batch(self, micro_step: int):
        """Micro-batch number ``micro_step`` on the run's device."""
        return self.host_batch(micro_step).to(self.device)

    def step_batches(self, step: int) -> list:
        """The host micro-batches of optimizer step ``step`` (the last two steps' are kept)."""
        cache = self.__dict__.setdefault("_step_batches", {})
        if step not in cache:
            accum = self.cfg.optim.grad_accum
            cache[step] = [self.host_batch(step * accum + i) for i in range(accum)]
            for old in [k for k in cache if k < step - 1]:
                del cache[old]
        return cache[step]

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics record."""
        cfg, t0 = self.cfg, time.perf_counter()
        factor = lr_factor(self.step, cfg.run.steps, cfg.optim.warmup_ratio, cfg.optim.decay, cfg.optim.min_lr_ratio)
        set_lr(self.opt, self.table_opt, factor, cfg.optim.table_peak_lr)
        up_scale = self.apply_anneal()
        accum, losses, tables = cfg.optim.grad_accum, [], self.model.tables
        host = self.step_batches(self.step)
        ids = torch.cat([b.inputs.reshape(-1) for b in host])
        check_ids(ids, self.model.cfg.vocab_size)  # on the host: the device never has to report back
        if tables.prepares_steps:  # host tables through a fixed device slab: load the step's rows (not captured)
            tables.prepare_step([self.model.table_keys(b.inputs) for b in host], self._table_ticket)
        if self.step_graph != "eager":
            if self.captured is None:
                self.captured = CapturedStep(self, graphs=self.step_graph == "graph",
                                             fallback=self.cfg.run.step_graph == "auto")
            return self._finish_step(t0, ids, *self.captured(host), up_scale, applied=True)
        with ids_checked():
            tables.begin_step([self.model.table_keys(b.inputs) for b in host], self._table_ticket)
            for b in host:
                batch = b.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else b.to(self.device)
                with evaluate_mod.autocast(self.device, cfg.run.dtype):
                    loss, objective = self.micro_loss(batch)
                (objective / accum).backward()
                losses.append(loss.detach())
        self._table_ticket = None
        if self.step + 1 < cfg.run.steps:  # while backward runs (host-RAM tables move the next step's rows)
            self._table_ticket = tables.prefetch_step([self.model.table_keys(b.inputs)
                                                        for b in self.step_batches(self.step + 1)])
        table_grads = self.table_opt.collect() if self.table_opt is not None else []
        params = [p for g in self.opt.param_groups for p in g["params"]]
        values, norm = self.step_values(losses, self.clip_gradients(params, table_grads))
        self._check_finite(values, norm, applied=False)
        self.opt.step()
        if self.table_opt is not None:
            self.table_opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self._finish_step(t0, ids, values, norm, up_scale)

    def _check_finite(self, values: list[float], norm: float, applied: bool) -> None:
        done = ("its update was already applied by the fixed-buffer step (run.step_graph): the weights in memory "
                "are not to be trusted" if applied else "stopped before updating the weights")
        for value in values:
            if not is_finite(value):
                self._diverged(f"loss is {value}", done=done)
        if not is_finite(norm):
            self._diverged(f"gradient norm is {norm}", done=done)

    def _finish_step(self, t0: float, ids: torch.Tensor, values: list[float], norm: float, up_scale,
                     applied: bool = False) -> dict:
        """Counters, spike detection and the metrics record of a step whose update is done."""
        cfg, accum = self.cfg, self.cfg.optim.grad_accum
        if applied:
            self._check_finite(values, norm, applied=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        step_flops = self.flops_per_token * self.tokens_per_step
        self.flops_seen += step_flops
        dt = time.perf_counter() - t0
        loss = sum(values) / accum
        spike = self.spikes.update(loss)
        return {"step": self.step, "loss": loss, "lr": self.opt.param_groups[0]["lr"], "grad_norm": norm,
                "tokens_per_s": self.tokens_per_step / dt, "mfu": step_flops / dt / self.peak_flops if self.peak_flops else None,
                "unique_tokens": int(torch.unique(ids).numel()),
                "tokens_seen": self.tokens_seen, "flops_seen": self.flops_seen, "loss_spikes": self.spikes.count,
                "spike": spike, "step_time": dt, **({"up_scale": up_scale} if cfg.run.anneal != "off" else {})}

    def micro_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cross-entropy, objective)`` of one micro-batch; they differ only under ``run.distill``."""
        if self.teacher is None:
            loss = evaluate_mod.compute_loss(self.forward_model, batch, self.cfg.data.doc_masking)
            return loss, loss
        weight = self.teacher.cfg.weight_at(self.step, self.cfg.run.steps)
        return self.teacher.losses(self.forward_model, self.model, batch, weight, self.cfg.data.doc_masking)

    def apply_anneal(self) -> float:
        """Set the gradual-insertion scales for the current step (``run.anneal``); returns ``s``."""
        r = self.cfg.run
        return apply_schedule(self.model, r.anneal, self.step, r.steps, r.anneal_ratio)

    def _diverged(self, what: str, step: int | None = None, done: str = "stopped before updating the weights") -> None:
        raise self.divergence(what, step, done)

    def divergence(self, what: str, step: int | None = None,
                   done: str = "stopped before updating the weights") -> TrainingDiverged:
        """The error that stops a diverged run: what happened, at which step, what is intact, how to retry."""
        where = f"the last good checkpoint {self.last_ckpt} is intact" if self.last_ckpt else "no checkpoint was written yet"
        return TrainingDiverged(f"{what} at step {step or self.step + 1}; {done}; {where}. {self.retry_advice()}")

    def retry_advice(self) -> str:
        """The command that resumes this run with a tenth of the learning rate (tested verbatim)."""
        lr = self.cfg.optim.lr / 10
        return (f"Resume with a lower learning rate: stemlm train --config {self.run_dir / ckpt_io.RUN_CONFIG} --resume "
                f"--allow-change optim.lr optim.lr={lr:.3g} (or change optim.warmup_ratio the same way, or check the data)")

    # -- evaluation, checkpoints -----------------------------------------------------------
    def evaluate(self) -> dict:
        """Validation loss/perplexity over ``run.eval_batches`` fixed batches."""
        d, r = self.cfg.data, self.cfg.run
        self.apply_anneal()
        return evaluate_mod.evaluate(self.model, self.val_ds, d.batch_size, d.seq_len, r.eval_batches, r.dtype, d.doc_masking)

    def trainer_state(self) -> dict:
        return {"step": self.step, "data_position": self.step * self.cfg.optim.grad_accum,
                "tokens_seen": self.tokens_seen, "flops_seen": self.flops_seen, "spikes": self.spikes.state_dict(),
                "rng": ckpt_io.rng_state(), "config_hash": self.cfg.resume_hash(), "config_changes": self.config_changes}

    def config_yaml(self) -> str:
        """The run config as written to the run dir and checkpoints, with the allowed changes as comments."""
        notes = "".join(f"# changed on resume at step {c['step']}: {c['field']} {c['old']!r} -> {c['new']!r}\n"
                        for c in self.config_changes)
        return notes + self.cfg.to_yaml()

    def save(self) -> Path:
        """Atomically write the checkpoint of the current step (keeps the newest ``run.keep_last``).

        NaN/inf weights or optimizer state stop the run as a divergence: nothing is written. What is
        written comes from ``gathered_state`` (the seam distribution fills in); the main process writes.
        """
        self.model.tables.flush()  # rows updated off their home tier (host tables) are written back first
        path = ckpt_io.checkpoint_dir(self.run_dir, self.step)
        with self.gathered_state() as st:
            if self.is_main:
                try:
                    path = ckpt_io.save_checkpoint(self.run_dir, self.step, st.model, st.opt, st.table_opt, st.trainer,
                                                   self.config_yaml(), self.data_dir, self.cfg.run.keep_last)
                except CheckpointError as e:
                    self._diverged(str(e), self.step, "the weights were updated")
        self.saved()
        self.last_ckpt = path
        return path

    @contextlib.contextmanager
    def gathered_state(self):
        """What a checkpoint holds, as ``SaveState`` (seam: under torchrun every rank gathers the shards
        and rank 0 writes); here the live model, optimizers and trainer state."""
        yield ckpt_io.SaveState(self.model, self.opt, self.table_opt, self.trainer_state())

    def saved(self) -> None:
        """Called on every process once the checkpoint is written (seam: a barrier under torchrun)."""

    # -- the run ---------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train from the current step to ``run.steps``; evaluate, checkpoint, log and plot.

        ``stop_at`` pauses after that many steps (with a checkpoint) without changing the
        schedule, which still spans ``run.steps``: ``--resume`` continues the same trajectory.
        """
        r = self.cfg.run
        end = min(r.steps, stop_at) if stop_at else r.steps
        if self.step >= r.steps and (done := finished_result(self.run_dir, self.step)) is not None:
            return done  # a finished run run again: report it and leave every file as it is
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            atomic_write_text(self.run_dir / ckpt_io.RUN_CONFIG, self.config_yaml())
            write_run_config(self.run_dir, self.model.cfg)  # from_pretrained(run_dir) finds the newest checkpoint
        self.peak_flops = peak_flops_for_run(self.run_dir, self.device, r.peak_flops, r.dtype)
        log = MetricsLog(RunDir(self.run_dir).metrics, resume_step=self.step) if self.is_main else _NoLog()
        from tqdm import tqdm  # here, not at import: the GPU suite imports the loop where only torch & co. exist
        bar = tqdm(total=r.steps, initial=self.step, desc=f"train {self.model.cfg.ffn}", disable=not (r.progress and self.is_main),
                   dynamic_ncols=True)
        start, rec, val = time.perf_counter(), None, None
        try:
            while self.step < end:
                rec = self.train_step()
                if self._new_changes:  # the first step after a resume with allowed changes records them
                    rec["config_changes"], self._new_changes = self._new_changes, []
                last = self.step == r.steps
                if last or (r.eval_every and self.step % r.eval_every == 0):
                    val = self.evaluate()["loss"]
                    rec["val_loss"] = val
                log.write(rec)
                if last or self.step == end or self.step % r.ckpt_every == 0:
                    self.save()
                if self.step % r.log_every == 0 or last:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    **({"val": f"{val:.3f}"} if val is not None else {}))
                bar.update(1)
        finally:
            bar.close()
            log.close()
        if val is None:  # resumed at the end: nothing trained, report the stored model
            val = self.evaluate()["loss"]
        if r.plots and self.is_main:
            from .plots import plot_run
            from .report import unigram_entropy
            plot_run(self.run_dir, baseline=unigram_entropy(self.data_dir))
        done = self.step >= r.steps and r.anneal != "off" and self.is_main
        export = export_stem(self.model, self.run_dir / "stem", self.data_dir) if done else None
        result = TrainResult(self.run_dir, self.step, rec["loss"] if rec else None, val, self.tokens_seen,
                             self.flops_seen, time.perf_counter() - start, self.last_ckpt, self.spikes.count, export,
                             self.matmul_backend)
        if self.is_main:
            atomic_write_text(RunDir(self.run_dir).summary, json.dumps(result.summary(), indent=2))
        return result


class _NoLog:
    """Metrics sink of the processes that do not write logs."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
