"""Calibrated insertion into the real SmolLM2-135M (slow: loads the GGUF, one calibration pass).

Run with ``pytest -m slow tests/test_smollm2_insert.py -s``. The measured numbers are in
docs/insertion.md (``benchmarks/bench_insertion.py``); this checks the properties on few tokens.
"""

import numpy as np
import pytest
import torch

from stemlm.data import TokenDataset, corpus_in_vocabulary
from stemlm.insert.anneal import set_scales
from stemlm.insert.calibrate import CalibrationConfig, assemble, calibrate, calibration_windows
from stemlm.data.codec import load_codec
from stemlm.interop.convert import llama_config_to_stem_of, llama_to_stem, load_llama, resolve_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dense_and_text(tmp_path_factory):
    directory, gguf = resolve_source("smollm2")
    dense = llama_to_stem(load_llama(directory, gguf), ffn="dense")
    tok = load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf, hint="").tokenizer
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    data = corpus_in_vocabulary(d / "tokenizer.json", progress=False)
    return dense, TokenDataset.open(data, "train"), TokenDataset.open(data, "val")


def loss(model, val):
    ids = torch.from_numpy(np.asarray(val.tokens[:4 * 128 + 1], dtype=np.int64))
    x, y = ids[:-1].view(4, 128), ids[1:].view(4, 128)
    with torch.no_grad():
        return float(model(x, targets=y))


def test_calibrated_insertion_starts_far_closer_to_dense_than_zero_tables(dense_and_text, tmp_path):
    dense, train, val = dense_and_text
    calib = CalibrationConfig(tokens=8192, seq_len=256)
    ids = calibration_windows(train.tokens, calib.tokens, calib.seq_len)
    target = llama_config_to_stem_of(dense.cfg, "stem", "1/3")
    stem = assemble(dense, target, calibrate(dense, target, ids, calib, tmp_path / "w", progress=False))
    zero = assemble(dense, target, calibrate(dense, target, ids, CalibrationConfig(tokens=8192, seq_len=256,
                                                                                   method="zero"), tmp_path / "z",
                                             progress=False))
    d, s, z = loss(dense, val), loss(stem, val), loss(zero, val)
    print(f"\nheld-out loss dense {d:.3f}, calibrated {s:.3f}, zero {z:.3f}")
    assert d < s < z and s - d < 0.6 * (z - d)


def test_blend_start_is_the_dense_model(dense_and_text, tmp_path):
    dense, train, val = dense_and_text
    calib = CalibrationConfig(tokens=2048, seq_len=256, dagger_rows="fit")
    ids = calibration_windows(train.tokens, calib.tokens, calib.seq_len)
    target = llama_config_to_stem_of(dense.cfg, "stem_dagger", "1/3")
    blend = assemble(dense, target, calibrate(dense, target, ids, calib, tmp_path / "w", progress=False))
    set_scales(blend, 1.0, 0.0)
    assert loss(blend, val) == pytest.approx(loss(dense, val), abs=1e-5)
