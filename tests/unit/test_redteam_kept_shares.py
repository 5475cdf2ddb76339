"""Red-team findings on resumed uploads and the shares kept for them
(fedpca.owner.share_snapshots, fedpca.owner.task_processing).

They fail on the code they were written against; REDTEAM.md describes each finding
and a fix.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from fedpca.codec import CryptoPool
from fedpca.errors import FedpcaError
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from fedpca.owner.share_snapshots import ShareSnapshots
from fedpca.protocol import ReleasePlan
from helpers import signed_task
from inprocess import (
    ONE_ATTEMPT,
    deployment,
    labelled,
    standalone_owner_config,
    unit_box_queries,
    unreachable_proxy,
)

M = 3
_spec = unit_box_queries(M)


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.9, 0.9, size=(n, M))


def test_the_kept_share_of_an_upload_whose_query_ended_is_deleted(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """share_snapshots: a kept share is "deleted as soon as the upload ends (accepted,
    refused, cancelled), and a node's start deletes any left by an upload that no longer
    runs" (operations.md: "deleted when the upload ends and at start for uploads that no
    longer run").

    Owner 1 begins its upload (the share is kept on disk, the task recorded as
    UPLOADING) and goes down before anything reached the proxy. While it is down, the
    query gets its quorum from owner 2 and is done. Owner 1 restarts and reconnects to
    the real proxy: the proxy offers only COLLECTING queries and withdraws only tasks it
    delivered on the current stream, so the node never hears of the query again; the
    task stays UPLOADING and start-up pruning keeps its share. The owner's exact,
    unnoised statistics (its scatter, sums and count) stay on disk for good, and the
    release stays charged for a share that is in no result.
    """
    public_key, _ = test_only_keypair_512
    tables = {"owner-1": labelled(_rows(1, 20)), "owner-2": labelled(_rows(2, 20))}
    spec = _spec(public_key, "ended", quorum=1, deadline_seconds=60.0)
    with deployment(
        workdir=tmp_path,
        tables=tables,
        pool=pool,
        public_key=public_key,
        capacity=100,
        running=("owner-2",),
    ) as running:
        config = running.write_owner_config("owner-1")
        due = datetime.now(UTC) + timedelta(seconds=60)
        task = signed_task(spec, due, "alice")  # as the proxy names it: alice/ended
        crashed = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
        assert crashed.process_task(unreachable_proxy(), task) is None
        record = owner_ledger(config).task(task.key)
        assert record is not None and record.outcome is TaskOutcome.UPLOADING
        assert record.upload_id is not None
        kept = config.owner.state_dir / "shares" / f"{record.upload_id}.npz"
        assert kept.is_file()

        # Owner 1 is down; the query ends without it.
        outcome = running.run(spec)
        assert outcome.state == "done" and outcome.owners_contributed == 1

        # Owner 1 restarts and stays connected for several heartbeats (1 s each).
        restarted = running.start_owner(config)  # stopped with the deployment
        assert restarted.connected.wait(30.0)
        deadline = time.monotonic() + 5.0
        while kept.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        final = owner_ledger(config).task(task.key)
        assert not kept.exists(), (
            f"the share of upload {record.upload_id}, whose query is done, is still on "
            f"disk; the task is recorded as {final.outcome.value if final else None}"
        )


def _share_values(snapshots: ShareSnapshots, upload_id: str, plan: ReleasePlan) -> list[int]:
    kept = snapshots.load(upload_id, plan)
    assert kept is not None
    return [int(v) for block in plan.owner_blocks for v in kept.values[block.name]]


def test_a_lost_kept_share_is_not_replaced_by_one_of_the_changed_data_file(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """privacy.md: "A resumed upload sends the encoded share it began with ... so one
    contribution is always a function of one table. Only an upload begun by a version
    that kept no share is encoded again." The ledger does not record whether a share
    was kept, so a resume that finds no kept share (a ledger restored from a backup
    taken without state_dir/shares, which operations.md allows: "back it up with the
    ledger or not at all"; a share removed with the rest of a folder that looks like a
    cache) encodes the share again from the data file as it is now. An upload begun by
    this version, whose first chunks may already be folded at the proxy, then goes on
    under the same upload id with the values of another table.
    """
    public_key, _ = test_only_keypair_512
    config = standalone_owner_config(tmp_path, public_key)
    spec = _spec(public_key, "q1", quorum=1)
    due = datetime.now(UTC) + timedelta(seconds=60)
    task = signed_task(spec, due, "alice")
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    snapshots = ShareSnapshots(config.owner.state_dir / "shares")

    first = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
    assert first.process_task(unreachable_proxy(), task) is None  # began, then the node died
    record = owner_ledger(config).task(task.key)
    assert record is not None and record.outcome is TaskOutcome.UPLOADING
    assert record.upload_id is not None
    began_with = _share_values(snapshots, record.upload_id, plan)

    # The nightly export replaces the data file; the kept share is lost (restore).
    changed = np.loadtxt(config.data.path, delimiter=",")
    changed[:, 1:] *= 0.5
    np.savetxt(config.data.path, changed, delimiter=",", fmt="%.17g")
    snapshots.discard(record.upload_id)

    restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
    with contextlib.suppress(FedpcaError):  # refusing to resume is a correct answer
        restarted.process_task(unreachable_proxy(), task)
    # What the restarted node is sending under the upload id (it keeps it on disk before
    # the first chunk may leave): nothing, or the share the upload began with.
    again = snapshots.load(record.upload_id, plan)
    if again is not None:
        resent = _share_values(snapshots, record.upload_id, plan)
        assert resent == began_with, (
            f"upload {record.upload_id} began with one table's share and resumed with "
            "another's (encoded again from the changed data file)"
        )
