"""pytest plugin: with ``FEDPCA_NO_SKIPS=1`` (set by ``.ci/run``) every skip fails.

A skipped check is not a passed one. A developer's machine may lack what a test needs
(a tool, a file limit, a second CPU, network namespaces) and the test skips, saying
why; CI must not go green on checks it did not run, so there a skip, of a test or of
a whole module, is reported as a failure naming its reason. Expected failures (xfail)
are not skips and are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

VARIABLE = "FEDPCA_NO_SKIPS"


def _forbid_skip(report: Any) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or os.environ.get(VARIABLE) != "1":
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, which {VARIABLE}=1 forbids: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _forbid_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _forbid_skip(outcome.get_result())
