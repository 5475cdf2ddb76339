"""Red-team findings (second pass) on uploads in flight and their resume
(fedpca.owner.task_processing, fedpca.proxy.owner_tasks).

They fail on the code they were written against (98d67ee); REDTEAM2.md describes each
finding and a fix. Nothing here is marked xfail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fedpca.codec import CryptoPool, generate_keypair, unpack_slots
from fedpca.errors import FedpcaError
from fedpca.messages import Task
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.owner.node import OwnerNode
from fedpca.owner.share_snapshots import ShareSnapshots
from fedpca.protocol import ReleasePlan
from fedpca.transport import serde
from helpers import signed_task
from inprocess import (
    ONE_ATTEMPT,
    StubUpload,
    accepting_upload,
    standalone_owner_config,
    unit_box_queries,
    unreachable_proxy,
)

_spec = unit_box_queries(3)


class _RecordingProxy:
    """A malicious proxy's end of the owner's calls: keeps every upload it is sent."""

    def __init__(self) -> None:
        self.uploads: list[tuple[Any, list[int]]] = []
        self.declines: list[Any] = []
        self.Upload = StubUpload(self._upload)

    def _upload(self, messages: Iterator[Any], timeout: float | None = None) -> Any:
        header, payload, receipt = accepting_upload(messages)
        self.uploads.append((header, list(payload.in_wire_order())))
        return receipt

    def DeclineTask(self, request: Any, timeout: float | None = None) -> Any:
        decline = serde.task_decline_from_proto(request)
        self.declines.append(decline)
        return serde.decline_receipt_to_proto(decline.query_id)


def test_a_resumed_upload_is_not_encrypted_under_a_key_the_proxy_substituted(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """operations.md, malicious proxy, *cannot*: "invent a task or alter a query, its
    quorum and Paillier modulus included (owners verify the analyst's Ed25519 signature
    over the whole query; the modulus is also checked against the pinned fingerprint)".

    A task whose upload is in flight (recorded UPLOADING, share kept) is resumed by
    ``TaskProcessing._prepare`` without any of those checks: the re-delivered task's
    query is used as it comes (its modulus encrypts the kept share), and neither its
    signature, nor the pinned fingerprint, nor the spec digest reserved in the ledger
    is looked at. Since 6fc5950 the node even tells the proxy, at every stream open,
    which task keys are in flight, and expects the proxy to send those tasks again.

    The proxy stalls owner 1's upload (here: unreachable on its only attempt) until the
    node restarts, then answers the reported key with the same task whose query carries
    the proxy's own modulus (same size, so the kept share fits the plan) under the
    pinned fingerprint and the analyst's original signature. The node encrypts its
    exact, unnoised share under the proxy's key and uploads it: the proxy decrypts the
    owner's exact scatter, sums and record count.
    """
    public_key, _ = test_only_keypair_512
    attacker_public, attacker_private = generate_keypair(512, allow_insecure_test_key=True)
    config = standalone_owner_config(tmp_path, public_key)
    spec = _spec(public_key, "q1", quorum=1)
    due = datetime.now(UTC) + timedelta(seconds=60)
    task = signed_task(spec, due, "alice")
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())

    first = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
    assert first.process_task(unreachable_proxy(), task) is None  # began; the proxy stalled it
    record = owner_ledger(config).task(task.key)
    assert record is not None and record.outcome is TaskOutcome.UPLOADING
    assert record.upload_id is not None
    kept = ShareSnapshots(config.owner.state_dir / "shares").load(record.upload_id, plan)
    assert kept is not None
    exact = [int(v) for block in plan.owner_blocks for v in kept.values[block.name]]
    assert any(exact)

    # After the restart the proxy answers the in-flight key with an altered query: its
    # own modulus under the pinned fingerprint, the analyst's signature of the original.
    forged_spec = replace(spec, analyst_public_key_n=attacker_public.n)
    forged = Task(
        forged_spec,
        due,
        query_signature=task.query_signature,
        query_signer=task.query_signer,
        task_id=task.task_id,
    )
    proxy = _RecordingProxy()
    restarted = OwnerNode(config, pool=pool, retry=ONE_ATTEMPT)
    with contextlib.suppress(FedpcaError):  # refusing the altered task is a correct answer
        restarted.process_task(proxy, forged)  # type: ignore[arg-type]

    leaked: list[int] = []
    for _header, ciphertexts in proxy.uploads:
        start = 0
        for block in plan.owner_blocks:
            count = block.layout.n_ciphertexts
            plaintexts = pool.decrypt(attacker_private, ciphertexts[start : start + count])
            leaked.extend(unpack_slots(plaintexts, block.layout, attacker_public.n))
            start += count
    assert not proxy.uploads, (
        "the owner resumed its upload under a query the analyst did not sign, encrypted "
        f"under the proxy's modulus; the proxy decrypted {len(leaked)} values, equal to the "
        f"owner's exact unnoised share: {leaked == exact}"
    )
