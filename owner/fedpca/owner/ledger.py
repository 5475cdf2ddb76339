"""The owner's durable privacy-budget ledger and handled-task record (SQLite).

Every release of this owner's data is charged here *before* anything is
encrypted. The owner's budget covers every release of its data, whichever
analyst receives it: the owner's concern is the total leakage of its rows.

Durability and atomicity
------------------------
* WAL journal with ``synchronous=FULL``: a reservation that returned has
  reached the disk, so a crash right after it cannot forget a spent budget.
* A reservation runs in one ``BEGIN IMMEDIATE`` transaction: it takes SQLite's
  write lock *before* reading the past releases, so two reservations (threads
  of one node, or two processes started on the same state folder by mistake)
  are serialised and can never both pass when only one fits.
* Each operation opens its own connection, so one ledger object can be shared
  by threads without a Python-level lock (SQLite's file lock is the lock).

Verification mode (``epsilon = inf``)
-------------------------------------
A query with ``epsilon = inf`` adds no noise: the analyst learns the exact sums.
It is accepted only by owners whose policy sets ``allow_not_private`` (the
caller passes that flag), and it is recorded with ``not_private = 1`` and
composed like every other release: its epsilon is infinite, so after it this
ledger's (finite) budget is exhausted and every later private query is refused.
An owner that verifies a deployment on test data does so with an infinite budget
or on a ledger it discards afterwards.

Neighbouring relation
---------------------
A ledger belongs to one deployment and is kept under its neighbouring relation
(``[privacy] neighbouring`` in the owner's config): a release recorded under
another relation is refused. Ledgers written by fedpca 0.1 (schema 1) recorded
no relation; opening one migrates it once, halving every recorded noise multiplier
and recording the deployment's relation. For a stats-mode release of 0.1 that is
a valid bound under either relation (a replacement changes a sum at most twice as
much as an addition); a masked-mode release of 0.1 has no finite epsilon under
add/remove adjacency and cannot be covered by any migration (docs/privacy.md).

Replays
-------
A query id can be reserved once. Reserving it again with the same parameters
(``spec_digest``) is a no-op that reports the current state, so a task
re-delivered after a reconnect or a restart is not charged twice. The same id
with *different* parameters is refused: otherwise a proxy could obtain two
different releases for the price of one. And the same query (``spec_digest``)
under *another* id is refused too: the task id is the proxy's, not signed by the
analyst, so a proxy could otherwise replay one signed query under new task ids and
spend this owner's budget on releases nobody asked for. A declined task keeps its
query's digest too (schema 5), so a replay of a declined query is recognised
(:meth:`BudgetLedger.answered_under`, :mod:`fedpca.owner.task_intake`) and answered
without another row. An open task keeps its upload deadline (schema 6), so a restarted
node ends it past that if the proxy never delivers it again; every task, its start for
``policy.max_tasks_per_day``, which a refund does not remove (schema 7).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from fedpca.dp.accounting import Accountant, check_budget, compose_epsilon, compose_recorded
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.dp.shares import BudgetShares
from fedpca.errors import BudgetExceededError, ConfigError, PolicyError
from fedpca.files import (
    DATABASE_MODE,
    create_database,
    database_missing,
    holds_database,
    restrict_database,
)
from fedpca.formatting import distinct
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger_records import BudgetDecision, LedgerEntry, Reentered, TaskOutcome
from fedpca.owner.ledger_rows import (
    EVENT_COLUMNS,
    event_from_row,
    insert_release,
    read_events,
    reenter_release,
    release_changes,
    write_task_row,
)
from fedpca.owner.ledger_schema import (
    check_version,
    create_or_migrate,
    keep_copy_before_migrating,
)
from fedpca.owner.ledger_tasks import LedgerTaskReads
from fedpca.query import Neighbouring

__all__ = ["BudgetLedger", "owner_ledger"]

logger = logging.getLogger(__name__)


# How long a reservation waits for another one holding the write lock. A
# reservation's critical section is one PLD composition (well under a second),
# so a minute only expires if something is badly stuck.
_BUSY_TIMEOUT_SECONDS = 60.0


class BudgetLedger(LedgerTaskReads):
    """Durable, process-safe privacy budget ledger of one owner.

    Parameters
    ----------
    path : the SQLite file (its folder is created if missing).
    neighbouring : the deployment's neighbouring relation; every release is accounted
        under it, and a release stated for another one is refused.
    accountant : how releases compose (zcdp, the proven default, or pld-continuous).
    shares : per-analyst shares of the budget (None: one budget for every analyst). A
        release must then fit its analyst's share before the whole budget is checked
        (fedpca.dp.shares).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
        accountant: Accountant = Accountant.ZCDP,
        shares: BudgetShares | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = Path(path)
        self.read_only = read_only
        """Read an existing ledger of this version, changing nothing (``owner budget``,
        which runs beside a serving node without its lock: it migrated the ledger of a
        running older node, which then refused to restart; found by review)."""
        self.neighbouring = Neighbouring(neighbouring)
        self.accountant = Accountant(accountant)
        self.shares = shares
        self.within_shares = False
        """Every recorded release is of this ledger's relation and fits its analyst's
        share: the owner-wide check is then implied. Found when the ledger opens, and
        again whenever another connection has written releases (:meth:`_within_shares_now`)."""
        self._known_changes = -1  # the ledger's count of release writes when last found
        existed = holds_database(self.path)
        if read_only and not existed:
            raise ConfigError(f"no budget ledger: {database_missing(self.path)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the ledger folder {self.path.parent}: {exc}") from exc
        try:
            if not existed and not read_only:
                # Whole or not at all: a crash while the tables were made left a file
                # with none, which the next start refused (fedpca.files).
                create_database(
                    self.path,
                    lambda connection: create_or_migrate(
                        connection, self.path, self.neighbouring, existed=False
                    ),
                    DATABASE_MODE,
                )
            elif not read_only:
                restrict_database(self.path)
            with self._connect() as connection:
                if read_only:
                    check_version(connection, self.path)
                else:
                    # WAL is a property of the file; setting it needs no transaction.
                    mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                    if str(mode).lower() != "wal":
                        raise ConfigError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
                    keep_copy_before_migrating(connection, self.path, existed=existed)
                    with _immediate(connection):
                        create_or_migrate(connection, self.path, self.neighbouring, existed=existed)
                if shares is not None:
                    self._within_shares_now(connection)
        except OSError as exc:
            raise ConfigError(f"cannot create the budget ledger {self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            # Not a traceback: a damaged or truncated ledger is named. Never start on a
            # new, empty one instead: the budget spent would be forgotten.
            raise ConfigError(
                f"cannot use the budget ledger {self.path}: {exc}; if the file is damaged, "
                "restore it from a backup, which forgets the releases made since it was taken "
                "(docs/operations.md, Backup and restore)"
            ) from exc

    def __repr__(self) -> str:
        return f"BudgetLedger({str(self.path)!r})"

    def _within_shares_now(self, connection: sqlite3.Connection) -> bool:
        """Whether the ledger is within its shares (False without shares).

        Read again, from every release, only when the ledger's count of release writes
        (kept by triggers in the database file, so by every writer) is not the one this
        ledger last saw: another connection (a node of an older version, one without
        shares, another host on a network folder) wrote releases, which may exceed a
        share. Otherwise it is kept: this ledger records a release only if it fits its
        share, so without such writers the ledger stays within, and reading one counter
        takes the same time whatever the others spent.
        """
        if self.shares is None:
            return False
        changes = release_changes(connection)
        if changes != self._known_changes:
            self.within_shares = self._check_within_shares(self.shares, read_events(connection))
            self._known_changes = changes
        return self.within_shares

    def _check_within_shares(self, shares: BudgetShares, events: list[PrivacyEvent]) -> bool:
        if any(event.neighbouring is not self.neighbouring for event in events):
            return False  # the owner-wide check then refuses to mix the two relations
        over = shares.over_share(events)
        if over:
            logger.warning(
                "the ledger's releases exceed the budget share of %s (recorded before "
                "budget.analyst_shares, or a share was cut): while they do, the whole budget "
                "is checked after each share and can refuse a query that fits its analyst's "
                "share, and a decline can again depend on other analysts' releases "
                "(docs/privacy.md)",
                ", ".join(over),
            )
        return not over

    # ------------------------------------------------------------ connection
    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            # isolation_level=None: no implicit transactions; every write below
            # runs inside an explicit BEGIN IMMEDIATE.
            connection = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT_SECONDS, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open the budget ledger {self.path}: {exc}") from exc
        try:
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("PRAGMA foreign_keys=ON")
            if self.read_only:
                connection.execute("PRAGMA query_only=ON")
            yield connection
        finally:
            connection.close()

    # ------------------------------------------------------------- budget
    def reserve(
        self,
        event: PrivacyEvent,
        budget: PrivacyParams,
        *,
        spec_digest: str = "",
        allow_not_private: bool = False,
        upload_deadline: float | None = None,
    ) -> BudgetDecision:
        """Charge ``event`` to the budget if it fits, atomically.

        Parameters
        ----------
        event : the release (``ReleasePlan.privacy_event``).
        budget : the owner's total (epsilon, delta).
        spec_digest : digest of the public query; a later reservation of the same
            query id must carry the same digest.
        allow_not_private : accept an ``epsilon = inf`` event (it exhausts a finite
            budget: every later private release is refused).
        upload_deadline : the task's upload deadline (POSIX seconds), kept on its row
            (:meth:`open_task_deadlines`).

        Returns
        -------
        BudgetDecision

        Raises
        ------
        BudgetExceededError
            If the release does not fit its analyst's share (with ``shares``), or the
            composition of every recorded private release and this one exceeds
            ``budget`` at ``budget.delta`` (not computed while the ledger is within its
            shares, which imply it: :attr:`within_shares`). Nothing is recorded.
        PolicyError
            For a verification (``epsilon = inf``) event without
            ``allow_not_private``, an event stated for another neighbouring relation
            than this ledger's, a query id already reserved with different
            parameters, or a query (``spec_digest``) already reserved under another id.
        CalibrationError
            If the release (or its composition with the ledger) has less noise than
            the accountant supports (:data:`fedpca.dp.accounting.MIN_NOISE_MULTIPLIER`,
            e.g. epsilon = 1e6). Nothing is recorded.
        """
        not_private = event.noise_multiplier == 0
        if not_private and self.shares is not None:
            raise PolicyError(
                f"query {event.query_id!r} asks for epsilon = inf (NOT PRIVATE), which "
                "per-analyst budget shares never admit"
            )
        if not_private and not allow_not_private:
            raise PolicyError(
                f"query {event.query_id!r} asks for epsilon = inf (no noise, NOT PRIVATE) and "
                "this owner does not allow verification queries (policy.allow_not_private)"
            )
        if event.neighbouring is not self.neighbouring:
            raise PolicyError(
                f"query {event.query_id!r} is stated for {event.neighbouring.value} adjacency; "
                f"this owner accounts under {self.neighbouring.value}"
            )
        with self._connect() as connection, _immediate(connection):
            existing = connection.execute(
                "SELECT spec_digest, noise_multiplier, not_private FROM releases "
                "WHERE query_id = ?",
                (event.query_id,),
            ).fetchone()
            # Within the shares the owner-wide check is implied (fedpca.dp.shares) and not
            # made: only the analyst's own releases are read, so neither the answer nor
            # the time it takes depends on another analyst's releases.
            # The shares, when the ledger is within them (None otherwise).
            within = self.shares if self._within_shares_now(connection) else None
            if within is not None and budget != within.budget:
                raise ConfigError(
                    f"the shares were made for the budget {within.budget}, not {budget}"
                )
            past = read_events(connection, analyst=None if within is None else event.analyst)
            replayed = (
                connection.execute(
                    "SELECT query_id FROM releases WHERE spec_digest = ? AND query_id != ?",
                    (spec_digest, event.query_id),
                ).fetchone()
                if spec_digest
                else None
            )
            if replayed is not None:
                raise PolicyError(
                    f"task {event.query_id!r} carries the same signed query as task "
                    f"{replayed[0]!r}, already answered; a query is answered once, whatever "
                    "task id it comes under"
                )
            if existing is not None:
                digest, z, was_not_private = existing
                # The same signed query planned by a later version may differ in z's
                # last bits (its rounding changed): the same release (review).
                if digest != spec_digest or not math.isclose(
                    z, event.noise_multiplier, rel_tol=1e-12
                ):
                    raise PolicyError(
                        f"query id {event.query_id!r} was already reserved with different "
                        "parameters; refusing a second, different release under the same id"
                    )
                logger.info("query %s: budget already reserved, not charged again", event.query_id)
                if within is not None:
                    used = within.used(past, event.analyst)
                    return BudgetDecision.within_share(
                        event.query_id, budget, used, used, already_reserved=True
                    )
                spent = self._compose(past, budget)
                return BudgetDecision(
                    event.query_id,
                    budget,
                    spent,
                    spent,
                    not_private=bool(was_not_private),
                    already_reserved=True,
                )
            if not_private:
                # Allowed by the owner's policy: recorded even over a finite budget,
                # which it exhausts (its epsilon is infinite).
                before = self._compose(past, budget)
                after = math.inf if 0 < budget.delta < 1 else math.nan
                decision = BudgetDecision(event.query_id, budget, before, after, not_private=True)
                logger.warning(
                    "query %s: NOT PRIVATE verification release (epsilon = inf) recorded; a "
                    "finite budget is now exhausted",
                    event.query_id,
                )
            elif within is not None:
                share = within.require(past, event)
                decision = BudgetDecision.within_share(
                    event.query_id, budget, share.used_before, share.used_after
                )
            else:
                if self.shares is not None:
                    self.shares.require(past, event)
                check = check_budget(
                    past, event, budget, self.accountant, neighbouring=self.neighbouring
                )
                if not check.fits:
                    was, would, total = distinct(
                        check.epsilon_spent_before, check.epsilon_spent_after, budget.epsilon
                    )
                    raise BudgetExceededError(
                        f"query {event.query_id!r} refused: it would bring this owner's epsilon "
                        f"from {was} to {would} at delta={budget.delta:g}, over "
                        f"the budget epsilon={total}"
                    )
                decision = BudgetDecision(
                    event.query_id,
                    budget,
                    check.epsilon_spent_before,
                    check.epsilon_spent_after,
                )
            insert_release(connection, event, spec_digest)
            # In the same transaction: a reservation never exists without a task row
            # (before, a node killed between the two left a charge no restart found).
            connection.execute(
                "INSERT INTO tasks (query_id, state, detail, upload_started, updated_at, "
                "upload_deadline) VALUES (?, ?, '', 0, ?, ?) ON CONFLICT (query_id) DO NOTHING",
                (event.query_id, TaskOutcome.RESERVED.value, time.time(), upload_deadline),
            )
            changes_after = release_changes(connection)
        # Only once committed: a commit that failed (a full disk) left the file's count
        # where it was, and the count cached here must not run ahead of it.
        if self.shares is not None:  # a release within its share: nothing new to check
            self._known_changes = changes_after
        return decision

    def _compose(self, events: list[PrivacyEvent], budget: PrivacyParams) -> float:
        if not 0 < budget.delta < 1:
            return math.nan  # an unlimited budget may carry delta 0 or 1
        # What it says of a recorded release stays in this log (CompositionError).
        return compose_recorded(
            events, budget.delta, self.accountant, neighbouring=self.neighbouring
        )

    def tasks_started_since(
        self, timestamp: float, *, asking: str, excluding: str = "", own_only: bool = False
    ) -> int:
        """The task-rate cap's count, since ``timestamp`` and but for task ``excluding``,
        for a task of analyst ``asking``: its own tasks, refunded ones included, if
        ``own_only`` (shares); else every analyst's releases held and its own refunded
        tasks. A refund counts against its own analyst only: counted against all, an
        analyst cancelling before any upload used up every owner's allowance for free,
        locking the other analysts out for a day (review, stop 42)."""
        refunded = " AND NOT EXISTS (SELECT 1 FROM releases r WHERE r.query_id = s.query_id)"
        with self._connect() as connection:  # by the analyst index: its own tasks only
            own = connection.execute(
                "SELECT COUNT(*) FROM task_starts s WHERE s.analyst = ? AND s.started_at >= ? "
                "AND s.query_id != ?" + ("" if own_only else refunded),
                (asking, timestamp, excluding),
            ).fetchone()
            if own_only:
                return int(own[0])
            held = connection.execute(
                "SELECT COUNT(*) FROM releases WHERE recorded_at >= ? AND query_id != ?",
                (timestamp, excluding),
            ).fetchone()
        return int(own[0]) + int(held[0])

    def cancel_reservation(self, query_id: str) -> bool:
        """Refund a reservation whose data was not released; True if one was removed.

        Sound only because nothing derived from the data reaches a result: a
        reservation is refunded while no header of the task's upload was ever accepted
        (:meth:`mark_upload_started`, checked in the same transaction), in any process.
        """
        return self.end_task(query_id, None)

    def end_task(
        self,
        query_id: str,
        outcome: TaskOutcome | None,
        detail: str = "",
        *,
        refund: bool = True,
        upload_id: str | None = None,
        spec_digest: str | None = None,
    ) -> bool:
        """End a task in one transaction: refund its reservation if ``refund`` and no
        header of its upload was ever accepted (as :meth:`cancel_reservation`), and
        record ``outcome`` (None: delete the task's RESERVED row instead).

        One transaction, so that no crash or failed write leaves a task final and still
        charged though nothing of it left (never looked at again), or refunded with no
        outcome written. Returns True if a reservation was removed.
        """
        with self._connect() as connection, _immediate(connection):
            seen = self.shares is not None and release_changes(connection) == self._known_changes
            started = connection.execute(
                "SELECT upload_started FROM tasks WHERE query_id = ?", (query_id,)
            ).fetchone()
            removed = False
            if refund and started is not None and started[0]:
                logger.info("query %s: an upload was started; the budget stays charged", query_id)
            elif refund:
                deleted = connection.execute("DELETE FROM releases WHERE query_id = ?", (query_id,))
                removed = deleted.rowcount > 0
            changes_after = release_changes(connection)
            if outcome is None:
                connection.execute(
                    "DELETE FROM tasks WHERE query_id = ? AND state = ?",
                    (query_id, TaskOutcome.RESERVED.value),
                )
            else:
                write_task_row(connection, query_id, outcome, detail, upload_id, spec_digest)
        if removed:
            # Once committed: a refund leaves the ledger within its shares; what another
            # connection added before it is still to be looked at (the next reservation
            # re-reads then).
            self._known_changes = changes_after if seen else -1
            logger.info("query %s: nothing was sent, reservation refunded", query_id)
        return removed

    def reenter(
        self, releases: Sequence[tuple[PrivacyEvent, str, bool]], *, dry_run: bool = False
    ) -> Reentered:
        """Charge releases this ledger forgot (restored from a backup), without a budget
        check: they happened. Each is ``(event, spec_digest, chargeable)``; one
        transaction. One the ledger does not hold is charged only if chargeable.

        A release the ledger holds keeps its cost. Every release held or charged has its
        task marked begun (never refunded; UPLOADED where it has no row, so that it is
        never answered again): the backup may predate its upload's start, and a
        withdrawal would then refund what was sent (found by review).
        """
        done = Reentered()
        seen: set[str] = set()
        with (
            self._connect() as connection,
            _read(connection) if dry_run else _immediate(connection),
        ):
            for event, digest, chargeable in releases:
                if event.neighbouring is not self.neighbouring:
                    raise ConfigError(
                        f"release {event.query_id} is stated for {event.neighbouring.value} "
                        f"adjacency; this ledger accounts under {self.neighbouring.value}: "
                        "nothing was re-entered"
                    )
                if event.query_id not in seen:
                    seen.add(event.query_id)
                    reenter_release(
                        connection, event, digest, done, dry_run=dry_run, chargeable=chargeable
                    )
        if not dry_run:
            self._known_changes = -1  # the shares are looked at again
        return done

    def events(self) -> list[LedgerEntry]:
        """Every recorded release, oldest first (verification releases included)."""
        with self._connect() as connection:
            rows = connection.execute(
                f"SELECT {EVENT_COLUMNS}, not_private, spec_digest FROM releases "
                "ORDER BY recorded_at, query_id"
            ).fetchall()
        return [LedgerEntry(event_from_row(row), bool(row[9]), row[10]) for row in rows]

    def spent(self, delta: float) -> float:
        """Composed epsilon at ``delta`` of every release (inf after a NOT PRIVATE one)."""
        return compose_epsilon(
            [entry.event for entry in self.events()],
            delta,
            self.accountant,
            neighbouring=self.neighbouring,
        )

    # --------------------------------------------------------------- tasks
    def record_task(
        self,
        query_id: str,
        outcome: TaskOutcome,
        detail: str = "",
        *,
        upload_id: str | None = None,
        seed: bytes | None = None,
        capacity: int | None = None,
        spec_digest: str | None = None,
        upload_deadline: float | None = None,
    ) -> None:
        """Record what became of a task (UPLOADING: an upload id and kept share exist;
        :meth:`mark_upload_started` records when chunks may leave).

        ``seed`` and ``capacity`` (the sample's seed and the ``data.max_records`` it was
        drawn under) were recorded by versions that kept no share; tests still use them.
        ``spec_digest`` is the signed query's, kept for declines (:meth:`answered_under`);
        ``upload_deadline`` (POSIX seconds) for :meth:`open_task_deadlines`.
        """
        with self._connect() as connection, _immediate(connection):
            write_task_row(
                connection,
                query_id,
                outcome,
                detail,
                upload_id,
                spec_digest,
                seed,
                capacity,
                upload_deadline,
            )

    def mark_upload_started(self, query_id: str) -> bool:
        """Record, durably, that chunks of the task's upload may now leave this node:
        called when the proxy accepted the header, before the first chunk is handed to
        gRPC. From then on the reservation is never refunded; before it, a withdrawal
        refunds it (only the header, which holds nothing of the records, had left).

        Returns False, marking nothing, if the task's reservation is gone (refunded by
        a withdrawal handled meanwhile, or by another process on this state folder):
        then no chunk may leave, since it would leave uncharged."""
        with self._connect() as connection, _immediate(connection):
            charged = connection.execute(
                "SELECT 1 FROM releases WHERE query_id = ?", (query_id,)
            ).fetchone()
            if charged is None:
                logger.error(
                    "query %s: the header was accepted but the reservation is gone; no chunk "
                    "is sent",
                    query_id,
                )
                return False
            marked = connection.execute(
                "UPDATE tasks SET upload_started = 1 WHERE query_id = ?", (query_id,)
            ).rowcount
        return marked > 0


# ------------------------------------------------------------------ helpers


@contextmanager
def _immediate(connection: sqlite3.Connection) -> Iterator[None]:
    """An explicit write transaction: the write lock is taken before any read."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


@contextmanager
def _read(connection: sqlite3.Connection) -> Iterator[None]:
    """An explicit read transaction (one snapshot), which a read-only ledger allows."""
    connection.execute("BEGIN")
    try:
        yield
    finally:
        connection.execute("ROLLBACK")


def owner_ledger(config: OwnerConfig, *, read_only: bool = False) -> BudgetLedger:
    """The ledger of an owner's configuration (state folder, relation, accountant,
    shares); ``read_only`` for commands that only read it (:attr:`BudgetLedger.read_only`)."""
    accountant = config.privacy.accountant
    shares = None
    if config.analyst_shares:
        shares = BudgetShares.for_budget(config.analyst_shares, config.budget, accountant)
    return BudgetLedger(
        config.ledger_path,
        neighbouring=config.privacy.neighbouring,
        accountant=accountant,
        shares=shares,
        read_only=read_only,
    )
