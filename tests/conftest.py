"""Shared pytest fixtures.

Keys made here are TEST-ONLY: 512-bit Paillier moduli offer no security at all and
exist so that unit tests run in seconds.  Production code refuses keys below
2048 bits unless ``allow_insecure_test_key=True`` is passed explicitly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

import helpers
from fedpca import logs
from fedpca.codec import CryptoPool, generate_keypair

# Property tests judge results, not speed: on a shared 2-core machine one example can
# take longer than hypothesis's default 200 ms deadline while other work runs, which
# failed a correct test (DeadlineExceeded). Speed is measured in benchmarks/.
settings.register_profile("fedpca", deadline=None)
settings.load_profile("fedpca")

# Under .ci/run every skip is a failure (tests/no_skips.py).
pytest_plugins = ["no_skips"]


@pytest.fixture(scope="session")
def test_only_keypair_512() -> tuple[Any, Any]:
    """A TEST-ONLY 512-bit phe keypair ``(public_key, private_key)``, shared by the session."""
    return generate_keypair(512, allow_insecure_test_key=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[CryptoPool]:
    """A crypto pool of two worker processes, shared by the tests of one module.

    Module scope, as each module had its own copy: the workers live no longer
    than the tests that use them.
    """
    with CryptoPool(processes=2) as crypto_pool:
        yield crypto_pool


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A CLI run in a test configures the process's logging as its entry point does (a
    root handler to stderr, a level); put it back afterwards, so that one test's CLI
    does not write log lines into the next test's captured output (the owner CLI's INFO
    level once put WARNING lines into an analyst CLI test run after it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    chosen, level_set = logs._chosen, logs._level_set
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._chosen, logs._level_set = chosen, level_set


@pytest.fixture(autouse=True)
def _queries_signed_now() -> None:
    """Queries built by helpers.make_query in a test carry the test's start as their
    signing time: owners answer a query only until issued_at + deadline_seconds."""
    helpers.QUERY_TIME[0] = time.time()
