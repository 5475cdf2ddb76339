"""A node killed after reserving a task's budget, before its upload began, ends the task
refunded when it restarts and the proxy withdraws it.

Found by review with real processes (``kill -9`` of ``fedpca owner serve`` right after
the reservation committed, the analyst then cancelling): the proxy refunded the analyst
(no upload had begun) but the owner's ledger kept the charge for ever. The reservation
had no task row, so the restarted node did not name it when its task stream opened and
the proxy's withdrawal never reached it. Now the reservation writes a RESERVED row in its
own transaction and the node names such tasks with its uploads in flight.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.messages import QueryState
from fedpca.owner.ledger import BudgetLedger, owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from helpers import TEST_SIGNING_KEY, signed_task, wait_until
from inprocess import FAST_RETRY, deployment, labelled, unit_box_queries

M = 5


def test_a_reservation_left_by_a_crash_is_refunded_when_its_query_is_withdrawn(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    tables = {"owner-1": labelled(np.random.default_rng(2).uniform(-0.3, 0.3, size=(20, M)))}
    spec = unit_box_queries(M)(public_key, "crashed", quorum=1, deadline_seconds=120.0)
    key = "alice/crashed"
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=()
    ) as running:
        assert running.proxy is not None
        config = running.write_owner_config("owner-1")
        ledger = owner_ledger(config)
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            # The node reserves the task's budget, as it does before encrypting, and
            # dies there: nothing else of the task is done or recorded.
            first = OwnerNode(config, pool=pool, retry=FAST_RETRY)
            due = datetime.now(UTC) + timedelta(seconds=120)
            accepted = first._accept(None, signed_task(spec, due, "alice"))  # type: ignore[arg-type]
            assert isinstance(accepted, tuple)
            assert ledger.has_reservation(key)
            # The query ends while the node is down, before any upload began: the
            # analyst is refunded.
            receipt = client.cancel(spec.query_id)
            assert receipt.refunded and receipt.status.state is QueryState.FAILED
            assert client.budget().n_releases == 0
            # The node restarts: the withdrawal ends the task, refunded here too.
            running.start_owner(config)  # a restart; stopped with the deployment
            wait_until(lambda: not ledger.has_reservation(key), "the owner's refund", 30.0)
        record = ledger.task(key)
        assert record is not None and record.outcome is TaskOutcome.CANCELLED, record
        assert ledger.events() == []


def test_an_upload_recorded_but_never_accepted_is_refunded_when_withdrawn(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """The same crash one step later (review): killed after recording the upload as
    begun, before the proxy accepted its header. The analyst was refunded but the owner
    stayed charged, since the upload counted as started before anything but the header
    could leave. It now counts as started only once the proxy accepted the header."""
    public_key, _ = test_only_keypair_512
    tables = {"owner-1": labelled(np.random.default_rng(4).uniform(-0.3, 0.3, size=(20, M)))}
    spec = unit_box_queries(M)(public_key, "header", quorum=1, deadline_seconds=120.0)
    key = "alice/header"
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=()
    ) as running:
        config = running.write_owner_config("owner-1")
        ledger = owner_ledger(config)
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            first = OwnerNode(config, pool=pool, retry=FAST_RETRY)
            due = datetime.now(UTC) + timedelta(seconds=120)
            assert isinstance(first._accept(None, signed_task(spec, due, "alice")), tuple)  # type: ignore[arg-type]
            # What _upload records before its first call, and then the node dies.
            ledger.record_task(key, TaskOutcome.UPLOADING, upload_id="u-header")
            receipt = client.cancel(spec.query_id)
            assert receipt.refunded and client.budget().n_releases == 0
            running.start_owner(config)  # a restart; stopped with the deployment
            wait_until(lambda: not ledger.has_reservation(key), "the owner's refund", 30.0)
        record = ledger.task(key)
        assert record is not None and record.outcome is TaskOutcome.CANCELLED, record
        assert ledger.events() == []


def test_a_refund_before_any_upload_leaves_no_reserved_row(tmp_path: Path) -> None:
    """A reservation refunded (nothing left the node) leaves the task unknown again, as
    before RESERVED rows existed; an upload records over the RESERVED row."""
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    budget = PrivacyParams(10.0, 1e-5)
    for query_id in ("a/1", "a/2"):
        event = PrivacyEvent(query_id, "a", 2.0, 1.0, 1e-6)
        ledger.reserve(event, budget, spec_digest=f"digest-{query_id}")
    record = ledger.task("a/1")
    assert record is not None and record.outcome is TaskOutcome.RESERVED
    assert not record.outcome.final and not record.upload_started
    assert set(ledger.unfinished_tasks()) == {"a/1", "a/2"}
    assert ledger.cancel_reservation("a/1")
    assert ledger.task("a/1") is None
    ledger.record_task("a/2", TaskOutcome.UPLOADING, upload_id="u2")
    record = ledger.task("a/2")
    assert record is not None and record.outcome is TaskOutcome.UPLOADING
    assert not record.upload_started  # chunks may leave only once the header is accepted
    assert ledger.unfinished_tasks() == ["a/2"]
    ledger.mark_upload_started("a/2")
    assert not ledger.cancel_reservation("a/2")  # chunks may have left: stays charged


def test_a_reservation_left_by_a_crash_does_not_count_against_its_own_task(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """The same crash while the query still collects: the task comes again and resumes.
    Found with it: the task-rate cap counted the task's own reservation, so under
    ``max_tasks_per_day = 1`` the re-delivered task was declined ("reached its limit")
    and the query failed while the owner stayed charged for it."""
    public_key, _ = test_only_keypair_512
    tables = {"owner-1": labelled(np.random.default_rng(3).uniform(-0.3, 0.3, size=(20, M)))}
    spec = unit_box_queries(M)(public_key, "again", quorum=1, deadline_seconds=120.0)
    key = "alice/again"
    with deployment(
        workdir=tmp_path,
        tables=tables,
        pool=pool,
        public_key=public_key,
        running=(),
        policy={"max_tasks_per_day": 1},
    ) as running:
        config = running.write_owner_config("owner-1")
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            first = OwnerNode(config, pool=pool, retry=FAST_RETRY)
            due = datetime.now(UTC) + timedelta(seconds=120)
            assert isinstance(first._accept(None, signed_task(spec, due, "alice")), tuple)  # type: ignore[arg-type]
            running.start_owner(config)  # a restart; stopped with the deployment
            status = client.wait(spec.query_id, timeout=60.0)
        assert (status.state, status.owners_contributed) == (QueryState.DONE, 1), status
        ledger = owner_ledger(config)
        wait_until(
            lambda: (
                (record := ledger.task(key)) is not None and record.outcome is TaskOutcome.UPLOADED
            ),
            "the owner's upload recorded as uploaded",
        )
        assert [entry.event.query_id for entry in ledger.events()] == [key]
