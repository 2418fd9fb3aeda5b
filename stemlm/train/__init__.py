"""Training: one loop for every FFN kind, a row-sparse table optimizer, exact resume, metrics.

``train(load_train_config("debug", overrides=["data.dir=..."]))`` runs a training; see
docs/training.md.
"""

from .config import TrainConfig, describe_fields, load_train_config, train_defaults
from .loop import Trainer, TrainingDiverged
from .result import TrainResult
from .run import train
from .sparse_adam import SparseRowAdamW

__all__ = ["SparseRowAdamW", "TrainConfig", "TrainResult", "Trainer", "TrainingDiverged", "describe_fields",
           "load_train_config", "train", "train_defaults"]
