"""Metric arithmetic on hand-made answers, against values worked out by hand."""

import math

import pytest

from stemlm.eval.metrics import (bits_per_byte, choice_length, exact_match, mc_correct, mean_stderr,
                                 normalize_answer, summarize)
from stemlm.eval.run import above_chance
from stemlm.eval.tasks.base import subsample


def test_acc_acc_norm_and_unconditional_pick_different_choices():
    logprobs = [-2.0, -3.0, -6.0]
    conts = [" ab", " abcdefgh", " a"]  # 2, 8 and 1 characters (the leading separator does not count)
    # acc: argmax(-2, -3, -6) = 0; acc_norm: argmax(-1, -0.375, -6) = 1; uncond: argmax(-1, 2, -5) = 1
    assert mc_correct(logprobs, conts, gold=1, uncond=[-1.0, -5.0, -1.0]) == {"acc": 0.0, "acc_norm": 1.0,
                                                                             "acc_uncond": 1.0}
    assert mc_correct(logprobs, conts, gold=0) == {"acc": 1.0, "acc_norm": 0.0}
    assert mc_correct([-1.0, -1.0], [" x", " y"], gold=0)["acc"] == 1.0  # ties go to the first choice
    assert choice_length(" cellular telephone") == 18 and choice_length("yes") == 3


def test_binomial_stderr_is_sample_std_over_sqrt_n():
    mean, err = mean_stderr([1, 0, 1, 1])  # std(ddof=1) = sqrt((3 * 0.25**2 + 0.75**2) / 3) = 0.5
    assert mean == 0.75 and err == pytest.approx(0.25)
    assert math.isnan(mean_stderr([1.0])[1]) and math.isnan(mean_stderr([])[0])
    out = summarize([{"acc": 1.0, "acc_uncond": 1.0}, {"acc": 0.0}, {"acc": 1.0, "acc_uncond": 0.0}])
    assert out["acc"] == pytest.approx(2 / 3) and out["n"] == 3
    assert out["acc_uncond"] == 0.5 and out["n_acc_uncond"] == 2 and out["acc_uncond_stderr"] == pytest.approx(0.5)


def test_stderr_matches_the_harness():
    import numpy as np
    from lm_eval.api.metrics import mean_stderr as harness_stderr

    values = np.random.default_rng(0).integers(0, 2, 57).astype(float).tolist()
    assert mean_stderr(values)[1] == pytest.approx(harness_stderr(values), rel=1e-12)


def test_bits_per_byte_is_corpus_level():
    ln2 = math.log(2)
    # 8 + 4 bits over 4 + 2 bytes ("é" is two UTF-8 bytes) = 2 bits per byte, every item exactly on the ratio
    bpb, err = bits_per_byte([-8 * ln2, -4 * ln2], ["abcd", "é"])
    assert bpb == pytest.approx(2.0) and err == pytest.approx(0.0, abs=1e-12)
    bpb, err = bits_per_byte([-8 * ln2, -2 * ln2], ["abcd", "ab"])  # 10 bits / 6 bytes
    # residuals l - r b: 8 - 20/3 = 4/3 and 2 - 10/3 = -4/3; sqrt((32/9) / 2) / 3 = (4/3) / 3
    assert bpb == pytest.approx(10 / 6) and err == pytest.approx(4 / 9)


def test_squad_normalisation_and_exact_match():
    assert normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert normalize_answer("An  apple, a day") == "apple day"
    assert exact_match("the Apple.", ["Banana", "apple"]) == 1.0
    assert exact_match("apples", ["apple"]) == 0.0
    assert exact_match("Sunset Blvd", ["Sunset Boulevard", "Sunset Blvd."]) == 1.0


def test_subsample_is_seeded_nested_and_ordered():
    items = list(range(100))
    a = subsample(items, 10, seed=0, key=str)
    assert a == sorted(a) and len(a) == 10 and a == subsample(items, 10, seed=0, key=str)
    assert set(a) <= set(subsample(items, 30, seed=0, key=str))  # a larger limit keeps the smaller one's items
    assert a != subsample(items, 10, seed=1, key=str)
    assert subsample(items, None, 0, str) == items and subsample(items, 500, 0, str) == items
    with pytest.raises(ValueError, match="--limit"):
        subsample(items, 0, 0, str)


def test_above_chance_needs_two_standard_errors():
    r = {"metric": "acc", "acc": 0.40, "acc_stderr": 0.05, "chance": 0.25}
    assert above_chance(r) is True and above_chance({**r, "acc_stderr": 0.08}) is False
    assert above_chance({"metric": "bpb", "bpb": 1.0, "bpb_stderr": 0.1, "chance": None}) is None
    assert above_chance({**r, "metric": "greedy", "greedy": 0.2, "greedy_stderr": 0.05, "chance_greedy": 0.0})
