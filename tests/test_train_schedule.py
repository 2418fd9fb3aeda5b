"""The learning-rate schedule and the loss-spike counter (stemlm/train/schedule.py, metrics.py)."""

import math

import pytest

from stemlm.train.metrics import SpikeDetector
from stemlm.train.schedule import lr_factor


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_then_decay_to_min_ratio(decay):
    factors = [lr_factor(s, 101, warmup_ratio=0.1, decay=decay, min_ratio=0.1) for s in range(101)]  # 10 warmup steps
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # the first step already learns
    assert factors[9] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # never rises after warmup
    assert factors[10] == 1.0  # decay runs from step 10 (factor 1) to step 100 (min_ratio): halfway is step 55
    assert factors[55] == pytest.approx(0.1 + 0.9 * (0.5 if decay == "linear" else 0.5 * (1 + math.cos(math.pi / 2))))


def test_no_warmup_and_unknown_decay():
    assert lr_factor(0, 10, warmup_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="unknown decay 'step'"):
        lr_factor(5, 10, 0.0, decay="step")


def test_spike_detector_counts_spikes_and_keeps_them_out_of_the_median():
    det = SpikeDetector(factor=3.0, window=5, min_history=3)
    assert [det.update(x) for x in (2.0, 2.0, 7.0)] == [False, False, False]  # too little history yet
    assert det.update(2.1) is False and det.update(6.9) is True and det.count == 1  # median 2.05: 6.9 > 6.15
    assert list(det.recent) == [2.0, 2.0, 7.0, 2.1]  # the spike is not recorded
    clone = SpikeDetector(factor=3.0, window=5, min_history=3)
    clone.load_state_dict(det.state_dict())
    assert clone.count == 1 and list(clone.recent) == list(det.recent) and clone.update(9.0) == det.update(9.0)
