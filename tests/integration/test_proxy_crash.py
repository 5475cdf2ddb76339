"""``kill -9`` the proxy at 20 random points of a query, restart it: nothing lost, nothing twice.

Real processes over mutual TLS (:class:`fedpca.app.cluster.LocalCluster`): one proxy, five
owner nodes (madelon, 200 features, ~616 ciphertexts each at 2048 bits), the analyst
in this process. The proxy runs through the TEST-ONLY launcher ``seeded_proxy.py`` so
that every run of the query draws the same noise; production noise cannot be seeded.

1. Calibration: two uninterrupted runs; the first is the reference, the second
   (on a proxy just restarted, with owners that have worked before, as in every
   trial) measures the *phase window*: from the moment the first owner has its
   share encrypted (its upload starts) to the moment the proxy has stored the
   noised result. It holds the uploads, the folds into the encrypted aggregate and
   the final noise step (the proxy adds the noise it drew and encrypted under the
   analyst key in the background since submission, and stores the result).
2. 20 kill offsets are drawn uniformly over that window with a fixed seed. Each
   trial runs the query again (a new query id), SIGKILLs the proxy and its crypto
   workers that many seconds after its first encrypted share, restarts it with the
   same config and SQLite file, and lets the owners (upload retries, reconnects)
   and the analyst (watch reconnects) recover by themselves. Six more trials make
   the proxy SIGKILL itself (test-only fault injection) where outside kills rarely
   land: while drawing the query's noise (before the window, while the owners
   encrypt); inside a chunk fold before its COMMIT; after a chunk fold committed
   but before its upload completed (before the contributors are fixed the restart
   takes the chunk out and the owner's resend folds it once; after, the resend
   resumes behind the folded mark); right after an upload was accepted but before the owner's
   acknowledgement left (mid-collection and at the last upload), where a double
   count would come from: the owner must retry and be answered DUPLICATE; and with
   the noise of the first result page computed but the page not yet stored.
3. Every trial must complete with all owners (quorum = all owners, so an owner that
   gave up could not hide behind a smaller quorum; its "giving up" fails the trial
   by name), one ``uploads`` row per owner in the SQLite file, no refused upload,
   and decrypted statistics *equal* to the reference's: owners release exact integer
   statistics and every run draws the same noise, so one owner's share lost or
   doubled (its record count alone is 400) shows, and so does any other difference.

The complete log of each killed proxy (DEBUG: it logs every fold before it starts)
tells which phase the kill hit; the test prints kill offsets, phases and what the
recovery took (with ``-s``, or in the report of a failure).
"""

from __future__ import annotations

import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fedpca.analyst.client import AnalystClient
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.estimators import FederatedPCA
from fedpca.analyst.keys import load_analyst_private_key, load_analyst_signing_key
from fedpca.analyst.querying import run_query
from fedpca.analyst.rpc_errors import ProxyUnavailableError
from fedpca.app.cluster import OWNER_READY_MARKER, LocalCluster, ManagedProcess, split_rows
from fedpca.codec import CryptoPool
from fedpca.proxy.coordinator import task_id
from fedpca.query import QuerySpec
from fedpca.transport.certs import TlsMaterial
from helpers import dataset_table

pytestmark = pytest.mark.slow

SEEDED_PROXY = Path(__file__).resolve().with_name("seeded_proxy.py")
ANALYST = "analyst"
"""The cluster's analyst (its certificate's node id): the proxy keys queries by it."""

N_OWNERS = 5
N_FEATURES = 200  # of madelon's 500: ~615 ciphertexts per owner at 2048 bits
N_KILLS = 20
KILL_SEED = 20_240_611
NOISE_SEED = 1_234
FRAC_BITS = 32
QUERY_DEADLINE = 120.0  # a stuck trial fails at the proxy instead of hanging the test
TRIAL_TIMEOUT = 150.0
POLL = 0.01


def _madelon_unit_rows() -> np.ndarray:
    table = dataset_table("madelon")[:, : N_FEATURES + 1]
    labels, rows = table[:, :1], table[:, 1:]
    return np.column_stack([labels, rows / np.linalg.norm(rows, axis=1).max()])


class LogWatch:
    """The text a process's log gained since a mark."""

    def __init__(self, process: ManagedProcess) -> None:
        self.process = process
        self.start = len(process.log_text())

    def text(self) -> str:
        return self.process.log_text()[self.start :]


def _wait_until(
    condition: Callable[[], bool], timeout: float, what: str, poll: float = POLL
) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class QueryRun:
    """One query, run by the analyst on a background thread."""

    spec: QuerySpec
    release: DecodedRelease | None = None
    error: BaseException | None = None
    analyst_retries: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    @property
    def query_id(self) -> str:
        """The proxy's task id of the query: what its store, its log and the owners use."""
        return task_id(ANALYST, self.spec.query_id)


@dataclass
class Trial:
    """One interrupted run of the query ``spec``: SIGKILL ``offset`` s after its first
    encrypted share, or the proxy kills itself at an injected ``fault``."""

    name: str
    spec: QuerySpec
    offset: float | None = None
    fault: str | None = None
    phase: str = ""
    detail: str = ""
    recovery: str = ""
    seconds: float = 0.0

    @property
    def when(self) -> str:
        return f"+{self.offset:.3f} s" if self.offset is not None else f"at {self.fault}"


class CrashHarness:
    def __init__(self, cluster: LocalCluster, pool: CryptoPool) -> None:
        self.cluster = cluster
        self.pool = pool
        self.private_key = load_analyst_private_key(cluster.key_dir / "analyst.key.json")
        self.signing_key = load_analyst_signing_key(cluster.key_dir)
        self.tls = TlsMaterial.load(cluster.analyst_tls())
        self.estimator = FederatedPCA(
            n_components=2,
            epsilon=1.0,
            delta=1e-5,
            quorum=N_OWNERS,
            deadline_seconds=QUERY_DEADLINE,
            frac_bits=FRAC_BITS,
        )

    # ------------------------------------------------------------ analyst
    def new_spec(self) -> QuerySpec:
        """The query of every run (a fresh query id each time)."""
        return self.estimator.build_query(N_FEATURES, self.private_key.public_key)

    def start_query(self, spec: QuerySpec | None = None) -> QueryRun:
        run = QueryRun(spec if spec is not None else self.new_spec())
        run.thread = threading.Thread(target=self._analyst, args=(run,), daemon=True)
        run.thread.start()
        return run

    def _analyst(self, run: QueryRun) -> None:
        # The analyst's own client reconnects its watch across restarts. Only if a call
        # fails on an absent proxy (a submission or a fetch cut by a kill, a watch that
        # gave up) does it ask again, with the same query: resubmission is idempotent
        # and charges nothing.
        give_up = time.monotonic() + TRIAL_TIMEOUT
        while time.monotonic() < give_up:
            try:
                with AnalystClient(self.cluster.proxy_address, self.tls) as client:
                    run.release, _ = run_query(
                        run.spec,
                        client,
                        self.private_key,
                        self.signing_key,
                        pool=self.pool,
                        wait_timeout=TRIAL_TIMEOUT,
                    )
                return
            except ProxyUnavailableError as exc:
                run.analyst_retries.append(str(exc))
                time.sleep(0.5)
            except BaseException as exc:
                run.error = exc
                return
        run.error = AssertionError(f"analyst gave up: {run.analyst_retries}")

    def wait_uploading(self, run: QueryRun, watches: list[LogWatch]) -> float:
        """When the first owner has its share encrypted: its upload starts.

        Not the submission: each owner's budget check composes all its past releases,
        so the time from submission to the uploads grows from query to query.
        """
        marker = f"query {run.query_id}: share encrypted"
        return _wait_until(
            lambda: any(marker in w.text() for w in watches),
            TRIAL_TIMEOUT,
            f"query {run.query_id}: the first encrypted share",
            poll=0.005,
        )

    def finish(self, run: QueryRun) -> FederatedPCA:
        assert run.thread is not None
        run.thread.join(TRIAL_TIMEOUT)
        if run.thread.is_alive():
            raise AssertionError(
                f"query {run.query_id} did not complete within {TRIAL_TIMEOUT:.0f} s\n"
                + self.diagnostics()
            )
        if run.error is not None:
            raise AssertionError(
                f"query {run.query_id} failed: {run.error!r}\n" + self.diagnostics()
            ) from run.error
        assert run.release is not None
        return FederatedPCA.from_result(run.release)

    # ------------------------------------------------------------- runs
    def uninterrupted(self) -> tuple[FederatedPCA, float]:
        """One run without a kill: the model and its phase window (uploading -> stored)."""
        assert self.cluster.proxy is not None
        proxy_watch = LogWatch(self.cluster.proxy)
        watches = [LogWatch(p) for p in self.cluster.owners]
        run = self.start_query()
        first = self.wait_uploading(run, watches)
        done = _wait_until(
            lambda: f"query {run.query_id} done" in proxy_watch.text(),
            TRIAL_TIMEOUT,
            "the result",
        )
        model = self.finish(run)
        self.check_store(run.query_id, "uninterrupted run")
        return model, done - first

    def restart_proxy(self, arm: Trial | None) -> None:
        """Start the proxy again (same config and SQLite file); armed for ``arm``'s fault."""
        command = [sys.executable, str(SEEDED_PROXY), "--seed", str(NOISE_SEED)]
        if arm is not None and arm.fault is not None:
            command += ["--crash", f"{task_id(ANALYST, arm.spec.query_id)}:{arm.fault}"]
        self.cluster.proxy_command = command
        self.cluster.start_proxy()

    def interrupted(self, trial: Trial, reference: FederatedPCA, arm: Trial | None) -> None:
        """Run ``trial``, kill -9 the proxy as it says, restart it, check everything.

        The restarted proxy is armed for the fault of ``arm`` (the next trial), if any.
        """
        started = time.monotonic()
        cluster = self.cluster
        killed = cluster.proxy
        assert killed is not None
        watches = [LogWatch(p) for p in cluster.owners]
        run = self.start_query(trial.spec)
        if trial.fault is None:
            assert trial.offset is not None
            anchor = self.wait_uploading(run, watches)
            time.sleep(max(0.0, anchor + trial.offset - time.monotonic()))
            assert killed.process.poll() is None, f"trial {trial.name}: the proxy died by itself"
        else:
            _wait_until(
                lambda: killed.process.poll() is not None,
                TRIAL_TIMEOUT,
                f"trial {trial.name}: the proxy to crash at {trial.fault}",
            )
        owners_at_kill = self.owner_texts(watches)
        killed.kill()  # the whole process group: the crypto workers die with it
        killed_log = killed.log_text()
        killed.stop()  # only closes its log
        trial.phase, trial.detail = _classify(run.query_id, killed_log, owners_at_kill)
        if trial.fault is not None:
            point = trial.fault.split(":")[0]
            trial.phase = {
                "prep": "noise preparation",
                "fold": "fold",
                "staged": "upload in progress",
                "folded": "ack lost",
                "page": "page noise",
            }[point]
        label = f"trial {trial.name} (kill {trial.when}, {trial.phase}: {trial.detail})"
        if trial.fault is not None:
            assert "TEST ONLY: crashing (SIGKILL)" in killed_log, f"{label}: did not crash"

        reconnect = [LogWatch(p) for p in cluster.owners]
        self.restart_proxy(arm)
        model = self.finish(run)
        _assert_same_statistics(model, reference, label)
        # The query can finish before an owner's retry: its last chunks folded before the
        # kill make the last page final, while the acknowledgement (and the row in
        # ``uploads``) waits for the owner's resent upload. Wait for every owner's answer
        # before the store is checked.
        outcome = re.compile(
            rf"query {re.escape(run.query_id)}: (upload \S+ (accepted|duplicate) by the proxy"
            r"|the proxy refused upload|pausing upload)"
        )
        _wait_until(
            lambda: all(outcome.search(w.text()) for w in watches),
            TRIAL_TIMEOUT,
            f"{label}: every owner's upload outcome",
        )
        owner_logs = self.owner_texts(watches)
        for owner, text in owner_logs.items():
            # Quorum = all owners, so an owner that gave up would also stall the query;
            # this names the culprit. A retry of an accepted upload must be answered
            # DUPLICATE, never refused.
            assert "pausing upload" not in text, f"{label}: {owner} paused its upload"
            assert "refused upload" not in text, f"{label}: {owner} was refused"
        self.check_store(run.query_id, label)
        if trial.fault is not None and trial.fault.startswith("folded:"):
            # The owner whose acknowledgement died with the proxy retried and was told
            # DUPLICATE: the retry was recognised, not folded a second time.
            k = trial.fault.split(":")[1]
            q = re.escape(run.query_id)
            match = re.search(rf"query {q}: accepted upload from (\S+) \({k} owners\)", killed_log)
            assert match is not None, label
            acked = re.search(
                rf"query {q}: upload \S+ duplicate by the proxy", owner_logs[match[1]]
            )
            assert acked is not None, f"{label}: {match[1]} was not answered DUPLICATE"
        assert cluster.proxy is not None
        trial.recovery = _recovery(run.query_id, cluster.proxy.log_text(), owner_logs)
        if trial.fault is not None and trial.fault.startswith("staged:"):
            # A chunk was folded before the crash and its upload was unfinished. While
            # the contributors were not fixed, the restart takes it out (the owner's
            # resent upload folds it once); once they were fixed, the owner's resent
            # upload resumes after the folded mark. Either way the statistics above
            # agree with the reference, so the chunk counted exactly once.
            assert (
                "unfinished chunk(s) taken out" in trial.recovery
                or "resumed after" in trial.recovery
            ), f"{label}: the restarted proxy neither took the upload out nor resumed it"
        if run.analyst_retries:
            trial.recovery += f"; analyst asked again {len(run.analyst_retries)}x"
        self.wait_owners_connected(reconnect)
        trial.seconds = time.monotonic() - started

    def check_store(self, query_id: str, label: str) -> None:
        """Exactly one ``uploads`` row per owner, DONE with all owners, in the SQLite file."""
        uploads, state, n_contributed = self.upload_rows(query_id)
        assert uploads == dict.fromkeys(self.cluster.owner_ids, 1), f"{label}: uploads {uploads}"
        assert (state, n_contributed) == ("done", N_OWNERS), f"{label}: {state}, {n_contributed}"

    # -------------------------------------------------------------- logs
    def owner_texts(self, watches: list[LogWatch]) -> dict[str, str]:
        return {watch.process.name: watch.text() for watch in watches}

    def wait_owners_connected(self, watches: list[LogWatch]) -> None:
        """Every owner printed a new "connected to" since its watch was set."""
        _wait_until(
            lambda: all(OWNER_READY_MARKER in w.text() for w in watches),
            120.0,
            "the owners to reconnect to the proxy",
        )

    def diagnostics(self) -> str:
        parts = []
        processes = [*self.cluster.owners, *([self.cluster.proxy] if self.cluster.proxy else [])]
        for process in processes:
            tail = "\n".join(process.log_text().splitlines()[-12:])
            parts.append(f"--- {process.name} ---\n{tail}")
        return "\n".join(parts)

    # -------------------------------------------------------------- store
    def upload_rows(self, query_id: str) -> tuple[dict[str, int], str, int]:
        """Uploads per owner, state and n_contributed of a query, read from the SQLite file."""
        database = self.cluster.workdir / "state" / "proxy.sqlite3"
        connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30.0)
        try:
            rows = connection.execute(
                "SELECT owner_id, COUNT(*) FROM uploads WHERE query_id=? GROUP BY owner_id",
                (query_id,),
            ).fetchall()
            state, n_contributed = connection.execute(
                "SELECT state, n_contributed FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
        finally:
            connection.close()
        return {str(owner): int(count) for owner, count in rows}, str(state), int(n_contributed)


def _owners(pattern: str, text: str) -> set[str]:
    return set(re.findall(pattern, text))


def _classify(query_id: str, proxy_log: str, owner_logs: dict[str, str]) -> tuple[str, str]:
    """Which phase of ``query_id`` the killed proxy was in, from its complete log."""
    q = re.escape(query_id)
    accepted = _owners(rf"query {q}: accepted upload from (\S+) \(", proxy_log)
    folding = _owners(rf"query {q}: folding upload \S+ from (\S+)", proxy_log)
    encrypted = f"query {query_id}: share encrypted"
    sent = {owner for owner, text in owner_logs.items() if encrypted in text}
    detail = f"{len(accepted)}/{len(owner_logs)} folded"
    if f"query {query_id} done" in proxy_log:
        return "after DONE", detail
    if f"query {query_id}: collection closed" in proxy_log:
        return "noise", f"{detail}; adding the noise, storing the result"
    if folding - accepted:
        return "fold", f"{detail}; folding {', '.join(sorted(folding - accepted))}"
    if sent - accepted:
        return "upload", f"{detail}; in flight {', '.join(sorted(sent - accepted))}"
    if len(accepted) == len(owner_logs):
        return "closing", f"{detail}; quorum reached, noise not added"
    if accepted:
        return "between uploads", f"{detail}; the others still encrypting"
    # Before any upload the proxy prepares the query's noise (draws, encrypts it
    # under the analyst key) while the owners encrypt their shares.
    preparing = proxy_log.rfind(f"query {query_id}: preparing its noise")
    if preparing >= 0 and not _NOISE_ENCRYPTED.search(proxy_log, preparing):
        return "noise preparation", f"{detail}; owners encrypting"
    return "before uploads", f"{detail}; noise ready, owners encrypting"


_NOISE_ENCRYPTED = re.compile(r"encrypted \d+ plaintexts")


def _recovery(query_id: str, proxy_log: str, owner_logs: dict[str, str]) -> str:
    """What the restarted proxy and the owners did to recover (for the report)."""
    q = re.escape(query_id)
    notes = []
    if f"query {query_id} was interrupted while adding noise" in proxy_log:
        notes.append("noise step redone")
    elif f"query {query_id}: preparing its noise" in proxy_log:
        notes.append("noise prepared anew")
    taken_out = re.search(
        rf"query {q}: (\d+) chunks of uploads interrupted by the restart taken out", proxy_log
    )
    if taken_out:
        notes.append(f"{taken_out[1]} unfinished chunk(s) taken out")
    resumed = re.findall(
        rf"query {q}: (\S+) resumes upload \S+ after (\d+) folded ciphertexts", proxy_log
    )
    if resumed:
        notes.append(
            "resumed after " + ", ".join(f"{count} by {owner}" for owner, count in resumed)
        )
    duplicate = sorted(
        owner
        for owner, text in owner_logs.items()
        if re.search(rf"query {q}: upload \S+ duplicate by the proxy", text)
    )
    if duplicate:
        notes.append(f"DUPLICATE to {', '.join(duplicate)}")
    retried = sorted(
        owner for owner, text in owner_logs.items() if f"query {query_id}: upload attempt" in text
    )
    if retried:
        notes.append(f"retried by {', '.join(retried)}")
    return "; ".join(notes) or "-"


def _assert_same_statistics(model: FederatedPCA, reference: FederatedPCA, label: str) -> None:
    got, want = model.release_.statistics, reference.release_.statistics
    assert got is not None and want is not None
    # Owners release exact integer statistics (no rounding coins) and every run draws
    # the same noise: the decrypted statistics are the very same numbers.
    assert model.n_owners_ == reference.n_owners_ == N_OWNERS, label
    np.testing.assert_array_equal(got.count, want.count, err_msg=label)
    np.testing.assert_array_equal(got.sums, want.sums, err_msg=label)
    np.testing.assert_array_equal(got.scatter, want.scatter, err_msg=label)


def test_kill_9_proxy_at_random_points_loses_and_doubles_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    table = _madelon_unit_rows()
    parts = split_rows(len(table), N_OWNERS, seed=1)
    cluster = LocalCluster(
        workdir=tmp_path / "work",
        owner_tables=[table[p] for p in parts],
        processes_per_node=1,
        proxy_command=[sys.executable, str(SEEDED_PROXY), "--seed", str(NOISE_SEED)],
    )
    with cluster, CryptoPool(2) as pool:
        cluster.prepare()
        cluster.start()
        harness = CrashHarness(cluster, pool)

        # ---- calibration: two uninterrupted runs
        reference, window_first = harness.uninterrupted()
        statistics = reference.release_.statistics
        assert statistics is not None and reference.n_owners_ == N_OWNERS
        # The reference holds every row once: its noisy count is within 6 sigma of N,
        # and one owner's rows are far more than 6 sigma.
        sigma_count = reference.noise_sigmas_["count"]
        assert abs(statistics.count - len(table)) < 6 * sigma_count < len(parts[0])
        # Every trial runs on a proxy just restarted (after the previous kill) and on
        # owners that have worked before: so does the run that calibrates the window.
        assert cluster.proxy is not None
        reconnect = [LogWatch(p) for p in cluster.owners]
        cluster.proxy.kill()
        cluster.proxy.stop()
        harness.restart_proxy(arm=None)
        harness.wait_owners_connected(reconnect)
        second, window = harness.uninterrupted()
        _assert_same_statistics(second, reference, "second uninterrupted run")
        offsets = np.random.default_rng(KILL_SEED).uniform(0.0, window, N_KILLS)
        print(
            f"\nphase window (first share encrypted -> result stored): {window:.3f} s "
            f"({window_first:.3f} s in the very first run); kill offsets (seed {KILL_SEED}): "
            + ", ".join(f"{o:.3f}" for o in offsets)
        )

        trials = [
            Trial(str(i + 1), harness.new_spec(), offset=float(o)) for i, o in enumerate(offsets)
        ]
        # Six more where the proxy SIGKILLs itself (test-only fault injection) where
        # kills from outside rarely land: while it draws the query's noise (it does so
        # from submission on, before the window opens), inside the fold of the
        # 2nd upload before COMMIT, after the 3rd upload's chunk was folded but before
        # that upload completed (the restart must take it out, the owner's resend
        # fold it once), right after the 2nd upload committed but before its
        # acknowledgement left (the retry must be answered DUPLICATE, not folded
        # again), right after the last fold committed (quorum not yet closed), and
        # with the noise added to the aggregate but the result not yet stored.
        faults = ("prep:2", "fold:2", "staged:3", "folded:2", f"folded:{N_OWNERS}", "page:1")
        trials += [Trial(fault, harness.new_spec(), fault=fault) for fault in faults]
        if trials[0].fault is not None:  # no random kill: arm the running proxy first
            assert cluster.proxy is not None
            cluster.proxy.kill()
            cluster.proxy.stop()
            harness.restart_proxy(arm=trials[0])
        print(
            f"{'trial':<9} {'kill':<12} {'phase':<15} {'state at the kill':<45} {'s':>5}  recovery"
        )
        for index, trial in enumerate(trials):
            following = trials[index + 1] if index + 1 < len(trials) else None
            harness.interrupted(trial, reference, arm=following)
            print(
                f"{trial.name:<9} {trial.when:<12} {trial.phase:<15} {trial.detail:<45} "
                f"{trial.seconds:>5.1f}  {trial.recovery}"
            )

    hits: dict[str, int] = {}
    for t in trials[:N_KILLS]:
        hits[t.phase] = hits.get(t.phase, 0) + 1
    print(f"random kills by phase: {hits}; test time {time.monotonic() - started:.0f} s")
