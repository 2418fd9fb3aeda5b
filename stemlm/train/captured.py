"""One training step on fixed buffers, and its capture as one CUDA graph (``run.step_graph``).

A dense step at the 350M shape is launch-bound on a GPU (issue 33: 50.6 ms of kernels in an 85.5 ms
step, ~2,400 kernels): the host cannot issue kernels as fast as the GPU runs them. Capturing the
whole step — every micro-batch's forward and backward, clipping, and both optimizer updates — as one
CUDA graph and replaying it costs one launch per step (Megatron-LM's full-iteration graphs; one
region, not one per block: each replay pays ~0.3 ms of host-side checks, PyTorch issue 150488).

``CapturedStep`` runs that step on fixed buffers, so it has no data-dependent shape and reads
nothing back to the host:

* the micro-batches' inputs and targets are copied into fixed ``(accum, B, T)`` buffers;
* the step's distinct ids are found on the device with static shapes (``FusedTables``, padded
  slots), so the table path needs no host sync;
* the learning rates are device tensors: the backbone's AdamW runs ``capturable`` with a tensor lr
  per group, the fused table optimizer reads its lr and step counter from device scalars
  (``FusedRowAdamW.use_device_scalars``); the host writes their values before each replay;
* the micro-batch losses and the gradient norm land in fixed output tensors, read back once after
  the step (as the eager loop's one ``.tolist()``).

Mode ``static`` runs this step eagerly (any device: the tests hold it equal to the eager loop);
``graph`` (CUDA) runs it eagerly for ``WARMUP`` steps (allocations, compilation, autotuning happen
there), captures it at the next step and replays it from then on. A captured step is one real
training step: capturing records, then the step is replayed once to run it.

What changes against the eager loop: the optimizers have updated the weights before the host
learns of a non-finite loss or norm (the step cannot be refused from the host without a sync), so a
diverged step stops the run with the weights in memory already updated; the checkpoints on disk are
untouched. Host-RAM tables are captured only when ``run.step_graph`` names ``static`` or ``graph``: they
then train through a fixed device slab (``SlabTables``, loaded before each step outside the graph); under
``auto`` they keep the uncaptured window of ``HostTables``. Not captured: ``run.anneal``
(scales change every step), Hash-MoE layers (they route by data), distributed runs.
"""

from __future__ import annotations

import warnings

import torch

from ..data.tokens import Batch
from ..model.tables import ids_checked
from . import evaluate as evaluate_mod

WARMUP = 2  # eager steps before the capture (side-stream warm-up, as torch.cuda.graphs recommends)


class CapturedStep:
    """Forward, backward, clipping and both optimizer updates of one step on fixed buffers."""

    def __init__(self, trainer, graphs: bool, fallback: bool = False):
        """``fallback``: when capturing fails (``run.step_graph=auto``), warn and run the same
        fixed-buffer step uncaptured from then on instead of stopping the run."""
        cfg = trainer.cfg
        self.trainer, self.graphs, self.fallback = trainer, graphs, fallback
        self.device = trainer.device
        accum, B, T = cfg.optim.grad_accum, cfg.data.batch_size, cfg.data.seq_len
        z = lambda *shape, dt=torch.long: torch.zeros(shape, dtype=dt, device=self.device)  # noqa: E731
        self.inputs, self.targets, self.doc_ids = z(accum, B, T), z(accum, B, T), z(accum, B, T)
        self.losses = z(accum, dt=torch.float32)
        self.norm = z(dt=torch.float32)
        self.params = [p for g in trainer.opt.param_groups for p in g["params"]]
        # learning rates on the device: fp32 for CUDA's fused AdamW (it reads a float), fp64 elsewhere
        lr_dtype = torch.float32 if self.device.type == "cuda" else torch.float64
        self.lrs = [torch.tensor(float(g["lr"]), dtype=lr_dtype, device=self.device) for g in trainer.opt.param_groups]
        if graphs:
            _make_capturable(trainer.opt, self.device)
        self.table_opt = trainer.table_opt
        if self.table_opt is not None:
            self.table_opt.use_device_scalars(self.device)
        self.calls = 0
        self.graph = None
        self.pool = None

    def __call__(self, host: list[Batch]) -> tuple[list[float], float]:
        """Run the step on the host micro-batches ``host``; ``(micro-batch losses, gradient norm)``."""
        for i, b in enumerate(host):
            for buf, t in ((self.inputs, b.inputs), (self.targets, b.targets), (self.doc_ids, b.doc_ids)):
                src = t.pin_memory() if self.device.type == "cuda" else t
                buf[i].copy_(src, non_blocking=True)
        groups = self.trainer.opt.param_groups
        for g, lr in zip(groups, self.lrs):
            lr.fill_(float(g["lr"]))
        if self.table_opt is not None:
            self.table_opt.sync_device_scalars()
        if not self.graphs or self.calls < WARMUP:
            self._run_eager(groups)
        elif self.graph is None:
            if self._capture_or_fall_back(groups):
                self.graph.replay()  # the capture recorded the step without running it
        else:
            self.graph.replay()
            if self.table_opt is not None:
                self.table_opt.global_step += 1  # the replay advanced the device's counter, not the host's
        self.calls += 1
        values = torch.cat([self.losses, self.norm[None]]).tolist()  # the step's one read-back
        return values[:-1], values[-1]

    def _run_eager(self, groups) -> None:
        if self.graphs:  # warm up on a side stream, as a capture needs
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(groups)
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self._body(groups)
        self.trainer.opt.zero_grad(set_to_none=True)

    def _capture_or_fall_back(self, groups) -> bool:
        """Capture the step (True); under ``fallback`` a capture that fails (no memory for the graph's
        pool, an op that cannot be captured) warns, runs this step uncaptured and returns False."""
        global_step = getattr(self.table_opt, "global_step", None)
        try:
            self._capture(groups)
            return True
        except Exception as e:
            if not self.fallback:
                raise
            self.graph, self.graphs = None, False
            if global_step is not None:
                self.table_opt.global_step = global_step  # a capture that broke off ran nothing
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            first = (str(e).splitlines() or [""])[0]
            warnings.warn(f"run.step_graph=auto: capturing the training step as a CUDA graph failed "
                          f"({type(e).__name__}: {first}); training on with the same step uncaptured "
                          "(run.step_graph=eager skips the attempt)", stacklevel=3)
            self._run_eager(groups)
            return False

    def _capture(self, groups) -> None:
        self.trainer.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self._body(groups)

    def _body(self, groups) -> None:
        """The step itself: what a graph records. Group lrs are the device tensors while it runs."""
        t, cfg = self.trainer, self.trainer.cfg
        accum = cfg.optim.grad_accum
        floats = [g["lr"] for g in groups]
        for g, lr in zip(groups, self.lrs):
            g["lr"] = lr
        try:
            tables = t.model.tables
            with ids_checked():
                tables.begin_step([t.model.table_keys(self.inputs[i]) for i in range(accum)])
                for i in range(accum):
                    batch = Batch(self.inputs[i], self.targets[i], self.doc_ids[i])
                    with evaluate_mod.autocast(self.device, cfg.run.dtype, cache=not self.graphs):
                        loss, objective = t.micro_loss(batch)  # they differ under run.distill
                    (objective / accum).backward()
                    self.losses[i].copy_(loss.detach())
            table_grads = self.table_opt.collect() if self.table_opt is not None else []
            self.norm.copy_(t.clip_gradients(self.params, table_grads))
            t.opt.step()
            if self.table_opt is not None:
                self.table_opt.step()
        finally:
            for g, lr in zip(groups, floats):
                g["lr"] = lr


def _make_capturable(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch a torch AdamW to ``capturable`` (its step counters on the device)."""
    for g in opt.param_groups:
        g["capturable"] = True
    opt.defaults["capturable"] = True
    for state in opt.state.values():
        if "step" in state and torch.is_tensor(state["step"]):
            state["step"] = state["step"].to(device=device, dtype=torch.float32)


def check_step_graph(trainer) -> str:
    """The step mode ``trainer`` runs (``eager``, ``static`` or ``graph``): ``run.step_graph``, with
    ``auto`` = ``graph`` on CUDA when the step can run on fixed buffers, else ``eager``; a one-line
    ``ConfigError`` when a mode asked for by name cannot run."""
    from ..config import ConfigError

    mode = trainer.cfg.run.step_graph
    if mode == "auto":
        return "graph" if trainer.device.type == "cuda" and _step_graph_problem(trainer, "graph") is None else "eager"
    if mode == "eager":
        return mode
    if mode == "graph" and trainer.device.type != "cuda":
        raise ConfigError(f"run.step_graph=graph captures a CUDA graph; the run is on {trainer.device} "
                          "(use run.step_graph=static to run the same step eagerly)")
    problem = _step_graph_problem(trainer, mode)
    if problem:
        raise ConfigError(f"run.step_graph={mode} cannot run this step on fixed buffers: {problem}")
    return mode


def _step_graph_problem(trainer, mode: str) -> str | None:
    """Why ``trainer``'s step cannot run on fixed buffers in ``mode`` (``static`` or ``graph``), or None."""
    from ..ffn import ffn_kind
    from ..model.tables import trained_whole
    from .fused import FusedTables, HostTables

    cfg = trainer.cfg
    tables = trainer.model.tables
    if isinstance(tables, HostTables):  # run.step_graph=static/graph install SlabTables instead
        return "host-RAM tables move rows between steps (name run.step_graph=static or graph to train them through a fixed device slab)"
    if len(tables) and not isinstance(tables, FusedTables) and not trained_whole(tables.values()):
        return "the table path must be fused (run.table_path=fused, or auto on CUDA)"
    if cfg.run.anneal != "off":
        return "run.anneal changes the layers' scales every step"
    if any(ffn_kind(k).routes_by_data for k in trainer.model.cfg.layer_kinds):
        return "Hash-MoE layers route by data"
    if not trainer.is_main or type(trainer).__name__ != "Trainer":
        return "distributed runs are not captured"
    if cfg.run.distill is not None and mode == "graph":
        return "run.distill's teacher (or its cached top-k files) is not captured; use run.step_graph=static"
    return None
