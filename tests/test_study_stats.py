"""The study's verdict rule on synthetic results: intervals, MDE arithmetic, the three verdicts, spikes,
trends, and the paper's numbers (its published ROIs follow from its accuracies and FLOPs)."""

import math

import pytest

from stemlm.study.claims import claim_rows
from stemlm.study.dynamics import gap_curves, gap_trend
from stemlm.study.paper import QUOTES, TABLE3
from stemlm.study.stability import find_spikes
from stemlm.study.stats import (combine, difference, fit_line, mde, one_sample, sign_test, smallest_significant_split,
                                t_quantile, verdict)


def table3_roi(variant: str) -> float:
    """Accuracy ROI of a Table 3 placement recomputed from its average accuracy and GFLOPs:
    ``(acc / F) / (acc_dense / F_dense)``."""
    v, d = TABLE3[variant], TABLE3["dense"]
    return (v["avg_acc"] / v["gflops"]) / (d["avg_acc"] / d["gflops"])


def test_t_quantiles_match_the_tables():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-3)
    assert t_quantile(0.80, 2) == pytest.approx(1.0607, abs=1e-3)
    assert t_quantile(0.975, 30) == pytest.approx(2.0423, abs=1e-3)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.95996, abs=1e-4)
    assert t_quantile(0.025, 5) == pytest.approx(-t_quantile(0.975, 5))


def test_mde_is_the_sum_of_two_quantiles_times_se():
    # n = 3 paired seeds: df = 2, MDE = (4.303 + 1.061) * se
    assert mde(0.1, 2) == pytest.approx((4.3027 + 1.0607) * 0.1, abs=1e-3)
    d = one_sample([-0.5, -0.4, -0.6])
    se = 0.1 / math.sqrt(3)
    assert (d.mean, d.se, d.df) == (pytest.approx(-0.5), pytest.approx(se), 2)
    assert d.ci == (pytest.approx(-0.5 - 4.3027 * se, abs=1e-3), pytest.approx(-0.5 + 4.3027 * se, abs=1e-3))
    assert d.mde == pytest.approx(5.3634 * se, abs=1e-3)


def test_paired_by_seed_removes_the_shared_noise():
    stem = {0: 4.70, 1: 4.90, 2: 4.50}     # seeds differ a lot ...
    dense = {0: 5.00, 1: 5.21, 2: 4.79}    # ... in the same way for dense
    paired, unpaired = difference(stem, dense), difference(list(stem.values()), list(dense.values()))
    assert paired.kind == "paired" and unpaired.kind == "welch"
    assert paired.mean == pytest.approx(unpaired.mean)
    assert verdict(paired, -1) == "holds" and verdict(unpaired, -1) == "inconclusive"


def test_three_verdicts():
    assert verdict(one_sample([0.30, 0.32, 0.28]), +1) == "holds"
    assert verdict(one_sample([-0.30, -0.32, -0.28]), +1) == "contradicted"
    assert verdict(one_sample([0.30, -0.20, 0.05]), +1) == "inconclusive"
    assert verdict(one_sample([0.30]), +1) == "inconclusive"  # one seed: no noise estimate
    assert one_sample([0.3]).ci is None and "no noise estimate" in one_sample([0.3]).text()
    assert combine(["holds", "holds"]) == "holds"
    assert combine(["holds", "inconclusive"]) == "inconclusive"
    assert combine(["holds", "contradicted"]) == "contradicted"


def test_sign_test_and_its_power():
    assert sign_test(0, 6) == pytest.approx(2 / 64)
    assert sign_test(3, 6) == 1.0
    assert smallest_significant_split(6) == 0 and smallest_significant_split(5) is None
    assert smallest_significant_split(20) == 5  # 5 : 15 has p = 0.041


def test_line_fit_and_root():
    line = fit_line([0, 1, 2, 3], [-1.0, -0.8, -0.6, -0.4])
    assert line.slope == pytest.approx(0.2) and line.root() == pytest.approx(5.0) and line.slope_se == pytest.approx(0)


def test_spikes_are_found_against_a_moving_average_and_a_robust_spread():
    # the old study's STEM-1/3 at lr 3e-3 (300 steps, 3 warm-up steps): 6.83 -> 8.76 -> 6.83 at step 16
    losses = [8.33, 8.24, 8.02, 7.79, 7.60, 7.37, 7.21, 7.20, 7.00, 6.89, 6.92, 6.89, 6.89, 6.80, 6.83, 8.76,
              6.83, 6.77, 6.74, 6.74] + [6.7 - 0.005 * i + 0.03 * (-1) ** i for i in range(60)]
    spikes = find_spikes(losses, warmup_steps=3)
    assert [s["step"] for s in spikes] == [16] and spikes[0]["z"] > 6
    assert find_spikes(losses, warmup_steps=20) == []  # counted only after warm-up + settle steps
    smooth = [5 + 0.05 * ((i * 7) % 5) for i in range(100)]  # batch-to-batch noise only
    assert find_spikes(smooth, 0) == []


def test_gap_trend_says_where_a_shrinking_gap_would_close():
    # mean gap = -0.999 + 0.1 * log2(t / 1000): closes at t = 1000 * 2**9.99
    points = [1000 * k for k in range(1, 21)]  # evenly spaced evaluations, as in training
    curves = {"dense": {s: [{"tokens": t, "val_loss": 5.0} for t in points] for s in (0, 1, 2)},
              "stem-1/3": {s: [{"tokens": t, "val_loss": 4.0 + 0.1 * math.log2(t / 1000) + 0.001 * s} for t in points]
                           for s in (0, 1, 2)}}
    t = gap_trend(gap_curves(curves, "stem-1/3"), epoch_tokens=1000 * 2 ** 9)
    assert t["slope"]["mean"] == pytest.approx(0.1) and t["cross_tokens"] == pytest.approx(1000 * 2 ** 9.99, rel=1e-6)
    assert t["cross_epochs"] == pytest.approx(2 ** 0.99, rel=1e-6)


def test_paper_rois_follow_from_table3():
    for variant in ("stem-1/3", "stem-1/2", "stem-full"):
        assert round(table3_roi(variant), 2) == TABLE3[variant]["roi"]
    assert "1.08× / 1.20× / 1.33×" in QUOTES["roi"].text and QUOTES["roi"].source.startswith("Table 3")
    assert "8.4% to 13%" in QUOTES["long_context"].text and "Fig. 1b" in QUOTES["long_context"].source
    assert "peak lr 0.002" in QUOTES["stability"].text and "Table 2" in QUOTES["stability"].source


def _run(stage, variant, seed, loss, size="d", **extra):
    kinds = {"dense": ["dense"] * 3, "stem-1/3": ["dense", "dense", "stem"], "stem-1/2": ["dense", "stem", "stem"],
             "stem-full": ["stem"] * 3, "stem_gate-1/3": ["dense", "dense", "stem_gate"]}
    flops = {"dense": 100.0}.get(variant, 90.0)
    return {"name": f"{stage}-{variant}-{seed}", "stage": stage, "status": "finished",
            "labels": {"size": size, "variant": variant, "seed": seed, **extra.pop("labels", {})},
            "metrics": {"final_val_loss": loss, "val": [], "train": [], "steps": 10, "val_loss_init": 8.0},
            "accounting": {"train_flops_per_token": flops, "layer_kinds": kinds.get(variant, ["dense"] * 3)},
            "data": {"unigram_entropy": 6.0}, "config": {"optim": {"warmup_ratio": 0.0}, "run": {"steps": 10}}, **extra}


def test_claims_hold_are_contradicted_or_stay_inconclusive_by_the_rule():
    noise = [0.01, -0.02, 0.015]
    clear = [_run("compare", "dense", s, 5.0 + n) for s, n in enumerate(noise)]
    clear += [_run("compare", v, s, 4.5 + n + 0.003 * s) for v in ("stem-1/3", "stem-1/2", "stem-full") for s, n in enumerate(noise)]
    clear += [_run("compare", "stem_gate-1/3", s, 4.5 + n - 0.004 * s) for s, n in enumerate(noise)]
    rows = {r["key"]: r for r in claim_rows(clear, {})}
    assert rows["roi"]["verdict"] == "holds" and "loss ROI" in rows["roi"]["measured"]
    parts = {p["label"]: p["verdict"] for p in rows["ablation"]["parts"]}
    assert parts["d STEM-1/3 − gate"] == "inconclusive"  # STEM and gate equal: inside the noise, not "does not hold"
    assert parts["d gate − dense"] == "contradicted"  # §4.4.2: the gate ablation is worse than dense; here it is better
    worse = [_run("compare", "dense", s, 5.0 + n) for s, n in enumerate(noise)]
    worse += [_run("compare", v, s, 5.6 + n) for v in ("stem-1/3", "stem-1/2", "stem-full") for s, n in enumerate(noise)]
    assert {r["key"]: r for r in claim_rows(worse, {})}["roi"]["verdict"] == "contradicted"
    one_seed = [_run("compare", "dense", 0, 5.0), _run("compare", "stem-1/3", 0, 4.0)]
    assert {r["key"]: r for r in claim_rows(one_seed, {})}["roi"]["verdict"] == "inconclusive"
    assert all(r["verdict"] in ("holds", "contradicted", "inconclusive") for r in claim_rows(clear + worse, {}))


def test_holm_corrects_across_the_placements_a_claim_combines():
    """The audit's case: (a′) at 1/3 has p = 0.043 alone; over three placements its 98.3 % interval spans 0."""
    from stemlm.study.claims import correct
    from stemlm.study.evidence import _part
    from stemlm.study.stats import holm, p_value

    one_third = one_sample([0.0334 + x for x in (-0.0072 * 3 ** 0.5, 0.0, 0.0072 * 3 ** 0.5)])  # se 0.0072, df 2
    assert verdict(one_third, -1) == "contradicted" and p_value(one_third) == pytest.approx(0.043, abs=0.003)
    flat = one_sample([-0.01, 0.01, 0.0])
    parts = correct([_part("1/3", one_third, -1), _part("1/2", flat, -1), _part("full", flat, -1)])
    assert parts[0]["raw_verdict"] == "contradicted" and parts[0]["verdict"] == "inconclusive"
    assert "Holm 1 of 3" in parts[0]["text"] and "98.3 % interval [-0.022, +0.08" in parts[0]["text"]
    assert combine([p["verdict"] for p in parts]) == "inconclusive"
    # step-down: 0.001 < 0.05/3, 0.02 < 0.05/2, then 0.04 < 0.05 — all three significant; 0.03 first stops the rest
    assert [h["verdict"] for h in holm([(0.02, "holds"), (0.001, "holds"), (0.04, "holds")])] == ["holds"] * 3
    assert [h["verdict"] for h in holm([(0.001, "holds"), (0.03, "holds"), (0.04, "holds")])] == \
        ["holds", "inconclusive", "inconclusive"]
    assert holm([(None, "inconclusive"), (0.001, "holds")])[1]["level"] == pytest.approx(1 - 0.025)


def test_a_missing_correction_fails():
    """Every claim of several judged comparisons carries its Holm correction in the parts and the text."""
    noise = [0.01, -0.02, 0.015]
    runs = [_run("compare", "dense", s, 5.0 + n) for s, n in enumerate(noise)]
    runs += [_run("compare", v, s, 4.9 + n + 0.02 * s) for v in ("stem-1/3", "stem-1/2", "stem-full") for s, n in enumerate(noise)]
    for row in claim_rows(runs, {}):
        judged = [p for p in row["parts"] if p["verdict"] in ("holds", "contradicted", "inconclusive")]
        if len(judged) > 1:
            assert all(p["holm"]["m"] == len(judged) for p in judged), row["key"]
            assert all("Holm" in p["text"] for p in judged if p["p"] is not None), row["key"]


def test_pseudo_replication_is_refused():
    """Replicates that are not seeds (validation batches of one model) never make a verdict."""
    from stemlm.study.evidence import PseudoReplication, _part

    d = one_sample([0.5, 0.6, 0.55, 0.58])
    d.kind = "paired by validation batch; 1 seed"
    with pytest.raises(PseudoReplication, match="pseudo-replication"):
        _part("one seed", d, -1)


def test_knowledge_claim_needs_its_positive_control():
    runs = []
    for s in range(3):
        for v, k in (("dense", 0.1), ("stem-1/3", 0.2), ("stem-1/2", 0.3), ("stem-full", 0.5)):
            fam = {"train": {"seen": k + 0.01 * s, "unseen": 0.0}}
            runs.append(_run("compare", v, s, 5.0, probes={"knowledge": {"families": fam}}))
    rows = {r["key"]: r for r in claim_rows(runs, {})}
    assert rows["knowledge"]["verdict"] == "probe blind" and "no positive control" in rows["knowledge"]["measured"]
    ok = {"mean": 2.0, "se": 0.1, "df": 100, "n": 100, "kind": "welch", "ci": [1.8, 2.2], "mde": 0.3}
    control = _run("controls", "dense", 0, 3.0, labels={"control": "knowledge"},
                   probes={"knowledge": {"families": {"train": {"seen": 2.0, "unseen": 0.0, "seen_minus_unseen": ok}}}})
    rows = {r["key"]: r for r in claim_rows(runs + [control], {})}
    assert rows["knowledge"]["verdict"] == "holds" and "the probe can see the effect" in rows["knowledge"]["measured"]
    failed = {**ok, "mean": 0.01, "ci": [-0.1, 0.12]}
    control["probes"]["knowledge"]["families"]["train"]["seen_minus_unseen"] = failed
    row = {r["key"]: r for r in claim_rows(runs + [control], {})}["knowledge"]
    assert row["verdict"] == "probe blind" and all(p["verdict"] == "probe blind" for p in row["parts"])


def _needle(margin: float, found: float, ci: float = 0.02) -> dict:
    stat = {"mean": margin, "se": 0.01, "df": 50, "n": 50, "kind": "items", "ci": [margin - ci, margin + ci], "mde": 0.03}
    return {"version": 2, "mean_margin": stat, "mean_gain": {**stat, "mean": 0.7}, "retrieved": {"mean": found, "n": 60}}


def test_no_verdict_is_drawn_from_a_failed_control():
    """(d) with a needle control that does not retrieve ≥ 50 % greedily: the clear margin of STEM over
    dense is not judged; a control of the earlier probe (no decoy, no greedy retrieval) does not count."""
    runs = [_run("context", v, s, 5.0, probes={"needle": _needle(m + 0.01 * s, 0.0)})
            for s in range(3) for v, m in (("dense", 0.1), ("stem-1/3", 0.5))]
    control = _run("controls", "dense", 0, 3.0, labels={"control": "needle"}, probes={"needle": _needle(2.0, 0.3)})
    row = {r["key"]: r for r in claim_rows(runs + [control], {})}["long_context"]
    assert row["verdict"] == "probe blind" and "could NOT see retrieval" in row["measured"]
    assert "greedy retrieval 30% of 60 keys" in row["measured"]
    control["probes"]["needle"] = _needle(2.0, 0.8)
    row = {r["key"]: r for r in claim_rows(runs + [control], {})}["long_context"]
    assert row["verdict"] == "holds" and "the probe can see retrieval" in row["measured"]
    control["probes"]["needle"] = {"mean_gain": {"mean": 2.0, "se": 0.1, "df": 79, "n": 80, "kind": "items",
                                                 "ci": [1.8, 2.2], "mde": 0.3}}
    row = {r["key"]: r for r in claim_rows(runs + [control], {})}["long_context"]
    assert row["verdict"] == "probe blind" and "before the probe had a decoy" in row["measured"]


def test_the_needle_gain_of_an_earlier_probe_is_not_judged():
    runs = [_run("context", v, s, 5.0, probes={"needle": {"mean_gain": {"mean": g, "se": 0.01, "df": 50, "n": 50,
                                                                          "kind": "items", "ci": [g - 0.02, g + 0.02]}}})
            for s in range(3) for v, g in (("dense", 0.7), ("stem-1/3", 0.5))]
    row = {r["key"]: r for r in claim_rows(runs, {})}["long_context"]
    assert not row.get("parts") and "earlier probe version" in row["measured"]


def _compare_curve(variant, seed, jumps, shared=(60, 140)):
    losses = [6.0 - 0.001 * i + (0.02 if (i + seed) % 2 else 0.0) for i in range(200)]
    for step in (*shared, *jumps):  # shared: a hard batch every run of the seed sees
        losses[step - 1] += 2.0
    return _run("compare", variant, seed, 5.0, metrics={"final_val_loss": 5.0, "steps": 200, "tokens_seen": 1000, "val": [],
                                                         "train": [[i + 1, x] for i, x in enumerate(losses)]},
                config={"optim": {"warmup_ratio": 0.01}, "run": {"steps": 200}})


def test_stability_claim_pairs_spikes_against_dense_so_data_bumps_cancel():
    runs = [_compare_curve("dense", s, []) for s in range(3)] + [_compare_curve("stem-1/3", s, []) for s in range(3)]
    runs += [_compare_curve("hash_moe-1/3", s, list(range(30, 200, 50))) for s in range(3)]
    row = {r["key"]: r for r in claim_rows(runs, {})}["stability"]
    # the bumps at steps 60 and 140 are in every run (dense too) and cancel; Hash-MoE's own 4 per seed remain
    assert row["verdict"] == "holds" and "hash_moe-1/3 12, stem-1/3 0" in row["measured"]
    calm = [_compare_curve(v, s, []) for v in ("dense", "stem-1/3", "hash_moe-1/3") for s in range(3)]
    row = {r["key"]: r for r in claim_rows(calm, {})}["stability"]
    assert row["verdict"] == "untestable" and "no split of 0 spikes" in row["measured"]


def test_status_tells_slow_start_from_collapse_and_divergence():
    from stemlm.study.stability import status_of

    h, v = 6.77, 4096
    slow = [8.3 - 0.01 * i for i in range(192)]                    # still falling, ends above H − 0.5
    assert status_of(slow, 1, 6.5, h, v, False)[0] == "slow start"
    back = [8.3 - 0.05 * i for i in range(60)] + [6.7] * 132         # got to 5.35, back at the unigram level, flat
    assert status_of(back, 1, 6.7, h, v, False)[0] == "collapsed"
    flat = [8.3 - 0.05 * i for i in range(30)] + [6.8] * 162        # never below H − 0.5, flat
    assert status_of(flat, 1, 6.8, h, v, False)[0] == "collapsed"
    spike = [8.3 - 0.01 * i for i in range(192)]
    spike[3] = 23.4                                                 # explodes and recovers: noted, not diverged
    status, why = status_of(spike, 1, 5.5, h, v, False)
    assert status in ("finished", "slow start") and "exploded to 23.4 at step 4" in why and "recovered" in why
    assert status_of(slow[:10] + [12.0] * 182, 1, 12.0, h, v, False)[0] == "diverged"
    assert status_of(slow, 1, None, h, v, True)[0] == "diverged"


def test_seeds_needed_to_settle_an_inconclusive_difference():
    from stemlm.study.stats import seeds_needed

    d = one_sample([0.10, -0.02, 0.07])  # mean 0.05, sd 0.062
    n = seeds_needed(d)
    sd = d.se * math.sqrt(3)
    assert mde(sd / math.sqrt(n), n - 1) <= 0.05 < mde(sd / math.sqrt(n - 1), n - 2)
    assert seeds_needed(one_sample([0.3])) is None and seeds_needed(one_sample([1.0, -1.0, 0.01])) == 101


def test_a_best_lr_at_the_grid_top_is_flagged_unless_a_worse_run_beyond_it_brackets_it():
    from stemlm.study.tuning import best_lrs

    def run(variant, lr, loss):
        return {"stage": "sweep", "status": "finished", "name": f"{variant}-{lr}", "metrics": {"final_val_loss": loss},
                "labels": {"variant": variant, "lr": lr, "roles": ["tune"]}}
    runs = [run("a", 1e-3, 6.0), run("a", 4e-3, 5.5), run("b", 1e-3, 6.0), run("b", 4e-3, 5.5), run("b", 3e-2, 5.8),
            run("c", 1e-3, 6.0), run("c", 4e-3, 5.5), run("c", 3e-2, 5.4)]
    best = best_lrs(runs, [1e-3, 4e-3])
    assert (best["a"]["lr"], best["a"]["edge"]) == (4e-3, "high")  # nothing measured above: the optimum may be there
    assert (best["b"]["lr"], best["b"]["edge"]) == (4e-3, None)    # 3e-2 did worse: bracketed
    assert (best["c"]["lr"], best["c"]["edge"]) == (4e-3, "high")  # 3e-2 did better, outside the grid: still flagged


def test_sweep_resolution_extends_past_an_edge_and_reseeds_the_near_best():
    """STEM-1/3's case in the full study: 2e-3 and 4e-3 a coin flip apart, the best at the grid's top."""
    from stemlm.study.tuning import pick, resolve

    sweep = {"lrs": [1e-3, 2e-3, 4e-3], "seeds": [0], "variants": ["a"],
             "resolve": {"seeds": [1, 2], "within": 0.02, "extend": 2}}

    def run(lr, seed, loss, roles=("tune",)):
        return {"stage": "sweep", "status": "finished", "name": f"a-{lr}-{seed}", "metrics": {"final_val_loss": loss},
                "labels": {"variant": "a", "lr": lr, "seed": seed, "roles": list(roles)}}
    runs = [run(1e-3, 0, 5.0), run(2e-3, 0, 4.60), run(4e-3, 0, 4.59)]
    r = resolve(runs, sweep)["a"]
    assert not r["resolved"] and r["extra"] == [(8e-3, 0, "extend")]  # best at the top edge: try past it
    runs.append(run(8e-3, 0, 4.70, ["extend"]))
    r = resolve(runs, sweep)["a"]  # 4e-3 is bracketed now; 2e-3 and 4e-3 are within 0.02: two more seeds each
    assert not r["resolved"] and set(r["extra"]) == {(8e-3, 0, "extend")} | {(lr, s, "resolve") for lr in (2e-3, 4e-3)
                                                                              for s in (1, 2)}
    runs += [run(2e-3, 1, 4.55), run(2e-3, 2, 4.56), run(4e-3, 1, 4.62), run(4e-3, 2, 4.63)]
    tuned, extra = pick(runs, sweep)
    assert tuned["a"]["lr"] == 2e-3 and tuned["a"]["edge"] is None and tuned["a"]["seeds"] == 3
    assert tuned["a"]["loss"] == pytest.approx((4.60 + 4.55 + 4.56) / 3)
    # the full study's STEM-1/3: a stress lr (1e-2) beats the grid's best, so it is a candidate like the grid's
    stress = [run(1e-3, 0, 5.66), run(2e-3, 0, 5.569), run(4e-3, 0, 5.577), run(1e-2, 0, 5.530, ["stress"]),
              run(3e-2, 0, 5.70, ["stress"])]
    r = resolve(stress, {**sweep, "resolve": {"seeds": [1, 2], "within": 0.05}})["a"]
    assert {lr for lr, _, role in r["extra"] if role == "resolve"} == {2e-3, 4e-3, 1e-2} and not any(
        role == "extend" for _, _, role in r["extra"])
    from stemlm.study import load_spec, plan

    spec = load_spec("gpu", quick=True)
    spec["sweep"] = {**spec["sweep"], "resolve": {"seeds": [1]}}
    runs = plan(spec, {}, {"dense": [(0.2, 0, "extend"), (1e-2, 1, "resolve"), (1e-2, 0, "resolve")]})
    names = {r.name: r for r in runs if r.stage == "sweep"}
    assert names["sweep-d32-dense-lr0.2-seed0"].labels["roles"] == ["extend"]
    assert names["sweep-d32-dense-lr0.01-seed0"].labels["roles"] == ["resolve", "tune"]  # the grid run, one more role
    assert "sweep-d32-dense-lr0.01-seed1" in names


def test_sweep_resolution_confirms_the_near_candidates_at_the_comparisons_length():
    """``resolve.confirm_steps``: the full study's STEM-1/3, whose stress lr 1e-2 led the 192-step sweep
    and fell behind over the epoch: the candidates are trained for the comparison's steps and the
    lowest loss there is the pick; the confirmations stay out of the sweep's own table."""
    from stemlm.study import load_spec, plan
    from stemlm.study.tuning import pick, resolve, sweep_table

    sweep = {"lrs": [1e-3, 2e-3, 4e-3], "seeds": [0], "variants": ["a"],
             "resolve": {"within": 0.05, "extend": 0, "confirm_steps": 1153}}

    def run(lr, seed, loss, roles=("tune",)):
        return {"stage": "sweep", "status": "finished", "name": f"a-{lr}-{seed}-{roles}",
                "metrics": {"final_val_loss": loss}, "labels": {"variant": "a", "lr": lr, "seed": seed,
                                                                "roles": list(roles)}}
    runs = [run(1e-3, 0, 5.66), run(2e-3, 0, 5.569), run(4e-3, 0, 5.577), run(1e-2, 0, 5.530, ["stress"]),
            run(3e-2, 0, 5.70, ["stress"])]
    r = resolve(runs, sweep)["a"]
    assert not r["resolved"] and set(r["extra"]) == {(lr, 0, "confirm") for lr in (2e-3, 4e-3, 1e-2)}
    runs += [run(2e-3, 0, 4.352, ["confirm"]), run(4e-3, 0, 4.40, ["confirm"]), run(1e-2, 0, 4.685, ["confirm"])]
    tuned, _ = pick(runs, sweep)
    assert tuned["a"]["lr"] == 2e-3 and tuned["a"]["confirmed"] == {2e-3: 4.352, 4e-3: 4.40, 1e-2: 4.685}
    assert set(sweep_table(runs)["a"]) == {1e-3, 2e-3, 4e-3, 1e-2, 3e-2}  # the sweep's own losses only
    assert sweep_table(runs)["a"][2e-3]["losses"] == [5.569]
    # a stress lr alone near the best is checked against the grid's best
    far = [run(1e-3, 0, 5.9), run(2e-3, 0, 5.8), run(4e-3, 0, 5.7), run(1e-2, 0, 5.5, ["stress"])]
    assert {lr for lr, _, role in resolve(far, sweep)["a"]["extra"] if role == "confirm"} == {4e-3, 1e-2}
    # one grid lr clearly best: no confirmation needed
    clear = [run(1e-3, 0, 5.9), run(2e-3, 0, 5.5), run(4e-3, 0, 5.8)]
    r = resolve(clear, sweep)["a"]
    assert r["resolved"] and r["lr"] == 2e-3 and r["extra"] == []
    # planned as sweep runs at the comparison's length, named apart from the sweep's own
    spec = load_spec("gpu", quick=True)
    spec["sweep"] = {**spec["sweep"], "resolve": {"confirm_steps": 40}}
    names = {r.name: r for r in plan(spec, {}, {"dense": [(1e-2, 0, "confirm")]}) if r.stage == "sweep"}
    confirm = names["sweep-d32-dense-lr0.01-seed0-steps40"]
    assert confirm.labels["roles"] == ["confirm"] and confirm.labels["steps"] == 40
    assert "run.steps=40" in confirm.overrides and names["sweep-d32-dense-lr0.01-seed0"].labels["roles"] == ["tune"]


def test_a_claim_measured_on_the_wide_corpus_is_settled_beyond_it():
    """What settles (a)/(a′) follows the scale they were measured at: on the default corpus, the wide-corpus
    comparison; once measured there (≥ 10M tokens), its missing seeds and then more text. A contradiction far
    below the paper's tokens reads "not recovered"."""
    from stemlm.study.scale import SETTLE, reading, settle_text

    small = {"tokens": 2.36e6, "sizes": ["d128"], "seeds": 3, "text": "d128, 2.36M tokens per run, 3 seeds"}
    wide = {"tokens": 32.1e6, "sizes": ["d384"], "seeds": 1, "text": "d384, 32.1M tokens per run, 1 seed"}
    assert settle_text("roi", small) == SETTLE["roi"] and "studies/gpu.yaml" in SETTLE["roi"]
    assert settle_text("roi", wide).startswith("all 3 seeds of the wide-corpus comparison")
    assert settle_text("dynamics", wide).startswith("all 3 seeds") and settle_text("knowledge", wide) == SETTLE["knowledge"]
    assert settle_text("roi", None) == SETTLE["roi"]
    verdict, text = reading("roi", "contradicted", wide)
    assert verdict == "not recovered" and text.startswith("not recovered within 32.1M tokens")


def test_the_scale_text_names_the_fewest_seeds_when_variants_differ():
    """A comparison with 3 dense seeds and 2 of a STEM placement is as strong as its 2 pairs: the text says so."""
    from stemlm.study.scale import PAPER, measured

    stage = PAPER["roi"][0]

    def run(variant, seed):
        return {"stage": stage, "status": "finished", "metrics": {"tokens_seen": 32.1e6},
                "labels": {"size": "d384", "variant": variant, "seed": seed}}

    uneven = [run("dense", s) for s in range(3)] + [run("stem-1/3", s) for s in range(2)]
    m = measured(uneven, "roi")
    assert m["seeds"] == 2 and m["text"] == "d384, 32.1M tokens per run, 2–3 seeds per variant"
    even = [run(v, s) for v in ("dense", "stem-1/3") for s in range(3)]
    assert measured(even, "roi")["text"] == "d384, 32.1M tokens per run, 3 seeds"
