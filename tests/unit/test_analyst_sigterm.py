"""SIGTERM to a waiting ``fedpca analyst pca`` cancels its query, as Ctrl-C does.

A CI job's kill or ``timeout`` sends SIGTERM; before, it ended the process at once: the
query stayed open at the proxy (charged if it then failed at its deadline after an
upload began) and Python's resource tracker reported the decryption pool's semaphores
as leaked. The command runs as a real process against the in-process deployment, whose
owners are not running, so the query waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.analyst.keys import create_analyst_keys, load_analyst_private_key
from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.messages import CANCELLED_REASON, QueryState
from fedpca.transport.certs import Role
from inprocess import deployment, labelled

# The command as `fedpca analyst` runs it, with the TEST-ONLY 512-bit key allowed.
ENTRY = """
import sys
import fedpca.analyst.federated_estimator as estimators
from fedpca.analyst.keys import load_analyst_private_key

def load(path):
    return load_analyst_private_key(path, allow_insecure_test_key=True)

estimators.load_analyst_private_key = load
from fedpca.analyst.cli import analyst_group
analyst_group(sys.argv[1:], prog_name="fedpca analyst")
"""


@pytest.mark.parametrize("group", [False, True], ids=["process", "process-group"])
def test_sigterm_cancels_the_waiting_query_and_exits_cleanly(
    tmp_path: Path, pool: CryptoPool, group: bool
) -> None:
    """SIGTERM to the command alone (``kill``), or to its whole process group with its
    decryption workers (``timeout``, a CI job's kill): the query is cancelled at the
    proxy (refunded: no owner had begun an upload), the command exits 143 without a
    traceback, and nothing is reported leaked."""
    keys = create_analyst_keys(tmp_path / "keys", 512, allow_insecure_test_key=True)
    public_key = load_analyst_private_key(keys.directory, allow_insecure_test_key=True).public_key
    tables = {owner: labelled(np.zeros((4, 3))) for owner in ("owner-1", "owner-2")}
    with deployment(
        workdir=tmp_path / "deployment",
        tables=tables,
        pool=pool,
        public_key=public_key,
        running=(),
        analyst_budget=PrivacyParams(3.0, 1e-5),
    ) as running:
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        files = running.tls(Role.ANALYST, "alice")
        args = [
            *("pca", "--proxy", running.proxy.address, "--ca", str(files.ca_certificate)),
            *("--cert", str(files.certificate), "--key", str(files.private_key)),
            *("--key-dir", str(keys.directory), "--features", "3", "--components", "1"),
            *("--epsilon", "0.5", "--delta", "1e-6", "--bounds", "-1:1", "--workers", "1"),
            *("--max-records-per-owner", "64", "--max-owners", "4", "--deadline", "120"),
            *("--out", str(tmp_path / "result.json")),
            "--wait-for-owners",  # no owner runs: the query waits for them
        ]
        process = subprocess.Popen(
            [sys.executable, "-c", ENTRY, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _wait_until(lambda: _open_queries(store) or process.poll() is not None)
            assert process.poll() is None, process.communicate()
            # The decryption pool is up by then (it starts before the submission).
            if group:
                os.killpg(process.pid, signal.SIGTERM)
            else:
                process.send_signal(signal.SIGTERM)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        (record,) = store.queries()
        assert record.state is QueryState.FAILED, stderr
        assert record.failure_reason == CANCELLED_REASON
        assert store.releases("alice") == []  # refunded: no owner had begun an upload
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "cancelled; its charge was refunded" in stderr
    assert "terminated (SIGTERM)" in stderr
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr
    assert not (tmp_path / "result.json").exists() and stdout == ""


def _open_queries(store: Any) -> bool:
    return bool(store.queries(QueryState.COLLECTING))


def _wait_until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
