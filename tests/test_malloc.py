"""``keep_freed_memory``: freed blocks stay mapped, so allocating them again faults no pages."""

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from stemlm.runtime.malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # 4 x 40 MiB alive at once and then freed, like a step's activations
    alive = [torch.ones(10 << 20) for _ in range(4)]
    del alive
for _ in range(3):
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
    # by default blocks above 32 MiB always get a fresh mapping: 40 allocations x 10240 pages
    assert faults["default"] > 200_000, faults
    # kept: the heap serves them again (now and then one block lands on new pages: 0-4 of 40 here)
    assert faults["keep"] < faults["default"] / 5, faults
