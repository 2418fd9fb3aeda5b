"""The comparisons behind each claim, from a study's result JSON: ``(parts, notes)`` per claim.

A part is one judged comparison ``{"label", "text", "verdict", "difference", "p"}`` (``stats``); its
noise comes from seeds only (``SEED_KINDS``: a difference over the validation batches or probe items
of one model is refused, ``PseudoReplication``). A part's verdict is before the correction across
the claim's parts (``claims``), except ``probe blind`` (its probe failed its positive control:
nothing is drawn from it). A note is context that is not judged (an accuracy at chance, a
comparison that only describes). ``settings``: ``{"spikes": stability settings, "paper_lr": lr}`` (the report takes
them from the study's spec).
"""

from __future__ import annotations

from collections import defaultdict

from .dynamics import gap_curves, gap_trend, val_curves
from .measures import loss_roi
from .paper import TABLE2
from .probes import knowledge_score, mean_or_nan, needle_retrieval, needle_score, probe_of
from .stability import DEFAULTS as SPIKE_DEFAULTS, paired_spikes, run_stability
from .variants import BASELINE, is_dense_kind
from .stats import (Difference, difference, fit_line, one_sample, p_value, seeds_needed, sign_test,
                    smallest_significant_split, verdict)

PLACEMENTS = ("stem-1/3", "stem-1/2", "stem-full")
STEM, MOE, GATE = "stem-1/3", "hash_moe-1/3", "stem_gate-1/3"


def by_seed(runs: list[dict], stage: str, value) -> dict[str, dict[str, dict[int, float]]]:
    """``{size: {variant: {seed: value(run)}}}`` over the stage's finished runs (None values dropped)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r["stage"] == stage and r["status"] == "finished" and (v := value(r)) is not None:
            out[r["labels"].get("size", "-")][r["labels"]["variant"]][r["labels"]["seed"]] = v
    return out


def _final(r: dict) -> float | None:
    return r["metrics"]["final_val_loss"]


def _first(runs: list[dict], stage: str, **labels) -> dict | None:
    return next((r for r in runs if r["stage"] == stage and all(r["labels"].get(k) == v for k, v in labels.items())), None)


SEED_KINDS = ("paired", "welch", "single")  # paired or unpaired by seed; one value (no noise estimate)
BLIND = "probe blind"


class PseudoReplication(ValueError):
    """A difference whose replicates are not seeds (batches or items of one model) offered as a verdict."""


def _part(label: str, d: Difference, sign: int, unit: str = "", extra: str = "") -> dict:
    if d.kind not in SEED_KINDS:
        raise PseudoReplication(f"{label}: a verdict needs seeds as replicates, got {d.kind!r} (pseudo-replication)")
    v = verdict(d, sign)
    need = seeds_needed(d) if v == "inconclusive" and d.kind == "paired" else None
    if need is not None:
        extra += f"; ~{need if need <= 100 else '> 100'} seeds would detect a difference this size"
    return {"label": label, "text": d.text(unit) + extra, "verdict": v, "difference": d.to_dict(), "p": p_value(d),
            "unit": unit}


def _common(a: dict, b: dict) -> tuple[dict, dict]:
    keys = sorted(set(a) & set(b))
    return {k: a[k] for k in keys}, {k: b[k] for k in keys}


def roi_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(a): the loss ROI of each placement against dense, per seed; the accuracy ROI as a note."""
    parts, notes = [], []
    losses = by_seed(runs, "compare", _final)
    info = {(r["labels"]["size"], r["labels"]["variant"]): r for r in runs if r["stage"] == "compare"}
    for size, variants in losses.items():
        if BASELINE not in variants:
            continue
        fd = info[(size, BASELINE)]["accounting"]["train_flops_per_token"]
        h = info[(size, BASELINE)]["data"]["unigram_entropy"]
        for p in PLACEMENTS:
            if p not in variants:
                continue
            lp, ld = _common(variants[p], variants[BASELINE])
            fp = info[(size, p)]["accounting"]["train_flops_per_token"]
            rois = [loss_roi(lp[s], fp, ld[s], fd, h) for s in lp]
            if not rois or any(x is None for x in rois):
                notes.append(f"{size} {p}: loss ROI undefined (dense not below the unigram entropy)")
                continue
            d = one_sample([x - 1 for x in rois])
            roi = (f"loss ROI {1 + d.mean:.2f} [{1 + d.ci[0]:.2f}, {1 + d.ci[1]:.2f}], MDE {d.mde:.2g} (n={d.n} {d.kind})"
                   if d.ci else f"loss ROI {1 + d.mean:.2f} (n={d.n}, no noise estimate)")
            part = {**_part(f"{size} {p.split('-')[1]}", d, +1), "unit": " (loss ROI − 1)"}
            need = part["text"].partition("; ~")[2]
            part["text"] = (f"{roi}; Δ loss {difference(lp, ld).text(' nats')}; FLOP ratio {fd / fp:.3f}"
                            + (f"; ~{need}" if need else ""))
            parts.append(part)
        notes += _accuracy_roi_notes(size, info, evals)
    return parts, notes


def _accuracy_roi_notes(size: str, info: dict, evals: dict) -> list[str]:
    """The paper's accuracy ROI when evals exist; flagged when every accuracy is at chance (it then only
    restates the FLOP ratio)."""
    from .tables import compare_rows

    if not evals:
        return []
    rows = {r["variant"]: r for r in compare_rows([r for (s, _), r in info.items() if s == size], evals).get(size, [])}
    if BASELINE not in rows or rows[BASELINE]["paper_roi"] is None:
        return []
    at_chance = all(not d.get("above") for r in rows.values() for d in r["acc_detail"].values())
    cells = ", ".join(f"{p.split('-')[1]} {rows[p]['paper_roi']:.2f} (FLOP ratio "
                      f"{rows[BASELINE]['train_flops_per_token'] / rows[p]['train_flops_per_token']:.2f})"
                      for p in PLACEMENTS if p in rows and rows[p]["paper_roi"] is not None)
    why = ("every accuracy is at chance, so this ROI is the FLOP ratio times the ratio of two chance scores: "
           "not judged" if at_chance else "accuracies of a few hundred items: not judged")
    return [f"{size} accuracy ROI (Table 3's definition) {cells}: {why}"]


def dynamics_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(a′): the trend of each placement's gap to dense over the second half of training."""
    parts = []
    epoch = next((r["data"].get("train_tokens") for r in runs if r["stage"] == "compare"), None)
    for size, curves in val_curves(runs).items():
        for p in PLACEMENTS:
            t = gap_trend(gap_curves(curves, p), epoch_tokens=epoch)
            if t is None:
                continue
            d = _as_difference(t["slope"])
            cross = (f"; at this trend the gap closes at ~{t['cross_tokens'] / 1e6:.3g}M tokens"
                     + (f" ({t['cross_epochs']:.1f} epochs)" if t["cross_epochs"] else "") if t["cross_tokens"]
                     else "; the gap does not close on this trend")
            parts.append(_part(f"{size} {p.split('-')[1]} slope", d, -1, " nats/doubling",
                               f"; gap {t['gap_first']:+.3f} at {t['tokens_first'] / 1e6:.2f}M tokens → "
                               f"{t['gap_end']:+.3f} at {t['tokens_end'] / 1e6:.2f}M{cross}"))
    return parts, []


def _stem_fraction(r: dict) -> float:
    kinds = r["accounting"]["layer_kinds"]
    return sum(not is_dense_kind(k) for k in kinds) / len(kinds)


def _control(runs: list[dict], kind: str, score) -> tuple[bool | None, str]:
    """Whether the positive control of ``kind`` succeeded (None: not run), and a note."""
    r = _first(runs, "controls", control=kind)
    if r is None or r["status"] != "finished" or not probe_of(r, kind):
        return None, f"no positive control of the {kind} probe was run: the probe is not shown able to succeed"
    d = score(probe_of(r, kind))
    ok = verdict(d, +1) == "holds"
    return ok, f"positive control ({r['name']}): {d.text()} → the probe {'can' if ok else 'could NOT'} see the effect"


def _as_difference(d: dict) -> Difference:
    """A ``Difference`` from its stored dict (``Difference.to_dict``)."""
    return Difference(**{**d, "ci": tuple(d["ci"]) if d["ci"] else None})


def _knowledge_diff(probe: dict) -> Difference:
    return _as_difference(probe["families"]["train"]["seen_minus_unseen"])


def knowledge_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(b): per seed, the slope of the knowledge probe against the fraction of STEM layers."""
    ok, control = _control(runs, "knowledge", _knowledge_diff)
    scores = by_seed(runs, "compare", lambda r: knowledge_score(probe_of(r, "knowledge")))
    held = by_seed(runs, "compare", lambda r: knowledge_score(probe_of(r, "knowledge"), "heldout"))
    frac = {r["labels"]["variant"]: _stem_fraction(r) for r in runs if r["stage"] == "compare"}
    parts, notes = [], [control]
    for size, variants in scores.items():
        chain = [v for v in (BASELINE, *PLACEMENTS) if v in variants]
        if len(chain) < 2:
            continue
        seeds = sorted(set.intersection(*(set(variants[v]) for v in chain)))
        slopes = [fit_line([frac[v] for v in chain], [variants[v][s] for v in chain]).slope for s in seeds]
        means = ", ".join(f"{v} {sum(variants[v].values()) / len(variants[v]):+.3f}" for v in chain)
        hmeans = ", ".join(f"{v} {sum(held[size][v].values()) / len(held[size][v]):+.3f}" for v in chain if v in held[size])
        part = _part(f"{size} slope", one_sample(slopes), +1, " nats per unit STEM fraction",
                     f"; seen − unseen contrast (nats): training templates {means}; held-out template {hmeans}")
        if ok is not True:
            part["verdict"] = BLIND
        parts.append(part)
    return parts, notes


def stability_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(c): spikes of every comparison run against dense's run of the same seed (same batches, so the data's
    own bumps cancel: ``stability.paired_spikes``), STEM-1/3 against Hash-MoE-1/3 by an exact sign test;
    the sweep's runs at the paper's lr and above are described by their status (not judged: one seed)."""
    paper_lr = settings.get("paper_lr", TABLE2["lr"])
    st = {**SPIKE_DEFAULTS, **(settings.get("spikes") or {})}
    compare = {(r["labels"]["size"], r["labels"]["variant"], r["labels"]["seed"]): r for r in runs
               if r["stage"] == "compare" and r["status"] in ("finished", "diverged")}
    count: dict = defaultdict(lambda: defaultdict(int))
    for (size, variant, seed), r in compare.items():
        if variant != BASELINE and (dense := compare.get((size, BASELINE, seed))) is not None:
            count[size][variant] += len(paired_spikes(r, dense, st))
    parts, notes = [], []
    for size, counts in count.items():
        if STEM not in counts or MOE not in counts:
            continue
        k, n = counts[STEM], counts[STEM] + counts[MOE]
        p = sign_test(k, n)
        split = smallest_significant_split(n)
        v = ("holds" if k < n - k else "contradicted") if p < 0.05 else "untestable" if split is None else "inconclusive"
        power = (f"at n = {n} a split of ≤ {split} : {n - split} is significant" if split is not None
                 else f"no split of {n} spikes could be significant (≥ 6 are needed)")
        seeds = len({s for (z, v_, s) in compare if z == size and v_ == STEM})
        text = (f"spikes over the {seeds} seeds' comparison runs, each against dense's run of its seed: "
                + ", ".join(f"{x} {c}" for x, c in sorted(counts.items())) + f"; sign test p = {p:.3g} ({power})")
        parts.append({"label": f"{size} STEM-1/3 vs Hash-MoE-1/3", "text": text, "verdict": v,
                      "difference": {"k": k, "n": n, "p": p}, "p": p if split is not None else None})
    by_variant: dict = defaultdict(list)
    for r in runs:  # "stability": results of STUDY_VERSION 1, whose stress sweep was a stage of its own
        if r["stage"] in ("sweep", "stability") and r["labels"]["lr"] >= paper_lr * (1 - 1e-9):
            s_ = run_stability(r, st)
            by_variant[r["labels"]["variant"]].append(f"{r['labels']['lr']:g} {s_['status']}"
                                                      + (" (exploded, recovered)" if "recovered" in s_["why"] else ""))
    notes += [f"sweep, 1 seed, not judged — {v}: {', '.join(xs)}" for v, xs in sorted(by_variant.items())]
    return parts, notes


RETRIEVAL_GOAL = 0.5  # the needle control must retrieve at least this fraction of keys greedily


def needle_control(runs: list[dict]) -> tuple[bool | None, str]:
    """Whether the needle probe's positive control retrieves: greedy retrieval ≥ ``RETRIEVAL_GOAL`` and
    a key-over-decoy margin whose interval is above 0 (None: no control was run), and a note."""
    r = _first(runs, "controls", control="needle")
    probe = probe_of(r, "needle") if r is not None and r["status"] == "finished" else None
    if probe is None:
        return None, "no positive control of the needle probe was run: the probe is not shown able to succeed"
    if needle_retrieval(probe) is None:
        return False, (f"positive control ({r['name']}) measured before the probe had a decoy and greedy retrieval: "
                       "it does not show that the probe sees retrieval")
    got, margin = needle_retrieval(probe), _as_difference(probe["mean_margin"])
    ok = got >= RETRIEVAL_GOAL and verdict(margin, +1) == "holds"
    return ok, (f"positive control ({r['name']}): greedy retrieval {got:.0%} of {probe['retrieved']['n']} keys "
                f"(needs ≥ {RETRIEVAL_GOAL:.0%}), key − decoy margin {margin.text(' nats')} → the probe "
                f"{'can' if ok else 'could NOT'} see retrieval")


def needle_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(d): the needle probe's key − decoy margin (retrieval, not repetition) of STEM-1/3 against dense
    after context extension, per seed; probe blind unless the positive control retrieves."""
    ok, control = needle_control(runs)
    margins = by_seed(runs, "context", lambda r: needle_score(probe_of(r, "needle")))
    gains = by_seed(runs, "context", lambda r: needle_score(probe_of(r, "needle"), "gain"))
    found = by_seed(runs, "context", lambda r: needle_retrieval(probe_of(r, "needle")))
    tail = by_seed(runs, "context", lambda r: _last_quarter(r))
    if not margins and (gains or tail):
        return [], ["the context runs carry no key − decoy margin (results of an earlier probe version): not judged"]
    parts = []
    for size, variants in margins.items():
        if BASELINE not in variants or STEM not in variants:
            continue
        a, b = _common(variants[STEM], variants[BASELINE])
        qa, qb = _common(tail[size].get(STEM, {}), tail[size].get(BASELINE, {}))
        g, f = gains[size], found[size]
        retrieved, gain = ({v: mean_or_nan(d.get(v, {}).values()) for v in (BASELINE, STEM)} for d in (f, g))
        extra = (f"; greedy retrieval dense {retrieved[BASELINE]:.0%}, STEM-1/3 {retrieved[STEM]:.0%}; needle gain "
                 f"(rewards repetition too, not judged) dense {gain[BASELINE]:+.3f}, STEM-1/3 {gain[STEM]:+.3f} nats"
                 + (f"; loss in the window's last quarter, STEM − dense {difference(qa, qb).text(' nats')}" if qa else ""))
        part = _part(f"{size} needle key − decoy margin, STEM − dense", difference(a, b), +1, " nats", extra)
        if ok is not True:
            part["verdict"] = BLIND
        parts.append(part)
    return parts, ([control] if parts else [])


def _last_quarter(r: dict) -> float | None:
    final = (r.get("position_loss") or {}).get("final")
    return sum(final[-len(final) // 4:]) / (len(final) // 4) if final else None


def midtrain_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """(e): each STEM arm's final loss against the dense arm continued on the same tokens."""
    arms: dict = defaultdict(dict)
    for r in runs:
        if r["stage"] == "midtrain" and r["status"] == "finished":
            arms[r["labels"]["variant"]][r["labels"].get("seed", 0)] = r
    dense = next((a for a, rs in arms.items() if is_dense_kind(next(iter(rs.values()))["labels"].get("ffn", a))),
                 None)
    if dense is None:
        return [], []
    parts, notes = [], []
    for arm, rs in arms.items():
        if arm == dense:
            continue
        lab = next(iter(rs.values()))["labels"]
        a, b = _common({s: _final(r) for s, r in rs.items()}, {s: _final(r) for s, r in arms[dense].items()})
        d = difference(a, b)  # one seed: no noise estimate, inconclusive (its validation batches are not seeds)
        tags = [lab["ffn"]] if lab.get("ffn") else []
        tags += [f"{k} {lab[k]}" for k in ("init", "anneal", "distill") if lab.get(k)]
        label = f"{arm} ({', '.join(tags)})" if tags else arm
        s0 = next(iter(a))
        tokens = rs[s0]["metrics"].get("tokens_seen")
        parts.append(_part(label, d, -1, " nats", f"; start {rs[s0]['metrics']['val_loss_init']:.3f} vs "
                                                  f"{arms[dense][s0]['metrics']['val_loss_init']:.3f}"
                                                  + (f"; after {tokens:,} tokens" if tokens else "")))
    return parts, notes


ABLATIONS = (  # (variant, reference, predicted sign of variant − reference in loss, label): Table 3's ordering
    (STEM, GATE, -1, "STEM-1/3 − gate"),
    (GATE, BASELINE, +1, "gate − dense"),
    ("stem_dagger-1/3", STEM, +1, "STEM† − STEM-1/3"),
    (MOE, STEM, +1, "Hash-MoE − STEM-1/3"),
)


def ablation_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """Ablations, each judged: STEM-1/3 below the gate ablation, the gate ablation above dense (§4.4.2), STEM†
    and Hash-MoE above STEM-1/3 (final validation loss, per seed); other variants against STEM-1/3 described."""
    parts, notes = [], []
    for size, variants in by_seed(runs, "compare", _final).items():
        for a, b, sign, label in ABLATIONS:
            if a in variants and b in variants:
                parts.append(_part(f"{size} {label}", difference(*_common(variants[a], variants[b])), sign, " nats"))
        judged = {STEM, GATE, BASELINE, "stem_dagger-1/3", MOE, *PLACEMENTS, *(a for a, *_ in NGRAM_ARMS)}
        for other in sorted(v for v in variants if v not in judged and STEM in variants):
            d = difference(*_common(variants[other], variants[STEM]))
            notes.append(f"{size} {other} − STEM-1/3 (described): {d.text(' nats')}")
    return parts, notes


NGRAM_ARMS = (  # (variant, reference, predicted sign of variant − reference in loss, label)
    ("ngram-1/3", STEM, -1, "n-gram-1/3 − STEM-1/3 (equal table bytes)"),
    ("stem-1/3+engram", STEM, -1, "STEM-1/3 + Engram memory − STEM-1/3 (memory added: 2× the table bytes)"),
)


def ngram_parts(runs: list[dict], evals: dict, settings: dict) -> tuple[list, list]:
    """n-gram keys against token keys (``studies/ngram.yaml``, docs/ngram.md): final validation loss per seed,
    each arm against STEM-1/3 of the same seed; predicted < 0. Dense is described against both."""
    parts, notes = [], []
    for size, variants in by_seed(runs, "compare", _final).items():
        for a, b, sign, label in NGRAM_ARMS:
            if a in variants and b in variants:
                parts.append(_part(f"{size} {label}", difference(*_common(variants[a], variants[b])), sign, " nats"))
        if parts and BASELINE in variants:
            for a in [STEM, *(a for a, *_ in NGRAM_ARMS)]:
                if a in variants:
                    d = difference(*_common(variants[a], variants[BASELINE]))
                    notes.append(f"{size} {a} − dense (described): {d.text(' nats')}")
    return parts, notes
