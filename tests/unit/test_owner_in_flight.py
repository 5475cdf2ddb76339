"""Uploads left in flight by an owner that went away, as the real proxy answers them:
resumed when the query still takes them, withdrawn (and their kept share deleted) when
it does not (fedpca.proxy.owner_tasks.OwnerTasks.in_flight_answers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.codec import CryptoPool
from fedpca.messages import QueryState
from fedpca.owner import node as node_module
from fedpca.owner import task_processing
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import BudgetLedger, owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from fedpca.query import QuerySpec
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import TEST_SIGNING_KEY, signed_task, wait_until
from inprocess import FAST_RETRY, StubUpload, deployment, labelled, unit_box_queries

M = 12
_spec = unit_box_queries(M)


class _StreamThatBreaks:
    """Forwards an upload's header and first chunk, then stalls until the call's deadline
    (a network that went away): the owner sees DEADLINE_EXCEEDED, the proxy has folded
    the first chunk and keeps the owner as a contributor."""

    def __init__(self, real: owner_grpc.OwnerServiceStub, folded: threading.Event) -> None:
        self.real = real
        self.folded = folded
        self.Upload = StubUpload(self._upload)

    def _upload(self, messages: Iterator[Any], timeout: float | None = None) -> Any:
        def first_chunk_only() -> Iterator[Any]:
            for index, message in enumerate(messages):
                if index == 2:
                    self.folded.wait(20.0)
                    time.sleep(10.0)  # past the deadline below
                    return
                yield message

        # Room for the header and the first chunk to arrive on a loaded machine.
        return self.real.Upload(first_chunk_only(), timeout=8.0)


@contextmanager
def _owner_2_uploaded(
    tmp_path: Path, pool: CryptoPool, public_key: Any, tables: dict[str, Any], spec: QuerySpec
) -> Iterator[tuple[Any, Any, OwnerConfig]]:
    """A deployment running owner-2 only, ``spec`` submitted by alice and owner-2's
    upload accepted: the deployment, alice's client and owner-1's configuration (its node
    not started)."""
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=("owner-2",)
    ) as running:
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            key = f"alice/{spec.query_id}"
            wait_until(lambda: len(store.uploads(key)) == 1, "owner-2's upload")
            yield running, client, running.write_owner_config("owner-1")


def test_a_contributor_that_restarts_after_the_contributors_are_fixed_resumes(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found while fixing withdrawn uploads: the proxy offered tasks of collecting
    queries only, so a contributor restarted after the contributors were fixed never
    got its task again and the query waited for it until its deadline, then failed.
    Now the restarted node reports its upload in flight and the proxy delivers the task
    again: the upload resumes after the chunks already folded and the query completes."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(4)
    tables = {
        name: labelled(rng.uniform(-0.3, 0.3, size=(40, M))) for name in ("owner-1", "owner-2")
    }
    spec = _spec(public_key, "fixed", quorum=2, deadline_seconds=120.0)
    key = "alice/fixed"
    with _owner_2_uploaded(tmp_path, pool, public_key, tables, spec) as (running, client, config):
        store = running.proxy.coordinator.store
        # Owner 1 joins (which fixes the contributors) and its stream breaks after
        # the first chunk: its node then dies.
        # Chunks of 7 ciphertexts (before and after the restart): several per upload.
        monkeypatch.setattr(node_module, "UPLOAD_CHUNK_BYTES", 1024)
        first = OwnerNode(config, pool=pool, retry=replace(FAST_RETRY, upload_attempts=1))
        folded = threading.Event()
        broken = _StreamThatBreaks(owner_grpc.OwnerServiceStub(first._open_channel()), folded)

        def first_chunk_folded() -> bool:
            mine = [c for c in store.contributors(key) if c.owner_id == "owner-1"]
            return bool(mine) and mine[0].covered > 0

        watcher = threading.Thread(
            target=lambda: (wait_until(first_chunk_folded, "chunk 0"), folded.set()),
            daemon=True,
        )
        watcher.start()
        due = datetime.now(UTC) + timedelta(seconds=120)
        assert first.process_task(broken, signed_task(spec, due, "alice")) is None
        assert store.query(key).state is QueryState.AGGREGATING
        record = owner_ledger(config).task(key)
        assert record is not None and record.outcome is TaskOutcome.UPLOADING

        # The restarted node reports the upload in flight; the proxy sends the task.
        running.start_owner(config)  # a restart; stopped with the deployment
        status = client.wait(spec.query_id, timeout=60.0)
        assert status.state is QueryState.DONE and status.owners_contributed == 2
        # The proxy is done once the last chunk is folded; the receipt comes just after.
        final = wait_until(
            lambda: (lambda r: r if r and r.outcome is TaskOutcome.UPLOADED else None)(
                owner_ledger(config).task(key)
            ),
            "owner-1 records its upload as accepted",
        )
        assert final.upload_id == record.upload_id
        assert not list((config.owner.state_dir / "shares").iterdir())


def test_the_proxy_withdraws_what_cannot_go_on_and_says_nothing_more(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """An owner may name any task id as in flight: for a query that ended without it
    and for one the proxy never had, the answer is the same withdrawal with one reason
    (no state, failure reason or other owners' declines); an owner whose upload was
    accepted gets the task again (and then records the receipt); an owner off the
    allow-list gets nothing."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(5)
    tables = {name: labelled(rng.uniform(-0.3, 0.3, size=(20, M))) for name in ("o-1", "o-2")}
    spec = _spec(public_key, "over", quorum=1)
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=("o-2",)
    ) as running:
        assert running.run(spec).state == "done"
        assert running.proxy is not None
        coordinator = running.proxy.coordinator
        answers = coordinator.in_flight_answers("o-1", ["alice/over", "alice/never"])
        assert [type(a).__name__ for a in answers] == ["TaskCancellation"] * 2
        assert len({getattr(a, "reason", None) for a in answers}) == 1
        # The query is DONE once its last chunk is folded; the upload's completion is
        # recorded just after.
        wait_until(
            lambda: any(u.owner_id == "o-2" for u in coordinator.store.uploads("alice/over")),
            "o-2's upload recorded as accepted",
        )
        (again,) = coordinator.in_flight_answers("o-2", ["alice/over"])
        assert type(again).__name__ == "Task" and again.key == "alice/over"
        assert coordinator.in_flight_answers("stranger", ["alice/over"]) == []


class _Killed(BaseException):
    """Stands for the node's process dying at the point it is raised."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # _Killed
def test_an_owner_killed_after_its_upload_was_accepted_ends_it_uploaded_on_restart(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the proxy accepted the upload, the node died before recording
    it; restarted, it resumed from its kept share, encrypted again (fresh randomness),
    and the proxy refused the confirmation for its other ciphertexts: the task ended
    REJECTED with an ERROR for a normal recovery. The proxy now answers it DUPLICATE."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(3)
    tables = {n: labelled(rng.uniform(-0.3, 0.3, size=(30, M))) for n in ("owner-1", "owner-2")}
    spec = unit_box_queries(M)(public_key, "accepted", quorum=2, deadline_seconds=120.0)
    task_key = "alice/accepted"
    real_record_task = BudgetLedger.record_task
    killed = threading.Event()

    def killed_before_recording_it(
        self: BudgetLedger, query_id: str, outcome: Any, *args: Any, **kwargs: Any
    ) -> None:
        if outcome is TaskOutcome.UPLOADED and "owner-1" in str(self.path) and not killed.is_set():
            killed.set()
            raise _Killed
        real_record_task(self, query_id, outcome, *args, **kwargs)

    monkeypatch.setattr(BudgetLedger, "record_task", killed_before_recording_it)
    with deployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key, running=("owner-1",)
    ) as running:
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        with running.analyst() as client:
            client.submit(spec, TEST_SIGNING_KEY)
            wait_until(killed.is_set, "owner-1's upload accepted, the node killed")
            assert [u.owner_id for u in store.uploads(task_key)] == ["owner-1"]
            config = running.nodes["owner-1"].config
            record = owner_ledger(config).task(task_key)
            assert record is not None and record.outcome is TaskOutcome.UPLOADING
            running.stop_owner("owner-1")
            running.start_owner(config)  # the same state folder
            wait_until(
                lambda: owner_ledger(config).task(task_key).outcome is not TaskOutcome.UPLOADING,  # type: ignore[union-attr]
                "the restarted node ends the task",
            )
            record = owner_ledger(config).task(task_key)
            assert record is not None
            assert record.outcome is TaskOutcome.UPLOADED, record.detail  # was: REJECTED
            assert [u.owner_id for u in store.uploads(task_key)] == ["owner-1"]  # kept once


def test_a_node_stopped_while_it_encrypts_pauses_its_upload_and_resumes_it(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an operator's review: a node stopped (SIGTERM: a restart, an upgrade)
    while it encrypted ended its upload's messages, so the stream closed cleanly after
    the header; the proxy refused it as short of its chunks, the node recorded the task
    as rejected, and the query, its contributors fixed, waited for it until its
    deadline and failed, charged. Now stopping cancels the call: the task stays open
    and the restarted node's upload completes the query."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(6)
    tables = {
        name: labelled(rng.uniform(-0.3, 0.3, size=(40, M))) for name in ("owner-1", "owner-2")
    }
    spec = _spec(public_key, "stopped", quorum=2, deadline_seconds=120.0)
    key = "alice/stopped"
    real_stream = task_processing.encrypt_share_stream
    encrypting, go_on = threading.Event(), threading.Event()

    def held_before_the_first_batch(*args: Any, **kwargs: Any) -> Iterator[list[int]]:
        encrypting.set()
        go_on.wait(30.0)
        yield from real_stream(*args, **kwargs)

    with _owner_2_uploaded(tmp_path, pool, public_key, tables, spec) as (running, client, config):
        store = running.proxy.coordinator.store
        first = OwnerNode(config, pool=pool, retry=FAST_RETRY)
        monkeypatch.setattr(task_processing, "encrypt_share_stream", held_before_the_first_batch)
        stub = owner_grpc.OwnerServiceStub(first._open_channel())
        due = datetime.now(UTC) + timedelta(seconds=120)
        outcome: list[Any] = []
        worker = threading.Thread(
            target=lambda: outcome.append(
                first.process_task(stub, signed_task(spec, due, "alice"))
            ),
            daemon=True,
        )
        worker.start()
        assert encrypting.wait(30.0)
        # The proxy has the header (owner-1 is a contributor); no chunk exists yet.
        wait_until(
            lambda: any(c.owner_id == "owner-1" for c in store.contributors(key)),
            "owner-1's upload header",
        )
        first.stop()
        worker.join(30.0)
        go_on.set()
        assert outcome == [None]
        record = owner_ledger(config).task(key)
        assert record is not None and record.outcome is TaskOutcome.UPLOADING
        assert store.query(key).state is QueryState.AGGREGATING

        monkeypatch.setattr(task_processing, "encrypt_share_stream", real_stream)
        running.start_owner(config)  # the restart; stopped with the deployment
        status = client.wait(spec.query_id, timeout=60.0)
        assert status.state is QueryState.DONE and status.owners_contributed == 2
