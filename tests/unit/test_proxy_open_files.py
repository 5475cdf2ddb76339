"""The proxy raises its open-files limit so that every owner can hold a connection.

Each case runs in a child process whose limits it lowers first: a lowered hard limit
cannot be raised again, so the test process itself is left alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedpca.proxy.open_files import RESERVED_FILES, needed_open_files

resource = pytest.importorskip("resource")  # POSIX only, like the limit itself

_CHILD = """
import json, logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from fedpca.proxy.open_files import ensure_open_files
soft, hard, needed = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
returned = ensure_open_files(needed)
print(json.dumps([returned, *resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def _run(soft: int, hard: int, needed: int) -> tuple[list[int], str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(soft), str(hard), str(needed)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(done.stdout), done.stderr


def _hard_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def test_two_descriptors_per_owner_and_a_reserve() -> None:
    assert needed_open_files(0) == RESERVED_FILES
    assert needed_open_files(1000) == 2000 + RESERVED_FILES


def test_a_low_soft_limit_is_raised_to_the_hard_limit() -> None:
    """Not only to what the owners need: other peers' connections take descriptors too,
    and one peer holding the last ones locked every new connection out (review)."""
    if _hard_limit() < 600:
        pytest.skip("this machine's hard limit is below the case's 600 files")
    (returned, soft, hard), log = _run(soft=64, hard=600, needed=500)
    assert (returned, soft, hard) == (600, 600, 600)
    assert "raised from 64 to 600" in log
    assert "WARNING" not in log


def test_a_soft_limit_at_the_hard_limit_is_left_as_it_is() -> None:
    if _hard_limit() < 600:
        pytest.skip("this machine's hard limit is below the case's 600 files")
    (returned, soft, hard), log = _run(soft=600, hard=600, needed=500)
    assert (returned, soft, hard) == (600, 600, 600)
    assert "raised" not in log


def test_a_hard_limit_below_the_need_is_used_in_full_and_reported() -> None:
    (returned, soft, hard), log = _run(soft=64, hard=100, needed=500)
    assert (returned, soft, hard) == (100, 100, 100)
    assert "WARNING" in log
    assert "at most 100 files" in log and "need 500" in log
    assert "LimitNOFILE" in log
