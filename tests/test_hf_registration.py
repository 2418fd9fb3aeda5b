"""``import stemlm`` changes no global state; ``import stemlm.interop.hf`` registers with the Auto classes."""

import subprocess
import sys

import pytest

CHECK = "from transformers import AutoConfig; assert type(AutoConfig.for_model('stemlm')).__name__ == 'StemConfig'"
# Process-wide state a library import must leave alone: torch's numerics and threads, import
# machinery, warning filters, logging and the environment.
STATE = """
import logging, os, sys, warnings, torch
def state():
    return dict(dtype=torch.get_default_dtype(), threads=torch.get_num_threads(),
                deterministic=torch.are_deterministic_algorithms_enabled(),
                cudnn=(torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
                matmul=torch.get_float32_matmul_precision(), grad=torch.is_grad_enabled(),
                meta_path=list(sys.meta_path), warnings=list(warnings.filters),
                logging=list(logging.getLogger().handlers), env=dict(os.environ))
"""


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]


def test_import_stemlm_has_no_global_side_effects():
    _run(STATE + """
before = state()
import stemlm
assert state() == before, {k: v for k, v in state().items() if before[k] != v}
heavy = [m for m in ("transformers", "fastapi", "lm_eval", "uvicorn") if m in sys.modules]
assert not heavy, heavy
""")


@pytest.mark.parametrize("code", [
    "import stemlm.interop.hf; " + CHECK,
    "import transformers; import stemlm.interop.hf; " + CHECK,
])
def test_import_stemlm_hf_registers_the_auto_classes(code):
    _run(code)
