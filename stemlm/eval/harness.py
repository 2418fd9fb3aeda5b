"""lm-evaluation-harness backend ``stemlm``: the harness's three request types answered by ``load_lm``'s engine.

lm-eval 0.4.13 finds models only in its own registry (a fixed name -> module table, no entry
points or plugin hook), so the backend is registered by ``register()`` and the command line goes
through this module, which registers it and then runs the harness's own CLI::

    python -m stemlm.eval.harness --model stemlm --model_args pretrained=RUN[,tables=disk] --tasks ...

From Python: ``register()`` then ``lm_eval.simple_evaluate(model="stemlm", ...)``, or pass a
``StemHarnessLM(...)`` instance as ``model``. Needs ``pip install stemlm[eval]``.
"""

from __future__ import annotations

import logging

from lm_eval.api.model import LM

from .api import GenerateRequest, LoglikelihoodRequest
from .models import load_lm

NAME = "stemlm"
DEFAULT_MAX_GEN_TOKS = 256  # as the harness's hf backend


def register() -> None:
    """Add ``stemlm`` to the harness's model registry (idempotent; the built-in models stay available)."""
    import lm_eval.models  # noqa: F401  (fills the registry with the built-in names first)
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=f"{__name__}:StemHarnessLM")


def _device(value: str | None) -> str:
    """The harness's CLI asks for ``cuda`` unless told otherwise; without CUDA that means the CPU."""
    import torch

    if not value or (str(value).startswith("cuda") and not torch.cuda.is_available()):
        if value:
            logging.getLogger(__name__).warning("device %s is not available; using cpu", value)
        return "cpu"
    return str(value)


def _batch_size(value) -> int:
    """The harness passes ``--batch_size`` as text (``auto`` and ``auto:N`` take the default)."""
    if value is None or str(value).startswith("auto"):
        return 32
    return int(value)


class StemHarnessLM(LM):
    """A stemlm model (run, checkpoint, Llama directory or GGUF) as a harness ``LM``.

    ``model_args``: ``pretrained`` (path, or ``smollm2``), ``gguf``, ``tables`` (device | host |
    disk), ``dtype``, ``max_length``, ``tokenizer``, ``max_gen_toks`` (default of
    ``generate_until``), ``engine`` (fast | reference); the rest goes to ``load_lm``. Decoding is
    greedy; a request that asks for sampling is refused.
    """

    def __init__(self, pretrained: str, gguf: str | None = None, tables: str = "device", device: str | None = None,
                 batch_size=None, max_batch_size=None, dtype: str = "float32", max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, **load_kw):
        super().__init__()
        self.lm = load_lm(str(pretrained), tables, gguf=gguf, device=_device(device),
                          batch_size=_batch_size(batch_size), dtype=dtype, max_length=max_length, **load_kw)
        self.max_gen_toks = max_gen_toks

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log-prob, is_greedy)`` of each ``(context, continuation)``."""
        answers = self.lm.loglikelihood([LoglikelihoodRequest(*r.args) for r in requests])
        return [(a.logprob, a.is_greedy) for a in answers]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-prob of each whole text (rolling windows of ``max_length``)."""
        return [a.logprob for a in self.lm.loglikelihood_rolling([r.args[0] for r in requests])]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first of its ``until`` strings."""
        return self.lm.generate_until([self._generate_request(*r.args) for r in requests])

    def _generate_request(self, context: str, gen_kwargs: dict) -> GenerateRequest:
        kw = dict(gen_kwargs or {})
        if kw.get("do_sample") or float(kw.get("temperature") or 0.0) > 0:
            raise ValueError("the stemlm backend decodes greedily: set do_sample=false and temperature=0")
        until = kw.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        return GenerateRequest(context, until, int(kw.get("max_gen_toks", self.max_gen_toks)))

    def get_model_info(self) -> dict:
        """Recorded by the harness in its results (``config``)."""
        return {"model_identity": self.lm.identity, "max_length": self.lm.max_length}


def main() -> None:
    """``lm_eval``'s command line with the ``stemlm`` backend registered."""
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
