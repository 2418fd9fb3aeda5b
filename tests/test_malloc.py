"""``keep_freed_memory``: freed blocks stay mapped, so allocating them again faults no pages."""

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from stemlm.malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # 8 x 16 MiB alive at once and then freed, like a step's activations
    alive = [torch.ones(4 << 20) for _ in range(8)]
    del alive
for _ in range(2):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds exist only in glibc")
def test_freed_memory_is_reused_without_page_faults():
    faults = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                       check=True).stdout.split()[-1]) for mode in ("default", "keep")}
    assert faults["default"] > 10_000, faults  # glibc trims the freed 128 MiB and the next step maps it again
    assert faults["keep"] < 1_000, faults
