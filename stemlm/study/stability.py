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

**Collapse**: the run finished, but its final validation loss is within ``eps`` nats of the unigram
entropy of the corpus (it learned next to nothing beyond token frequencies). **Diverged**: the
trainer stopped on a non-finite loss or gradient norm. The three are reported apart.
"""

from __future__ import annotations

import statistics

DEFAULTS = {"average": 5, "spread": 50, "k": 6.0, "settle": 10, "floor": 0.05, "collapse_eps": 0.5}
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


def run_stability(result: dict, settings: dict) -> dict:
    """``{"spikes": [...], "status": finished|collapsed|diverged, "final_val_loss", "gap_to_unigram"}`` of a run result."""
    train = result["metrics"]["train"]
    losses = [p[1] for p in train]
    cfg = result["config"]
    warmup = int(cfg["optim"]["warmup_ratio"] * cfg["run"]["steps"])
    spikes = find_spikes(losses, warmup, **settings)
    final, h = result["metrics"]["final_val_loss"], result["data"]["unigram_entropy"]
    status = result["status"]
    if status == "finished" and final is not None and final > h - settings["collapse_eps"]:
        status = "collapsed"
    return {"spikes": spikes, "status": status, "final_val_loss": final, "unigram_entropy": h,
            "gap_to_unigram": None if final is None else h - final, "warmup_steps": warmup,
            "steps": result["metrics"]["steps"], "total_steps": cfg["run"]["steps"]}
