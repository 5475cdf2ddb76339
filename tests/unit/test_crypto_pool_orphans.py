"""Crypto pool workers exit on their own once the process that created the pool is killed.

A ``kill -9`` of an owner node daemon or of the proxy runs no cleanup, so nothing
shuts the pool down; without a watchdog its workers stayed alive forever as orphans.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

# Generous: the workers poll every 0.5 s, so they normally go within about a second.
_EXIT_DEADLINE_S = 15.0
_START_DEADLINE_S = 60.0

# Creates a pool, prints its worker pids and waits to be killed.  The pids come from
# ProcessPoolExecutor's private `_processes` dict (pid -> Process): there is no public
# way to list an executor's workers, and multiprocessing.active_children() does not
# see them reliably.
_CREATOR = """
import sys, time
from fedpca.codec import CryptoPool
pool = CryptoPool(processes=2, start_method=sys.argv[1])
pool.start()
print(" ".join(str(pid) for pid in pool._executor._processes), flush=True)
time.sleep(600)
"""


def _is_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (an unreaped zombie has already exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (comm) state ...": comm may itself contain spaces and parentheses.
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise AssertionError(f"the pool creator printed nothing within {timeout} s")
    return process.stdout.readline()


@pytest.fixture()
def leftover_pids() -> Iterator[list[int]]:
    """Worker pids to SIGKILL after the test, so a failing run leaves no orphans behind."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _is_running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_exit_after_their_creator_is_killed(
    start_method: str, leftover_pids: list[int]
) -> None:
    creator = subprocess.Popen(
        [sys.executable, "-c", _CREATOR, start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = _read_line(creator, _START_DEADLINE_S)
        if not line:
            creator.wait(timeout=_START_DEADLINE_S)
            assert creator.stderr is not None
            raise AssertionError(f"the pool creator failed: {creator.stderr.read()}")
        worker_pids = [int(pid) for pid in line.split()]
        leftover_pids.extend(worker_pids)
        assert len(worker_pids) == 2
        assert creator.pid not in worker_pids
        assert all(_is_running(pid) for pid in worker_pids), "workers not running before the kill"
    finally:
        creator.kill()
        creator.wait(timeout=_START_DEADLINE_S)
        assert creator.stdout is not None and creator.stderr is not None
        creator.stdout.close()
        creator.stderr.close()
    assert creator.returncode == -signal.SIGKILL

    deadline = time.monotonic() + _EXIT_DEADLINE_S
    while any(_is_running(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in worker_pids if _is_running(pid)]
    assert not survivors, (
        f"workers {survivors} still running {_EXIT_DEADLINE_S} s after their creator was killed"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_ignore_ctrl_c_and_leave_it_to_their_creator(
    capfd: pytest.CaptureFixture[str], test_only_keypair_512: tuple[object, object]
) -> None:
    """Ctrl-C reaches every process of the terminal's group: workers printed a
    KeyboardInterrupt traceback each while the analyst was cancelling its query."""
    from fedpca.codec import CryptoPool

    public_key, private_key = test_only_keypair_512
    with CryptoPool(processes=2) as pool:
        pool.start()
        workers = list(pool._executor._processes)  # type: ignore[union-attr]
        # start() returns once the warm-up tasks ran, maybe all on one worker: wait for
        # every worker's initializer (its ignored-signal mask, from /proc).
        deadline = time.monotonic() + _EXIT_DEADLINE_S
        while not all(_ignores_sigint(pid) for pid in workers):
            assert time.monotonic() < deadline, "workers never ignored SIGINT"
            time.sleep(0.05)
        for pid in workers:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(_is_running(pid) for pid in workers)
        ciphertexts = pool.encrypt(public_key, [1, 2, 3])
        assert pool.decrypt(private_key, ciphertexts) == [1, 2, 3]
    assert "KeyboardInterrupt" not in capfd.readouterr().err
