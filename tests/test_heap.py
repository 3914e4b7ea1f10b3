"""workbench.train.heap: freed memory stays in the process, so a step's large arrays are not
faulted in again every step (run in a child process: the setting is process-wide)."""

import subprocess
import sys

import pytest

CHILD = """
import resource, sys
import numpy as np

def faults_of_a_second_allocation():
    a = np.ones(32 * 1024 * 1024)  # 256 MiB: over glibc's largest mmap threshold (32 MiB)
    del a
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b = np.ones(32 * 1024 * 1024)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del b
    return after - before

plain = faults_of_a_second_allocation()
from workbench.train.heap import keep_freed_memory
ok = keep_freed_memory()
faults_of_a_second_allocation()  # grows the heap once
kept = faults_of_a_second_allocation()
print(plain, ok, kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_array_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    plain, ok, kept = out.stdout.split()
    assert ok == "True"
    # a fresh mmap every time: every page faulted in (and zeroed) again, 4 KiB or, with
    # transparent huge pages, 2 MiB at a time (at least 128 faults for 256 MiB)
    assert int(plain) >= 128
    assert int(kept) <= int(plain) // 10  # the heap kept it: (almost) nothing to fault
