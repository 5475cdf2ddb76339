"""What a privacy budget still admits, as plain values every role shares.

"How much epsilon may my next query ask for?" has no additive answer: composition
(zCDP or PLD) is not additive in epsilon, so the budget's limit minus the epsilon spent
is not it. :func:`fedpca.dp.accounting.largest_admissible_epsilon` answers it with the
admission rule itself, and its answer, a :class:`NextQuery`, is what the proxy reports to
an analyst (``BudgetStatus.next_query``) and what ``fedpca analyst budget`` and
``fedpca owner budget`` print. Nothing is computed here (no dp_accounting import), so
that the messages package can carry these values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from fedpca.errors import ConfigError
from fedpca.formatting import distinct

__all__ = ["NOT_ADDITIVE", "AdmissionLimit", "NextQuery"]


class AdmissionLimit(StrEnum):
    """What a query asking for more epsilon than :attr:`NextQuery.epsilon` runs into."""

    BUDGET = "budget"
    """Its composition with the ledger would exceed the budget."""
    PER_QUERY_CAP = "per-query-cap"
    """Its own epsilon at the budget's delta would exceed an owner's
    ``policy.max_epsilon_per_query``."""
    NOISE_FLOOR = "noise-floor"
    """It (or its composition with the ledger) would have less noise than the accountant
    accepts: pld-continuous's ``MIN_NOISE_MULTIPLIER``."""
    EXHAUSTED = "exhausted"
    """Nothing is admitted any more: the epsilon is 0."""
    UNLIMITED = "unlimited"
    """An infinite budget under an accountant with no floor: any epsilon (inf)."""


@dataclass(frozen=True)
class NextQuery:
    """The largest epsilon one more query may ask for and still be admitted now.

    Attributes
    ----------
    epsilon : float
        Rounded down to a few significant digits, so that a query asking for exactly
        this value is admitted; ``0.0`` when exhausted, ``inf`` when unlimited.
    delta : float
        The query's own delta, in ``(0, 1)``: with its epsilon it fixes the query's noise
        multiplier, which is all the accountant sees of it.
    limit : AdmissionLimit
        Why a larger epsilon would be refused.

    Raises
    ------
    ConfigError
        A value out of range, or an epsilon that contradicts the limit (0 goes with
        EXHAUSTED and only with it, inf with UNLIMITED and only with it).
    """

    epsilon: float
    delta: float
    limit: AdmissionLimit

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "limit", AdmissionLimit(self.limit))
        except ValueError:
            raise ConfigError(f"NextQuery: unknown limit {self.limit!r}") from None
        if math.isnan(self.epsilon) or self.epsilon < 0:
            raise ConfigError(f"NextQuery: epsilon must be >= 0, got {self.epsilon!r}")
        if math.isnan(self.delta) or not 0 < self.delta < 1:
            raise ConfigError(f"NextQuery: delta must be in (0, 1), got {self.delta!r}")
        if (self.epsilon == 0) != (self.limit is AdmissionLimit.EXHAUSTED) or math.isinf(
            self.epsilon
        ) != (self.limit is AdmissionLimit.UNLIMITED):
            raise ConfigError(
                f"NextQuery: epsilon {self.epsilon!r} does not go with limit {self.limit.value}"
            )

    def summary(self, *, per_query_cap: tuple[float, float] | None = None) -> str:
        """What the budget commands print, e.g. ``epsilon up to 0.412345 at delta 1e-06``.

        The epsilon is printed with 6 significant digits: exactly the value checked.
        ``per_query_cap``, the cap's (epsilon, delta), is named when it binds: the cap
        is measured at the budget's delta, the epsilon shown at the query's, so each
        figure is printed with its own delta (a query's epsilon at a smaller delta is
        larger than the cap it meets at the budget's).
        """
        if self.limit is AdmissionLimit.EXHAUSTED:
            return "none: the budget is exhausted"
        if self.limit is AdmissionLimit.UNLIMITED:
            return "any epsilon (the budget is unlimited)"
        text = f"epsilon up to {self.epsilon:.6g} at delta {self.delta:g}"
        if self.limit is AdmissionLimit.PER_QUERY_CAP and per_query_cap is not None:
            cap, cap_delta = per_query_cap
            return text + (
                f" (capped by policy.max_epsilon_per_query: epsilon {cap:g} at "
                f"the budget's delta {cap_delta:g})"
            )
        return text + _CAPS.get(self.limit, "")

    def notes(self, budget_epsilon: float, budget_delta: float) -> tuple[str, ...]:
        """The explanations the budget commands print under :meth:`summary`.

        None when nothing or everything is admitted. Otherwise, when the epsilon shown
        is above the budget's own (it is the query's epsilon at the query's delta, and
        by the zcdp calibration; the budget is composed at its delta by its accountant),
        a line that says why; then :data:`NOT_ADDITIVE`.
        """
        if self.limit in (AdmissionLimit.EXHAUSTED, AdmissionLimit.UNLIMITED):
            return ()
        notes: list[str] = []
        if self.epsilon > budget_epsilon:
            budget = distinct(self.epsilon, budget_epsilon)[1]
            if self.delta != budget_delta:
                query_delta, at = distinct(self.delta, budget_delta)
                why = (
                    f"it is at the query's delta {query_delta}, the budget at delta {at}; "
                    "the same noise costs more epsilon at a smaller delta"
                )
            else:
                why = (
                    "it is the query's epsilon by the zcdp calibration; the budget's "
                    "accountant counts the same noise as less epsilon"
                )
            notes.append(f"more than the budget's epsilon {budget}: {why}")
        notes.append(NOT_ADDITIVE)
        return tuple(notes)


_CAPS = {
    AdmissionLimit.PER_QUERY_CAP: (
        " (capped by policy.max_epsilon_per_query, measured at the budget's delta)"
    ),
    AdmissionLimit.NOISE_FLOOR: " (capped by the least noise the PLD accountant accepts)",
}

NOT_ADDITIVE = (
    "composition is not additive; this is what the accountant admits now for a query at "
    "this delta (another delta admits another epsilon: --query-delta)"
)
"""The explanation the budget commands print under :meth:`NextQuery.summary` (the last
of :meth:`NextQuery.notes`)."""
