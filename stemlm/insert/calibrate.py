"""Calibrated table initialisation: turn a dense model into STEM with rows fitted to its activations.

One streamed pass of the dense model over calibration text, layer by layer: the residual stream
of every calibration sequence is kept (``n_seq × T × d`` fp32, the only activation held), each
block is applied to it in chunks of sequences, and at a STEM layer the FFN's statistics are
accumulated per token id and the rows fitted (``stemlm.insert.fit``) *before* the stream moves on.
With ``sequential`` (default) the stream then passes through the converted STEM layer, so every
later layer is fitted on the activations the already-converted layers produce; without it the
dense FFN is kept in the stream (every layer fitted on the dense model's own activations).
``correct_drift`` carries the dense model's own stream beside the converted one, and the ``W_d``
refit and local distillation of each converted layer then aim at the dense stream after the layer:
target ``h_dense + FFN(h_dense) − h``, which also undoes what the layers before it changed
(both ``h`` after the layer's attention; the rows' own fit is unchanged).

After a layer's rows are fitted (and ``W_d`` refitted with ``refit_down``), ``als_rounds`` rounds of
alternating least squares and ``distill_steps`` steps of local distillation can follow
(``stemlm.insert.distill``): both make the converted layer's output match the dense layer's on the
same inputs, the pass's stream (the dense model's own hidden states with ``sequential=False``).

Memory is bounded by the stream (two with ``correct_drift``), one layer's statistics
(``2 × V × d_ff`` fp64) and one table: each fitted table goes to a work directory on disk at once. The work directory also makes the
pass resumable: the stream and the position are saved after a table layer when at least
``save_every_s`` seconds passed since the last save, and a new call with the same settings
continues from there. Everything is deterministic (fixed windows, CPU sums in a fixed order).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..ffn import ffn_kind
from ..fields import coerce_fields
from ..model.decoder import StemLM, rope_cos_sin
from ..runtime.devices import resolve_device
from ..runtime.files import atomic_file, atomic_write_text
from .distill import DistillSettings, alternate_layer, distill_layer, layer_output, resolved_precision
from .fit import METHODS, UNSEEN, DownRefit, LayerStats, refine_through_down

LAYER_CHOICES = ("cheapest", "uniform")


@dataclass(frozen=True)
class CalibrationConfig:
    """How the rows are fitted (see ``stemlm.insert.fit`` for the methods).

    The defaults are the best setting of the committed grid (``benchmarks/bench_insertion_grid.py``,
    docs/insertion.md): measured on held-out text in and out of the calibration domain."""

    method: str = "gated"  # gated | mean | down | zero
    unseen: str = "pooled"  # default row of ids the calibration text never shows: pooled | zero
    sequential: bool = True  # fit each layer on the activations of the layers converted before it
    refit_down: bool = True  # also refit W_d by least squares on the STEM hidden activations
    tokens: int = 262_144  # calibration tokens (rounded down to whole windows)
    seq_len: int = 256  # window length
    chunk: int = 8  # windows per forward chunk
    down_iters: int = 8  # conjugate-gradient iterations of ``method=down``
    dagger_rows: str = "zero"  # stem_dagger tables: zero (exactly the dense model) | fit (rows replacing W_u x,
    #                            for run.anneal=blend, which weighs them against the annealed-out up-projection)
    shrink: float = 4096.0  # pseudo-contexts of the pooled fit added to every seen id (rare ids lean to the pooled row)
    als_rounds: int = 0  # rounds of alternating least squares after the fit: rows given W_d, then W_d given rows
    distill_steps: int = 0  # Adam steps of local distillation per converted layer (stemlm.insert.distill)
    distill_lr: float = 1e-3  # its learning rate (linear decay to a tenth)
    distill_batch: int = 2048  # its minibatch, in tokens
    distill_down: bool = False  # also train W_d of the converted layers while distilling
    distill_gate: bool = False  # also train W_g of the converted layers while distilling
    distill_rows: str = "catchup"  # distillation's row update: dense (Adam on all rows) | catchup (the same, on
    #                                the touched rows only) | lazy (per-row Adam on the touched rows); DistillSettings
    distill_precision: str = "auto"  # distillation's GEMMs: fp32 | bf16 | auto (bf16 where it is fast: bf16_is_fast)
    correct_drift: bool = False  # sequential: the W_d refit and local distillation aim at the dense model's own
    #                              residual stream, so each converted layer also undoes the drift of those before it
    layer_choice: str = "cheapest"  # ratio placements: cheapest (the layers of least measured cost,
    #                                 stemlm.insert.placement) | uniform (the placement's own layers)
    device: str = "auto"  # where the pass runs: auto (the GPU if there is one) | cpu | cuda[:N]; not part of the key

    def __post_init__(self):
        # every field as its annotation says, as the configs do: a YAML 4096 and the CLI's 4096.0 are one shrink,
        # with one work-dir key; YAML 1.1's text "2e-3" is a number
        coerce_fields(self, "calibration ")
        if self.method not in METHODS:
            raise ValueError(f"unknown calibration method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.unseen not in UNSEEN:
            raise ValueError(f"unknown unseen-id default {self.unseen!r}; choose one of {', '.join(UNSEEN)}")
        for name in ("tokens", "seq_len", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration {name} must be a positive integer, got {getattr(self, name)}")
        if self.layer_choice not in LAYER_CHOICES:
            raise ValueError(f"unknown layer_choice {self.layer_choice!r}; choose one of {', '.join(LAYER_CHOICES)}")
        if self.dagger_rows not in ("zero", "fit"):
            raise ValueError(f"unknown dagger_rows {self.dagger_rows!r}; choose zero or fit")
        for name in ("als_rounds", "distill_steps", "shrink"):
            if getattr(self, name) < 0:
                raise ValueError(f"calibration {name} must be >= 0, got {getattr(self, name)}")
        if self.distill_batch < 1 or self.distill_lr <= 0:
            raise ValueError(f"distillation needs distill_batch >= 1 and distill_lr > 0, got {self.distill_batch}, "
                             f"{self.distill_lr}")
        if self.correct_drift and not self.sequential:
            raise ValueError("correct_drift needs sequential calibration (with a parallel pass nothing drifts)")
        if self.distill_gate and not self.distill_steps:
            raise ValueError("distill_gate trains W_g during local distillation: set distill_steps > 0")
        self.distill_settings()  # a one-line error for an unknown distill_rows or distill_precision
        if self.correct_drift and self.als_rounds:
            raise ValueError("correct_drift applies to the W_d refit and local distillation, not to als_rounds")
        if self.tokens < self.seq_len:
            raise ValueError(f"calibration tokens ({self.tokens}) must cover one window of seq_len {self.seq_len}")
        resolve_device(self.device, "calibration device")

    def torch_device(self) -> torch.device:
        """The ``torch.device`` the pass runs on."""
        return resolve_device(self.device, "calibration device")

    def distill_settings(self) -> DistillSettings:
        """The local distillation these settings ask for (``steps`` 0: none)."""
        return DistillSettings(self.distill_steps, self.distill_lr, self.distill_batch, self.distill_down,
                               train_gate=self.distill_gate, rows=self.distill_rows,
                               precision=self.distill_precision)

    def key(self, model_digest: str, ids_digest: str, target: ModelConfig) -> str:
        # the same fit on any device; correct_drift and distill_gate only when on, distillation's row update and
        # precision only when distilling and not as before they existed (dense, fp32; auto as what it resolves to
        # here), so work dirs keyed before these settings existed stay valid
        settings = {k: v for k, v in asdict(self).items()
                    if k != "device" and not (k in ("correct_drift", "distill_gate") and not v)}
        settings["distill_precision"] = resolved_precision(self.distill_precision, self.torch_device())
        for name, legacy in (("distill_rows", "dense"), ("distill_precision", "fp32")):
            if not self.distill_steps or settings[name] == legacy:
                del settings[name]
        text = json.dumps({"calib": settings, "model": model_digest, "ids": ids_digest,
                           "target": target.to_dict()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibration_windows(tokens: np.ndarray, n_tokens: int, seq_len: int) -> torch.Tensor:
    """``(n_seq, seq_len)`` windows spread evenly over a token stream (deterministic)."""
    n_seq = max(1, min(n_tokens // seq_len, len(tokens) // seq_len))
    if len(tokens) < seq_len:
        raise ValueError(f"calibration text has {len(tokens)} tokens, fewer than one window of {seq_len}")
    starts = np.linspace(0, len(tokens) - seq_len, n_seq).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts]))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class _WorkDir:
    """Fitted tables (one file per layer) and the resumable stream position."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = Path(root), key
        self.root.mkdir(parents=True, exist_ok=True)

    def table_file(self, layer: int) -> Path:
        return self.root / f"table_{layer}.safetensors"

    def down_file(self, layer: int) -> Path:
        """The layer's refitted projections (``w_down``, and ``w_gate`` where distillation trained it)."""
        return self.root / f"down_{layer}.safetensors"

    def save_table(self, layer: int, rows: torch.Tensor, weights: dict[str, torch.Tensor]) -> None:
        _atomic_save({"rows": rows.contiguous()}, self.table_file(layer))
        if weights:
            _atomic_save({k: w.contiguous() for k, w in weights.items()}, self.down_file(layer))

    def save_stream(self, next_layer: int, stream: torch.Tensor, dense_stream: torch.Tensor | None = None) -> None:
        _atomic_save({"stream": stream, **({"dense": dense_stream} if dense_stream is not None else {})},
                     self.root / "stream.safetensors")
        atomic_write_text(self.root / "progress.json", json.dumps({"key": self.key, "next_layer": next_layer}))

    def save_done(self, next_layer: int) -> None:
        """Every table is fitted: a later call with the same key reuses them and needs no stream."""
        atomic_write_text(self.root / "progress.json",
                          json.dumps({"key": self.key, "next_layer": next_layer, "done": True}))

    def resume(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(next layer, saved streams)`` of a pass with this key (no streams once it is done), or None."""
        try:
            progress = json.loads((self.root / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if progress.get("key") != self.key:
            return None
        if progress.get("done"):
            return progress["next_layer"], {}
        return progress["next_layer"], load_file(str(self.root / "stream.safetensors"))


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_file(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))


def chunk_slices(n: int, size: int) -> list[slice]:
    """``n`` windows in slices of at most ``size`` (the forward chunks of the calibration pass and ``fit_layer``)."""
    return [slice(a, min(n, a + size)) for a in range(0, n, size)]


@torch.no_grad()
def calibrate(dense: StemLM, target: ModelConfig, ids: torch.Tensor, calib: CalibrationConfig, work_dir: Path,
              progress: bool = True, save_every_s: float = 60.0,
              log: Callable[[str], None] = lambda s: None) -> dict[int, tuple[Path, Path | None]]:
    """Fit the tables of ``target``'s table layers from the all-dense ``dense`` over ``ids (n_seq, T)``.

    The pass runs where ``dense`` is (``calibrated_model`` moves it to ``calib.device``).

    Returns ``{layer: (table file, refitted projections file or None)}`` in ``work_dir``; every table
    is ``(V, d_ff)`` fp32 under key ``rows``, the projections under their names (``w_down``, ``w_gate``).
    ``stem_dagger`` layers get zero tables (with its up-projection kept, zero rows are exactly the dense
    layer) unless ``calib.dagger_rows="fit"``. Resumes a pass stopped earlier in the same ``work_dir``
    with the same model, text and settings.
    """
    from tqdm import tqdm

    if not all(ffn_kind(k).is_dense for k in dense.cfg.layer_kinds):
        raise ValueError("calibrate needs the all-dense model (convert with ffn=dense first)")
    if (target.d_model, target.n_layers, target.d_ff, target.vocab_size) != (
            dense.cfg.d_model, dense.cfg.n_layers, dense.cfg.d_ff, dense.cfg.vocab_size):
        raise ValueError("the target config's shape differs from the dense model's")
    dense = dense.float().eval()
    device = dense.tok_embeddings.weight.device
    ids = ids.to(device)
    work = _WorkDir(work_dir, calib.key(_digest(dense.tok_embeddings.weight[:64]), _digest(ids), target))
    n_seq, T = ids.shape
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(T), target.head_dim, target.rope_theta, torch.float32))
    chunks = chunk_slices(n_seq, calib.chunk)
    resumed = work.resume()
    if resumed is not None:
        start, saved = resumed  # saved is empty for a finished pass: every layer below is skipped
        stream = saved["stream"].to(device) if saved else None
        dense_stream = saved["dense"].to(device) if saved and calib.correct_drift else None
        log(f"calibration resumed at layer {start} from {work.root}" if saved else
            f"calibration finished earlier in {work.root}: its tables are reused")
    else:
        start = 0
        stream = torch.cat([dense.tok_embeddings(ids[c]) for c in chunks])  # (n_seq, T, d)
        dense_stream = stream.clone() if calib.correct_drift else None  # the dense model's own, beside the converted
    streams = [s for s in (stream, dense_stream) if s is not None]
    out: dict[int, tuple[Path, Path | None]] = {}
    last_save = time.monotonic()
    last = max((i for i, k in enumerate(target.layer_kinds) if ffn_kind(k).owns_table), default=-1)
    bar = tqdm(total=last + 1, initial=start, desc="calibrate", disable=not progress, dynamic_ncols=True)
    for i in range(last + 1):  # nothing after the last table layer changes a fit
        kind = target.layer_kinds[i]
        if i < start:
            if ffn_kind(kind).owns_table:
                down = work.down_file(i)
                out[i] = (work.table_file(i), down if down.exists() else None)
            continue
        block = dense.layers[i]
        for c in chunks:
            for s in streams:
                h = s[c]
                h += block.attn(block.attn_norm(h), cos, sin, 0)
            if dense_stream is not None:  # the dense stream passes the whole layer now: it is the fit's target
                hd = dense_stream[c]
                hd += block.ffn(block.ffn_norm(hd))
        if ffn_kind(kind).owns_table:
            refine = not ffn_kind(kind).zero_rows_are_dense  # such a start must stay the dense model: no W_d change
            kind = fitted_kind(kind, calib)
            rows, weights = fit_layer(block, kind, stream, ids, chunks, calib, dense.tok_embeddings.weight, refine,
                                      lambda s, i=i: log(f"layer {i}: {s}"), progress, dense_stream)
            work.save_table(i, rows, weights)
            out[i] = (work.table_file(i), work.down_file(i) if weights else None)
            use_stem = calib.sequential
        else:
            rows, weights, use_stem = None, {}, False
        for c in chunks:
            h = stream[c]
            x = block.ffn_norm(h)
            if use_stem:
                h += layer_output(block.ffn, kind, x, rows[ids[c]], weights)
            else:
                h += block.ffn(x)
        del rows
        bar.update(1)
        if ffn_kind(kind).owns_table and time.monotonic() - last_save > save_every_s and i < last:
            work.save_stream(i + 1, stream, dense_stream)
            last_save = time.monotonic()
    work.save_done(last + 1)
    bar.close()
    return out


def fitted_kind(kind: str, calib: CalibrationConfig) -> str:
    """The kind whose rows are fitted: a kind that gradual insertion turns into another (STEM† into
    STEM) is, with ``dagger_rows=fit``, fitted (and propagated) as the layer it becomes at the end of
    ``run.anneal=blend`` (``FFNKind.anneals_to``)."""
    becomes = ffn_kind(kind).anneals_to
    return becomes if becomes and calib.dagger_rows == "fit" else kind


def fit_layer(block, kind: str, stream: torch.Tensor, ids: torch.Tensor, chunks: list[slice],
              calib: CalibrationConfig, embedding: torch.Tensor, refine: bool,
              log: Callable[[str], None] = lambda s: None, progress: bool = False,
              dense_stream: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows ``(V, d_ff)`` and the refitted projections (``{"w_down": …}``, with ``W_g`` where distillation trains
    it; empty: the dense ones) for one layer from the current stream.

    With ``refine`` the fit is followed by the ``W_d`` refit, alternating least squares and local
    distillation that ``calib`` asks for (``stemlm.insert.distill``). Their target is the dense FFN's
    output on the same inputs, or, given the dense model's own stream after this whole layer
    (``calib.correct_drift``), what brings the converted stream (after the attention) to it."""
    ffn = block.ffn
    d, d_ff = stream.shape[-1], ffn.w_down.weight.shape[1]

    def ffn_input(c: slice) -> torch.Tensor:  # (n·T, d)
        return block.ffn_norm(stream[c]).reshape(-1, d)

    def target_of(c: slice) -> torch.Tensor:  # (n·T, d): what the layer's FFN should add to the stream
        if dense_stream is None:
            return ffn(ffn_input(c))
        return (dense_stream[c] - stream[c]).reshape(-1, d)  # the dense stream after the layer, less ours

    if ffn_kind(kind).zero_rows_are_dense or calib.method == "zero":
        rows = torch.zeros(len(embedding), d_ff, device=embedding.device)
    else:
        stats = LayerStats.zeros(len(embedding), d_ff, embedding.device)
        for c in chunks:
            x = ffn_input(c)
            target, weight = ffn_kind(kind).calibration_target(ffn, x)
            stats.add(ids[c].reshape(-1), target, None if calib.method == "mean" else weight)
        rows = stats.rows(calib.unseen, embedding, shrink=calib.shrink)
        del stats
        if calib.method == "down":
            xs = torch.cat([ffn_input(c) for c in chunks])
            rows = _refine_down(ffn, kind, xs, ids, rows, calib.down_iters)
    weights: dict[str, torch.Tensor] = {}
    if not refine:
        return rows, weights
    if calib.als_rounds:
        xs = torch.cat([ffn_input(c) for c in chunks])
        rows, w_down, info = alternate_layer(ffn, kind, xs, ids.reshape(-1), rows, calib.als_rounds, calib.down_iters)
        weights = {"w_down": w_down}
        log(f"alternating least squares, output error {info['error_before']:.4f} -> {info['error_after']:.4f}")
    elif calib.refit_down:
        refit = DownRefit(d_ff, ffn.w_down.weight.shape[0], embedding.device)
        for c in chunks:
            x = ffn_input(c)
            hidden = ffn_kind(kind).hidden(ffn, x, rows[ids[c].reshape(-1)])
            refit.add(hidden, target_of(c))
        weights = {"w_down": refit.solve()}
    if calib.distill_steps:
        settings = calib.distill_settings()
        xs = torch.cat([ffn_input(c) for c in chunks])
        target = torch.cat([target_of(c) for c in chunks]) if dense_stream is not None else None
        started = time.perf_counter()
        with torch.enable_grad():
            rows, weights, info = distill_layer(ffn, kind, xs, ids.reshape(-1), rows, weights, settings, progress,
                                                target=target)
        log(f"local distillation, output error {info['error_before']:.4f} -> {info['error_after']:.4f}"
            + (" (larger: the fit it started from is kept)" if info["kept_start"] else "")
            + f" in {time.perf_counter() - started:.1f} s ({info['seconds_steps']:.1f} s of steps)")
    return rows, weights


def _refine_down(ffn, kind, xs, ids, rows, iters):
    """Rows fitted through ``W_d`` where the kind's rows enter as ``W_d (g ⊙ rows)``; others unchanged."""
    gate = ffn_kind(kind).gate_of_rows(ffn, xs)
    if gate is None:
        return rows
    target = ffn(xs)
    return refine_through_down(rows, ids.reshape(-1), gate, target, ffn.w_down.weight, iters)


def assemble(dense: StemLM, target: ModelConfig, fitted: dict[int, tuple[Path, Path | None]],
             mmap: bool = False) -> StemLM:
    """The STEM model of ``target``: the dense model's weights, the fitted tables (memory-mapped
    from the work dir with ``mmap``), refitted projections (``W_d``, a distilled ``W_g``) where there are any."""
    from ..checkpoint.directory import model_from_state
    from ..checkpoint.safetensors_io import map_tensor, tensor_info

    state = dict(dense.state_dict())
    for i, kind in enumerate(target.layer_kinds):
        if i not in fitted:
            continue
        if (name := ffn_kind(kind).replaces) is not None:
            del state[f"layers.{i}.ffn.{name}.weight"]
        table_file, down_file = fitted[i]
        if mmap:
            state[f"tables.{i}.weight"] = map_tensor(table_file, tensor_info(table_file, "rows"))[0]
        else:
            state[f"tables.{i}.weight"] = load_file(str(table_file))["rows"]
        if down_file is not None:
            for name, w in load_file(str(down_file)).items():
                state[f"layers.{i}.ffn.{name}.weight"] = w
    return model_from_state(target, state)
