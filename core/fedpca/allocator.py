"""How a long-running role process gives the memory its tasks freed back to the system.

glibc's malloc serves a request of at least its mmap threshold with a mapping of its
own, unmapped when freed; smaller requests come from heaps it keeps, one per thread
that allocates ("arenas"). The threshold starts at 128 KiB and *rises* to the size of
every larger mapped block that is freed, up to 32 MiB. So once a server has freed one
large array (an owner's 30 MiB Gram matrix at M = 2,000), every later array below that
size comes from a heap, and what a task thread freed there mostly stays resident:
after its statistics at M = 2,000, an owner kept 21 MiB besides its share in its task
thread's heap. Measured with ``benchmarks/high_dimension.py --features 2000``, a fixed
1 MiB threshold lowered each owner's peak above idle from 73 to 54 MiB, with no
measurable cost in time (a mapping costs microseconds; an array of 1 MiB or more here
is part of milliseconds to seconds of numeric or cryptographic work).

:func:`map_large_blocks` fixes the threshold. The owner and proxy ``serve`` commands
and the ``analyst`` commands call it at start-up; library code (the analyst's
estimators, running in someone else's process) leaves the host process's allocator
alone.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["LARGE_BLOCK_BYTES", "map_large_blocks"]

logger = logging.getLogger(__name__)

LARGE_BLOCK_BYTES = 1 << 20
"""Blocks of at least this size get their own mapping, returned to the system when freed."""

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (``malloc.h``)."""


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process.

    Returns
    -------
    bool
        True if set; False where the C library has no such setting (macOS, musl),
        which changes nothing else.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    if done:
        logger.debug("blocks of %d bytes or more are mapped and unmapped on their own", threshold)
    return done
