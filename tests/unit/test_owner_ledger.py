"""The owner's SQLite budget ledger: fits/refuses, idempotence, concurrency, durability."""

from __future__ import annotations

import logging
import math
import multiprocessing
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Barrier as BarrierType
from pathlib import Path
from typing import Any

import pytest

from fedpca.dp.accounting import Accountant, compose_epsilon
from fedpca.dp.calibration import calibrate_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import (
    BudgetExceededError,
    CalibrationError,
    CompositionError,
    ConfigError,
    PolicyError,
)
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.query import Neighbouring

DELTA = 1e-5
# One release at epsilon 0.7 fits a budget of 1.0; a second one composes to more (zCDP).
BUDGET = PrivacyParams(1.0, DELTA)
Z = calibrate_noise_multiplier(0.7, DELTA)


def _event(query_id: str, z: float = Z, epsilon: float = 0.7) -> PrivacyEvent:
    return PrivacyEvent(query_id, "sha256:analyst", z, epsilon, DELTA if z else 0.0)


def _not_private(query_id: str) -> PrivacyEvent:
    return PrivacyEvent(query_id, "sha256:analyst", 0.0, math.inf, 0.0)


def test_fits_then_refuses_and_records_nothing_on_refusal(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    decision = ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    assert decision.epsilon_spent_before == 0.0
    assert decision.epsilon_spent_after == pytest.approx(0.7, abs=1e-6)
    assert not decision.already_reserved
    with pytest.raises(BudgetExceededError, match=r"'q2'.*over the budget epsilon=1"):
        ledger.reserve(_event("q2"), BUDGET, spec_digest="d2")
    assert [e.event.query_id for e in ledger.events()] == ["q1"]
    assert ledger.spent(DELTA) == pytest.approx(0.7, abs=1e-6)
    # A weaker release still fits beside the first one.
    weak = calibrate_noise_multiplier(0.1, DELTA)
    ledger.reserve(_event("q3", weak, 0.1), BUDGET, spec_digest="d3")
    assert 0.7 < ledger.spent(DELTA) <= 1.0


def test_a_refusal_prints_two_different_values_differently(tmp_path: Path) -> None:
    # A budget a hair below what two releases compose to: 6 significant digits printed
    # the epsilon it would reach and the budget alike.
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    ledger.reserve(_event("q1"), PrivacyParams(math.inf, DELTA), spec_digest="d1")
    after = compose_epsilon([Z, Z], DELTA)
    budget = PrivacyParams(after * (1 - 1e-8), DELTA)
    with pytest.raises(BudgetExceededError) as refused:
        ledger.reserve(_event("q2"), budget, spec_digest="d2")
    shown = re.search(
        r"from (\S+) to (\S+) at delta=1e-05, over the budget epsilon=(\S+)$", str(refused.value)
    )
    assert shown is not None, str(refused.value)
    assert float(shown[2]) > float(shown[3]) > float(shown[1])


def test_huge_epsilon_is_refused_by_the_accountant_and_records_nothing(tmp_path: Path) -> None:
    # epsilon = 1e6 (z ~ 7e-4) made dp_accounting's PLD accountant run out of memory:
    # the continuous-PLD option refuses it by name; zCDP (closed form) refuses it as
    # over a finite budget.
    pld = BudgetLedger(tmp_path / "pld.sqlite3", accountant=Accountant.PLD_CONTINUOUS)
    huge = calibrate_noise_multiplier(1e6, DELTA, "analytic")
    for budget in (BUDGET, PrivacyParams(math.inf, DELTA)):
        with pytest.raises(CalibrationError, match=r"'q-huge'.*epsilon=1e\+06.*minimum 0\.1"):
            pld.reserve(_event("q-huge", huge, 1e6), budget, spec_digest="d")
    assert pld.events() == []
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    with pytest.raises(BudgetExceededError, match="q-huge"):
        ledger.reserve(_event("q-huge", huge, 1e6), BUDGET, spec_digest="d")
    assert ledger.events() == []
    ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    assert [e.event.query_id for e in ledger.events()] == ["q1"]


def test_re_reserving_the_same_query_is_idempotent(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    again = ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    assert again.already_reserved
    assert again.epsilon_spent_after == pytest.approx(0.7, abs=1e-6)
    assert len(ledger.events()) == 1
    assert ledger.spent(DELTA) == pytest.approx(0.7, abs=1e-6)


def test_the_digest_a_query_was_reserved_for_is_read_by_its_id(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    z = calibrate_noise_multiplier(0.3, DELTA)
    ledger.reserve(_event("q1", z, 0.3), BUDGET, spec_digest="d1")
    ledger.reserve(_event("q2", z, 0.3), BUDGET, spec_digest="d2")
    assert ledger.reserved_digest("q1") == "d1"
    assert ledger.reserved_digest("q2") == "d2"
    assert ledger.reserved_digest("q3") is None


def test_release_outcomes_are_the_task_states_of_recorded_releases(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = BudgetLedger(path)
    z = calibrate_noise_multiplier(0.2, DELTA)
    for query_id in ("q1", "q2", "q3"):
        ledger.reserve(_event(query_id, z, 0.2), BUDGET, spec_digest=query_id)
    ledger.record_task("q2", TaskOutcome.UPLOADED)
    ledger.record_task("declined", TaskOutcome.DECLINED)  # a task without a release
    with sqlite3.connect(path) as raw:  # a release recorded before tasks were kept
        raw.execute("DELETE FROM tasks WHERE query_id = 'q3'")
    assert ledger.release_outcomes() == {"q1": TaskOutcome.RESERVED, "q2": TaskOutcome.UPLOADED}


def test_same_query_id_with_other_parameters_is_refused(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    with pytest.raises(PolicyError, match="different parameters"):
        ledger.reserve(_event("q1"), BUDGET, spec_digest="other")
    with pytest.raises(PolicyError, match="different parameters"):
        ledger.reserve(_event("q1", Z * 2, 0.35), BUDGET, spec_digest="d1")
    # The same signed query planned by a later version, whose z differs in its last
    # bits (rounded down by 2^-50), is the same release: reserved already, not refused.
    again = ledger.reserve(_event("q1", Z * (1 - 2**-50)), BUDGET, spec_digest="d1")
    assert again.already_reserved


def test_the_same_query_under_another_id_is_refused(tmp_path: Path) -> None:
    """Task ids are the proxy's, not signed: a proxy replaying one signed query under new
    task ids must not spend the owner's budget again (issue 15, point 5)."""
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    ledger.reserve(_event("alice/q1"), BUDGET, spec_digest="d1")
    for replay in ("mallory/q1", "alice/renamed"):
        with pytest.raises(PolicyError, match="same signed query as task 'alice/q1'"):
            ledger.reserve(_event(replay, Z * 2, 0.35), BUDGET, spec_digest="d1")
    assert [e.event.query_id for e in ledger.events()] == ["alice/q1"]
    # Released (refunded) reservations leave nothing to compare with.
    ledger.cancel_reservation("alice/q1")
    ledger.reserve(_event("mallory/q1", Z * 2, 0.35), BUDGET, spec_digest="d1")
    # Ledgers of fedpca 0.1 recorded no digest: an empty one matches nothing.
    ledger.reserve(_event("old-1", Z * 2, 0.35), BUDGET, spec_digest="")
    ledger.reserve(_event("old-2", Z * 2, 0.35), BUDGET, spec_digest="")


def test_ledger_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ledger.sqlite3"
    BudgetLedger(path).reserve(_event("q1"), BUDGET, spec_digest="d1")
    BudgetLedger(path).record_task("q1", TaskOutcome.UPLOADED, "accepted", upload_id="u1")
    reopened = BudgetLedger(path)
    assert [e.event.query_id for e in reopened.events()] == ["q1"]
    assert reopened.events()[0].event.noise_multiplier == Z
    with pytest.raises(BudgetExceededError):
        reopened.reserve(_event("q2"), BUDGET, spec_digest="d2")
    record = reopened.task("q1")
    assert record is not None and record.outcome is TaskOutcome.UPLOADED
    assert record.upload_id == "u1" and record.upload_started
    assert reopened.is_handled("q1") and not reopened.is_handled("q2")
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_not_private_needs_permission_and_exhausts_a_finite_budget(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    with pytest.raises(PolicyError, match="NOT PRIVATE"):
        ledger.reserve(_not_private("v1"), BUDGET, spec_digest="v")
    assert ledger.events() == []
    budget = PrivacyParams(3.0, DELTA)
    decision = ledger.reserve(_not_private("v1"), budget, spec_digest="v", allow_not_private=True)
    assert decision.not_private
    assert decision.epsilon_spent_after == math.inf
    (entry,) = ledger.events()
    assert entry.not_private and math.isinf(entry.event.epsilon)
    # The release composes to an infinite epsilon: every later private release is
    # refused (fedpca 0.1 left it out and a 0.83-epsilon release still fit a 3.0 budget).
    assert ledger.spent(DELTA) == math.inf
    with pytest.raises(BudgetExceededError, match="'q1'"):
        ledger.reserve(_event("q1", calibrate_noise_multiplier(0.83, DELTA), 0.83), budget)
    again = ledger.reserve(_not_private("v1"), budget, spec_digest="v", allow_not_private=True)
    assert again.already_reserved and again.not_private


def test_a_recorded_release_below_the_pld_floor_is_never_described_to_an_asker(
    tmp_path: Path,
) -> None:
    """Found by review: a release recorded under zcdp with z below the PLD floor, read
    by the same ledger under pld-continuous, raised a CalibrationError naming its z
    from the NOT PRIVATE path, which an owner sends back with the decline. Every path
    that composes recorded releases raises CompositionError, kept in the owner's log."""
    path = tmp_path / "ledger.sqlite3"
    wide = PrivacyParams(500.0, DELTA)
    BudgetLedger(path).reserve(_event("bob", 0.05, 60.0), wide, spec_digest="bob")
    pld = BudgetLedger(path, accountant=Accountant.PLD_CONTINUOUS)
    asks = (
        lambda: pld.reserve(_not_private("v1"), wide, spec_digest="v", allow_not_private=True),
        lambda: pld.reserve(_event("q2", 5.0, 1.0), wide, spec_digest="q2"),
    )
    for ask in asks:
        with pytest.raises(CompositionError, match=r"z=0\.05"):
            ask()


def test_a_release_under_another_relation_is_refused(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3", neighbouring=Neighbouring.REPLACE_ONE)
    with pytest.raises(PolicyError, match=r"add-remove adjacency.*replace-one"):
        ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    replace_one = PrivacyEvent(
        "q2", "sha256:analyst", Z, 0.7, DELTA, neighbouring=Neighbouring.REPLACE_ONE
    )
    ledger.reserve(replace_one, BUDGET, spec_digest="d2")
    (entry,) = ledger.events()
    assert entry.event.neighbouring is Neighbouring.REPLACE_ONE


def test_a_schema_1_ledger_is_migrated_conservatively(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(
            """
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '1');
            CREATE TABLE releases (query_id TEXT PRIMARY KEY, analyst TEXT NOT NULL,
                noise_multiplier REAL NOT NULL, epsilon REAL NOT NULL, delta REAL NOT NULL,
                recorded_at REAL NOT NULL, not_private INTEGER NOT NULL, spec_digest TEXT NOT NULL);
            CREATE TABLE tasks (query_id TEXT PRIMARY KEY, state TEXT NOT NULL,
                detail TEXT NOT NULL, upload_id TEXT, upload_started INTEGER NOT NULL DEFAULT 0,
                updated_at REAL NOT NULL);
            """
        )
        old.execute("INSERT INTO releases VALUES ('old', 'a', 4.0, 1.0, 1e-5, 1.0, 0, 'd')")
    ledger = BudgetLedger(path, neighbouring=Neighbouring.REPLACE_ONE)
    (entry,) = ledger.events()
    assert entry.event.noise_multiplier == 2.0  # halved: valid under either relation
    assert entry.event.neighbouring is Neighbouring.REPLACE_ONE
    assert (
        BudgetLedger(path, neighbouring=Neighbouring.REPLACE_ONE).events()[0].event == entry.event
    )


def test_a_schema_3_ledger_keeps_its_uploads_and_learns_capacities(tmp_path: Path) -> None:
    # A ledger written before tasks recorded their capacity: an upload in flight keeps
    # its id and seed (a resume falls back to the configured capacity), and new uploads
    # record theirs.
    path = tmp_path / "v3.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(
            """
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '3');
            CREATE TABLE releases (query_id TEXT PRIMARY KEY, analyst TEXT NOT NULL,
                noise_multiplier REAL NOT NULL, epsilon REAL NOT NULL, delta REAL NOT NULL,
                recorded_at REAL NOT NULL, not_private INTEGER NOT NULL, spec_digest TEXT NOT NULL,
                neighbouring TEXT NOT NULL DEFAULT 'add-remove',
                sensitivity REAL NOT NULL DEFAULT 1.0, delta_extra REAL NOT NULL DEFAULT 0.0);
            CREATE TABLE tasks (query_id TEXT PRIMARY KEY, state TEXT NOT NULL,
                detail TEXT NOT NULL, upload_id TEXT, upload_started INTEGER NOT NULL DEFAULT 0,
                updated_at REAL NOT NULL, seed BLOB);
            """
        )
        old.execute(
            "INSERT INTO tasks VALUES ('q1', 'uploading', '', 'u1', 1, 1.0, ?)", (b"s" * 32,)
        )
    ledger = BudgetLedger(path)
    record = ledger.task("q1")
    assert record is not None and record.outcome is TaskOutcome.UPLOADING
    assert record.upload_id == "u1" and record.seed == b"s" * 32 and record.capacity is None
    ledger.record_task("q2", TaskOutcome.UPLOADING, upload_id="u2", seed=b"t" * 32, capacity=40)
    # A later outcome keeps what the upload began with.
    ledger.record_task("q2", TaskOutcome.UPLOADED)
    again = BudgetLedger(path).task("q2")
    assert again is not None and again.capacity == 40 and again.seed == b"t" * 32
    with sqlite3.connect(path) as check:
        version = check.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert version == ("7",)


def test_a_declined_query_replayed_under_another_id_is_known_across_restarts(
    tmp_path: Path,
) -> None:
    """Schema 5: a decline keeps its signed query's digest, so a proxy replaying it under
    fresh task ids is recognised after any number of others and after a restart (a
    bounded memory of digests let >4,096 of them grow the ledger a row per cycle)."""
    path = tmp_path / "ledger.sqlite3"
    ledger = BudgetLedger(path)
    ledger.record_task("alice/q1", TaskOutcome.DECLINED, "policy_refusal: x", spec_digest="d1")
    assert BudgetLedger(path).answered_under("d1") == "alice/q1"
    assert BudgetLedger(path).answered_under("d2") is None
    # A schema-4 ledger gains the column and keeps its rows.
    old = tmp_path / "old.sqlite3"
    with sqlite3.connect(old) as conn:
        conn.executescript(
            """
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '4');
            CREATE TABLE tasks (query_id TEXT PRIMARY KEY, state TEXT NOT NULL,
                detail TEXT NOT NULL, upload_id TEXT, upload_started INTEGER NOT NULL
                DEFAULT 0, updated_at REAL NOT NULL, seed BLOB, capacity INTEGER);
            INSERT INTO tasks VALUES ('alice/q0', 'declined', 'x', NULL, 0, 1.0, NULL, NULL);
            """
        )
    migrated = BudgetLedger(old)
    assert migrated.is_handled("alice/q0") and migrated.answered_under("d1") is None
    migrated.record_task("alice/q9", TaskOutcome.DECLINED, "y", spec_digest="d9")
    assert migrated.answered_under("d9") == "alice/q9"


def test_the_daily_cap_counts_refunded_tasks_and_forgets_old_ones(tmp_path: Path) -> None:
    """Schema 7: a task's start outlives its refund (the cap bounds the computing as well
    as the releases), counted against its own analyst only (review, stop 42: against
    every analyst, one analyst's cancelled queries locked the others out for free);
    starts older than the cap's window and a day are dropped."""
    path = tmp_path / "ledger.sqlite3"
    ledger = BudgetLedger(path)
    budget = PrivacyParams(10.0, 1e-5)
    now = time.time()
    old = PrivacyEvent("a/old", "a", 2.0, 1.0, 1e-6, timestamp=now - 3 * 86400)
    ledger.reserve(old, budget, spec_digest="d-old")
    ledger.reserve(PrivacyEvent("a/1", "a", 2.0, 1.0, 1e-6), budget, spec_digest="d1")
    assert ledger.cancel_reservation("a/1")
    assert [entry.event.query_id for entry in ledger.events()] == ["a/old"]
    day_ago = now - 86400
    assert ledger.tasks_started_since(day_ago, asking="a") == 1  # its refunded task
    assert ledger.tasks_started_since(day_ago, asking="a", excluding="a/1") == 0
    assert ledger.tasks_started_since(day_ago, asking="b") == 0  # not a's refund
    # The 3-day-old start was dropped (its release is still held).
    assert ledger.tasks_started_since(0, asking="a", own_only=True) == 1
    assert ledger.tasks_started_since(0, asking="a") == 2
    ledger.reserve(PrivacyEvent("b/2", "b", 2.0, 1.0, 1e-6), budget, spec_digest="d2")
    assert ledger.tasks_started_since(day_ago, asking="b") == 1  # its release
    assert ledger.tasks_started_since(day_ago, asking="a") == 2  # b's release, a's refund
    assert ledger.tasks_started_since(day_ago, asking="b", own_only=True) == 1
    # A schema-6 ledger (no starts kept) counts the releases it holds as begun.
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE task_starts")
        conn.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    conn.close()
    migrated = BudgetLedger(path)
    assert migrated.tasks_started_since(day_ago, asking="a") == 1  # b/2; a/1's refund lost
    assert migrated.tasks_started_since(0, asking="a", own_only=True) == 1  # a/old


def test_the_ledger_is_readable_by_its_user_only(tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): the ledger, which lists every query the owner
    answered, was made 0644 (SQLite's default) where the docs said 0600. New ledgers are
    0600, and an older 0644 one is made so when the node opens it."""
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    BudgetLedger(path, read_only=True)  # a reader changes nothing, mode included
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    BudgetLedger(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_later_ledger_names_the_copy_kept_before_its_migration(tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): going back a version, the refusal of the
    migrated ledger did not say that the later version had kept a copy to go back to."""
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.close()
    with pytest.raises(ConfigError, match=r"version 99, this fedpca understands 7$"):
        BudgetLedger(path)
    kept = tmp_path / "ledger.sqlite3.schema-7.bak"
    kept.write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"kept the ledger as it was in {re.escape(str(kept))}"):
        BudgetLedger(path)
    # A reading command (owner budget, owner backup) says the same, not that this
    # version's `owner serve` would migrate it (review, stop 42).
    with pytest.raises(ConfigError, match=r"a later fedpca wrote it.*kept the ledger") as read:
        BudgetLedger(path, read_only=True)
    assert "migrated by" not in str(read.value)


def _schema_5_ledger(path: Path, rows: str) -> Path:
    """A ledger as fedpca's schema 5 left it, with ``rows`` (SQL) added."""
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript(
            """
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '5');
            CREATE TABLE tasks (query_id TEXT PRIMARY KEY, state TEXT NOT NULL,
                detail TEXT NOT NULL, upload_id TEXT, upload_started INTEGER NOT NULL
                DEFAULT 0, updated_at REAL NOT NULL, seed BLOB, capacity INTEGER,
                spec_digest TEXT);
            """
            + rows
        )
    conn.close()
    return path


def test_a_reader_leaves_an_older_ledger_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``owner budget`` opened the ledger as the node does, so the new version's command
    migrated the ledger of a running older node, which then refused to restart (review)."""
    old = _schema_5_ledger(tmp_path / "old.sqlite3", "")
    before = old.read_bytes()
    with pytest.raises(ConfigError, match=r"version 5, this fedpca reads 7.*owner serve"):
        BudgetLedger(old, read_only=True)
    assert old.read_bytes() == before
    with caplog.at_level(logging.WARNING, logger="fedpca.owner.ledger"):
        BudgetLedger(old).reserve(_event("alice/q1"), BUDGET, spec_digest="d1")  # it migrates
    # ... and says so (an operator's walkthrough saw nothing of it).
    assert "migrated the budget ledger from schema version 5 to 7" in caplog.text
    reader = BudgetLedger(old, read_only=True)
    assert [entry.event.query_id for entry in reader.events()] == ["alice/q1"]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.reserve(_event("alice/q2"), BUDGET, spec_digest="d2")
    with pytest.raises(ConfigError, match="no budget ledger"):
        BudgetLedger(tmp_path / "missing.sqlite3", read_only=True)
    assert not (tmp_path / "missing.sqlite3").exists()


def test_an_sqlite_file_without_tables_is_not_taken_for_a_new_ledger(tmp_path: Path) -> None:
    """A backup taken of the wrong path is an SQLite file with no tables; a node started
    on it made a new ledger of it, and the owner's budget started again (review)."""
    path = tmp_path / "ledger.sqlite3"
    source = sqlite3.connect(tmp_path / "nothing-here.sqlite3")
    target = sqlite3.connect(path)
    source.backup(target)
    source.close()
    target.close()
    for read_only in (False, True):
        with pytest.raises(ConfigError, match="SQLite file with no tables"):
            BudgetLedger(path, read_only=read_only)
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
    check.close()


def test_open_tasks_keep_their_deadline_and_a_schema_5_ledger_gains_it(tmp_path: Path) -> None:
    """Schema 6: a reserved task and an upload in flight keep their upload deadline, so
    a restarted node can end them if the proxy never delivers them again; a schema-5
    ledger gains the column, and its open rows (no deadline known) are left to the
    proxy as before."""
    old = _schema_5_ledger(
        tmp_path / "v5.sqlite3",
        "INSERT INTO tasks VALUES ('q0', 'uploading', '', 'u0', 1, 1.0, NULL, NULL, NULL);",
    )
    ledger = BudgetLedger(old)
    assert ledger.unfinished_tasks() == ["q0"] and ledger.open_task_deadlines() == {}
    ample = PrivacyParams(100.0, DELTA)
    ledger.reserve(_event("q1"), ample, spec_digest="d1", upload_deadline=100.0)
    ledger.reserve(_event("q2"), ample, spec_digest="d2", upload_deadline=200.0)
    ledger.record_task("q2", TaskOutcome.UPLOADING, upload_id="u2")  # keeps its deadline
    ledger.reserve(_event("q3"), ample, spec_digest="d3", upload_deadline=300.0)
    ledger.record_task("q3", TaskOutcome.UPLOADED, upload_id="u3")  # ended: not open
    assert BudgetLedger(old).open_task_deadlines() == {"q1": 100.0, "q2": 200.0}


def test_cancel_reservation_only_before_any_upload(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    ledger.reserve(_event("q1"), BUDGET, spec_digest="d1")
    assert ledger.cancel_reservation("q1")
    assert ledger.events() == []
    ledger.reserve(_event("q2"), BUDGET, spec_digest="d2")
    ledger.record_task("q2", TaskOutcome.UPLOADING, upload_id="u2")
    record = ledger.task("q2")
    assert record is not None and not record.upload_started  # only the header may leave
    ledger.mark_upload_started("q2")  # the proxy accepted the header: chunks may leave
    assert not ledger.cancel_reservation("q2")
    # Later outcomes never clear the fact that data left the node.
    ledger.record_task("q2", TaskOutcome.CANCELLED, "cancelled")
    assert not ledger.cancel_reservation("q2")
    assert [e.event.query_id for e in ledger.events()] == ["q2"]
    record = ledger.task("q2")
    assert record is not None and record.upload_id == "u2" and record.upload_started


def test_concurrent_threads_never_both_pass(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path)
    barrier = threading.Barrier(4)
    results: list[str] = []
    lock = threading.Lock()

    def reserve(index: int) -> None:
        ledger = BudgetLedger(path)
        barrier.wait()
        try:
            ledger.reserve(_event(f"q{index}"), BUDGET, spec_digest=f"d{index}")
            outcome = "fit"
        except BudgetExceededError:
            outcome = "refused"
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=reserve, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["fit", "refused", "refused", "refused"]
    assert len(BudgetLedger(path).events()) == 1


def _reserve_in_process(path: str, index: int, barrier: BarrierType, out: Any) -> None:
    ledger = BudgetLedger(path)
    barrier.wait()
    try:
        ledger.reserve(_event(f"p{index}"), BUDGET, spec_digest=f"d{index}")
        out.put("fit")
    except BudgetExceededError:
        out.put("refused")


def test_concurrent_processes_never_both_pass(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    out = context.Queue()
    processes = [
        context.Process(target=_reserve_in_process, args=(str(path), i, barrier, out))
        for i in range(2)
    ]
    for process in processes:
        process.start()
    results = sorted(out.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == ["fit", "refused"]
    assert len(BudgetLedger(path).events()) == 1


def test_the_open_tasks_are_found_by_index_not_by_scanning_every_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node names its open tasks at every connection: each read of them searches the
    ``tasks_by_state`` index, so its time grows with the open tasks, not with every
    task the ledger has recorded (it scanned the whole table before)."""
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    statements: list[str] = []
    real_connect = BudgetLedger._connect

    @contextmanager
    def traced(self: BudgetLedger) -> Iterator[sqlite3.Connection]:
        with real_connect(self) as connection:
            connection.set_trace_callback(statements.append)
            yield connection

    monkeypatch.setattr(BudgetLedger, "_connect", traced)
    ledger.unfinished_tasks()
    ledger.open_task_deadlines()
    ledger.uploads_in_flight()
    reads = [s for s in statements if s.startswith("SELECT") and "FROM tasks" in s]
    assert len(reads) == 3
    with sqlite3.connect(ledger.path) as connection:
        for read in reads:
            plan = [row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {read}")]
            assert not any(step.startswith("SCAN tasks") for step in plan), (read, plan)
            assert any("USING INDEX tasks_by_state" in step for step in plan), (read, plan)


def test_an_older_ledger_is_copied_before_it_is_migrated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A migration is one way: the ledger as the earlier version left it stays beside
    it, for an operator who did not back up before upgrading."""
    old = _schema_5_ledger(
        tmp_path / "ledger.sqlite3",
        "INSERT INTO tasks VALUES ('alice/q0', 'declined', 'x', NULL, 0, 1.0, NULL, NULL, 'd0');",
    )
    with caplog.at_level(logging.WARNING, logger="fedpca.owner.ledger"):
        BudgetLedger(old).reserve(_event("alice/q1"), BUDGET, spec_digest="d1")
    copy = tmp_path / "ledger.sqlite3.schema-5.bak"
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert str(copy) in caplog.text
    with sqlite3.connect(f"file:{copy}?immutable=1", uri=True) as kept:  # no -wal beside
        version = kept.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        tasks = kept.execute("SELECT query_id FROM tasks").fetchall()
    assert version == ("5",) and tasks == [("alice/q0",)]  # before the migration and q1
    before = copy.read_bytes()
    BudgetLedger(old)  # of this version now: no other copy, the first one kept
    assert copy.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if ".bak" in p.name) == [copy.name]
    fresh = BudgetLedger(tmp_path / "new.sqlite3")
    fresh.reserve(_event("alice/q2"), BUDGET, spec_digest="d2")
    BudgetLedger(tmp_path / "new.sqlite3")
    assert not list(tmp_path.glob("new.sqlite3.schema-*"))
