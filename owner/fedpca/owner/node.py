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
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import grpc

from fedpca.codec.ciphertext import PackedCiphertexts
from fedpca.codec.paillier import CryptoPool, Obfuscation
from fedpca.errors import (
    BudgetExceededError,
    CalibrationError,
    ConfigError,
    PolicyError,
    ProtocolError,
)
from fedpca.messages import (
    PROTOCOL_VERSION,
    UPLOAD_CHUNK_BYTES,
    CiphertextPayload,
    DeclineReason,
    Heartbeat,
    ObfuscationVariant,
    OwnerHello,
    Task,
    TaskCancellation,
    TaskDecline,
    TaskEvent,
    blocks_of,
    new_upload_id,
)
from fedpca.owner.compute import LocalTable, encrypt_share, record_cap
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import TaskOutcome, owner_ledger
from fedpca.owner.policy import SECONDS_PER_DAY, Refusal, check_task
from fedpca.protocol import ReleasePlan
from fedpca.query import ProtocolMode, spec_digest
from fedpca.transport import serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial
from fedpca.transport.channels import insecure_channel, secure_channel
from fedpca.transport.diagnose import diagnose_connection
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import __version__

__all__ = ["OwnerNode", "RetryPolicy", "choose_obfuscation", "wire_payload"]

logger = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""Statuses that say "try again later"; every other failure of an upload is final."""


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff and timeouts of the node's calls to the proxy.

    Attributes
    ----------
    upload_attempts : attempts per upload (the first one included).
    backoff_initial, backoff_max : seconds; attempt ``a`` waits a uniform draw
        from ``[d/2, d]`` with ``d = min(backoff_max, backoff_initial 2^a)``
        (jitter keeps owners that lost the proxy together from retrying in lockstep).
    reconnect_initial, reconnect_max : the same for re-opening the task stream.
    call_timeout : seconds for Hello and DeclineTask.
    upload_timeout : seconds for one Upload call.
    decline_attempts : attempts to deliver a decline.
    """

    upload_attempts: int = 6
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    reconnect_initial: float = 1.0
    reconnect_max: float = 30.0
    call_timeout: float = 30.0
    upload_timeout: float = 600.0
    decline_attempts: int = 3

    def __post_init__(self) -> None:
        if self.upload_attempts < 1 or self.decline_attempts < 1:
            raise ConfigError("retry attempts must be >= 1")
        for name in (
            "backoff_initial",
            "backoff_max",
            "reconnect_initial",
            "reconnect_max",
            "call_timeout",
            "upload_timeout",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be finite and > 0, got {value!r}")

    @staticmethod
    def delay(attempt: int, initial: float, cap: float) -> float:
        """Jittered exponential backoff before retry number ``attempt`` (0-based)."""
        ceiling = min(cap, initial * 2.0 ** min(attempt, 30))
        return random.uniform(ceiling / 2, ceiling)


def choose_obfuscation(
    preferred: Obfuscation, accepted: Sequence[ObfuscationVariant]
) -> Obfuscation:
    """The obfuscator to encrypt a task with.

    The configured DJN falls back to the standard ``r^n`` obfuscator (which needs
    one assumption less) when the proxy does not accept DJN; an owner configured
    for the standard obfuscator never switches to DJN.

    Raises
    ------
    PolicyError
        If the proxy accepts only DJN and the owner is configured for standard.
    """
    if not accepted:
        return preferred
    if preferred is Obfuscation.DJN and ObfuscationVariant.DJN in accepted:
        return Obfuscation.DJN
    if ObfuscationVariant.FULL in accepted:
        return Obfuscation.STANDARD
    raise PolicyError(
        "the task accepts only DJN short-exponent encryption; this owner is configured for "
        'crypto.obfuscation = "standard"'
    )


def wire_payload(shares: dict[str, PackedCiphertexts], plan: ReleasePlan) -> CiphertextPayload:
    """The codec's packed ciphertexts as the wire payload, blocks in plan order."""
    return CiphertextPayload(
        blocks_of(plan.owner_blocks),
        {block.name: shares[block.name].ciphertexts for block in plan.owner_blocks},
    )


class _ProgressLog:
    """INFO lines about encryption progress: every quarter, every 5 s, and at the end."""

    def __init__(self, query_id: str) -> None:
        self.query_id = query_id
        self.last_time = time.monotonic()
        self.last_fraction = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        fraction = done / total if total else 1.0
        if done == total or fraction - self.last_fraction >= 0.25 or now - self.last_time >= 5.0:
            logger.info("query %s: encrypted %d/%d ciphertexts", self.query_id, done, total)
            self.last_time = now
            self.last_fraction = fraction


class OwnerNode:
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
        self.ledger = owner_ledger(config)
        self._owns_pool = pool is None
        processes = config.crypto.processes or None
        self._pool = pool if pool is not None else CryptoPool(processes)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the open StreamTasks call, cancelled by stop()
        self._queue: queue.Queue[Task | None] = queue.Queue()
        self._queued: set[str] = set()
        self._cancelled: set[str] = set()
        # Upload messages of tasks not yet finished: a re-delivered task resends
        # the same bytes under the same upload id instead of encrypting again.
        self._prepared: dict[str, tuple[str, list[owner_pb.UploadMessage]]] = {}
        self._max_message_bytes = UPLOAD_CHUNK_BYTES
        self.connected = threading.Event()
        """Set while a task stream is open (for tests and health checks)."""
        self.metrics: Any = None
        """Told every handled task's outcome and duration (:mod:`fedpca.owner.metrics`)."""
        self._worker: threading.Thread | None = None
        # The record count is a statistic of the data: logs carry the public capacity.
        logger.info(
            "owner %s ready: table of %d features (%s), capacity %d records, budget "
            "epsilon=%g delta=%g under %s adjacency",
            config.owner.id,
            self.table.n_features,
            "no label column"
            if self.table.label_column is None
            else f"label in column {self.table.label_column} of {self.table.n_columns}",
            config.data.max_records,
            config.budget.epsilon,
            config.budget.delta,
            config.privacy.neighbouring.value,
        )

    # ------------------------------------------------------------ lifecycle
    def alive(self) -> tuple[bool, str]:
        """Liveness: the node runs and its task worker thread is alive."""
        if self._stop.is_set():
            return False, "stopping"
        if self._worker is None or not self._worker.is_alive():
            return False, "the task worker is not running"
        return True, "running"

    def ready(self) -> tuple[bool, str]:
        """Readiness: the task stream to the proxy is open."""
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
        """
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
            attempt = 0
            while not self._stop.is_set():
                try:
                    if self._session(stub):
                        attempt = 0
                except grpc.RpcError as err:
                    if self._stop.is_set():
                        break
                    logger.warning(
                        "owner %s: proxy %s unreachable or stream lost (%s: %s)",
                        self.config.owner.id,
                        self.config.owner.proxy,
                        _code_name(err),
                        _details(err),
                    )
                    if attempt == 0 and _code(err) is grpc.StatusCode.UNAVAILABLE:
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
                delay = RetryPolicy.delay(
                    attempt, self.retry.reconnect_initial, self.retry.reconnect_max
                )
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
        (a certificate that does not name the proxy's host) as an ERROR."""
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
            raise ProtocolError(
                f"the proxy speaks wire protocol {info.protocol_version}, this owner "
                f"{PROTOCOL_VERSION}"
            )
        if info.authenticated_node_id and info.authenticated_node_id != self.config.owner.id:
            logger.warning(
                "the proxy knows this node as %r, the config says %r",
                info.authenticated_node_id,
                self.config.owner.id,
            )
        if info.max_message_bytes > 0:
            self._max_message_bytes = min(info.max_message_bytes, UPLOAD_CHUNK_BYTES)
        call = stub.StreamTasks(serde.task_stream_request_to_proto(self.config.owner.id))
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
                        "owner %s connected to %s (proxy %s, fedpca %s)",
                        self.config.owner.id,
                        self.config.owner.proxy,
                        info.proxy_id or "?",
                        info.software_version or "?",
                    )
                    self.connected.set()
                try:
                    event = serde.task_event_from_proto(message)
                except ProtocolError as exc:
                    logger.error("ignoring a malformed task event: %s", exc)
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
            logger.info("query %s: cancelled by the proxy (%s)", event.query_id, event.reason)
            with self._lock:
                self._cancelled.add(event.query_id)
            return
        query_id = event.key
        with self._lock:
            if query_id in self._queued:
                logger.debug("query %s: already queued", query_id)
                return
        if self.ledger.is_handled(query_id):
            logger.info("query %s: already handled, ignoring the re-delivered task", query_id)
            return
        with self._lock:
            self._queued.add(query_id)
        logger.info("query %s: task received (%s)", query_id, event.query.kind.value)
        self._queue.put(event)

    def _work(self, stub: owner_grpc.OwnerServiceStub) -> None:
        while True:
            task = self._queue.get()
            if task is None or self._stop.is_set():
                return
            started = time.monotonic()
            try:
                outcome = self.process_task(stub, task)
            except Exception:
                # A bug must not kill the worker: later tasks still deserve an answer.
                logger.exception("query %s: unexpected failure", task.key)
                if self.metrics is not None:
                    self.metrics.task_failed(time.monotonic() - started)
            else:
                if self.metrics is not None:
                    self.metrics.task_finished(outcome, time.monotonic() - started)
            finally:
                with self._lock:
                    self._queued.discard(task.key)

    def _is_cancelled(self, query_id: str) -> bool:
        with self._lock:
            return query_id in self._cancelled

    # ---------------------------------------------------------------- tasks
    def process_task(self, stub: owner_grpc.OwnerServiceStub, task: Task) -> TaskOutcome | None:
        """Handle one task end to end (policy, budget, encryption, upload or decline).

        Returns
        -------
        TaskOutcome or None
            The recorded outcome, or None if the task was skipped (already
            handled) or the upload gave up on a transient failure (it stays
            open for a re-delivery).
        """
        query_id = task.key
        if self.ledger.is_handled(query_id):
            logger.info("query %s: already handled", query_id)
            return None
        if self._is_cancelled(query_id):
            return self._finish_cancelled(query_id)
        if task.upload_deadline <= datetime.now(UTC):
            logger.warning("query %s: upload deadline already passed, skipping", query_id)
            self.ledger.record_task(query_id, TaskOutcome.EXPIRED, "deadline passed")
            return TaskOutcome.EXPIRED
        prepared = self._prepared.get(query_id)
        if prepared is None:
            outcome = self._prepare(stub, task)
            if outcome is not None:
                return outcome
            prepared = self._prepared[query_id]
        if self._is_cancelled(query_id):
            return self._finish_cancelled(query_id)
        upload_id, messages = prepared
        return self._upload(stub, task, upload_id, messages)

    def _prepare(self, stub: owner_grpc.OwnerServiceStub, task: Task) -> TaskOutcome | None:
        """Public checks, budget and encryption; stores the upload messages, or declines.

        Every decline happens before the records are looked at, for a public reason
        (:mod:`fedpca.owner.policy`); after the budget is reserved the share is computed
        and encrypted whatever the records hold.
        """
        spec = task.query
        query_id = task.key
        day_ago = time.time() - SECONDS_PER_DAY
        decision = check_task(
            task,
            self.config,
            self.table,
            releases_last_day=self.ledger.reservations_since(day_ago),
        )
        if isinstance(decision, Refusal):
            return self._decline(stub, query_id, decision.reason, decision.detail)
        try:
            obfuscation = choose_obfuscation(
                self.config.crypto.obfuscation, task.accepted_obfuscation_variants
            )
        except PolicyError as exc:
            return self._decline(stub, query_id, DeclineReason.POLICY_REFUSAL, str(exc))
        plan = decision.plan
        # The ledger keys releases by the task's key (scoped by analyst at the proxy).
        event = replace(plan.privacy_event(analyst=spec.analyst_key_fingerprint), query_id=query_id)
        try:
            budget = self.ledger.reserve(
                event,
                self.config.budget,
                spec_digest=spec_digest(spec),
                allow_not_private=self.config.policy.allow_not_private,
            )
        except BudgetExceededError as exc:
            return self._decline(stub, query_id, DeclineReason.BUDGET_EXHAUSTED, str(exc))
        except (CalibrationError, PolicyError) as exc:
            return self._decline(stub, query_id, DeclineReason.POLICY_REFUSAL, str(exc))
        logger.info(
            "query %s: budget reserved (epsilon spent %.6g -> %.6g of %g%s)",
            query_id,
            budget.epsilon_spent_before,
            budget.epsilon_spent_after,
            self.config.budget.epsilon,
            ", NOT PRIVATE verification release" if budget.not_private else "",
        )

        started = time.perf_counter()
        capacity = self.config.data.max_records
        try:
            shares = encrypt_share(
                spec,
                decision.table,
                self._pool,
                capacity=capacity,
                plan=plan,
                obfuscation=obfuscation,
                progress=_ProgressLog(query_id),
            )
        except BaseException:
            # Not a decline: nothing here depends on the records (a crash or a bug).
            # Nothing left the node, so the reservation is refunded; the task stays
            # open and a re-delivery tries again.
            self.ledger.cancel_reservation(query_id)
            raise
        logger.info(
            "query %s: share encrypted (%s, %d ciphertexts) in %.1f s",
            query_id,
            obfuscation.value,
            sum(len(s.ciphertexts) for s in shares.values()),
            time.perf_counter() - started,
        )
        # Masked mode publishes the count of records the statistics cover (its relation,
        # replace-one, makes it public); stats mode keeps it inside the noised release.
        record_count = (
            min(decision.table.features.shape[0], record_cap(spec, capacity))
            if spec.mode is ProtocolMode.MASKED
            else None
        )
        upload_id = new_upload_id()
        messages = serde.encode_upload(
            query_id,
            spec.analyst_key_fingerprint,
            upload_id,
            wire_payload(shares, plan),
            self._max_message_bytes,
            public_record_count=record_count,
        )
        self._prepared[query_id] = (upload_id, messages)
        return None

    def _upload(
        self,
        stub: owner_grpc.OwnerServiceStub,
        task: Task,
        upload_id: str,
        messages: list[owner_pb.UploadMessage],
    ) -> TaskOutcome | None:
        query_id = task.key
        # From here on data derived from the rows may leave: no refund any more.
        self.ledger.record_task(query_id, TaskOutcome.UPLOADING, upload_id=upload_id)
        attempts = self.retry.upload_attempts
        for attempt in range(attempts):
            if self._stop.is_set():
                logger.warning("query %s: stopping before the upload finished", query_id)
                return None
            try:
                response = stub.Upload(iter(messages), timeout=self.retry.upload_timeout)
            except grpc.RpcError as err:
                if _code(err) not in RETRYABLE_CODES:
                    logger.error(
                        "query %s: the proxy refused upload %s: %s: %s",
                        query_id,
                        upload_id,
                        _code_name(err),
                        _details(err),
                    )
                    self._prepared.pop(query_id, None)
                    self.ledger.record_task(
                        query_id,
                        TaskOutcome.REJECTED,
                        f"{_code_name(err)}: {_details(err)}",
                        upload_id=upload_id,
                    )
                    if _code(err) is grpc.StatusCode.FAILED_PRECONDITION:
                        # The query stopped collecting: the proxy takes an upload it did
                        # not complete out of the aggregate, so this share is in no
                        # result, and the proxy refunds the analyst only if no upload
                        # began. Nothing of this owner's data was released.
                        self.ledger.cancel_reservation(query_id, upload_refused=True)
                    return TaskOutcome.REJECTED
                delay = RetryPolicy.delay(
                    attempt, self.retry.backoff_initial, self.retry.backoff_max
                )
                remaining = (task.upload_deadline - datetime.now(UTC)).total_seconds()
                if attempt + 1 >= attempts or delay >= remaining:
                    logger.error(
                        "query %s: giving up upload %s after %d attempt(s) (%s: %s); a "
                        "re-delivered task will resend it",
                        query_id,
                        upload_id,
                        attempt + 1,
                        _code_name(err),
                        _details(err),
                    )
                    return None
                logger.warning(
                    "query %s: upload attempt %d/%d failed (%s: %s); retrying upload %s in %.1f s",
                    query_id,
                    attempt + 1,
                    attempts,
                    _code_name(err),
                    _details(err),
                    upload_id,
                    delay,
                )
                self._stop.wait(delay)
                continue
            receipt = serde.upload_receipt_from_proto(response)
            self._prepared.pop(query_id, None)
            self.ledger.record_task(
                query_id, TaskOutcome.UPLOADED, receipt.status.value, upload_id=upload_id
            )
            logger.info(
                "query %s: upload %s %s by the proxy (%d chunks, %d ciphertexts)",
                query_id,
                upload_id,
                receipt.status.value,
                receipt.chunks_received,
                receipt.ciphertexts_received,
            )
            return TaskOutcome.UPLOADED
        return None  # pragma: no cover - the loop always returns

    def _finish_cancelled(self, query_id: str) -> TaskOutcome:
        self._prepared.pop(query_id, None)
        self.ledger.cancel_reservation(query_id)
        self.ledger.record_task(query_id, TaskOutcome.CANCELLED, "cancelled by the proxy")
        logger.info("query %s: cancelled before upload; nothing was sent", query_id)
        return TaskOutcome.CANCELLED

    def _decline(
        self,
        stub: owner_grpc.OwnerServiceStub,
        query_id: str,
        reason: DeclineReason,
        detail: str,
    ) -> TaskOutcome | None:
        """Send DeclineTask (with retries); record it once the proxy acknowledged.

        Declines happen only for public reasons (:mod:`fedpca.owner.policy`), so the
        detail goes to the proxy and the analyst as it is logged here.
        """
        logger.warning("query %s: declined (%s): %s", query_id, reason.value, detail)
        message = serde.task_decline_to_proto(TaskDecline(query_id, reason, detail))
        for attempt in range(self.retry.decline_attempts):
            try:
                stub.DeclineTask(message, timeout=self.retry.call_timeout)
            except grpc.RpcError as err:
                retry = _code(err) in RETRYABLE_CODES and attempt + 1 < self.retry.decline_attempts
                logger.warning(
                    "query %s: could not deliver the decline (%s: %s)%s",
                    query_id,
                    _code_name(err),
                    _details(err),
                    "; retrying" if retry else "",
                )
                if not retry:
                    # Not recorded: a re-delivered task is evaluated and declined again.
                    return None
                self._stop.wait(
                    RetryPolicy.delay(attempt, self.retry.backoff_initial, self.retry.backoff_max)
                )
                continue
            self.ledger.record_task(query_id, TaskOutcome.DECLINED, f"{reason.value}: {detail}")
            return TaskOutcome.DECLINED
        return None  # pragma: no cover - the loop always returns


def _variants(preferred: Obfuscation) -> tuple[ObfuscationVariant, ...]:
    if preferred is Obfuscation.DJN:
        return (ObfuscationVariant.DJN, ObfuscationVariant.FULL)
    return (ObfuscationVariant.FULL,)


def _code(err: grpc.RpcError) -> grpc.StatusCode:
    # Errors raised by calls are also grpc.Call objects; a bare RpcError has no code.
    code: Callable[[], grpc.StatusCode] | None = getattr(err, "code", None)
    return code() if code is not None else grpc.StatusCode.UNKNOWN


def _code_name(err: grpc.RpcError) -> str:
    return _code(err).name


def _details(err: grpc.RpcError) -> str:
    details: Callable[[], str | None] | None = getattr(err, "details", None)
    text = details() if details is not None else None
    return text or str(err)
