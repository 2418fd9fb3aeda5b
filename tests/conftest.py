"""Shared fixtures: fixed seeds, tiny configs."""

import os

import torch

if not torch.cuda.is_available():  # the Triton table kernels run under the interpreter here (tests/test_table_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the suite runs from working trees with changes; the study runner refuses those otherwise (test_study.py
# checks the refusal with the variable unset)
os.environ.setdefault("STEMLM_ALLOW_DIRTY", "1")

import pytest  # noqa: E402

from stemlm import model_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def debug_cfg():
    """The debug preset with STEM in 1/3 of the layers."""
    return model_config("debug", ffn="stem", stem_layers="1/3")
