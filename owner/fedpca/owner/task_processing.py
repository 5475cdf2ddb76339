"""How an owner node answers one task: policy and budget checks, computing and encrypting
its share, the upload with retries under one upload id, and declines.

:class:`TaskProcessing` is the part of :class:`fedpca.owner.node.OwnerNode` that does
this; the node itself keeps the connection to the proxy and the task stream.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Container, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import grpc
import numpy as np

from fedpca.codec.ciphertext import ciphertext_byte_length
from fedpca.codec.paillier import CryptoPool, Obfuscation
from fedpca.errors import (
    BudgetExceededError,
    CalibrationError,
    CompositionError,
    PolicyError,
    ShareExceededError,
    UntrustedKeyError,
)
from fedpca.logs import SparseLog
from fedpca.messages import (
    DECLINES_CLOSED,
    MAX_DECLINE_DETAIL,
    DeclineReason,
    ObfuscationVariant,
    Task,
    TaskDecline,
    blocks_of,
    chunk_count,
    ciphertexts_per_chunk,
    new_upload_id,
)
from fedpca.owner.compute import encode_share, encrypt_share_stream, record_cap
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.local_table import LocalTable
from fedpca.owner.policy import (
    SECONDS_PER_DAY,
    Refusal,
    check_resumable,
    check_resumed_task,
    check_task,
)
from fedpca.owner.retry import (
    RETRYABLE_CODES,
    RetryPolicy,
    status_code,
    status_details,
    status_name,
)
from fedpca.owner.share_snapshots import KeptShare, ShareSnapshots
from fedpca.owner.task_endings import TaskEndings
from fedpca.owner.upload import OutgoingUpload
from fedpca.owner.upload_call import HeaderAcknowledgement, result_when_done
from fedpca.protocol import ReleasePlan
from fedpca.query import ProtocolMode, QuerySpec, spec_digest
from fedpca.transport import serde
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc

__all__ = [
    "BUDGET_DECLINE_DETAIL",
    "UNACCOUNTABLE_DECLINE_DETAIL",
    "TaskProcessing",
    "choose_obfuscation",
]

logger = logging.getLogger("fedpca.owner.node")

BUDGET_DECLINE_DETAIL = "the query does not fit in this owner's remaining privacy budget"
"""What a budget decline tells the proxy and the analyst (no figures: see its use)."""

UNACCOUNTABLE_DECLINE_DETAIL = (
    "this owner's ledger cannot account for one more release of this size (the figures "
    "are in the owner's log)"
)
"""What a decline tells when the ledger's accountant cannot compose one more release
(no figures: they count every analyst's releases at this owner)."""


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


class TaskProcessing(TaskEndings):
    """Answers tasks for :class:`~fedpca.owner.node.OwnerNode` (which sets this state)."""

    config: OwnerConfig
    table: LocalTable
    ledger: BudgetLedger
    shares: ShareSnapshots
    retry: RetryPolicy
    _pool: CryptoPool
    _stop: threading.Event
    _lock: threading.Lock
    _cancelled: Container[str]
    _prepared: dict[str, OutgoingUpload]
    _max_message_bytes: int
    _unrecorded_declines: SparseLog
    _paused: dict[str, datetime]

    def _is_cancelled(self, query_id: str) -> bool:
        with self._lock:
            return query_id in self._cancelled

    def process_task(self, stub: owner_grpc.OwnerServiceStub, task: Task) -> TaskOutcome | None:
        """Handle one task end to end (policy, budget, encryption and upload, or decline).

        Returns
        -------
        TaskOutcome or None
            The recorded outcome, or None if the task was skipped (already
            handled) or the upload gave up on a transient failure (it stays
            open for a re-delivery, or until its deadline: :meth:`_pause_if_still_open`).
        """
        earlier = self._paused.pop(task.key, None)  # delivered again: it runs (or ends) now
        try:
            return self._process_task(stub, task)
        finally:
            self._pause_if_still_open(task, earlier)

    def _process_task(self, stub: owner_grpc.OwnerServiceStub, task: Task) -> TaskOutcome | None:
        query_id = task.key
        if self.ledger.is_handled(query_id):
            logger.info("query %s: already handled", query_id)
            return None
        if self._is_cancelled(query_id):
            return self._finish_cancelled(query_id)
        if task.upload_deadline <= datetime.now(UTC):
            return self._past_deadline(stub, task)
        upload = self._prepared.get(query_id)
        if upload is None:
            outcome = self._prepare(stub, task)
            upload = self._prepared.get(query_id)
            if outcome is not None or upload is None:
                # Declined, or a decline the proxy did not acknowledge (None: nothing
                # recorded, a re-delivered task is evaluated again).
                return outcome
        if self._is_cancelled(query_id):
            return self._finish_cancelled(query_id)
        return self._upload(stub, task, upload)

    def _prepare(self, stub: owner_grpc.OwnerServiceStub, task: Task) -> TaskOutcome | None:
        """Public checks and budget, then start encrypting; or decline.

        Every decline happens before the records are looked at, for a public reason
        (:mod:`fedpca.owner.policy`); after the budget is reserved the share is computed
        and encrypted whatever the records hold. A task whose upload had begun before a
        restart is resumed: same upload id and the very share it began with (kept on
        disk, :mod:`fedpca.owner.share_snapshots`), so the proxy continues after the
        chunks it already folded.
        """
        spec = task.query
        query_id = task.key
        record = self.ledger.task(query_id)
        resuming = (
            record is not None
            and record.outcome is TaskOutcome.UPLOADING
            and record.upload_id is not None
        )
        try:
            obfuscation = choose_obfuscation(
                self.config.crypto.obfuscation, task.accepted_obfuscation_variants
            )
        except PolicyError as exc:
            if resuming:
                raise
            return self._decline_task(stub, task, DeclineReason.POLICY_REFUSAL, str(exc))
        if resuming:
            assert record is not None and record.upload_id is not None
            if not record.upload_started and not self.ledger.has_reservation(query_id):
                # Refunded as it ended, and stopped before writing how: a ledger left by
                # a node before the refund and the outcome were one transaction (found
                # by review). It ended, whatever comes now.
                self.ledger.record_task(
                    query_id, TaskOutcome.CANCELLED, "ended before a restart, refunded"
                )
                self.shares.discard(record.upload_id)
                return TaskOutcome.CANCELLED
            # Data of this task may already be at the proxy: finish what was agreed, and
            # only that: the task sent again must be the signed query the budget was
            # reserved for, under the pinned key (the proxy chooses what it sends).
            try:
                check_resumed_task(task, self.config.policy, self.ledger.reserved_digest(query_id))
            except UntrustedKeyError as exc:
                logger.error("query %s: upload %s not resumed: %s", query_id, record.upload_id, exc)
                return None
            plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
            upload_id = record.upload_id
            kept = self.shares.load(upload_id, plan)
            if kept is not None:
                # After a restart, or a pause whose ciphertexts were dropped (task_endings).
                logger.info("query %s: resuming upload %s from its kept share", query_id, upload_id)
                self._begin_upload(spec, query_id, upload_id, plan, kept, obfuscation)
                return None
            if record.seed is None:
                # Begun by a version that keeps every share before its first chunk may
                # leave (and records no seed): the share was lost. Encoding it again from
                # the data file could put two tables in one contribution.
                return self._abandon(
                    query_id,
                    upload_id,
                    f"its kept share is missing from {self.shares.folder} (was state_dir "
                    "restored without it?); encoding it again could mix two tables",
                )
            # Begun by a version that kept no share: encode it again from the data file
            # with the recorded seed and capacity (the same share if the file is unchanged).
            seed = record.seed
            capacity = record.capacity or self.config.data.max_records
            check_resumable(spec, self.config, capacity)
            table = self.table.table_for(spec)
            logger.warning(
                "query %s: resuming upload %s without a kept share: encoding it again from "
                "the data file, which must not have changed since the upload began",
                query_id,
                upload_id,
            )
        else:
            accepted = self._accept(stub, task)
            if not isinstance(accepted, tuple):
                return accepted
            plan, table = accepted
            upload_id, seed = new_upload_id(), secrets.token_bytes(32)
            capacity = self.config.data.max_records
        try:
            # The sample of rows is drawn from a secret seed (kept in memory only: a
            # restart resumes from the kept share).
            encoded = encode_share(
                spec,
                table,
                plan,
                capacity=capacity,
                rng=np.random.default_rng(int.from_bytes(seed, "big")),
            )
            # Masked mode publishes the count of records the statistics cover (its
            # relation, replace-one, makes it public); stats mode keeps it noised.
            record_count = (
                min(table.n_records, record_cap(spec, capacity))
                if spec.mode is ProtocolMode.MASKED
                else None
            )
            self._begin_upload(
                spec,
                query_id,
                upload_id,
                plan,
                KeptShare(encoded, record_count),
                obfuscation,
            )
        except BaseException:
            # Not a decline: nothing here depends on the records (a bug, or a proxy whose
            # Hello set an impossible message size). Nothing left the node, so a fresh
            # reservation is refunded; a re-delivery tries again.
            if not resuming:
                self.ledger.cancel_reservation(query_id)
            raise
        return None

    def _begin_upload(
        self,
        spec: QuerySpec,
        query_id: str,
        upload_id: str,
        plan: ReleasePlan,
        share: KeptShare,
        obfuscation: Obfuscation,
    ) -> None:
        upload = self._start_upload(
            spec, query_id, upload_id, plan, share.values, obfuscation, share.record_count
        )
        upload.share = share
        self._prepared[query_id] = upload

    def _accept(
        self, stub: owner_grpc.OwnerServiceStub, task: Task
    ) -> tuple[ReleasePlan, Any] | TaskOutcome | None:
        """Public policy checks and the budget reservation of a new task.

        Returns the plan and the query's view of the table, or the decline's outcome.
        """
        spec = task.query
        query_id = task.key
        # The task's own reservation (a crash before its upload) is not another task:
        # counted, the task coming again was declined at the cap. With shares the cap
        # counts this analyst's tasks only (its declines tell nothing of the others).
        day_ago, own_only = time.time() - SECONDS_PER_DAY, self.ledger.shares is not None
        analyst = spec.analyst_key_fingerprint
        decision = check_task(
            task,
            self.config,
            self.table,
            tasks_last_day=lambda: self.ledger.tasks_started_since(
                day_ago, asking=analyst, excluding=query_id, own_only=own_only
            ),
        )
        if isinstance(decision, Refusal):
            return self._decline_task(stub, task, decision.reason, decision.detail)
        plan = decision.plan
        # The ledger keys releases by the task's key (scoped by analyst at the proxy).
        event = replace(plan.privacy_event(analyst=spec.analyst_key_fingerprint), query_id=query_id)
        try:
            budget = self.ledger.reserve(
                event,
                self.config.budget,
                spec_digest=spec_digest(spec),
                allow_not_private=self.config.policy.allow_not_private,
                upload_deadline=task.upload_deadline.timestamp(),
            )
        except ShareExceededError as exc:
            # Its figures are this analyst's own releases against its share: they tell
            # it nothing about anyone else's, so they go back with the decline.
            return self._decline_task(stub, task, DeclineReason.BUDGET_EXHAUSTED, str(exc))
        except BudgetExceededError as exc:
            # The figures compose every analyst's releases: they stay in this log, so
            # that one analyst does not read another's spend here to the digit (whether
            # a query fits still depends on it: docs/privacy.md, "What each party
            # observes").
            logger.info("query %s: %s", query_id, exc)
            return self._decline_task(
                stub, task, DeclineReason.BUDGET_EXHAUSTED, BUDGET_DECLINE_DETAIL
            )
        except CompositionError as exc:
            # The ledger cannot account for the composition: its message counts every
            # analyst's releases here, so it stays in this log too.
            logger.info("query %s: %s", query_id, exc)
            return self._decline_task(
                stub, task, DeclineReason.POLICY_REFUSAL, UNACCOUNTABLE_DECLINE_DETAIL
            )
        except (CalibrationError, PolicyError) as exc:
            return self._decline_task(stub, task, DeclineReason.POLICY_REFUSAL, str(exc))
        if budget.share_used is not None:
            before, after = budget.share_used
            logger.info(
                "query %s: budget reserved (share of analyst %s used %.4g%% -> %.4g%%)",
                query_id,
                spec.analyst_key_fingerprint,
                100 * before,
                100 * after,
            )
            return plan, decision.table
        logger.info(
            "query %s: budget reserved (epsilon spent %.6g -> %.6g of %g%s)",
            query_id,
            budget.epsilon_spent_before,
            budget.epsilon_spent_after,
            self.config.budget.epsilon,
            ", NOT PRIVATE verification release" if budget.not_private else "",
        )
        return plan, decision.table

    def _start_upload(
        self,
        spec: QuerySpec,
        query_id: str,
        upload_id: str,
        plan: ReleasePlan,
        encoded: Any,
        obfuscation: Obfuscation,
        record_count: int | None,
    ) -> OutgoingUpload:
        """Start encrypting; the upload's messages exist as soon as their chunks do."""
        width = ciphertext_byte_length(spec.analyst_public_key_n.bit_length())
        per_chunk = ciphertexts_per_chunk(width, self._max_message_bytes)
        total = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
        header = serde.upload_header_message(
            query_id,
            spec.analyst_key_fingerprint,
            upload_id,
            blocks_of(plan.owner_blocks),
            chunk_count(total, per_chunk),
            public_record_count=record_count,
        )
        kind = "encrypt_chunk_djn" if obfuscation is Obfuscation.DJN else "encrypt_chunk_standard"
        cpu_before = self._pool.work_done().get(kind, (0, 0.0))[1]
        started = time.perf_counter()

        def done() -> None:
            cpu = self._pool.work_done().get(kind, (0, 0.0))[1] - cpu_before
            logger.info(
                "query %s: share encrypted (%s, %d ciphertexts) in %.2f s, %.2f CPU-s in the "
                "crypto workers",
                query_id,
                obfuscation.value,
                total,
                time.perf_counter() - started,
                cpu,
            )

        logger.info(
            "query %s: encrypting %d ciphertexts (%s), sending each chunk as soon as it is ready",
            query_id,
            total,
            obfuscation.value,
        )
        batches = encrypt_share_stream(
            spec,
            encoded,
            plan,
            self._pool,
            obfuscation=obfuscation,
            progress=_ProgressLog(query_id),
        )
        return OutgoingUpload(
            upload_id, header, batches, width, per_chunk, serde.upload_chunk_message, on_done=done
        ).start()

    def _upload(
        self,
        stub: owner_grpc.OwnerServiceStub,
        task: Task,
        upload: OutgoingUpload,
    ) -> TaskOutcome | None:
        query_id = task.key
        upload_id = upload.upload_id
        # From here on data derived from the rows may leave: no refund any more. The
        # share is kept on disk first and the upload id in the ledger, so a restart
        # resumes this very upload.
        if upload.share is not None:
            try:
                self.shares.save(upload_id, upload.share)
            except OSError as exc:
                # Nothing has left the node: the task stays open for a re-delivery.
                logger.error(
                    "query %s: cannot keep the share on disk before uploading (%s); the "
                    "task stays open (free space in %s)",
                    query_id,
                    exc,
                    self.shares.folder,
                )
                return None
            upload.share = None
        self.ledger.record_task(
            query_id,
            TaskOutcome.UPLOADING,
            upload_id=upload_id,
            upload_deadline=task.upload_deadline.timestamp(),
        )
        attempts = self.retry.upload_attempts
        for attempt in range(attempts):
            if self._stop.is_set():
                logger.warning("query %s: stopping before the upload finished", query_id)
                return None
            try:
                # Chunks leave only once that is on disk: a node killed before it
                # (the header alone sent) is refunded if the task is then withdrawn.
                acknowledgement = HeaderAcknowledgement(
                    functools.partial(self.ledger.mark_upload_started, query_id)
                )
                call = stub.Upload.future(
                    upload.messages(acknowledgement.wait), timeout=self.retry.upload_timeout
                )
                upload.attach(call)
                acknowledgement.watch(call)
                response = result_when_done(call)
            except grpc.FutureCancelledError:
                # upload.stop cancelled the call: the node stops (the proxy keeps what it
                # folded, and the task stays open for the restart), or the task was
                # ended here (withdrawn, expired), by code that records how.
                if self._stop.is_set():
                    logger.warning("query %s: stopping during upload %s; it resumes at "
                                   "the next start", query_id, upload_id)  # fmt: skip
                return None
            except grpc.RpcError as err:
                if upload.error is not None:
                    # Encrypting failed (a bug or a dead worker), not the proxy: the task
                    # stays open, and a re-delivery resumes it.
                    self._drop_upload(query_id)
                    logger.error(
                        "query %s: encrypting the share failed (%s); the task stays open",
                        query_id,
                        type(upload.error).__name__,
                    )
                    return None
                if acknowledgement.failure is not None:
                    # Not the proxy: this node could not record the accepted header (a
                    # locked or full ledger). No chunk left; the upload is tried again.
                    logger.error(
                        "query %s: cannot record upload %s as started (%s); no chunk was sent",
                        query_id,
                        upload_id,
                        acknowledgement.failure,
                    )
                elif status_code(err) not in RETRYABLE_CODES:
                    return self._end_refused(task, upload, err)
                delay = RetryPolicy.delay(
                    attempt, self.retry.backoff_initial, self.retry.backoff_max
                )
                remaining = (task.upload_deadline - datetime.now(UTC)).total_seconds()
                if attempt + 1 >= attempts or delay >= remaining:
                    # Not an error yet: the proxy re-delivers the task when the node
                    # reconnects and the upload resumes where it stopped.
                    logger.warning(
                        "query %s: pausing upload %s after %d attempt(s) (%s: %s); it "
                        "resumes when the proxy delivers the task again",
                        query_id,
                        upload_id,
                        attempt + 1,
                        status_name(err),
                        status_details(err),
                    )
                    return None  # kept for the deadline sweep (_pause_if_still_open)
                logger.warning(
                    "query %s: upload attempt %d/%d failed (%s: %s); retrying upload %s in %.1f s",
                    query_id,
                    attempt + 1,
                    attempts,
                    status_name(err),
                    status_details(err),
                    upload_id,
                    delay,
                )
                self._stop.wait(delay)
                continue
            receipt = serde.upload_receipt_from_proto(response)
            self._drop_upload(query_id)
            self.ledger.record_task(
                query_id, TaskOutcome.UPLOADED, receipt.status.value, upload_id=upload_id
            )
            self.shares.discard(upload_id)
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

    def _decline_task(
        self, stub: owner_grpc.OwnerServiceStub, task: Task, reason: DeclineReason, detail: str
    ) -> TaskOutcome | None:
        """:meth:`_decline` a task looked at, recording its signed query's digest (so
        a replay of it under another task id is recognised)."""
        return self._decline(stub, task.key, reason, detail, digest=spec_digest(task.query))

    def _decline(
        self,
        stub: owner_grpc.OwnerServiceStub,
        query_id: str,
        reason: DeclineReason,
        detail: str,
        *,
        record: bool = True,
        digest: str | None = None,
    ) -> TaskOutcome | None:
        """Send DeclineTask (with retries); record it once the proxy acknowledged
        (unless ``record`` is False: an unsigned task leaves no ledger row), with the
        signed query's ``digest``, so that a replay of it is recognised.

        Declines happen only for public reasons (:mod:`fedpca.owner.policy`), so the
        detail goes to the proxy and the analyst as it is logged here.
        """
        detail = detail[:MAX_DECLINE_DETAIL]  # what the proxy keeps; a peer's text may be long
        # A declined signed query costs a ledger row and is logged; an unsigned or
        # replayed task (not recorded) is the proxy's to send at will: logged sparingly.
        if record or self._unrecorded_declines.due():
            logger.warning("query %s: declined (%s): %s", query_id, reason.value, detail)
        message = serde.task_decline_to_proto(TaskDecline(query_id, reason, detail))
        for attempt in range(self.retry.decline_attempts):
            try:
                stub.DeclineTask(message, timeout=self.retry.call_timeout)
            except grpc.RpcError as err:
                code, details = status_code(err), status_details(err)
                retry = code in RETRYABLE_CODES and attempt + 1 < self.retry.decline_attempts
                # The query ended meanwhile (another owner's decline failed it): an
                # expected race (a new user read a warning as a fault).
                logger.log(
                    logging.INFO if DECLINES_CLOSED in details else logging.WARNING,
                    "query %s: could not deliver the decline (%s: %s)%s",
                    query_id,
                    code.name,
                    details,
                    "; retrying" if retry else "",
                )
                if not retry:
                    # Not recorded: a re-delivered task is evaluated and declined again.
                    return None
                self._stop.wait(
                    RetryPolicy.delay(attempt, self.retry.backoff_initial, self.retry.backoff_max)
                )
                continue
            if record:
                # A task reserved before a restart and declined when it came again (a
                # stricter policy now): final, and nothing of it left the node. Refunded
                # in the transaction that writes the outcome.
                self.ledger.end_task(
                    query_id, TaskOutcome.DECLINED, f"{reason.value}: {detail}", spec_digest=digest
                )
            return TaskOutcome.DECLINED
        return None  # pragma: no cover - the loop always returns
