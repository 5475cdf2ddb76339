"""How an owner's task ends without its upload completing (cancelled, withdrawn,
expired, declined again, refused, abandoned), and when that refunds its reservation.

How it ends is also what the node's operators see: a task ends REJECTED, with an
ERROR, only when the proxy refused its upload for a fault of the upload's own; an
upload the query no longer takes (another owner declined, the analyst cancelled, the
quorum was reached without this owner) ends CANCELLED at INFO, as a withdrawn task does,
so that alerts on either page no organisation for another's decline.

:class:`TaskEndings` is a part of :class:`fedpca.owner.task_processing.TaskProcessing`.
One rule decides every refund (docs/privacy.md, "Refunds", Owners): a task's
reservation is refunded when the task ends and the ledger says no proxy ever accepted
a header of its upload, in this process or an earlier one
(:meth:`~fedpca.owner.ledger.BudgetLedger.end_task`, in the transaction that writes
how the task ended). Chunks leave only after
that acceptance is marked on disk, and the mark is refused once the reservation is gone
(:meth:`~fedpca.owner.ledger.BudgetLedger.mark_upload_started`), so no chunk ever leaves
uncharged and no reservation stays charged for a task of which nothing left the node.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc

from fedpca.messages import DeclineReason, Task
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.retry import status_details, status_name
from fedpca.owner.share_snapshots import ShareSnapshots
from fedpca.owner.upload import OutgoingUpload
from fedpca.owner.upload_call import query_closed, share_unreleased

__all__ = ["TaskEndings"]

logger = logging.getLogger("fedpca.owner.node")

PAUSED_UPLOAD_GRACE_SECONDS = 60.0
"""How long after its deadline a paused upload waits for its task to come again before
the node ends it (the proxy fails a query whose contributor is late at the deadline)."""


PAUSED_UPLOADS_IN_MEMORY = 2
"""Paused uploads whose ciphertexts the node keeps in memory; older ones are dropped
and encrypted again from their kept share when their task comes again."""

_OPEN = (TaskOutcome.UPLOADING, TaskOutcome.RESERVED)


class TaskEndings:
    """Ends tasks for :class:`~fedpca.owner.task_processing.TaskProcessing`."""

    ledger: BudgetLedger
    shares: ShareSnapshots
    _lock: threading.Lock
    _cancelled: Container[str]
    _prepared: dict[str, OutgoingUpload]
    _paused: dict[str, datetime]
    _endings: threading.Lock
    _decline: Callable[..., TaskOutcome | None]

    def _past_deadline(self, stub: Any, task: Task) -> TaskOutcome:
        """A task that came after its upload deadline (by this node's clock): declined
        at once if new, then ended (:meth:`_expire`)."""
        query_id = task.key
        deadline = task.upload_deadline.isoformat(timespec="seconds")
        logger.warning(
            "query %s: upload deadline (%s, at most the signed one: issued_at + "
            "deadline_seconds + 5 min) already passed, skipping",
            query_id,
            deadline,
        )
        if not self._known(query_id):
            # Said at once, for a public reason: silence left the query waiting for this
            # owner until its deadline, then failed it, charged (an owner whose clock ran
            # 20 minutes fast; an operator's review). The proxy refuses a decline of a
            # query no longer collecting, which changes nothing.
            self._decline(
                stub,
                query_id,
                DeclineReason.POLICY_REFUSAL,
                f"the task's upload deadline {deadline} has passed by this owner's clock "
                "(if the query is new, this owner's clock is wrong)",
                record=False,
            )
        return self._expire(query_id)

    def end_paused_past_deadline(self, now: datetime) -> list[str]:
        """End the uploads paused in this process, and the tasks a restart left open
        (reserved, or with an upload in flight), whose upload deadline passed
        :data:`PAUSED_UPLOAD_GRACE_SECONDS` ago: EXPIRED, refunded if nothing of them
        left, their ciphertexts dropped and their kept share deleted. Returns their keys.

        Before, a paused upload waited for the proxy to deliver its task again or
        withdraw it, so a proxy that did neither kept every ciphertext in memory and the
        share on disk for as long as the node ran (found by review). Called by the
        node's worker between tasks, so never beside the task's own processing.
        """
        ended = []
        grace = timedelta(seconds=PAUSED_UPLOAD_GRACE_SECONDS)
        for query_id, deadline in list(self._paused.items()):
            if now < deadline + grace:
                continue
            try:
                with self._endings:  # not beside a withdrawal of the same task
                    record = self.ledger.task(query_id)
                    if record is not None and record.outcome in _OPEN:
                        logger.warning(
                            "query %s: %s, and the proxy did not deliver it again by its "
                            "deadline (%s): ended%s",
                            query_id,
                            "reserved"
                            if record.upload_id is None
                            else f"upload {record.upload_id} paused",
                            deadline.isoformat(timespec="seconds"),
                            "" if record.upload_id is None else ", its kept share deleted",
                        )
                        self._expire(query_id)
                        ended.append(query_id)
            except Exception:
                # Kept for the next sweep, and the others still ended now: a task whose
                # ending could not be written (a full disk, a locked ledger) was dropped
                # from the sweep for good, its reservation and share kept (found by review).
                logger.exception("query %s: cannot end it yet; tried again later", query_id)
                continue
            self._paused.pop(query_id, None)
        return ended

    def _pause_if_still_open(self, task: Task, earlier: datetime | None) -> None:
        """After a delivery of ``task``: if its task is still open (reserved, or with an
        upload in flight: paused here among others), keep it where
        :meth:`end_paused_past_deadline` ends it, by the earlier of its deadlines. Before,
        one delivery that left it open (a query that
        did not match the reservation, a decline the proxy refused, a share that could
        not be kept) took it out of that sweep for good (found by review)."""
        query_id = task.key
        deadline = task.upload_deadline if earlier is None else min(earlier, task.upload_deadline)
        try:
            record = self.ledger.task(query_id)
        except Exception:  # not over the delivery's own error
            logger.exception("query %s: cannot read its task after a delivery", query_id)
            self._paused[query_id] = deadline  # the sweep reads the ledger again
            return
        if record is not None and record.outcome in _OPEN:
            self._paused[query_id] = deadline
            self._shed_paused_uploads()

    def _shed_paused_uploads(self) -> None:
        """Keep the ciphertexts of the :data:`PAUSED_UPLOADS_IN_MEMORY` uploads paused
        last; stop and drop the older ones. Each is resumed from its share kept on disk
        when its task comes again, as after a restart (same upload id and share). Before,
        a proxy that answered every upload with UNAVAILABLE made the node keep every
        paused upload's ciphertexts until its deadline: about 30 MiB each at M = 2,000
        (found by review). Only an upload whose share is on disk is dropped."""
        held = [
            query_id
            for query_id in self._paused
            if (upload := self._prepared.get(query_id)) is not None and upload.share is None
        ]
        for query_id in held[: max(0, len(held) - PAUSED_UPLOADS_IN_MEMORY)]:
            logger.info(
                "query %s: upload paused; its ciphertexts are dropped from memory (more "
                "than %d uploads paused) and encrypted again from its kept share when the "
                "proxy delivers the task again",
                query_id,
                PAUSED_UPLOADS_IN_MEMORY,
            )
            self._drop_upload(query_id)

    def _drop_upload(self, query_id: str) -> None:
        upload = self._prepared.pop(query_id, None)
        if upload is not None:
            upload.stop()

    def _expire(self, query_id: str) -> TaskOutcome:
        """The task came after its upload deadline: end it, refunded if nothing left."""
        self._drop_upload(query_id)  # one prepared in this process stops encrypting
        if self._known(query_id):
            # A task never seen before leaves no row: a proxy replaying old signed
            # queries under fresh ids with past deadlines grew the ledger without end.
            # Final: a reservation left by a crash or a paused upload whose header was
            # never accepted is refunded now or never (the analyst is refunded too), in
            # the transaction that writes the outcome (BudgetLedger.end_task).
            self.ledger.end_task(query_id, TaskOutcome.EXPIRED, "deadline passed")
            self._forget_share(query_id)
        return TaskOutcome.EXPIRED

    def _end_refused(self, task: Task, upload: OutgoingUpload, err: grpc.RpcError) -> TaskOutcome:
        """The proxy refused the upload for good (a status no retry gets past): end it.

        A refusal because the query no longer takes the upload
        (:func:`~fedpca.owner.upload_call.query_closed`, told by the status and the
        proxy's metadata) is none of this owner's doing: INFO, CANCELLED. Past the
        task's upload deadline this owner may itself have been too late: a WARNING,
        EXPIRED. Any other refusal (the upload invalid, or not allowed) is an ERROR,
        REJECTED. The refund rule is the same for the three.
        """
        query_id, upload_id = task.key, upload.upload_id
        refusal = f"{status_name(err)}: {status_details(err)}"
        if not query_closed(err):
            logger.error("query %s: the proxy refused upload %s: %s", query_id, upload_id, refusal)
            outcome, detail = TaskOutcome.REJECTED, refusal
        elif task.upload_deadline <= datetime.now(UTC):
            logger.warning(
                "query %s: upload %s was not taken: it came after the query's upload deadline (%s)",
                query_id,
                upload_id,
                refusal,
            )
            outcome, detail = TaskOutcome.EXPIRED, f"deadline passed: {refusal}"
        else:
            logger.info(
                "query %s: the query ended or closed to this owner before upload %s was "
                "taken, through nothing this owner did (%s)",
                query_id,
                upload_id,
                refusal,
            )
            outcome, detail = TaskOutcome.CANCELLED, f"query closed: {refusal}"
        self._drop_upload(query_id)
        # Refunded if no header of this upload was ever accepted, in this process or
        # before a restart (the ledger knows): only headers left, so no result holds
        # anything of the share. The proxy's word alone is not enough: it could fold
        # every chunk, let the analyst read the result, and still say "not released".
        refunded = self.ledger.end_task(
            query_id, outcome, detail, refund=not upload.chunk_handed_out, upload_id=upload_id
        )
        self.shares.discard(upload_id)
        if not refunded and share_unreleased(err):
            logger.info(
                "query %s: the proxy says no result holds this share; a header of it was "
                "accepted (chunks may have left), so it stays charged",
                query_id,
            )
        return outcome

    def _abandon(self, query_id: str, upload_id: str, why: str) -> TaskOutcome:
        """Give up an upload that began and cannot go on; the release stays charged."""
        logger.error("query %s: upload %s abandoned: %s", query_id, upload_id, why)
        self.ledger.record_task(query_id, TaskOutcome.ABANDONED, why, upload_id=upload_id)
        self.shares.discard(upload_id)
        return TaskOutcome.ABANDONED

    def end_withdrawn_upload(self, query_id: str, reason: str) -> None:
        """The proxy withdrew a task whose upload this node has in flight but no longer
        runs (its query ended while the node was away): end it and delete its share."""
        with self._endings:  # the task stream's thread, beside the worker's sweep
            self._end_withdrawn_upload(query_id, reason)

    def _end_withdrawn_upload(self, query_id: str, reason: str) -> None:
        record = self.ledger.task(query_id)
        if record is None or record.outcome is TaskOutcome.RESERVED:
            # A task that failed after its reservation, before any upload began: the
            # withdrawal ends it, refunded (the ledger refunds only if nothing started).
            # An id the ledger does not know costs a read, no write.
            self._drop_upload(query_id)  # one prepared whose share could not be kept
            if self.ledger.has_reservation(query_id):
                self.ledger.end_task(query_id, TaskOutcome.CANCELLED, f"withdrawn: {reason}")
            return
        if record.outcome is not TaskOutcome.UPLOADING:
            return
        logger.info("query %s: the upload in flight was withdrawn (%s)", query_id, reason)
        self._finish_cancelled(query_id)

    def _forget_share(self, query_id: str) -> None:
        """Delete the kept share of a task that ended without its upload completing."""
        record = self.ledger.task(query_id)
        if record is not None and record.upload_id is not None:
            self.shares.discard(record.upload_id)

    def _known(self, query_id: str) -> bool:
        """The ledger holds a record or a reservation of the task."""
        return self.ledger.task(query_id) is not None or self.ledger.has_reservation(query_id)

    def _finish_cancelled(self, query_id: str) -> TaskOutcome:
        self._drop_upload(query_id)
        if self._known(query_id):  # a task cancelled before it began leaves no row
            # Refunded only if no upload of the task had begun (the ledger checks).
            self.ledger.end_task(query_id, TaskOutcome.CANCELLED, "cancelled by the proxy")
            self._forget_share(query_id)
        logger.info("query %s: cancelled by the proxy", query_id)
        return TaskOutcome.CANCELLED
