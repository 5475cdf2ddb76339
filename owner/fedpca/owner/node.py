"""The owner node daemon: dial the proxy, receive tasks, answer each with an upload or a decline.

One :class:`OwnerNode` per organisation. It never listens: it dials the proxy
(mutual TLS with the owner's certificate), says Hello, and keeps a long-lived
``StreamTasks`` server stream open. Tasks are handled one at a time by a worker
thread, so the stream keeps reading heartbeats and cancellations while a share
is being encrypted:

1. skip a task already handled (the record lives in the ledger database, so a
   restart does not redo work) or past its upload deadline;
2. local policy (:mod:`fedpca.owner.policy`): pinned analyst key whose modulus
   matches its fingerprint, epsilon caps, fit to the data. A refusal is sent
   as ``DeclineTask`` with KEY_NOT_PINNED or POLICY_REFUSAL;
3. reserve the release in the local budget ledger (one SQLite transaction);
   BUDGET_EXHAUSTED if it does not fit;
4. preprocess, local statistics, fixed point, pack, encrypt on all cores
   (:mod:`fedpca.owner.compute`), progress logged at INFO;
5. upload with one upload id chosen once per task: every retry (and a
   re-delivery of the same task to this process) resends the very same
   messages, so a retry after a lost acknowledgement is answered DUPLICATE and
   never counted twice. UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED
   are retried with exponential backoff and jitter; any other status is final.

If the data never left the node (a cancellation, or a preprocessing refusal
after the budget was reserved), the reservation is refunded: nothing was
released, so nothing was spent.

Nothing derived from the rows is logged or put in a decline's detail.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import grpc

from fedpca.codec.paillier import CryptoPool, Obfuscation
from fedpca.errors import (
    ConfigError,
    ProtocolError,
    ProtocolVersionError,
)
from fedpca.files import ExclusiveUse, holds_database
from fedpca.formatting import shortened
from fedpca.logs import SparseLog
from fedpca.messages import (
    PROTOCOL_VERSION,
    UPLOAD_CHUNK_BYTES,
    Heartbeat,
    ObfuscationVariant,
    OwnerHello,
    Task,
    TaskCancellation,
    TaskEvent,
)
from fedpca.monitoring import free_space_problem
from fedpca.owner.compute import blas_pools
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.local_table import LocalTable
from fedpca.owner.policy import check_allowed_columns, stated_terms
from fedpca.owner.retry import RetryPolicy, status_code, status_details, status_name
from fedpca.owner.share_snapshots import SHARES_FOLDER, ShareSnapshots
from fedpca.owner.state_folder import refuse_if_another_process_serves, use_state_folder
from fedpca.owner.task_intake import RefusedTask, TaskIntake
from fedpca.owner.task_processing import TaskProcessing
from fedpca.owner.upload import OutgoingUpload
from fedpca.tables import describe_columns
from fedpca.transport import serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial
from fedpca.transport.channels import insecure_channel, secure_channel
from fedpca.transport.diagnose import diagnose_connection
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import __version__

__all__ = [
    "OwnerNode",
]

logger = logging.getLogger(__name__)

# The proxy answered, and said no (a certificate it does not trust, an id it does not
# allow, a request it cannot take: another wire protocol version): not an outage, though
# the owner keeps retrying in case the operator fixes it.
_REFUSALS = frozenset(
    {
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)

PAUSED_SWEEP_SECONDS = 15.0
"""How often the worker, between tasks or idle, looks for uploads paused past their
deadline (:meth:`~fedpca.owner.task_endings.TaskEndings.end_paused_past_deadline`)."""

REMEMBERED_CANCELLATIONS = 1024
"""Cancelled task ids an owner remembers at most (see ``OwnerNode._cancelled``)."""


CLOCK_SKEW_WARNING_SECONDS = 60.0
"""A proxy clock this far from the node's is logged at connection: upload deadlines are
read on the node's clock (a node 20 minutes fast dropped every task; an operator's
review)."""


def warn_of_clock_skew(server_time: datetime | None, now: datetime) -> None:
    """Log a WARNING when the proxy's clock (its Hello) and this node's differ by more
    than :data:`CLOCK_SKEW_WARNING_SECONDS` (the call's own latency is far less)."""
    if server_time is None:
        return
    skew = (now - server_time).total_seconds()
    if abs(skew) > CLOCK_SKEW_WARNING_SECONDS:
        logger.warning(
            "this node's clock is %.0f s %s the proxy's: tasks are read against their "
            "upload deadlines on this clock (a clock ahead declines fresh tasks as past "
            "their deadline); synchronise it (NTP)",
            abs(skew),
            "ahead of" if skew > 0 else "behind",
        )


class OwnerNode(TaskProcessing):
    """A data owner's long-running node.

    Construction loads and checks everything that can be wrong locally (data
    file, TLS files, ledger) so that ``fedpca owner serve`` fails at start-up,
    not at the first task. It does not connect yet: see :meth:`run_forever`.

    Parameters
    ----------
    config : the owner's configuration.
    pool : crypto pool to encrypt on (default: one with ``crypto.processes``
        workers, closed when the node stops).
    retry : backoff and timeouts.

    Raises
    ------
    DataError
        The data file is missing or malformed (the loader's message).
    ConfigError
        Bad TLS material, a certificate for another node, or an unusable state folder.
    """

    def __init__(
        self,
        config: OwnerConfig,
        *,
        pool: CryptoPool | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.config = config
        self.retry = retry if retry is not None else RetryPolicy()
        self.table = LocalTable.load(config.data)
        check_allowed_columns(config.policy, self.table)
        self._tls: TlsMaterial | None = None
        if config.tls.insecure:
            logger.warning(
                "owner %s: tls.insecure = true - no TLS to the proxy, the connection is neither "
                "encrypted nor authenticated; for local experiments only",
                config.owner.id,
            )
        else:
            self._tls = TlsMaterial.load(config.tls.files())
            expected = NodeIdentity(Role.OWNER, config.owner.id)
            if self._tls.identity != expected:
                raise ConfigError(
                    f"tls.cert {config.tls.cert} is the certificate of {self._tls.identity}, "
                    f"but this node is {expected}"
                )
        # Before the ledger is opened, which migrates it: a node started on a folder
        # another serves is refused here, not after it has changed that node's ledger
        # (found by review: an older node then refused to restart). run_forever holds it.
        refuse_if_another_process_serves(config)
        created = not holds_database(config.ledger_path)
        self.ledger = owner_ledger(config)
        if created:
            # A typo in [owner] state_dir starts the node on an empty ledger: its budget
            # would start again at zero. Say so where the operator looks.
            logger.warning(
                "created a new, empty budget ledger %s: this owner has spent no budget in "
                "it. Expected on a first start; if this node ran before, [owner] state_dir "
                "names the wrong folder: stop it and correct the path",
                config.ledger_path,
            )
        self.shares = ShareSnapshots(config.owner.state_dir / SHARES_FOLDER)
        self._owns_pool = pool is None
        processes = config.crypto.processes or None
        self._pool = pool if pool is not None else CryptoPool(processes)
        blas_pools()  # found now, not during the first query
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the open StreamTasks call, cancelled by stop()
        self._queue: queue.Queue[Task | RefusedTask | None] = queue.Queue()
        self._intake = TaskIntake(config.policy, self.ledger.answered_under)
        # Events a proxy can send at will, logged sparingly: task events that could not
        # be read, re-deliveries of handled tasks, cancellations of tasks not waiting.
        self._malformed = SparseLog()
        self._redelivered = SparseLog()
        self._cancellations = SparseLog()
        self._unrecorded_declines = SparseLog()  # unsigned or replayed tasks declined
        self._paused: dict[str, datetime] = {}  # uploads paused here -> their deadline
        self._endings = threading.Lock()  # a withdrawal and the paused-upload sweep
        self._queued: set[str] = set()
        # Ids the proxy cancelled, for a task queued (or arriving just after its
        # cancellation): the newest REMEMBERED_CANCELLATIONS, so a flood of made-up ids
        # cannot grow it.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # Uploads of tasks not yet finished: a retry or a re-delivered task resends the
        # same messages under the same upload id instead of encrypting again.
        self._prepared: dict[str, OutgoingUpload] = {}
        self._max_message_bytes = UPLOAD_CHUNK_BYTES
        self.connected = threading.Event()
        """Set while a task stream is open (for tests and health checks)."""
        self._state_lock: ExclusiveUse | None = None
        self.metrics: Any = None
        """Told every handled task's outcome and duration (:mod:`fedpca.owner.metrics`)."""
        self._worker: threading.Thread | None = None
        # The record count is a statistic of the data: logs carry the public capacity.
        logger.info(
            "owner %s ready: table of %s; capacity %d records, budget "
            "epsilon=%g delta=%g under %s adjacency",
            config.owner.id,
            describe_columns(self.table.n_columns, self.table.label_column),
            config.data.max_records,
            config.budget.epsilon,
            config.budget.delta,
            config.privacy.neighbouring.value,
        )
        if self.table.n_records > config.data.max_records:
            # Said without the count (one bit, in this owner's own log): records beyond
            # the capacity were left out of every query without a word (a new user's
            # walkthrough).
            logger.warning(
                "owner %s: %s holds more records than data.max_records = %d: every query "
                "uses a uniform sample of %d of them (raise data.max_records, a public "
                "figure, in the configuration to use them all)",
                config.owner.id,
                config.data.path,
                config.data.max_records,
                config.data.max_records,
            )

    # ------------------------------------------------------------ lifecycle
    @property
    def tls_material(self) -> TlsMaterial | None:
        """The TLS material the node connects with (None: tls.insecure)."""
        return self._tls

    def alive(self) -> tuple[bool, str]:
        """Liveness: the node runs and its task worker thread is alive."""
        if self._stop.is_set():
            return False, "stopping"
        if self._worker is None or not self._worker.is_alive():
            return False, "the task worker is not running"
        return True, "running"

    def ready(self) -> tuple[bool, str]:
        """Readiness: the task stream to the proxy is open and the state folder (the
        ledger, kept shares) has room to write."""
        folder = self.config.owner.state_dir
        if (problem := free_space_problem(folder, "the state folder")) is not None:
            return False, problem
        if self.connected.is_set():
            return True, f"task stream to {self.config.owner.proxy} open"
        return False, f"not connected to {self.config.owner.proxy}"

    def stop(self) -> None:
        """Ask :meth:`run_forever` to return; safe from any thread or a signal handler."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        for upload in list(self._prepared.values()):
            upload.stop()

    def _open_channel(self) -> grpc.Channel:
        target = self.config.owner.proxy
        if self._tls is None:
            # No certificate names this node: claim its id in metadata, so the proxy
            # keeps one identity for it across reconnections.
            return insecure_channel(target, node_id=self.config.owner.id)
        return secure_channel(target, self._tls)

    def run_forever(self, stop_event: threading.Event | None = None) -> None:
        """Connect, stream tasks and handle them until :meth:`stop` (or ``stop_event``).

        Connection failures and a lost stream are retried with backoff forever; the
        backoff starts again from ``reconnect_initial`` after every session that got
        its task stream up.

        Raises
        ------
        ConfigError
            Another process serves the same state folder (see :func:`use_state_folder`).
        """
        self.hold_state_folder()
        try:
            # Shares kept for uploads that ended while the node was down (or just
            # before): deleted only by the process that holds the folder.
            self.shares.prune(set(self.ledger.uploads_in_flight().values()))
            # The tasks a restart left open wait for the proxy to deliver them again,
            # as uploads paused here do, and end the same way past their deadline: a
            # proxy that did neither kept the share on disk (and the reservation) for
            # as long as the node ran (found by review).
            for query_id, deadline in self.ledger.open_task_deadlines().items():
                self._paused.setdefault(query_id, datetime.fromtimestamp(deadline, UTC))
            self._serve(stop_event)
        finally:
            self.release_state_folder()

    def release_state_folder(self) -> None:
        """Let another process take the state folder (safe to call twice)."""
        held, self._state_lock = self._state_lock, None
        if held is not None:
            held.release()

    def hold_state_folder(self) -> None:
        """Take the state folder for this process now (:meth:`run_forever` does, if not
        done before; ``owner serve`` does it before it opens its monitoring port, so a
        second node on the folder is told why, not that the port is taken).

        Raises
        ------
        ConfigError
            Another process holds it (named by its pid).
        """
        if self._state_lock is None:
            self._state_lock = use_state_folder(self.config)

    def _serve(self, stop_event: threading.Event | None) -> None:
        if stop_event is not None:

            def watch() -> None:
                # Polls so that the thread also ends when the node stops by other means.
                while not stop_event.wait(0.2):
                    if self._stop.is_set():
                        return
                self.stop()

            threading.Thread(target=watch, name="owner-stop-watch", daemon=True).start()
        # A daemon waits for tasks: start the encryption workers now, so that the first
        # task does not pay for process start-up.
        self._pool.start()
        channel = self._open_channel()
        stub = owner_grpc.OwnerServiceStub(channel)
        worker = threading.Thread(
            target=self._work, args=(stub,), name="owner-task-worker", daemon=True
        )
        self._worker = worker
        worker.start()
        try:
            attempt = refusals = 0
            while not self._stop.is_set():
                try:
                    if self._session(stub):
                        attempt = 0
                    refusals = 0
                except grpc.RpcError as err:
                    if self._stop.is_set():
                        break
                    refused = status_code(err) in _REFUSALS
                    refusals = refusals + 1 if refused else 0
                    # The 1st, 2nd, 4th, 8th ... refusal in a row: it takes an operator.
                    if refusals & (refusals - 1) == 0:
                        logger.log(
                            logging.ERROR if refused else logging.WARNING,
                            "owner %s: proxy %s %s (%s: %s)%s",
                            self.config.owner.id,
                            self.config.owner.proxy,
                            "refused this owner" if refused else "unreachable or stream lost",
                            status_name(err),
                            status_details(err),
                            f"; {refusals} times in a row, retrying less and less often "
                            f"(at most every {self.retry.refused_reconnect_max:g} s)"
                            if refusals > 1
                            else "",
                        )
                    if attempt == 0 and status_code(err) is grpc.StatusCode.UNAVAILABLE:
                        self._explain_unavailable()
                except ProtocolError as exc:
                    logger.error(
                        "owner %s: protocol error from the proxy: %s", self.config.owner.id, exc
                    )
                except Exception:
                    # A long-running daemon outlives surprises: log, back off, reconnect.
                    logger.exception(
                        "owner %s: unexpected failure of the session", self.config.owner.id
                    )
                finally:
                    if self.connected.is_set():
                        # The stream was up (the proxy had enrolled this node), so even
                        # an abrupt loss (proxy killed, connection cut) starts the backoff
                        # afresh; otherwise every outage would wait longer than the last.
                        attempt = 0
                    self.connected.clear()
                if self._stop.is_set():
                    break
                cap = self.retry.refused_reconnect_max if refusals else self.retry.reconnect_max
                delay = RetryPolicy.delay(attempt, self.retry.reconnect_initial, cap)
                attempt += 1
                logger.info("owner %s: reconnecting in %.1f s", self.config.owner.id, delay)
                self._stop.wait(delay)
        finally:
            self._stop.set()
            self._queue.put(None)
            worker.join()
            channel.close()
            if self._owns_pool:
                self._pool.close()
            logger.info("owner %s stopped", self.config.owner.id)

    def _explain_unavailable(self) -> None:
        """Log what each address of the proxy answers, and a TLS failure no retry fixes
        (a certificate that does not name the proxy's host, or this node's own that
        expired while it ran) as an ERROR."""
        expired = None if self._tls is None else self._tls.expiry_problem()
        if expired is not None:
            logger.error("owner %s: cannot connect: %s", self.config.owner.id, expired)
            return
        diagnosis = diagnose_connection(
            self.config.owner.proxy,
            None if self._tls is None else self._tls.root_certificates,
        )
        if diagnosis.problem is not None:
            logger.error(
                "owner %s: cannot connect to %s: %s",
                self.config.owner.id,
                self.config.owner.proxy,
                diagnosis.problem,
            )
        else:
            logger.warning(
                "owner %s: %s: %s",
                self.config.owner.id,
                self.config.owner.proxy,
                diagnosis.summary(),
            )

    def _session(self, stub: owner_grpc.OwnerServiceStub) -> bool:
        """Hello, then read the task stream until it ends. True if Hello succeeded."""
        hello = OwnerHello(
            node_id=self.config.owner.id,
            software_version=__version__,
            obfuscation_variants=_variants(self.config.crypto.obfuscation),
        )
        info = serde.proxy_info_from_proto(
            stub.Hello(serde.owner_hello_to_proto(hello), timeout=self.retry.call_timeout)
        )
        if info.protocol_version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                "the proxy", info.protocol_version, PROTOCOL_VERSION, "this owner"
            )
        if info.authenticated_node_id and info.authenticated_node_id != self.config.owner.id:
            logger.warning(
                "the proxy knows this node as %r, the config says %r",
                info.authenticated_node_id,
                self.config.owner.id,
            )
        if info.max_message_bytes > 0:
            self._max_message_bytes = min(info.max_message_bytes, UPLOAD_CHUNK_BYTES)
        warn_of_clock_skew(info.server_time, datetime.now(UTC))
        # The uploads left in flight (by a crash, an outage) and the tasks reserved before
        # one began: the proxy answers each with its task again (it resumes) or a
        # withdrawal (it ends: its share is deleted, a reservation without upload refunded).
        in_flight = self.ledger.unfinished_tasks()
        # With this owner's terms, which the proxy shows to analysts (public facts only),
        # unless its operator keeps them to itself (policy.state_terms = false).
        terms = stated_terms(self.config, self.table) if self.config.policy.state_terms else None
        call = stub.StreamTasks(
            serde.task_stream_request_to_proto(self.config.owner.id, in_flight, terms)
        )
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        try:
            for message in call:
                if not self.connected.is_set():
                    # The first event (the proxy sends a heartbeat at once) proves the
                    # proxy has enrolled this owner: only now is the node ready for tasks.
                    logger.info(
                        "owner %s connected to %s (proxy %s, fedpca %s, wire protocol %d)",
                        self.config.owner.id,
                        self.config.owner.proxy,
                        info.proxy_id or "?",
                        info.software_version or "?",
                        info.protocol_version,
                    )
                    self.connected.set()
                try:
                    event = serde.task_event_from_proto(message)
                except ProtocolError as exc:
                    # Cut, and logged for the 1st, 2nd, 4th, 8th, ... only.
                    if self._malformed.due():
                        logger.error(
                            "ignoring a malformed task event (%d so far): %s",
                            self._malformed.count,
                            str(exc)[:300],
                        )
                    continue
                self._dispatch(event)
        finally:
            with self._lock:
                self._call = None
        logger.info("owner %s: the proxy closed the task stream", self.config.owner.id)
        return True

    def _dispatch(self, event: TaskEvent) -> None:
        if isinstance(event, Heartbeat):
            logger.debug("heartbeat from the proxy (sent %s)", event.sent_at.isoformat())
            return
        if isinstance(event, TaskCancellation):
            # Only a waiting task's is logged at once: ending one in flight logs itself
            # (end_withdrawn_upload), and the proxy may send any number of others.
            with self._lock:
                self._cancelled[event.query_id] = None
                while len(self._cancelled) > REMEMBERED_CANCELLATIONS:
                    self._cancelled.popitem(last=False)
                queued = event.query_id in self._queued
            if queued or self._cancellations.due():
                logger.info(
                    "query %s: cancelled by the proxy (%s)%s",
                    event.query_id[:80],
                    shortened(event.reason, 300),
                    "" if queued else f" ({self._cancellations.count} such so far)",
                )
            if not queued:
                # Not waiting for the worker (which ends queued tasks itself): an upload
                # left in flight whose query ended while this node was away (an id the
                # ledger does not know costs one read).
                self.end_withdrawn_upload(event.query_id, event.reason)
            elif event.query_failed and (upload := self._prepared.get(event.query_id)):
                # Its encryption and upload stop now; the worker then ends the task as
                # withdrawn (under the one refund rule). Left to the worker, an upload
                # to a query that failed went on until its next chunk was refused (a
                # review of stop 42). Only then: another withdrawal may come for an
                # upload whose chunks are all folded, and its resend is acknowledged.
                upload.stop()
            return
        query_id = event.key
        with self._lock:
            if query_id in self._queued:
                logger.debug("query %s: already queued", query_id)
                return
            waiting = len(self._queued)
        if self.ledger.is_handled(query_id):
            if self._redelivered.due():
                logger.info(
                    "query %s: already handled, ignoring the re-delivered task (%d so far)",
                    query_id,
                    self._redelivered.count,
                )
            return
        admitted = self._intake.admit(event, waiting)
        if admitted is None:
            return
        with self._lock:
            self._queued.add(query_id)
        logger.info("query %s: task received (%s)", query_id, event.query.kind.value)
        self._queue.put(admitted)

    def _work(self, stub: owner_grpc.OwnerServiceStub) -> None:
        swept = time.monotonic()
        while True:
            idle = False
            try:
                task = self._queue.get(timeout=PAUSED_SWEEP_SECONDS)
            except queue.Empty:
                idle = True
            if time.monotonic() - swept >= PAUSED_SWEEP_SECONDS:
                # End the uploads paused past their deadline: by the clock, not only when
                # idle (a proxy sending junk tasks kept the worker from ever being idle:
                # review), and on this thread, which runs every task, so none is being
                # resumed meanwhile.
                swept = time.monotonic()
                try:
                    self.end_paused_past_deadline(datetime.now(UTC))
                except Exception:
                    logger.exception("ending paused uploads past their deadline failed")
            if idle:
                continue
            if task is None or self._stop.is_set():
                return
            if isinstance(task, RefusedTask):
                # Declined, not recorded: nothing about it is worth a ledger row.
                self._decline(stub, task.key, task.reason, task.detail, record=False)
                with self._lock:
                    self._queued.discard(task.key)
                    self._cancelled.pop(task.key, None)
                continue
            started = time.monotonic()
            try:
                outcome = self.process_task(stub, task)
                if outcome is not None or self.ledger.has_reservation(task.key):
                    self._intake.answered(task)
            except Exception:
                # A bug must not kill the worker: later tasks still deserve an answer.
                logger.exception("query %s: unexpected failure", task.key)
                if self.metrics is not None:
                    self.metrics.task_failed(time.monotonic() - started)
            else:
                if self.metrics is not None:
                    self.metrics.task_finished(outcome, time.monotonic() - started)
            finally:
                self._intake.done(task)
                with self._lock:
                    self._queued.discard(task.key)
                    withdrawn = task.key in self._cancelled
                    self._cancelled.pop(task.key, None)
                if withdrawn:
                    # A cancellation that arrived while the task was being handled (the
                    # stream thread left it to this worker): an upload left in flight
                    # ends now rather than at the next connection.
                    self.end_withdrawn_upload(task.key, "withdrawn while it was handled")


def _variants(preferred: Obfuscation) -> tuple[ObfuscationVariant, ...]:
    if preferred is Obfuscation.DJN:
        return (ObfuscationVariant.DJN, ObfuscationVariant.FULL)
    return (ObfuscationVariant.FULL,)
