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
settings alone. :func:`return_free_memory` changes no setting: it hands back what the
heaps hold free now (``malloc_trim``), which is what remains after many small blocks,
e.g. the analyst's ciphertexts (a 2048-bit key's are about 560 bytes each, far below any
threshold), were freed among ones still live.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["LARGE_BLOCK_BYTES", "map_large_blocks", "return_free_memory"]

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
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    if done:
        logger.debug("blocks of %d bytes or more are mapped and unmapped on their own", threshold)
    return done


def return_free_memory() -> bool:
    """Return the free pages of glibc's heaps to the system (``malloc_trim(0)``).

    Measured with ``benchmarks/high_dimension.py --features 2000``: after decrypting,
    the analyst's heaps held about 20 MiB free, under the 30 MiB matrix its PCA
    allocates next.

    Returns
    -------
    bool
        True if glibc returned memory; False if it had none to return or the C library
        has no ``malloc_trim`` (macOS, musl), which changes nothing else.
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
