"""The model fields are declared once, in ``ModelConfig``: a field added there reaches the training
config's ``model.*`` section, the transformers ``StemConfig`` and a checkpoint's ``config.json``
without an edit elsewhere."""

import subprocess
import sys

ADD_A_FIELD = """
import dataclasses
import stemlm.config, stemlm.presets

@dataclasses.dataclass(frozen=True)
class WithStorage(stemlm.config.ModelConfig):
    table_dtype: str = "float32"

stemlm.config.ModelConfig = stemlm.presets.ModelConfig = WithStorage  # before the mirrors are built

from stemlm.interop.hf import StemConfig
from stemlm.train.config import load_train_config

assert {f.name: f.default for f in dataclasses.fields(StemConfig)}["table_dtype"] == "float32"
cfg = load_train_config("debug", overrides=["model.table_dtype=int8", "model.d_model=128"]).model.build()
assert (cfg.table_dtype, cfg.d_model) == ("int8", 128), cfg
hf = StemConfig.from_model_config(cfg)
assert hf.to_dict()["table_dtype"] == "int8" and hf.model_config() == cfg
assert StemConfig(**hf.to_dict()).model_config() == cfg  # as from_pretrained rebuilds it from config.json

import tempfile
from stemlm.checkpoint.directory import read_config, save_model
from stemlm.model.decoder import StemLM
with tempfile.TemporaryDirectory() as tmp:
    assert read_config(save_model(StemLM(cfg), tmp + "/ckpt")) == cfg  # config.json carries it
"""


def test_a_field_added_to_model_config_reaches_training_config_and_stem_config():
    proc = subprocess.run([sys.executable, "-c", ADD_A_FIELD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
