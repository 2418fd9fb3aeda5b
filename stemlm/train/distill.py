"""Distillation from a frozen teacher during training (``run.distill=TEACHER``).

A converted model can be trained against the dense model it came from: the loss of a micro-batch
becomes

    (1 − w) · CE(student, next token)  +  w · T² · KL(teacher_T ‖ student_T)

with ``w = run.distill_weight`` and ``T = run.distill_temperature``; ``X_T`` is the next-token
distribution of ``X`` at temperature ``T``, the KL is the mean over the tokens that have a target.
``run.distill_schedule=linear`` takes ``w`` down linearly to 0 over the run (``w_s = w · (1 − s / steps)``
at step ``s`` from 0): the teacher guides the start, where the converted model is furthest from it, and the
end is trained on the data alone; ``constant`` (the default) keeps ``w``.
``run.distill_top_k = k > 0`` keeps the teacher's ``k`` most likely tokens (renormalised over them),
which is what a cache of teacher outputs would hold; ``0`` uses the full distribution.

The teacher's logits are computed on the fly, on the same batch, with no gradient: its final hidden
states ``(B, T, d)`` are kept, and the logits of both models are formed ``chunk`` tokens at a time
inside an activation checkpoint, so peak memory is ``chunk × V`` per model rather than ``B·T × V``.
The logged ``loss`` stays the cross-entropy, so a distilled run reads like any other.

When memory is short, ``run.distill_cache`` computes the teacher's top-k logits of every micro-batch
of the run once, before training, into ``<run.out>/distill_topk/`` (``CachedTeacher``), and training
holds only the student.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.loss import IGNORE_INDEX, linear_cross_entropy
from ..runtime.matmul import matmul_backend_of

CHUNK_ELEMENTS = 1 << 22  # logits per chunk, as in the fused cross-entropy


DISTILL_SCHEDULES = ("constant", "linear")


def mixed_objective(ce: torch.Tensor, kl: torch.Tensor, weight: float, temperature: float) -> torch.Tensor:
    """``(1 − w) CE + w T² KL``."""
    return (1 - weight) * ce + weight * temperature ** 2 * kl


@dataclass(frozen=True)
class DistillConfig:
    """The teacher checkpoint and how its distribution enters the loss."""

    teacher: str
    weight: float = 0.5
    temperature: float = 1.0
    top_k: int = 0
    schedule: str = "constant"

    def __post_init__(self):
        if self.schedule not in DISTILL_SCHEDULES:
            raise ValueError(f"run.distill_schedule must be one of {', '.join(DISTILL_SCHEDULES)}, got {self.schedule!r}")
        if not 0 <= self.weight <= 1:
            raise ValueError(f"run.distill_weight must be in [0, 1], got {self.weight!r}")
        if self.temperature <= 0:
            raise ValueError(f"run.distill_temperature must be positive, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"run.distill_top_k must be >= 0 (0 = the full distribution), got {self.top_k!r}")

    def weight_at(self, step: int, steps: int) -> float:
        """The KL's weight at 0-based ``step`` of ``steps`` (``schedule``, module doc)."""
        if self.schedule == "linear":
            return self.weight * max(0.0, 1.0 - step / max(steps, 1))
        return self.weight


def _kl_chunk(student_h, student_w, teacher_h, teacher_w, valid, temperature: float, top_k: int) -> torch.Tensor:
    """Σ over the chunk's valid tokens of KL(teacher_T ‖ student_T); ``*_h (c, d)``, ``*_w (V, d)``."""
    logq = F.log_softmax((student_h @ student_w.T).float() / temperature, dim=-1)  # (c, V)
    with torch.no_grad():
        t = (teacher_h @ teacher_w.T).float() / temperature  # (c, V)
        if top_k:
            t, idx = t.topk(top_k, dim=-1)  # (c, k)
        logp = F.log_softmax(t, dim=-1)
    if top_k:
        logq = logq.gather(1, idx)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (c,)
    return torch.where(valid, kl, 0.0).sum()


def _kl_cached_chunk(student_h, student_w, values, indices, valid, temperature: float) -> torch.Tensor:
    """Σ over the chunk's valid tokens of the top-k KL against cached teacher logits ``values``/``indices (c, k)``."""
    logq = F.log_softmax((student_h @ student_w.T).float() / temperature, dim=-1).gather(1, indices)
    logp = F.log_softmax(values.float() / temperature, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return torch.where(valid, kl, 0.0).sum()


def kd_kl_cached(student_h: torch.Tensor, student_w: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                 targets: torch.Tensor, temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """``kd_kl`` with ``top_k`` against the teacher's cached top-k logits ``values`` and ids ``indices (N, k)``."""
    chunk = chunk or max(1, CHUNK_ELEMENTS // student_w.shape[0])
    valid = targets != IGNORE_INDEX
    total = student_h.new_zeros((), dtype=torch.float32)
    for a in range(0, student_h.shape[0], chunk):
        c = slice(a, a + chunk)
        total = total + checkpoint(_kl_cached_chunk, student_h[c], student_w, values[c], indices[c].long(), valid[c],
                                   temperature, use_reentrant=False)
    return total / valid.sum().clamp(min=1)


def kd_kl(student_h: torch.Tensor, student_w: torch.Tensor, teacher_h: torch.Tensor, teacher_w: torch.Tensor,
          targets: torch.Tensor, temperature: float = 1.0, top_k: int = 0, chunk: int | None = None) -> torch.Tensor:
    """Mean KL(teacher_T ‖ student_T) over the tokens whose target is not ``-100``.

    ``student_h``/``teacher_h (N, d)`` are the final normed hidden states, ``*_w (V, d)`` the LM heads,
    ``targets (N,)``. Chunks of ``chunk`` tokens (default: ``CHUNK_ELEMENTS // V``) are checkpointed,
    so only one chunk's logits are alive at a time, in forward and in backward.
    """
    if student_h.shape[0] != teacher_h.shape[0] or student_w.shape[0] != teacher_w.shape[0]:
        raise ValueError(f"teacher and student disagree: tokens {teacher_h.shape[0]} vs {student_h.shape[0]}, "
                         f"vocabulary {teacher_w.shape[0]} vs {student_w.shape[0]}")
    chunk = chunk or max(1, CHUNK_ELEMENTS // student_w.shape[0])
    valid = targets != IGNORE_INDEX
    total = student_h.new_zeros((), dtype=torch.float32)
    for a in range(0, student_h.shape[0], chunk):
        c = slice(a, a + chunk)
        total = total + checkpoint(_kl_chunk, student_h[c], student_w, teacher_h[c], teacher_w, valid[c],
                                   temperature, top_k, use_reentrant=False)
    return total / valid.sum().clamp(min=1)


class Teacher:
    """A frozen teacher model and the loss that distils it into a student (``DistillConfig``)."""

    def __init__(self, cfg: DistillConfig, device: torch.device | str = "cpu"):
        from ..checkpoint.directory import CheckpointError, resolve_checkpoint
        from ..store import Placement, open_model

        self.cfg = cfg
        try:
            path = resolve_checkpoint(cfg.teacher)
        except CheckpointError as e:
            raise ValueError(f"run.distill: {e}") from None
        self.model = open_model(path, Placement(device=str(device))).eval().requires_grad_(False)

    def check_student(self, student) -> None:
        """A one-line ``ValueError`` unless the student predicts over the teacher's vocabulary."""
        if student.cfg.vocab_size != self.model.cfg.vocab_size:
            raise ValueError(f"run.distill: the teacher's vocabulary ({self.model.cfg.vocab_size}) differs from the "
                             f"model's ({student.cfg.vocab_size})")

    def losses(self, forward_model, student, batch, weight: float,
               doc_masking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cross-entropy, objective)`` of ``batch``: the objective mixes in the KL to the teacher at ``weight``
        (this step's, ``cfg.weight_at``).

        ``forward_model`` runs the student (it may wrap ``student``, e.g. DDP); ``student`` owns the LM head.
        """
        doc_ids = batch.doc_ids if doc_masking else None
        h = forward_model(batch.inputs, doc_ids=doc_ids, return_hidden=True)  # (B, T, d)
        with torch.no_grad():
            th = self.model(batch.inputs, doc_ids=doc_ids, return_hidden=True)
        d = h.shape[-1]
        targets = batch.targets.reshape(-1)
        w = student.lm_head.weight
        ce = linear_cross_entropy(h.reshape(-1, d), w, targets, backend=matmul_backend_of(student.lm_head))
        c = self.cfg
        if weight == 0:
            return ce, ce
        kl = kd_kl(h.reshape(-1, d), w, th.reshape(-1, d).to(h.dtype), self.model.lm_head.weight.to(w.dtype),
                   targets, c.temperature, c.top_k)
        return ce, mixed_objective(ce, kl, weight, c.temperature)


def batch_key(inputs: torch.Tensor) -> str:
    """The name a micro-batch's cached teacher outputs are stored under: a digest of its token ids."""
    return hashlib.sha256(inputs.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:24]


class CachedTeacher:
    """The teacher's top-k logits of every micro-batch of a run, computed once and read from disk.

    ``build`` runs the teacher over the micro-batches ``host_batch(0 … n_micro − 1)`` and writes one
    file per batch (``<dir>/<batch_key>.safetensors``: ``values`` fp16 and ``indices`` int32, ``(B, T, k)``);
    files already there are kept, so an interrupted build or a resumed run continues. The teacher is
    then dropped: training holds only the student.
    """

    def __init__(self, cfg: DistillConfig, cache_dir: Path):
        self.cfg, self.dir = cfg, Path(cache_dir)

    @classmethod
    def build(cls, teacher: Teacher, host_batch, n_micro: int, cache_dir: Path, device,
              progress: bool = True) -> "CachedTeacher":
        """Write the top-k cache of ``n_micro`` micro-batches (``host_batch(i)``) into ``cache_dir``."""
        from safetensors.torch import save_file
        from tqdm import tqdm

        from ..runtime.files import atomic_file

        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        k = teacher.cfg.top_k
        for i in tqdm(range(n_micro), desc="teacher top-k", disable=not progress, dynamic_ncols=True):
            batch = host_batch(i)
            path = cache_dir / f"{batch_key(batch.inputs)}.safetensors"
            if path.exists():
                continue
            with torch.no_grad():
                h = teacher.model(batch.inputs.to(device), return_hidden=True)  # (B, T, d)
                values, indices = (h @ teacher.model.lm_head.weight.T).float().topk(k, dim=-1)  # (B, T, k)
            with atomic_file(path) as tmp:
                save_file({"values": values.half().cpu().contiguous(), "indices": indices.int().cpu().contiguous()},
                          str(tmp))
        return cls(teacher.cfg, cache_dir)

    def losses(self, forward_model, student, batch, weight: float,
               doc_masking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cross-entropy, objective)`` as ``Teacher.losses``, the teacher's top-k read from the cache."""
        from safetensors.torch import load_file

        path = self.dir / f"{batch_key(batch.inputs)}.safetensors"
        if not path.exists():
            raise ValueError(f"run.distill_cache: no cached teacher outputs for this batch in {self.dir}")
        if doc_masking:
            raise ValueError("run.distill_cache caches the teacher without document masking; turn one of them off")
        h = forward_model(batch.inputs, return_hidden=True)
        d, w = h.shape[-1], student.lm_head.weight
        targets = batch.targets.reshape(-1)
        ce = linear_cross_entropy(h.reshape(-1, d), w, targets, backend=matmul_backend_of(student.lm_head))
        if weight == 0:
            return ce, ce
        cached = load_file(str(path), device=str(h.device))
        kl = kd_kl_cached(h.reshape(-1, d), w, cached["values"].reshape(-1, self.cfg.top_k),
                          cached["indices"].reshape(-1, self.cfg.top_k), targets, self.cfg.temperature)
        return ce, mixed_objective(ce, kl, weight, self.cfg.temperature)


def distill_config(run) -> DistillConfig:
    """The ``DistillConfig`` of a run section with ``run.distill`` set (``ValueError`` for a bad value)."""
    return DistillConfig(run.distill, run.distill_weight, run.distill_temperature, run.distill_top_k,
                         run.distill_schedule)


def teacher_for_run(run, device: torch.device | str, student, host_batch=None, n_micro: int = 0,
                    cache_dir: Path | None = None, progress: bool = True) -> Teacher | CachedTeacher | None:
    """The teacher of a run section (None without ``run.distill``), checked against ``student``.

    With ``run.distill_cache`` the teacher's top-k of the run's ``n_micro`` micro-batches
    (``host_batch(i)``) is written to ``cache_dir`` first and a ``CachedTeacher`` returned.
    """
    if not run.distill:
        return None
    cfg = distill_config(run)
    teacher = Teacher(cfg, device)
    teacher.check_student(student)
    if not run.distill_cache:
        return teacher
    return CachedTeacher.build(teacher, host_batch, n_micro, cache_dir, device, progress)
