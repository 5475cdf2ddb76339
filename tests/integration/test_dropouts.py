"""Owners that never answer, too few owners by the deadline, and an owner back too late.

Real processes over mutual TLS (:class:`fedpca.app.cluster.LocalCluster`): the real
``fedpca proxy serve`` and ``fedpca owner serve``, three owners configured, the
analyst in this process. The proxy's SQLite file is read after the fact to check
what it recorded.

* An owner that never answers (configured, never started) does not hold up a query
  whose quorum the others meet: it closes as soon as they have uploaded, and the
  result records the owners that contributed. Started late, that owner is not
  offered the closed query (it is offered the next one), and a late upload that
  does reach the proxy is refused with FAILED_PRECONDITION, logged on both sides,
  without touching the stored result.
* With one owner killed (kill -9) before the query, a quorum of all three cannot be
  met: at the deadline the query fails and the analyst gets a FedpcaError naming the
  deadline and the count, even across a graceful proxy restart in the meantime.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.analyst.estimators import FederatedPCA
from fedpca.analyst.keys import load_analyst_signing_key
from fedpca.analyst.querying import MissingOwnersWarning
from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.codec import CryptoPool
from fedpca.errors import FedpcaError
from fedpca.owner.config import load_config as load_owner_config
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from fedpca.proxy.coordinator import task_id
from fedpca.transport.certs import TlsMaterial
from fedpca.transport.channels import secure_channel
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import dataset_table, signed_task

pytestmark = pytest.mark.slow

N_OWNERS = 3
WAIT = 120.0
ANALYST = "analyst"
"""The cluster's analyst: the proxy stores its query q under the task id analyst/q."""


def _cluster(tmp_path: Path) -> LocalCluster:
    table = dataset_table("ionosphere")
    labels, rows = table[:, :1], table[:, 1:]
    table = np.column_stack([labels, rows / np.linalg.norm(rows, axis=1).max()])
    parts = split_rows(len(table), N_OWNERS, seed=1)
    return LocalCluster(
        workdir=tmp_path / "work", owner_tables=[table[p] for p in parts], processes_per_node=1
    )


def _pca(
    cluster: LocalCluster, quorum: int, deadline: float, wait_for_owners: bool = False
) -> FederatedPCA:
    return FederatedPCA(
        n_components=2,
        epsilon=1.0,
        delta=1e-5,
        quorum=quorum,
        deadline_seconds=deadline,
        wait_for_owners=wait_for_owners,
        **cluster.analyst_connection(),
    )


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT:.0f} s waiting for {what}")
        time.sleep(0.05)


class Store:
    """Read-only view of the proxy's SQLite file."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.path = cluster.workdir / "state" / "proxy.sqlite3"

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        connection = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30.0)
        try:
            return [tuple(row) for row in connection.execute(sql, args).fetchall()]
        finally:
            connection.close()

    def query(self, query_id: str) -> dict[str, Any]:
        ((state, n_contributed, reason, deadline_at, updated_at),) = self.rows(
            "SELECT state, n_contributed, failure_reason, deadline_at, updated_at "
            "FROM queries WHERE query_id=?",
            query_id,
        )
        return {
            "state": state,
            "n_contributed": n_contributed,
            "failure_reason": reason,
            "deadline_at": deadline_at,
            "updated_at": updated_at,
        }

    def uploaders(self, query_id: str) -> list[str]:
        return [
            owner
            for (owner,) in self.rows(
                "SELECT owner_id FROM uploads WHERE query_id=? ORDER BY owner_id", query_id
            )
        ]

    def result_digest(self, query_id: str) -> str:
        """One hash over everything stored for the query's result and its uploads."""
        digest = hashlib.sha256()
        for sql in (
            "SELECT page, data FROM result_pages WHERE query_id=? ORDER BY page",
            "SELECT meta FROM result_meta WHERE query_id=?",
            "SELECT state, n_contributed, failure_reason, updated_at FROM queries WHERE query_id=?",
            "SELECT owner_id, upload_id, content_sha256, accepted_at FROM uploads "
            "WHERE query_id=? ORDER BY owner_id",
            "SELECT page, n_folded, data FROM aggregate_pages WHERE query_id=? ORDER BY page",
            "SELECT owner_id, upload_id, covered, joined_at FROM contributors "
            "WHERE query_id=? ORDER BY owner_id",
            "SELECT owner_id, start_index, data FROM staged_chunks WHERE query_id=? "
            "ORDER BY owner_id, start_index",
        ):
            digest.update(repr(self.rows(sql, query_id)).encode())
        return digest.hexdigest()


def test_owner_that_never_answers_does_not_block_and_a_late_owner_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _cluster(tmp_path) as cluster:
        cluster.prepare()
        cluster.start_proxy()
        present = cluster.owner_ids[:2]
        late_id = cluster.owner_ids[2]  # has its config and certificate, never started
        cluster.start_owners(owner_ids=present)
        store = Store(cluster)

        # (a) quorum 2 of 3: the silent owner does not hold the query up.
        # The analyst is warned that the result covers 2 of the 3 registered owners.
        with pytest.warns(MissingOwnersWarning, match="only 2 of 3 registered owners"):
            model = _pca(cluster, quorum=2, deadline=WAIT).fit(n_features=34)
        key = task_id(ANALYST, model.query_id_)
        record = store.query(key)
        uploaders = store.uploaders(key)
        assert uploaders == present
        assert model.n_owners_ == len(uploaders) == record["n_contributed"] == 2
        assert record["state"] == "done"
        # Finished when the quorum had uploaded, not at the deadline.
        assert record["updated_at"] < record["deadline_at"]
        stored = store.result_digest(key)

        # (c1) The owner starts after the query finished: the closed query is not
        # offered to it, the next one is (the task stream sends open tasks in order).
        (late,) = cluster.start_owners(owner_ids=[late_id])
        next_model = _pca(cluster, quorum=N_OWNERS, deadline=WAIT).fit(n_features=34)
        assert next_model.n_owners_ == N_OWNERS
        late_log = late.log_text()
        assert f"query {task_id(ANALYST, next_model.query_id_)}: task received" in late_log
        assert model.query_id_ not in late_log
        late.stop()
        cluster.owners.remove(late)
        assert store.result_digest(key) == stored

        # (c2) A late upload that does reach the proxy (the owner's node is handed the
        # old task, as if it had received it before going away) is refused with
        # FAILED_PRECONDITION and the proxy's query-closed marker; the node logs it at
        # INFO (none of its doing) and records the task cancelled; the stored result
        # does not change.
        caplog.set_level(logging.INFO, logger="fedpca.owner")
        config = load_owner_config(cluster.owner_config(late_id))
        spec = model.release_.query
        # As the proxy delivered it: the analyst's signature, the task id.
        task = signed_task(
            spec,
            datetime.fromtimestamp(record["deadline_at"], UTC),
            ANALYST,
            load_analyst_signing_key(cluster.key_dir),
        )
        assert task.key == key
        with CryptoPool(1) as pool:
            node = OwnerNode(config, pool=pool)
            channel = secure_channel(config.owner.proxy, TlsMaterial.load(config.tls.files()))
            try:
                outcome = node.process_task(owner_grpc.OwnerServiceStub(channel), task)
            finally:
                channel.close()
        assert outcome is TaskOutcome.CANCELLED
        refusal = f"query {key!r} is done: uploads are no longer accepted"
        owner_records = [r for r in caplog.records if "was taken" in r.getMessage()]
        assert len(owner_records) == 1 and owner_records[0].levelno == logging.INFO
        owner_lines = [r.getMessage() for r in owner_records]
        assert "FAILED_PRECONDITION" in owner_lines[0] and refusal in owner_lines[0]
        assert not [
            r
            for r in caplog.records
            if r.name.startswith("fedpca.owner") and r.levelno >= logging.ERROR
        ]
        ledger = owner_ledger(config)
        ledger_record = ledger.task(key)
        assert ledger_record is not None and ledger_record.outcome is TaskOutcome.CANCELLED
        # The refused share is in no result: the owner's reservation was refunded.
        assert key not in [entry.event.query_id for entry in ledger.events()]
        assert cluster.proxy is not None
        proxy_log = cluster.proxy.log_text()
        assert re.search(
            r"Upload refused \(FAILED_PRECONDITION\): .*" + re.escape(refusal), proxy_log
        )

        assert store.result_digest(key) == stored
        assert store.uploaders(key) == present
        print(f"\nlate owner refused: {owner_lines[0]}")


def test_fewer_than_quorum_by_the_deadline_fails_with_the_reason(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        cluster.prepare()
        cluster.start()
        store = Store(cluster)
        # One owner dies (kill -9) after enrolling, before the query: 2 of 3 remain.
        dead = cluster.owners.pop()
        dead.kill()
        dead.stop()
        deadline = 20.0  # room for two owners' uploads under load; the test waits it out
        failure: list[BaseException] = []

        def analyst() -> None:
            try:
                # Submitted although an owner is gone (else refused, nothing submitted).
                _pca(cluster, quorum=N_OWNERS, deadline=deadline, wait_for_owners=True).fit(
                    n_features=34
                )
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=analyst, daemon=True)
        thread.start()
        _wait_until(lambda: len(store.rows("SELECT 1 FROM uploads")) == 2, "the two uploads")
        # While the query waits for its third owner, the proxy is restarted gracefully
        # (SIGTERM): the analyst keeps following it and the deadline still applies.
        assert cluster.proxy is not None
        cluster.proxy.stop()
        cluster.start_proxy()
        thread.join(WAIT)
        assert not thread.is_alive(), "the analyst did not see the query end"
        assert len(failure) == 1 and isinstance(failure[0], FedpcaError), failure
        message = str(failure[0])
        assert "deadline passed with 2 of 3 required owners uploading" in message, message
        print(f"\nanalyst sees: {type(failure[0]).__name__}: {message}")

        ((query_id,),) = store.rows("SELECT query_id FROM queries")
        assert query_id.startswith(f"{ANALYST}/")  # the task id
        record = store.query(query_id)
        assert record["state"] == "failed"
        assert record["failure_reason"] == "deadline passed with 2 of 3 required owners uploading"
        assert record["n_contributed"] == 2
        assert store.uploaders(query_id) == cluster.owner_ids[:2]
        assert store.rows("SELECT COUNT(*) FROM result_pages WHERE query_id=?", query_id) == [(0,)]
        # Two owners uploaded (and spent their budgets): the analyst is charged although
        # the query failed (no refund once an upload began).
        assert store.rows("SELECT COUNT(*) FROM releases WHERE query_id=?", query_id) == [(1,)]
        assert store.rows("SELECT uploads_begun FROM queries WHERE query_id=?", query_id) == [(1,)]
