"""The records the owner's budget ledger (:mod:`fedpca.owner.ledger`) hands out: a
reservation's decision, a recorded release, and what became of a task."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams

__all__ = ["BudgetDecision", "LedgerEntry", "TaskOutcome", "TaskRecord"]


@dataclass(frozen=True)
class BudgetDecision:
    """Outcome of a reservation that fit.

    Attributes
    ----------
    query_id : the reserved query.
    budget : the owner's total budget.
    epsilon_spent_before, epsilon_spent_after : composed epsilon at ``budget.delta``
        of the private releases without / with this one.
    not_private : this was an ``epsilon = inf`` verification release (it exhausts a
        finite budget).
    already_reserved : the query id had been reserved before with the same
        parameters; nothing new was charged.
    share_used : with per-analyst shares and a ledger within them, the part of the
        analyst's share used without / with this release (1 = all of it); the epsilon
        figures are then NaN: the owner-wide composition is implied and not computed.
    """

    query_id: str
    budget: PrivacyParams
    epsilon_spent_before: float
    epsilon_spent_after: float
    not_private: bool = False
    already_reserved: bool = False
    share_used: tuple[float, float] | None = None

    @classmethod
    def within_share(
        cls,
        query_id: str,
        budget: PrivacyParams,
        used_before: float,
        used_after: float,
        *,
        already_reserved: bool = False,
    ) -> BudgetDecision:
        """A reservation decided by its analyst's share alone (the owner-wide epsilon
        figures are not computed: NaN)."""
        return cls(
            query_id,
            budget,
            math.nan,
            math.nan,
            already_reserved=already_reserved,
            share_used=(used_before, used_after),
        )


@dataclass(frozen=True)
class LedgerEntry:
    """One recorded release.

    Attributes
    ----------
    event : the privacy event (``noise_multiplier = 0`` for verification mode).
    not_private : True for an ``epsilon = inf`` release.
    spec_digest : digest of the public query the reservation was made for.
    """

    event: PrivacyEvent
    not_private: bool
    spec_digest: str


class TaskOutcome(StrEnum):
    """What became of a task. All but RESERVED and UPLOADING are final: the task is never
    redone."""

    RESERVED = "reserved"
    """The budget is reserved and no upload was started (not final: recorded with the
    reservation, so that a node killed before its upload began still knows the task and
    ends it, refunded, when the proxy withdraws it after a restart)."""
    UPLOADING = "uploading"
    """An upload was started (not final: a restart resumes it with the same upload id and
    the same kept share, and the proxy continues after the chunks it holds)."""
    UPLOADED = "uploaded"
    DECLINED = "declined"
    REJECTED = "rejected"
    """The proxy refused the upload permanently for a fault of its own (invalid, not
    allowed); not for a query that no longer takes it (CANCELLED, EXPIRED)."""
    CANCELLED = "cancelled"
    """The query ended or closed to this owner before its upload was taken, through
    nothing this owner did: cancelled or withdrawn by the proxy, or its upload refused
    because the query no longer takes it (another owner declined, the analyst
    cancelled, the quorum was reached without this owner)."""
    EXPIRED = "expired"
    """The task's upload deadline passed before its upload was taken (the task came
    late, or the proxy refused an upload that came after the deadline)."""
    ABANDONED = "abandoned"
    """An upload that began and could not go on (its kept share was lost); charged."""

    @property
    def final(self) -> bool:
        return self not in (TaskOutcome.RESERVED, TaskOutcome.UPLOADING)


@dataclass(frozen=True)
class TaskRecord:
    """The recorded state of one task."""

    query_id: str
    outcome: TaskOutcome
    detail: str
    upload_id: str | None
    upload_started: bool
    updated_at: float
    seed: bytes | None = None
    """Seed of the sample of rows, recorded only by versions that kept no share."""
    capacity: int | None = None
    """``data.max_records`` of such an upload when it began (its resume uses it)."""


@dataclass
class Reentered:
    """What :meth:`fedpca.owner.ledger.BudgetLedger.reenter` did (in a dry run, would do),
    by query id."""

    entered: list[str] = field(default_factory=list)
    """Releases charged now."""
    already_recorded: list[str] = field(default_factory=list)
    """Releases the ledger held."""
    kept_charged: list[str] = field(default_factory=list)
    """Of those, the ones whose task was not marked begun: now it is, never refunded."""
    left_out: list[str] = field(default_factory=list)
    """Releases not to be charged (the node's policy would not have answered them) that
    the ledger does not hold: nothing written."""
