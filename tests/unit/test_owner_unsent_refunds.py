"""A reservation of which nothing left the node is refunded whichever way its task ends.

Found by review of the refund rules: an upload paused before the proxy ever accepted its
header (proxy unreachable) and resumed after a restart is recorded ``upload_started = 0``,
yet a refusal of its header, its task expiring, or a decline of a re-delivered reserved
task ended it charged for ever, while the proxy (no upload begun) refunded the analyst:
the analyst paid less than the owner spent. And a header accepted after the
reservation was refunded (a withdrawal handled meanwhile) let chunks leave uncharged.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.messages import UPLOAD_ACCEPTED_METADATA, QueryState, Task
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import BudgetLedger, owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from fedpca.owner.upload_call import HeaderAcknowledgement
from fedpca.query import spec_digest
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import TEST_SIGNING_KEY, signed_task
from inprocess import ONE_ATTEMPT, deployment, labelled, unit_box_queries, unreachable_proxy

M = 5


@contextmanager
def _owner_paused(
    tmp_path: Path, pool: CryptoPool, public_key: Any, name: str, *, reserve_only: bool = False
) -> Iterator[tuple[OwnerConfig, Task, Any]]:
    """A query of one owner whose upload paused before any header was accepted (the
    proxy unreachable), or with ``reserve_only`` whose node died after its reservation.
    Yields the owner's config, its task and the analyst's client."""
    tables = {"owner-1": labelled(np.random.default_rng(7).uniform(-0.3, 0.3, size=(20, M)))}
    spec = unit_box_queries(M)(public_key, name, quorum=1, deadline_seconds=120.0)
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=()
    ) as running:
        config = running.write_owner_config("owner-1")
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            task = signed_task(spec, datetime.now(UTC) + timedelta(seconds=120), "alice")
            first = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
            if reserve_only:
                assert isinstance(first._accept(None, task), tuple)  # type: ignore[arg-type]
            else:
                assert first.process_task(unreachable_proxy(), task) is None
                record = owner_ledger(config).task(task.key)
                assert record is not None and record.outcome is TaskOutcome.UPLOADING
                assert not record.upload_started
            first.stop()
            yield config, task, client


def _process_at_the_proxy(config: OwnerConfig, pool: CryptoPool, task: Task) -> Any:
    """What a restarted node on ``config`` does with ``task`` delivered again."""
    restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
    channel = restarted._open_channel()
    try:
        return restarted.process_task(owner_grpc.OwnerServiceStub(channel), task)
    finally:
        channel.close()
        restarted.stop()


def test_a_resumed_upload_refused_at_its_header_is_refunded(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    with _owner_paused(tmp_path, pool, public_key, "resumed") as (config, task, client):
        # The restarted node got the task again while the query collected; the query
        # fails before its worker uploads: no upload began, the analyst is refunded.
        receipt = client.cancel(task.query.query_id)
        assert receipt.refunded and receipt.status.state is QueryState.FAILED
        # Refused because the query no longer takes it (the proxy marks that): the
        # task ends cancelled, not rejected (an ERROR for the analyst's own cancel).
        assert _process_at_the_proxy(config, pool, task) is TaskOutcome.CANCELLED
        assert client.budget().n_releases == 0
        assert not owner_ledger(config).has_reservation(task.key)  # was: charged for ever


def test_an_expired_task_of_which_nothing_left_is_refunded(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    for name, reserve_only in (("expired-upload", False), ("expired-reserved", True)):
        folder = tmp_path / name
        with _owner_paused(folder, pool, public_key, name, reserve_only=reserve_only) as (
            config,
            task,
            client,
        ):
            # The worker reaches the re-delivered task after its deadline (a backlog, a
            # clock ahead of the proxy's); the query failed at it with no upload begun.
            assert client.cancel(task.query.query_id).refunded
            restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
            late = replace(task, upload_deadline=datetime.now(UTC) - timedelta(seconds=1))
            assert restarted.process_task(unreachable_proxy(), late) is TaskOutcome.EXPIRED
            restarted.stop()
            ledger = owner_ledger(config)
            assert not ledger.has_reservation(task.key), name  # was: charged for ever
            record = ledger.task(task.key)
            assert record is not None and record.outcome is TaskOutcome.EXPIRED


def test_a_reserved_task_declined_when_it_comes_again_is_refunded(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Killed after its reservation and restarted under a stricter policy, the node
    declines the task delivered again: the decline is final, nothing left the node."""
    public_key, _ = test_only_keypair_512
    with _owner_paused(tmp_path, pool, public_key, "stricter", reserve_only=True) as (
        config,
        task,
        _client,
    ):
        stricter = replace(config, policy=replace(config.policy, max_epsilon_per_query=0.5))
        assert _process_at_the_proxy(stricter, pool, task) is TaskOutcome.DECLINED
        ledger = owner_ledger(config)
        assert not ledger.has_reservation(task.key)  # was: charged for ever
        assert ledger.answered_under(spec_digest(task.query)) == task.key  # replays known


def test_no_chunk_leaves_once_the_reservation_was_refunded(tmp_path: Path) -> None:
    """The mark that lets chunks leave is refused when the reservation is gone (refunded
    by a withdrawal handled meanwhile, or by another process on the same state folder):
    chunks never leave uncharged."""
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    event = PrivacyEvent("a/1", "a", 2.0, 1.0, 1e-6)
    ledger.reserve(event, PrivacyParams(10.0, 1e-5), spec_digest="d1")
    ledger.record_task("a/1", TaskOutcome.UPLOADING, upload_id="u1")
    assert ledger.cancel_reservation("a/1")  # a withdrawal, before the header was accepted
    assert not ledger.mark_upload_started("a/1")
    record = ledger.task("a/1")
    assert record is not None and not record.upload_started
    ledger.reserve(replace(event, query_id="a/2"), PrivacyParams(10.0, 1e-5), spec_digest="d2")
    ledger.record_task("a/2", TaskOutcome.UPLOADING, upload_id="u2")
    assert ledger.mark_upload_started("a/2")
    assert not ledger.cancel_reservation("a/2")


def test_an_accepted_header_sends_no_chunk_when_the_mark_is_refused() -> None:
    """The header acknowledgement hands out no chunk when the ledger refuses the mark."""

    class Accepted:
        def initial_metadata(self) -> tuple[tuple[str, str], ...]:
            return ((UPLOAD_ACCEPTED_METADATA, "yes"),)

    refused = HeaderAcknowledgement(lambda: False)
    refused.watch(Accepted())
    assert not refused.wait()
    agreed = HeaderAcknowledgement(lambda: True)
    agreed.watch(Accepted())
    assert agreed.wait()


def test_a_ledger_that_cannot_mark_the_header_pauses_the_upload(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A locked ledger when the header is accepted: no chunk leaves, and the task stays
    open (it resumes on a re-delivery) instead of ending rejected for good."""
    public_key, _ = test_only_keypair_512
    tables = {"owner-1": labelled(np.random.default_rng(8).uniform(-0.3, 0.3, size=(20, M)))}
    spec = unit_box_queries(M)(public_key, "locked", quorum=1, deadline_seconds=120.0)
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=()
    ) as running:
        config = running.write_owner_config("owner-1")
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            task = signed_task(spec, datetime.now(UTC) + timedelta(seconds=120), "alice")

            def locked(self: BudgetLedger, query_id: str) -> bool:
                raise sqlite3.OperationalError("database is locked")

            with monkeypatch.context() as patch:
                patch.setattr(BudgetLedger, "mark_upload_started", locked)
                assert _process_at_the_proxy(config, pool, task) is None
            record = owner_ledger(config).task(task.key)
            assert record is not None and record.outcome is TaskOutcome.UPLOADING
            assert not record.upload_started
            # The ledger works again: the task delivered again resumes and completes.
            assert _process_at_the_proxy(config, pool, task) is TaskOutcome.UPLOADED
            assert client.wait(spec.query_id, timeout=60.0).state is QueryState.DONE


@contextmanager
def _final_writes_failing(config: OwnerConfig, final: TaskOutcome) -> Iterator[None]:
    """The ledger's write of ``final`` to a task row fails (a trigger aborts it), as a
    full disk or a node killed inside the transaction would leave it."""
    with sqlite3.connect(config.ledger_path) as connection:
        connection.execute(
            f"CREATE TRIGGER no_final BEFORE UPDATE ON tasks WHEN NEW.state = '{final.value}' "
            "BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    try:
        yield
    finally:
        with sqlite3.connect(config.ledger_path) as connection:
            connection.execute("DROP TRIGGER no_final")


@pytest.mark.parametrize("ending", ["expired", "declined"])
def test_a_task_ends_refunded_and_final_or_neither(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any], ending: str
) -> None:
    """Found by review: the final outcome and the refund were two transactions, so a
    crash between them left a task final and still charged (never looked at again) or
    refunded with no outcome. They are now one (BudgetLedger.end_task): when writing
    the outcome fails, the reservation is still there and the task still open, and the
    task delivered again (or withdrawn, after the decline reached the proxy) ends,
    refunded."""
    public_key, _ = test_only_keypair_512
    final = TaskOutcome.EXPIRED if ending == "expired" else TaskOutcome.DECLINED
    with _owner_paused(tmp_path, pool, public_key, ending, reserve_only=True) as (
        config,
        task,
        client,
    ):
        if ending == "expired":
            assert client.cancel(task.query.query_id).refunded
            task = replace(task, upload_deadline=datetime.now(UTC) - timedelta(seconds=1))
        else:
            config = replace(config, policy=replace(config.policy, max_epsilon_per_query=0.5))
        ledger = owner_ledger(config)

        def end_it() -> Any:
            if ending == "declined":
                return _process_at_the_proxy(config, pool, task)
            restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
            try:
                return restarted.process_task(unreachable_proxy(), task)
            finally:
                restarted.stop()

        with _final_writes_failing(config, final), pytest.raises(sqlite3.IntegrityError):
            end_it()
        assert ledger.has_reservation(task.key)  # was: refunded, and no outcome written
        assert not ledger.is_handled(task.key)
        if ending == "expired":  # delivered again
            assert end_it() is final
        else:  # the decline reached the proxy, which failed the query and withdraws it
            restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
            restarted.end_withdrawn_upload(task.key, "query failed")
            restarted.stop()
        record = ledger.task(task.key)
        assert record is not None and record.outcome.final
        assert not ledger.has_reservation(task.key)


def test_a_task_refunded_as_it_ended_before_a_restart_ends_when_it_comes_again(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Found by review of the refund-first order: a node that refunded an upload which
    never started and died before writing how it ended left it UPLOADING without a
    reservation; the task delivered again was refused as "not the query this owner's
    upload began for", and stayed open with its kept share. It now ends, cancelled."""
    public_key, _ = test_only_keypair_512
    with _owner_paused(tmp_path, pool, public_key, "refunded") as (config, task, _client):
        ledger = owner_ledger(config)
        record = ledger.task(task.key)
        assert record is not None and record.upload_id is not None
        assert ledger.cancel_reservation(task.key)  # the refund, then the node died
        shares = config.owner.state_dir / "shares"
        assert any(shares.iterdir())
        assert _process_at_the_proxy(config, pool, task) is TaskOutcome.CANCELLED
        ended = ledger.task(task.key)
        assert ended is not None and ended.outcome is TaskOutcome.CANCELLED
        assert not ledger.has_reservation(task.key)
        assert not any(shares.iterdir())
