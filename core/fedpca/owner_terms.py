"""An owner's terms: the public facts by which it decides whether to answer a query.

An owner decides from public facts only (docs/privacy.md, "Decisions from public
facts"): its table's schema, its ``[policy]`` and ``[privacy]`` configuration, and its
declared capacity. :class:`OwnerTerms` holds those facts and the rules that judge a
query by them. The owner's node judges every task with them
(:func:`fedpca.owner.policy.check_task`), and states them when it opens its task stream.
The proxy passes the connected owners' terms to an analyst who asks
(``fedpca analyst deployment``), and the analyst's tools judge a query by them before
submitting it. The same code decides in both places, so an analyst sees the refusal
an owner would send without spending a round on it.

A proxy could misstate an owner's terms: what the analyst reads is advice, and the
owner's own check of the signed query is what counts. What the terms leave out:
which analyst keys and signers an owner pins (that would tell one analyst about the
others), its total budget and what is spent of it (only the budget's delta is stated,
at which its epsilon cap is measured), and its tasks in the last 24 hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedpca.errors import (
    CalibrationError,
    ConfigError,
    EncodingOverflowError,
    LayoutError,
    PolicyError,
)
from fedpca.formatting import distinct
from fedpca.query import Accountant, Neighbouring, ProtocolMode, QuerySpec, ReleaseKind
from fedpca.table_schema import TableSchema

if TYPE_CHECKING:
    from fedpca.protocol import ReleasePlan

__all__ = ["MAX_STATED_COUNT", "OwnerTerms"]

MAX_STATED_COUNT = 1 << 31
"""The largest quorum or daily task cap terms state: an owner states a larger one as
this, which binds no query differently (no deployment has 2**31 owners, nor an owner
2**31 tasks a day), and the wire carries it."""


@dataclass(frozen=True)
class OwnerTerms:
    """What one owner answers.

    Attributes
    ----------
    schema : its file's column count and configured label column.
    neighbouring : the relation its ledger accounts under (``[privacy] neighbouring``).
    allowed_kinds : the release kinds it answers (``policy.allowed_kinds``).
    allowed_columns : the only file columns a query may read, or None for any
        (``policy.allowed_columns``).
    allow_masked_mode, allow_not_private : ``policy.allow_masked_mode`` and
        ``policy.allow_not_private``.
    max_delta_per_query : the largest delta a query may state (the policy's cap, else
        the budget's delta, at most 1e-5).
    max_epsilon_per_query : the largest epsilon of one release, measured at
        ``budget_delta`` from the release's noise (``policy.max_epsilon_per_query``).
    budget_delta : the delta of its budget, at which a release's epsilon is measured.
    accountant : how its ledger composes releases.
    min_quorum : the smallest quorum it contributes to (``policy.min_quorum``).
    max_tasks_per_day : tasks it begins per 24 hours (``policy.max_tasks_per_day``).
    max_records : its capacity when it enforces it (``data.max_records`` with
        ``data.enforce_max_records``; a query for bounded owner tables needs it), else
        None.
    """

    schema: TableSchema
    neighbouring: Neighbouring
    allowed_kinds: tuple[ReleaseKind, ...]
    allowed_columns: tuple[int, ...] | None
    allow_masked_mode: bool
    allow_not_private: bool
    max_delta_per_query: float
    max_epsilon_per_query: float
    budget_delta: float
    accountant: Accountant
    min_quorum: int
    max_tasks_per_day: int
    max_records: int | None = None

    def check_statement(self, spec: QuerySpec) -> None:
        """Refuse a query whose statement these terms do not accept: its relation, its
        kinds, masked mode, epsilon = inf, its delta, a calibration for bounded owner
        tables, its quorum.

        Raises
        ------
        PolicyError
        """
        if spec.neighbouring is not self.neighbouring:
            raise PolicyError(
                f"the query is stated for {spec.neighbouring.value} adjacency; this deployment "
                f"accounts under {self.neighbouring.value}"
            )
        for kind in spec.release_kinds:
            if kind not in self.allowed_kinds:
                raise PolicyError(
                    f"{kind.value} queries are not in policy.allowed_kinds "
                    f"({', '.join(k.value for k in self.allowed_kinds)})"
                )
        if spec.mode is ProtocolMode.MASKED and not self.allow_masked_mode:
            raise PolicyError(
                "masked mode reveals this owner's record count to the proxy; "
                "policy.allow_masked_mode is false"
            )
        if math.isinf(spec.epsilon):
            if not self.allow_not_private:
                raise PolicyError(
                    "the query asks for epsilon = inf (no noise, NOT PRIVATE); "
                    "policy.allow_not_private is false"
                )
        elif spec.delta > self.max_delta_per_query:
            delta, cap = distinct(spec.delta, self.max_delta_per_query)
            raise PolicyError(
                f"the query's delta {delta} is above this owner's per-query cap {cap}"
            )
        if spec.bounded_owner_tables:
            self._check_bounded_table(spec)
        if spec.quorum < self.min_quorum:
            raise PolicyError(
                f"the query's quorum {spec.quorum} is below policy.min_quorum = {self.min_quorum}"
            )

    def _check_bounded_table(self, spec: QuerySpec) -> None:
        """A query calibrated for owners that never sample."""
        if self.max_records is None:
            raise PolicyError(
                "the query is calibrated for bounded owner tables; this owner does not "
                "enforce its max_records (data.enforce_max_records is false), so it could "
                "have to sample"
            )
        if spec.max_records_per_owner < self.max_records:
            raise PolicyError(
                f"the query is calibrated for bounded owner tables, but its "
                f"max_records_per_owner {spec.max_records_per_owner} is below this owner's "
                f"public max_records {self.max_records}, so it could have to sample"
            )

    def check_columns(self, spec: QuerySpec) -> None:
        """Refuse a query that reads a column ``policy.allowed_columns`` leaves out, or
        that does not fit the table's columns (:meth:`TableSchema.query_columns`).

        Raises
        ------
        PolicyError
        """
        allowed = self.allowed_columns
        if allowed is not None:
            members = frozenset(allowed)  # terms may allow thousands of columns
            refused = [c for c in self.schema.columns_read(spec) if c not in members]
            if refused:
                raise PolicyError(
                    f"the query reads column {refused[0]} (0-based), which is not in "
                    f"policy.allowed_columns ({', '.join(str(c) for c in allowed)})"
                )
        self.schema.query_columns(spec)

    def check_epsilon(self, plan: ReleasePlan) -> None:
        """Refuse a release whose noise costs more than ``max_epsilon_per_query`` at the
        budget's delta (a large stated delta cannot make a weak release look cheap).

        Raises
        ------
        PolicyError
        """
        if not plan.private:
            return
        # dp_accounting takes about a second to import: only where a plan is judged.
        from fedpca.dp.accounting import compose_epsilon

        event = plan.privacy_event(analyst=plan.spec.analyst_key_fingerprint)
        at = self.budget_delta
        try:
            epsilon = compose_epsilon([event], at, self.accountant)
        except CalibrationError as exc:
            raise PolicyError(f"the release has too little noise to be accounted: {exc}") from None
        if epsilon > self.max_epsilon_per_query:
            # Enough digits that the two never print alike (4 printed "1 ... above ... = 1").
            cost, cap = distinct(epsilon, self.max_epsilon_per_query)
            raise PolicyError(
                f"the release costs epsilon = {cost} at this owner's budget delta "
                f"{at:g}, above policy.max_epsilon_per_query = {cap}"
            )

    def refusal(self, spec: QuerySpec) -> str | None:
        """Why an owner with these terms would decline ``spec``, or None if they accept
        it (its daily task limit aside, which the terms cannot tell)."""
        # Imported here: fedpca.protocol imports dp_accounting (about a second), and
        # the messages that carry terms are imported by every analyst command.
        from fedpca.protocol import ReleasePlan

        try:
            self.check_statement(spec)
            self.check_columns(spec)
            plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
            self.check_epsilon(plan)
        except (
            PolicyError,
            ConfigError,
            CalibrationError,
            LayoutError,
            EncodingOverflowError,
        ) as exc:
            return str(exc)
        return None
