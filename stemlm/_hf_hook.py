"""Register stemlm with Hugging Face's Auto classes without importing transformers eagerly.

Importing transformers' model stack costs seconds; most stemlm commands never need it. If
transformers is already imported, ``install()`` registers at once; otherwise it adds an import
hook that registers right after the first ``import transformers`` completes, so
``import stemlm; from transformers import AutoModelForCausalLM`` works in either order.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def _register() -> None:
    from . import hf  # noqa: F401  (the import registers the Auto classes)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``transformers`` so registration runs after the module executes."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Register now if transformers is loaded, else once it is (no-op without transformers)."""
    if "transformers" in sys.modules:
        _register()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())
