"""``import stemlm`` registers with the Auto classes in either import order, without loading transformers early."""

import subprocess
import sys

import pytest

CHECK = "from transformers import AutoConfig; assert type(AutoConfig.for_model('stemlm')).__name__ == 'StemConfig'"


@pytest.mark.parametrize("code", [
    "import stemlm, sys; assert 'transformers' not in sys.modules; " + CHECK,
    "import transformers; import stemlm; " + CHECK,
])
def test_auto_registration_in_any_import_order(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
