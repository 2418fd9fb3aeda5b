"""stemlm: STEM (Scaling Transformers with Embedding Modules) in plain PyTorch.

Importing stemlm changes no global state. ``import stemlm.interop.hf`` registers ``StemConfig`` and
``StemForCausalLM`` with Hugging Face's Auto classes (docs/hf_interop.md).
"""

from .config import ConfigError, ModelConfig, resolve_stem_layers
from .ffn import FFN_KINDS
from .model.decoder import StemLM
from .presets import PRESETS, model_config

__version__ = "0.1.0"
__all__ = ["FFN_KINDS", "ConfigError", "ModelConfig", "PRESETS", "StemLM", "model_config", "resolve_stem_layers"]
