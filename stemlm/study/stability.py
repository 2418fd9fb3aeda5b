"""Loss spikes, collapse and divergence, from every step's training loss of a run.

**Spike** (``find_spikes``): step ``t`` (counted only after warm-up plus ``settle`` steps) is a spike when

    loss_t − mean(loss_{t−a}, …, loss_{t−1})  >  k · σ_t,   σ_t = 1.4826 · MAD(Δ over the last w steps) / √2

with ``a`` (``average``) steps in the moving average that tracks the falling loss, and ``σ_t`` the
robust spread of one step's loss around its local level: the median absolute deviation of the
step-to-step changes ``Δ`` over the previous ``w`` (``spread``) steps, scaled to a standard deviation
(1.4826) and divided by √2 (a change is the difference of two noisy values); ``floor`` (nats)
keeps a perfectly flat stretch from calling noise a spike. A spike step is left out of the later
averages and spreads. Unlike the trainer's online detector (3× the running median), this finds
jumps of a few tenths of a nat at any loss level.

**Paired spikes** (``paired_spikes``): the same detector on ``loss_variant − loss_dense`` step by step,
for two runs of the same seed (same init seed, same batches in the same order). A bump that comes
from the data (a hard batch) is in both runs and cancels; what is left is the variant's own.

**Status**, judged from what the training loss did (``status_of``), not from one number at the end:

* **diverged**: the trainer stopped on a non-finite loss or gradient, or the loss *exploded* (some
  step after warm-up exceeds ``ln V + explode`` nats, worse than a uniform guess by that much) and
  the last quarter's median stays above ``ln V``; an explosion the run recovered from is noted in
  ``why`` whatever the status;
* **collapsed**: the smoothed training loss had gone below ``H − eps`` (H: the corpus's unigram
  entropy) and is back above it over the last quarter, without falling there (the model lost what
  it learned beyond token frequencies and stays there), or it never got below ``H − eps`` and is flat;
* **slow start**: the final validation loss is above ``H − eps`` but the training loss is still
  falling over the last quarter (or never got below ``H − eps`` and still falls): a run too short
  for its lr, not a failure;
* **finished**: none of these.
"""

from __future__ import annotations

import math
import statistics

DEFAULTS = {"average": 5, "spread": 50, "k": 6.0, "settle": 10, "floor": 0.05, "collapse_eps": 0.5, "explode": 1.0}
ROBUST = 1.4826


def spike_settings(spec: dict) -> dict:
    """The spec's ``stability.spikes`` (and ``collapse_eps``) over ``DEFAULTS``."""
    st = spec.get("stability") or {}
    return {**DEFAULTS, **(st.get("spikes") or {}), **({"collapse_eps": st["collapse_eps"]} if "collapse_eps" in st else {})}


def find_spikes(losses: list[float], warmup_steps: int, average: int = 5, spread: int = 50, k: float = 6.0,
                settle: int = 10, floor: float = 0.05, **_) -> list[dict]:
    """Spikes of a loss sequence (``losses[i]`` is step ``i + 1``): ``[{"step", "loss", "level", "sigma", "z"}]``."""
    kept: list[float] = []  # the losses of the non-spike steps so far
    out = []
    start = warmup_steps + settle
    for i, loss in enumerate(losses):
        step = i + 1
        if step > start and len(kept) > average + 2:
            level = sum(kept[-average:]) / average
            diffs = [b - a for a, b in zip(kept[-spread - 1:-1], kept[-spread:])]
            med = statistics.median(diffs)
            sigma = max(ROBUST * statistics.median(abs(d - med) for d in diffs) / 2 ** 0.5, floor)
            if loss - level > k * sigma:
                out.append({"step": step, "loss": loss, "level": level, "sigma": sigma, "z": (loss - level) / sigma})
                continue
        kept.append(loss)
    return out


def _smooth(losses: list[float], window: int) -> list[float]:
    """Running median over ``window`` steps (the first ``window − 1`` steps use what there is)."""
    return [statistics.median(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]


def status_of(losses: list[float], warmup_steps: int, final_val: float | None, unigram: float, vocab: int,
              stopped: bool, eps: float = 0.5, explode: float = 1.0) -> tuple[str, str]:
    """``(status, why)``: diverged / collapsed / slow start / finished from every step's training loss
    (module docstring). ``stopped``: the trainer stopped the run on a non-finite value."""
    if stopped or any(not math.isfinite(x) for x in losses):
        return "diverged", "stopped on a non-finite loss or gradient"
    ceiling = math.log(vocab) + explode
    note = ""
    if (peak := explosion(losses, warmup_steps, ceiling)) is not None:
        note = f"exploded to {peak[1]:.1f} at step {peak[0]} (> ln V + {explode:g} = {ceiling:.2f})"
        if statistics.median(losses[-max(2, len(losses) // 4):]) > math.log(vocab):
            return "diverged", note + ", and stayed worse than a uniform guess"
        note += f", recovered to {losses[-1]:.2f}"
    if not losses:
        return "finished", note
    smooth = _smooth(losses, max(5, len(losses) // 20))
    quarter = smooth[-max(2, len(smooth) // 4):]
    falling = quarter[-1] < quarter[0] - 0.05
    floor = unigram - eps
    if min(smooth) < floor and min(quarter) >= floor and not falling:
        return "collapsed", _join(note, f"training loss reached {min(smooth):.2f} (< H − {eps:g} = {floor:.2f}) and is back at "
                             f"{quarter[-1]:.2f} over the last quarter")
    if final_val is not None and final_val > floor:
        if falling:
            return "slow start", _join(note, f"final val loss {final_val:.2f} > H − {eps:g}, training loss still falling " \
                                 f"({quarter[0]:.2f} → {quarter[-1]:.2f} over the last quarter)")
        return "collapsed", _join(note, f"training loss at {quarter[-1]:.2f}, never below H − {eps:g} = {floor:.2f}, "
                                        "and flat")
    return "finished", note


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def explosion(losses: list[float], warmup_steps: int, ceiling: float) -> tuple[int, float] | None:
    """``(step, loss)`` of the highest training loss after warm-up when it exceeds ``ceiling``, else None."""
    after = losses[warmup_steps:]
    if not after or max(after) <= ceiling:
        return None
    return warmup_steps + after.index(max(after)) + 1, max(after)


def warmup_of(result: dict) -> int:
    """The run's warm-up steps (its config's warm-up ratio of its steps)."""
    cfg = result["config"]
    return int(cfg["optim"]["warmup_ratio"] * cfg["run"]["steps"])


def run_stability(result: dict, settings: dict) -> dict:
    """``{"spikes": [...], "status", "why", "final_val_loss", "gap_to_unigram", ...}`` of a run result."""
    losses = [p[1] for p in result["metrics"]["train"]]
    warmup = warmup_of(result)
    spikes = find_spikes(losses, warmup, **settings)
    final, h = result["metrics"]["final_val_loss"], result["data"]["unigram_entropy"]
    vocab = result["data"].get("vocab_size") or 4096
    status, why = status_of(losses, warmup, final, h, vocab, result["status"] == "diverged",
                            settings.get("collapse_eps", 0.5), settings.get("explode", 1.0))
    return {"spikes": spikes, "status": status, "why": why, "final_val_loss": final, "unigram_entropy": h,
            "gap_to_unigram": None if final is None else h - final, "warmup_steps": warmup,
            "steps": result["metrics"]["steps"], "total_steps": result["config"]["run"]["steps"]}


def paired_spikes(run: dict, dense: dict, settings: dict) -> list[dict]:
    """Spikes of ``run``'s training loss minus ``dense``'s, step by step (same seed: same batches), after
    the run's warm-up: bumps both runs share (the data's) cancel."""
    a = {p[0]: p[1] for p in run["metrics"]["train"]}
    b = {p[0]: p[1] for p in dense["metrics"]["train"]}
    steps = sorted(set(a) & set(b))
    diff = [a[s] - b[s] for s in steps]
    warmup = warmup_of(run)
    found = {steps[x["step"] - 1]: {**x, "step": steps[x["step"] - 1]} for x in find_spikes(diff, warmup, **settings)}
    # an explosion inside the detector's settle window (too early for a robust spread) counts when dense's
    # loss on the same batch did not explode
    ceiling = math.log(run["data"].get("vocab_size") or 4096) + settings.get("explode", 1.0)
    for s in steps[warmup:]:
        if a[s] > ceiling >= b[s] and s not in found:
            found[s] = {"step": s, "loss": a[s], "level": b[s], "sigma": None, "z": None}
    return [found[s] for s in sorted(found)]
