"""A role process that fixes glibc's mmap threshold gives freed arrays back to the system."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fedpca.allocator import map_large_blocks

# In a fresh interpreter: free one 16 MiB array (which raises glibc's dynamic
# threshold to 16 MiB), then, in another thread as an owner's task thread does with
# its statistics, fill a 4 MiB temporary, keep a small result made after it, and free
# the temporary; print how much stays resident (KiB).
SCRIPT = """
import sys, threading
import numpy as np
from fedpca.allocator import map_large_blocks

def rss():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

if sys.argv[1] == "fixed":
    assert map_large_blocks()
big = np.ones(2 << 20)
del big
before = rss()
kept = []
def task():
    block = np.ones(512 << 10)
    kept.append(np.ones(1 << 10))
    del block
thread = threading.Thread(target=task)
thread.start()
thread.join()
print(rss() - before)
"""


def _kept_kib(mode: str) -> int:
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(completed.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_arrays_are_returned_once_the_threshold_is_fixed() -> None:
    # Without the setting the 4 MiB array comes from the thread's heap and stays
    # resident after it is freed; with it, it is unmapped.
    assert _kept_kib("dynamic") >= 3 * 1024
    assert _kept_kib("fixed") < 1024


def test_setting_the_threshold_is_harmless_to_repeat() -> None:
    expected = platform.libc_ver()[0] == "glibc"
    assert map_large_blocks() is expected
    assert map_large_blocks() is expected
