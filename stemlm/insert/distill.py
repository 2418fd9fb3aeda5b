"""Local (layer-wise) distillation of a converted layer after its rows are fitted.

Calibration fits each row in closed form; what it cannot do is trade rows and ``W_d`` off against
each other over every context at once. Here the converted layer is trained to reproduce the dense
layer's output on the calibration pass's own inputs:

    min  Σ_n ‖ W_d^dense (SiLU(W_g x_n) ⊙ W_u x_n) − W_d (hidden(x_n, U[t_n])) ‖²  /  Σ_n ‖ y_n ‖²

over the rows of the ids the pass saw (a compact ``(U, d_ff)`` parameter, so the optimizer state
is ``U × d_ff``, not ``V × d_ff``) and, with ``train_down``, the layer's ``W_d``; with ``train_gate``
its ``W_g`` too. Rows fitted from few contexts, and the pooled row of ids never seen, cannot follow the
context; a trained ``W_g`` fits the whole layer, so it also changes what those ids get. Everything else
is frozen. Adam with a linear decay to a tenth of ``lr``, minibatches of ``batch`` tokens drawn from a
generator seeded by ``seed`` (deterministic on the CPU). The rows take their Adam steps in one of three ways:
``rows="dense"``, torch's Adam on the whole ``(U, d_ff)`` parameter, whose moments keep moving rows the minibatch
does not hold; ``rows="catchup"``, the same update computed for the rows the minibatch touched only, the steps a
row skipped applied in closed form when it is next read (``_RowAdam``: equal to the dense update but for how
``eps`` enters the skipped steps); ``rows="lazy"``, Adam on the touched rows with per-row counts (the training's
row update of ``stemlm.row_adam`` without weight decay), so a row the minibatches skip does not move. The last two
cost a step what its unique ids cost, not what ``U`` does. ``precision="bf16"`` runs the layer's GEMMs in
bfloat16 autocast (fp32 weights, moments and target): about four times the fp32 GEMM throughput on CPUs with
AVX512-BF16 or AMX.
``alternate`` runs alternating least squares instead: rows given ``W_d`` (conjugate gradients through the
down-projection), then ``W_d`` given the rows, for a few rounds.

Memory: the layer's inputs and targets (``N × d`` each), the compact rows and their Adam moments, and a copy of
``W_d`` / ``W_g`` with its moments where it trains.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ffn import ffn_kind
from ..row_adam import adamw_math_, row_factors
from ..runtime.matmul import bf16_is_fast
from .fit import DownRefit, refine_through_down


@dataclass(frozen=True)
class DistillSettings:
    """Steps, learning rate, batch (tokens), whether ``W_d`` and ``W_g`` train too, the minibatch seed, whether
    torch's Adam (the projections; the rows with ``rows="dense"``) runs as one fused pass over each parameter
    (``fused_adam``: the same update to float rounding), how the rows take their steps (``rows``: ``dense``,
    ``catchup`` or ``lazy``, see the module docstring) and the GEMMs' ``precision`` (``fp32``, ``bf16``, or ``auto``:
    bf16 where ``bf16_is_fast``). The defaults (catch-up rows, ``auto``) are the fastest settings measured that give
    the dense fp32 update's result (``benchmarks/bench_distill_speed.py``, docs/insertion.md); before 2026-11-29 the
    rows took dense, unfused fp32 steps."""

    steps: int = 0
    lr: float = 1e-3
    batch: int = 2048
    train_down: bool = False
    seed: int = 0
    train_gate: bool = False
    fused_adam: bool = True
    rows: str = "catchup"  # dense: torch's Adam on every row | catchup: the same update on the touched rows only |
    #                      lazy: Adam on the touched rows with per-row counts (a skipped row does not move)
    precision: str = "auto"  # fp32 | bf16 (the GEMMs in bfloat16 autocast) | auto (bf16 where it is fast)

    def __post_init__(self):
        if self.rows not in ROW_UPDATES:
            raise ValueError(f"distillation rows must be one of {', '.join(ROW_UPDATES)}, got {self.rows!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"distillation precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


ROW_UPDATES = ("dense", "catchup", "lazy")
PRECISIONS = ("fp32", "bf16", "auto")


def resolved_precision(precision: str, device: torch.device) -> str:
    """``fp32`` or ``bf16``: a distillation ``precision`` as it runs on ``device`` (``auto``: ``bf16_is_fast``)."""
    if precision == "auto":
        return "bf16" if bf16_is_fast(device) else "fp32"
    return precision


def autocast_of(precision: str, device: torch.device):
    """The autocast context of a distillation ``precision`` on ``device`` (a no-op for fp32)."""
    use_bf16 = resolved_precision(precision, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)


def relative_error(out: torch.Tensor, target: torch.Tensor) -> float:
    """``Σ‖out − target‖² / Σ‖target‖²`` (0 = the dense layer exactly; squares in fp32, sums in fp64)."""
    return float(_squared(out - target) / _squared(target).clamp_min(1e-30))


CHUNK = 8192  # rows a piece of the passes over every calibration token (the dense output, the output error)


def _slices(n: int, size: int = CHUNK) -> list[slice]:
    """``0..n`` in pieces of ``size`` rows."""
    return [slice(a, min(n, a + size)) for a in range(0, n, size)]


def _squared(x: torch.Tensor) -> torch.Tensor:
    """``Σ x²`` as an fp64 scalar: fp32 sums of ``CHUNK`` rows (torch's pairwise summation), added up in fp64."""
    parts = [x[c].float().square().sum() for c in _slices(len(x))]
    return torch.stack(parts).double().sum() if parts else torch.zeros((), dtype=torch.float64)


def layer_output(ffn, kind: str, x: torch.Tensor, rows: torch.Tensor,
                 weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The converted layer's output (``(…, d)``) at inputs ``x (…, d)`` with rows ``(…, d_ff)`` and its refitted or
    trained projections ``weights`` (``{"w_down": …, "w_gate": …}``; those absent are the dense FFN's)."""
    with projections(ffn, weights):
        return F.linear(ffn_kind(kind).hidden(ffn, x, rows), ffn.w_down.weight)


@contextmanager
def projections(ffn, weights: dict[str, torch.Tensor]):
    """``ffn``'s projections ``{name: weight}`` (``w_gate``, ``w_down``, …) replaced by ``weights`` inside the block:
    a converted layer's refitted or trained projections, used through the dense FFN's own modules."""
    saved = {name: getattr(ffn, name)._parameters["weight"] for name in weights}
    try:
        for name, w in weights.items():  # the module's parameter slot, without the Parameter-type check
            getattr(ffn, name)._parameters["weight"] = w
        yield ffn
    finally:
        for name, w in saved.items():
            getattr(ffn, name)._parameters["weight"] = w


def _chunked(fn, n: int) -> torch.Tensor:
    return torch.cat([fn(c) for c in _slices(n)])


@torch.no_grad()
def layer_error(ffn, kind: str, xs: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                weights: dict[str, torch.Tensor], target: torch.Tensor) -> float:
    """The relative output error of the converted layer (projections ``weights``) over every calibration token
    (``relative_error``, summed chunk by chunk)."""
    err = sum(_squared(layer_output(ffn, kind, xs[c], rows[ids[c]], weights).float() - target[c]).item()
              for c in _slices(len(xs)))
    return float(err / _squared(target).clamp_min(1e-30))


def distill_layer(ffn, kind: str, xs: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                  weights: dict[str, torch.Tensor], settings: DistillSettings, progress: bool = False,
                  desc: str = "distill", target: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    """Train the rows of the ids in ``ids (N,)`` (and ``W_d`` with ``train_down``, ``W_g`` with ``train_gate``) of one
    converted layer.

    ``ffn`` is the dense layer's FFN (its output is the target), ``xs (N, d)`` the normed inputs,
    ``rows (V, d_ff)`` the fitted table, ``weights`` the layer's refitted projections so far (``{"w_down": …}``;
    empty: the dense ones). ``target (N, d)`` replaces the dense layer's output as what the layer should produce
    (the calibration pass's drift correction). Returns ``(rows, weights, {"error_before", "error_after",
    "kept_start", "seconds_steps"})``: ``rows`` a new tensor, ``weights`` the refitted projections with the trained
    ones added, ``seconds_steps`` the wall time of the step loop alone (not the error passes around it). The errors
    are computed at the run's precision (bf16 GEMMs: about 1e-5 of relative error of their own).
    Distillation that ends with a larger error than it started from (seen at 262k calibration tokens with lr 1e-2;
    likely Adam's moments moving rows the minibatches no longer hold) returns the start unchanged, ``kept_start``
    True and ``error_after`` the error it reached.
    """
    from tqdm import tqdm

    if settings.steps < 0 or settings.batch < 1 or settings.lr <= 0:
        raise ValueError(f"distillation needs steps >= 0, batch >= 1 and lr > 0, got {settings}")
    if settings.train_gate and "w_gate" not in ffn_kind(kind).holds:
        raise ValueError(f"train_gate needs a layer that keeps W_g; a {kind!r} layer does not")
    if target is None:  # fp32 whatever the precision: a bf16 target's rounding is fitted too, and Adam's
        #                 normalised steps carry it far (the test suite's toy conversion moved by 0.08)
        with torch.no_grad():
            target = _chunked(lambda c: ffn(xs[c]), len(xs))  # (N, d): the dense layer's output
    autocast = lambda: autocast_of(settings.precision, xs.device)  # noqa: E731  (the GEMMs' precision)
    with autocast():
        before = layer_error(ffn, kind, xs, ids, rows, weights, target)
    uniq, inv = torch.unique(ids, return_inverse=True)
    compact = torch.nn.Parameter(rows[uniq].detach().clone())  # (U, d_ff)
    trains = [name for name, on in (("w_down", settings.train_down), ("w_gate", settings.train_gate)) if on]
    copies = {name: torch.nn.Parameter(weights.get(name, getattr(ffn, name).weight).detach().clone())
              for name in trains}  # the projections that train, as copies of where they start
    lrs = [settings.lr * (1.0 - 0.9 * step / max(1, settings.steps)) for step in range(settings.steps)]
    sparse = _RowAdam(compact.data, settings.rows == "catchup", lrs) if settings.rows in ("catchup", "lazy") else None
    params = [*([] if sparse else [compact]), *copies.values()]
    opt = (torch.optim.Adam(params, lr=settings.lr, **({"fused": True} if settings.fused_adam else {}))
           if params else None)
    gen = torch.Generator().manual_seed(settings.seed)
    scale = target.square().sum(1).mean().clamp_min(1e-30)  # mean ‖y‖²: the loss is a relative error
    order, pos = torch.randperm(len(xs), generator=gen), 0
    started = time.perf_counter()
    with _frozen(ffn):  # the dense weights are constants here (W_d, W_g train as their own copies)
        for step in tqdm(range(settings.steps), desc=desc, disable=not progress, leave=False, dynamic_ncols=True):
            if pos + settings.batch > len(order):
                order, pos = torch.randperm(len(xs), generator=gen), 0
            b = order[pos:pos + settings.batch].to(xs.device)
            pos += settings.batch
            lr = lrs[step]  # linear decay to a tenth
            if sparse:  # the minibatch's own rows as a leaf: its gradient is theirs alone
                touched, local = torch.unique(inv[b], return_inverse=True)
                leaf, m, v = sparse.gather(touched, step + 1)  # (u, d_ff) each
                leaf.requires_grad_()
                batch_rows = leaf.index_select(0, local)  # (batch, d_ff); its backward is an index_add
            else:
                batch_rows = compact[inv[b]]
            with autocast():
                out = layer_output(ffn, kind, xs[b], batch_rows, {**weights, **copies})
            loss = (out.float() - target[b]).square().sum(1).mean() / scale
            if opt:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            if opt:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            if sparse:
                sparse.update(touched, leaf.detach(), m, v, leaf.grad, lr)
        if sparse:
            sparse.finish()
    timing = {"seconds_steps": time.perf_counter() - started}  # the step loop alone (the error passes are not in it)
    new_rows = rows.detach().clone()
    new_rows[uniq] = compact.detach()
    new_weights = {**weights, **{name: p.detach() for name, p in copies.items()}}
    with autocast():
        after = layer_error(ffn, kind, xs, ids, new_rows, new_weights, target)
    if after > before:  # never leave the layer worse than the fit it started from
        new_rows[uniq] = rows[uniq].detach()
        return new_rows, weights, {"error_before": before, "error_after": after, "kept_start": True, **timing}
    return new_rows, new_weights, {"error_before": before, "error_after": after, "kept_start": False, **timing}


class _RowAdam:
    """Adam steps on the rows a minibatch touched (``rows="lazy"`` or ``"catchup"``), on ``weight (U, d_ff)`` in place,
    with torch's Adam defaults (``betas (0.9, 0.999)``, ``eps 1e-8``) and the arithmetic of ``stemlm.row_adam``.

    ``lazy``: each row keeps its own update count, so its bias corrections are its own (the training's row update,
    without weight decay); a row the minibatches skip does not move. ``catchup``: torch's Adam over every row, computed
    for the touched rows only. When a row is read again (``gather``), the steps it skipped are applied at once:
    with a zero gradient a skipped step ``j`` scales ``m`` by ``b1`` and ``v`` by ``b2`` and moves the row by
    ``lr_j sqrt(1 - b2^j) / (1 - b1^j) · m_j / sqrt(v_j)``, so ``k`` skipped steps after the row's last update ``a``
    move it by ``m_a / sqrt(v_a) · Σ_k r^k lr_(a+k) sqrt(1 - b2^(a+k)) / (1 - b1^(a+k))``, ``r = b1 / sqrt(b2)``.
    That is the dense update up to ``eps`` in the skipped steps (``eps`` against ``sqrt(v)``) and the terms past
    ``r^k < 1e-12``, which are dropped. ``gather`` reads rows (caught up), ``update`` steps and writes them back,
    ``finish`` brings every row to the last step."""

    betas, eps = (0.9, 0.999), 1e-8

    def __init__(self, weight: torch.Tensor, catchup: bool, lrs: list[float]):
        self.weight, self.catchup = weight, catchup  # (U, d_ff), updated in place
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
        # lazy: each row's update count; catchup: the step that last updated it (0: none yet)
        self.count = torch.zeros(len(weight), dtype=torch.long, device=weight.device)
        self.t = 0  # steps taken
        b1, b2 = self.betas
        j = torch.arange(1, len(lrs) + 1, dtype=torch.float64)
        zero, lr = torch.zeros(1, dtype=torch.float64), torch.tensor(lrs, dtype=torch.float64)
        # a skipped step j's move per unit of m_j / sqrt(v_j), and per unit of m_j / eps (index 0 unused)
        self.move = torch.cat([zero, lr * (1 - b2 ** j).sqrt() / (1 - b1 ** j)])
        self.move_eps = torch.cat([zero, lr / (1 - b1 ** j)])
        r = b1 / b2 ** 0.5
        self.horizon = int(math.ceil(math.log(1e-12) / math.log(r)))  # steps after which r^k < 1e-12 (b1^k too)
        k = torch.arange(1, self.horizon + 1, dtype=torch.float64)
        self.decay, self.decay_eps = r ** k, b1 ** k  # (K,) r^k, b1^k

    @torch.no_grad()
    def gather(self, rows: torch.Tensor, now: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies ``(w, m, v)`` ``(u, d_ff)`` of rows ``rows (u,)`` (unique) and their moments as step ``now`` reads
        them: with ``catchup``, the steps before ``now`` that they skipped since their last update applied."""
        w, m, v = (t.index_select(0, rows) for t in (self.weight, self.exp_avg, self.exp_avg_sq))
        if self.catchup:
            self._catch_up(w, m, v, self.count.index_select(0, rows), now)
        return w, m, v

    def _catch_up(self, w, m, v, last: torch.Tensor, now: int) -> None:
        skipped = (now - 1 - last).clamp_min(0)  # (u,) rows never updated (last 0) have no momentum: m = 0
        if not bool((skipped > 0).any()):
            return
        k = torch.arange(1, self.horizon + 1, device=w.device)  # (K,)
        steps = (last[:, None] + k).clamp_max(len(self.move) - 1)  # (u, K) the skipped steps' numbers
        inside = k <= skipped[:, None]  # (u, K)

        def summed(decay, move):  # (u,) Σ over the skipped steps k of decay^k · move[last + k]
            return (torch.where(inside, decay.to(w.device), 0.0) * move.to(w.device)[steps]).sum(1)

        total, total_eps = summed(self.decay, self.move), summed(self.decay_eps, self.move_eps)
        # the skipped moves sum to m_a · total / (sqrt(v_a) + eps · total / total_eps): exact for eps -> 0 and for one
        # skipped step; between, eps enters through the steps' mean denominator
        eps_r = (self.eps * total / total_eps.clamp_min(1e-300))[:, None].float()  # (u, 1)
        b1, b2 = self.betas
        w.sub_(total[:, None].float() * m / (v.sqrt() + eps_r).clamp_min(1e-30))  # m = 0 where v = 0 (a zero grad)
        m.mul_(torch.pow(b1, skipped.double())[:, None].float())
        v.mul_(torch.pow(b2, skipped.double())[:, None].float())

    @torch.no_grad()
    def update(self, rows: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               lr: float) -> None:
        """One Adam step of rows ``rows (u,)`` from ``gather``'s ``(w, m, v)`` (updated in place) and their
        gradient ``grad (u, d_ff)``, written back."""
        self.t += 1
        counts = torch.full_like(rows, self.t - 1) if self.catchup else self.count.index_select(0, rows)
        n, decay, neg_step, eps_r = row_factors(counts, None, lr, 0.0, 0, self.betas, self.eps, False)
        adamw_math_(w, m, v, grad, decay, neg_step, eps_r, *self.betas)
        for table, new in ((self.weight, w), (self.exp_avg, m), (self.exp_avg_sq, v)):
            table.index_copy_(0, rows, new)
        self.count.index_copy_(0, rows, n)  # lazy: one more update; catchup: last updated at step t

    @torch.no_grad()
    def finish(self, chunk: int = 4096) -> None:
        """Bring every row to the last step (catchup; nothing to do for lazy)."""
        if not self.catchup:
            return
        for a in range(0, len(self.weight), chunk):
            rows = torch.arange(a, min(a + chunk, len(self.weight)), device=self.weight.device)
            self.weight.index_copy_(0, rows, self.gather(rows, self.t + 1)[0])


@contextmanager
def _frozen(module):
    trainable = [p for p in module.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


@torch.no_grad()
def alternate_layer(ffn, kind: str, xs: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, rounds: int,
                    down_iters: int = 8) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Alternating least squares for ``rounds`` rounds: rows given ``W_d`` (conjugate gradients through
    the down-projection, ``refine_through_down``), then ``W_d`` given the rows (``DownRefit``).

    Starts from ``rows`` and the dense ``W_d``; returns ``(rows, W_d, {"error_before", "error_after"})``.
    Only kinds whose rows enter as ``W_d (g ⊙ rows)`` move their rows; others refit ``W_d`` only.
    """
    if rounds < 1:
        raise ValueError(f"alternating least squares needs rounds >= 1, got {rounds}")
    target = _chunked(lambda c: ffn(xs[c]), len(xs))
    w_down = ffn.w_down.weight.detach().clone()
    before = layer_error(ffn, kind, xs, ids, rows, {"w_down": w_down}, target)
    gate = ffn_kind(kind).gate_of_rows(ffn, xs)
    for _ in range(rounds):
        if gate is not None:
            rows = refine_through_down(rows, ids, gate, target, w_down, down_iters)
        refit = DownRefit(rows.shape[1], w_down.shape[0], xs.device)
        for c in _slices(len(xs)):
            refit.add(ffn_kind(kind).hidden(ffn, xs[c], rows[ids[c]]), target[c])
        w_down = refit.solve()
    after = layer_error(ffn, kind, xs, ids, rows, {"w_down": w_down}, target)
    return rows, w_down, {"error_before": before, "error_after": after}
