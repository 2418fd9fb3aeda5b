"""stemlm: STEM (Scaling Transformers with Embedding Modules) in plain PyTorch.

``import stemlm`` registers ``StemConfig``/``StemForCausalLM`` with Hugging Face's Auto classes
when transformers is installed (lazily: at the first ``import transformers``, see ``_hf_hook``).
"""

from .config import FFN_KINDS, ConfigError, ModelConfig, resolve_stem_layers
from .model import StemLM
from .presets import PRESETS, model_config

__version__ = "0.1.0"
__all__ = ["FFN_KINDS", "ConfigError", "ModelConfig", "PRESETS", "StemLM", "model_config", "resolve_stem_layers"]

from ._hf_hook import install as _install_hf_registration

_install_hf_registration()
