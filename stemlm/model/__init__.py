"""The model: the decoder (``decoder.StemLM``, architecture only; its FFN kinds are ``stemlm.ffn``), the
token-indexed tables (``tables``) and their quantized codecs (``quant``), and the loss (``loss``).
"""

from .decoder import StemLM

__all__ = ["StemLM"]
