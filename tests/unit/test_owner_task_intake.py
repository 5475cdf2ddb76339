"""What an owner queues when a task arrives (fedpca.owner.task_intake): a malicious
proxy once filled an owner's memory with queued unsigned tasks (1.5 GB for 40) and its
ledger with a row per declined one (10,000 rows in 30 s)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from fedpca.messages import DeclineReason, Task
from fedpca.owner.policy_config import PolicyConfig
from fedpca.owner.task_intake import RefusedTask, TaskIntake
from fedpca.query import spec_digest
from fedpca.signing import CLOCK_ALLOWANCE_SECONDS, generate_signing_key, sign_query
from helpers import TEST_SIGNER, TEST_SIGNING_KEY, query_builder, signed_task

_spec = query_builder(n_features=3, n_components=1, epsilon=0.5, delta=1e-6)
DUE = datetime.now(UTC) + timedelta(minutes=5)  # within what the queries below sign


@pytest.fixture
def intake(test_only_keypair_512: tuple[Any, Any]) -> tuple[TaskIntake, dict[str, str], Any]:
    public_key, _ = test_only_keypair_512
    reserved: dict[str, str] = {}  # digest -> task id, as the ledger would answer
    policy = PolicyConfig((), 1.0, False, accepted_query_signers=(TEST_SIGNER,))
    return TaskIntake(policy, reserved.get, max_waiting=3, remembered=2), reserved, public_key


def test_unsigned_tasks_are_kept_only_as_their_id_and_reason(intake: Any) -> None:
    gate, _, public_key = intake
    spec = _spec(public_key, "q1")
    unsigned = gate.admit(Task(spec, DUE, task_id="alice/q1"), waiting=0)
    assert isinstance(unsigned, RefusedTask)
    assert unsigned.key == "alice/q1" and "not signed" in unsigned.detail
    assert unsigned.reason is DeclineReason.UNSIGNED_QUERY
    # A signer of the proxy's making is quoted cut, not whole (logs, decline detail).
    huge = gate.admit(replace(signed_task(spec, DUE), query_signer="x" * 3_000_000), 0)
    assert isinstance(huge, RefusedTask) and len(huge.detail) <= 300
    stranger = signed_task(spec, DUE, key=generate_signing_key())
    foreign = gate.admit(stranger, waiting=0)
    assert isinstance(foreign, RefusedTask) and stranger.query_signer in foreign.detail
    altered = gate.admit(replace(signed_task(spec, DUE), query=_spec(public_key, "q2")), 0)
    assert isinstance(altered, RefusedTask)


def test_no_more_than_the_bound_wait_and_drops_are_logged_sparingly(
    intake: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gate, _, public_key = intake
    task = signed_task(_spec(public_key, "q1"), DUE)
    with caplog.at_level(logging.WARNING, logger="fedpca.owner.task_intake"):
        for _ in range(9):
            assert gate.admit(task, waiting=3) is None
    assert gate.dropped == 9
    assert len(caplog.records) == 4  # drops 1, 2, 4 and 8
    assert gate.admit(task, waiting=2) is task


def _is_replay(admitted: Any) -> bool:
    return (
        isinstance(admitted, RefusedTask)
        and admitted.reason is DeclineReason.POLICY_REFUSAL
        and "same signed query" in admitted.detail
    )


def test_one_signed_query_is_answered_under_one_task_id(intake: Any) -> None:
    gate, reserved, public_key = intake
    first = signed_task(_spec(public_key, "q1"), DUE, analyst="alice")
    replayed = replace(first, task_id="alice/replayed")
    assert gate.admit(first, waiting=0) is first
    assert _is_replay(gate.admit(replayed, waiting=1))  # while the first one waits
    gate.done(first)
    assert gate.admit(replayed, waiting=0) is replayed  # nothing known about it yet
    gate.done(replayed)
    gate.answered(first)  # declined, say
    assert _is_replay(gate.admit(replayed, waiting=0))
    assert gate.admit(first, waiting=0) is first  # its own re-delivery still passes
    gate.done(first)
    # Reserved queries are found in the ledger, whatever the memory holds.
    other = signed_task(_spec(public_key, "q2"), DUE)
    reserved[spec_digest(other.query)] = "alice/q2"
    assert _is_replay(gate.admit(replace(other, task_id="alice/again"), waiting=0))
    assert gate.admit(other, waiting=0) is other


def test_the_memory_of_answered_queries_is_bounded(intake: Any) -> None:
    gate, _, public_key = intake
    tasks = [signed_task(_spec(public_key, f"q{i}"), DUE) for i in range(3)]
    for task in tasks:
        gate.answered(task)
    oldest = replace(tasks[0], task_id="alice/late")
    assert gate.admit(oldest, waiting=0) is oldest  # forgotten (remembered=2)
    assert _is_replay(gate.admit(replace(tasks[2], task_id="alice/late2"), waiting=0))


def test_a_task_is_answered_only_within_the_deadline_its_analyst_signed(intake: Any) -> None:
    """Found by review: owners checked only the deadline the proxy states, so a proxy
    could keep signed queries (cancelled or refunded ones included) and deliver them to
    owners at any later time, with any deadline. The query now carries the time its
    analyst signed it, and its deadline_seconds bound the answer (plus 5 minutes for
    clocks)."""
    gate, _, public_key = intake
    now = time.time()
    allowance = timedelta(seconds=CLOCK_ALLOWANCE_SECONDS)
    # A proxy stating a later deadline than the signed one: held to the signed one.
    fresh = _spec(public_key, "fresh", issued_at=now, deadline_seconds=60.0)
    far = datetime(9999, 1, 1, tzinfo=UTC)
    admitted = gate.admit(signed_task(fresh, far), waiting=0)
    assert isinstance(admitted, Task)
    signed_deadline = datetime.fromtimestamp(now, UTC) + timedelta(seconds=60) + allowance
    assert admitted.upload_deadline == signed_deadline
    # Kept and delivered after its signed deadline: its deadline is the signed one, in
    # the past, so the worker ends it as too late (no ledger row for a task never seen:
    # test_owner_node.py) rather than answering it.
    issued = now - 60.0 - CLOCK_ALLOWANCE_SECONDS - 1
    old = _spec(public_key, "old", issued_at=issued, deadline_seconds=60.0)
    stale = gate.admit(signed_task(old, far), waiting=0)
    assert isinstance(stale, Task)
    assert stale.upload_deadline < datetime.now(UTC)
    assert stale.upload_deadline == (
        datetime.fromtimestamp(issued, UTC) + timedelta(seconds=60) + allowance
    )
    # Signed in the owner's future beyond the allowance: the analyst's clock is wrong.
    future = _spec(public_key, "future", issued_at=now + CLOCK_ALLOWANCE_SECONDS + 60.0)
    refused = gate.admit(signed_task(future, far), waiting=0)
    assert (
        isinstance(refused, RefusedTask) and "in the future of this node's clock" in refused.detail
    )
    # A query without a signing time (an analyst before wire protocol 5) is not answered.
    unstamped = _spec(public_key, "unstamped", issued_at=None)
    signature = sign_query(unstamped, TEST_SIGNING_KEY)
    task = Task(
        unstamped, DUE, query_signature=signature, query_signer=TEST_SIGNER, task_id="alice/x"
    )
    refused = gate.admit(task, waiting=0)
    assert isinstance(refused, RefusedTask) and "no signing time" in refused.detail
