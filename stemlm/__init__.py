"""stemlm: STEM (Scaling Transformers with Embedding Modules) in plain PyTorch.

``import stemlm`` registers ``StemConfig``/``StemForCausalLM`` with Hugging Face's Auto classes
when transformers is installed.
"""

from importlib.util import find_spec as _find_spec

from .config import FFN_KINDS, ConfigError, ModelConfig, resolve_stem_layers
from .model import StemLM
from .presets import PRESETS, model_config

__version__ = "0.1.0"
__all__ = ["FFN_KINDS", "ConfigError", "ModelConfig", "PRESETS", "StemLM", "model_config", "resolve_stem_layers"]

if _find_spec("transformers") is not None:  # optional Hugging Face interop; errors inside hf.py must surface
    from . import hf as _hf  # noqa: F401  (registers the Auto classes)
