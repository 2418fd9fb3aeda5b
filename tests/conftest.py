"""Shared fixtures: fixed seeds, tiny configs."""

import pytest
import torch

from stemlm import model_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def debug_cfg():
    """The debug preset with STEM in 1/3 of the layers."""
    return model_config("debug", ffn="stem", stem_layers="1/3")
