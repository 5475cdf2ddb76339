"""The largest epsilon one more query may ask for and still be admitted.

Composition is not additive in epsilon, so "the budget's epsilon minus the epsilon spent"
does not say what the next query may ask for. This module answers that question with the
admission rule itself (:func:`fedpca.dp.accounting.check_budget`, with the ledger's
accountant, neighbouring relation and rounding slack), by bisection on the query's
epsilon. The proxy reports the answer to an analyst (``fedpca analyst budget``) and an
owner prints its own (``fedpca owner budget``); it is a function of the ledger and of
public configuration only (docs/privacy.md, "What each party observes").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from decimal import ROUND_FLOOR, Decimal

from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.dp.accounting import (
    MIN_NOISE_MULTIPLIER,
    Accountant,
    Release,
    check_budget,
    compose_epsilon,
    extra_delta,
    noise_multiplier_of,
)
from fedpca.dp.calibration import (
    analytic_gaussian_sigma,
    calibrate_noise_multiplier,
    zcdp_epsilon,
    zcdp_noise_multiplier,
)
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import CalibrationError, ConfigError
from fedpca.query import Neighbouring

__all__ = ["ADMISSION_RTOL", "MAX_ADMISSION_CHECKS", "largest_admissible_epsilon"]

logger = logging.getLogger(__name__)


ADMISSION_RTOL = 1e-5
"""Relative precision of :func:`largest_admissible_epsilon`: its answer is below the
largest admitted epsilon by at most this much."""

MAX_ADMISSION_CHECKS = 16
"""Most admission checks one :func:`largest_admissible_epsilon` makes. From its closed-form
first guess it usually needs 2 (one admitted, one refused a grid step above); each
composes the ledger with and without the query, which takes about a millisecond under
zcdp and 0.1-1.5 s under pld-continuous (benchmarks/next_query_epsilon.py)."""


def largest_admissible_epsilon(
    ledger: Sequence[Release],
    budget: PrivacyParams,
    query_delta: float,
    accountant: Accountant | str = Accountant.ZCDP,
    *,
    neighbouring: Neighbouring | None = None,
    max_release_epsilon: float | None = None,
    fits_share: Callable[[float], bool] | None = None,
    rtol: float = ADMISSION_RTOL,
    max_checks: int = MAX_ADMISSION_CHECKS,
) -> NextQuery:
    """The largest epsilon one more query at ``query_delta`` may ask for and be admitted.

    A query's (epsilon, delta) reaches the accountant only as its noise multiplier
    ``z = calibrate_noise_multiplier(epsilon, delta)`` (the default zcdp calibration; a
    stats-mode plan rounds its noise up, never down). Each candidate epsilon is decided
    by the admission rule itself, :func:`~fedpca.dp.accounting.check_budget` of ``z`` after
    ``ledger``, so the answer is exactly what a submission would be told. A larger
    epsilon means a smaller z and a larger composed epsilon, so admission is monotone and
    a bisection finds the boundary: from a close guess (the closed forms of the two
    accountants), on a grid of decimal numbers with ``1 - log10(rtol)`` significant
    digits, keeping the largest candidate admitted. The answer is therefore rounded
    down, within ``rtol``, and a query that asks for exactly it is admitted.

    Parameters
    ----------
    ledger : sequence of PrivacyEvent or float
        Past releases charged to the budget (or their z).
    budget : PrivacyParams
        Total (epsilon, delta); an infinite epsilon admits everything the accountant can
        account for.
    query_delta : float
        In ``(0, 1)``: the delta the next query states. It fixes the query's z together
        with its epsilon; the budget is still composed at ``budget.delta``.
    accountant, neighbouring
        As for :func:`~fedpca.dp.accounting.check_budget`: the ledger's.
    max_release_epsilon : float, optional
        Also refuse a release whose own epsilon at ``budget.delta`` exceeds this, as an
        owner's ``policy.max_epsilon_per_query`` does.
    fits_share : callable, optional
        Also refuse a release whose noise multiplier z it rejects: an analyst's share of
        an owner's budget (:meth:`fedpca.dp.shares.BudgetShares.check`), checked before
        the whole budget as the owner does; reported as the BUDGET limit.
    rtol : float
        Relative precision, in ``(0, 0.1]``.
    max_checks : int
        Most admission checks; an unfinished search returns its largest admitted
        candidate (still admitted, less precise).

    Returns
    -------
    NextQuery
        ``epsilon = 0`` (EXHAUSTED) when nothing is admitted (or a search cut short by
        ``max_checks`` found nothing admitted), ``inf`` (UNLIMITED) for
        an infinite budget under zcdp with no per-release cap; otherwise the limit a
        slightly larger epsilon runs into: the budget, the per-release cap, or the PLD
        accountant's :data:`~fedpca.dp.accounting.MIN_NOISE_MULTIPLIER` (see
        :func:`~fedpca.dp.accounting.max_epsilon_per_release`).

    Raises
    ------
    ConfigError
        ``query_delta``, ``rtol`` or ``max_checks`` out of range, an unknown accountant,
        or an event of another neighbouring relation than ``neighbouring``.
    """
    try:
        kind = Accountant(accountant)
    except ValueError:
        raise ConfigError(f"unknown accountant {accountant!r}") from None
    if math.isnan(query_delta) or not 0 < query_delta < 1:
        raise ConfigError(f"query delta must be in (0, 1), got {query_delta!r}")
    if math.isnan(rtol) or not 0 < rtol <= 0.1:
        raise ConfigError(f"rtol must be in (0, 0.1], got {rtol!r}")
    if max_checks < 1:
        raise ConfigError(f"max_checks must be >= 1, got {max_checks!r}")
    if math.isinf(budget.epsilon) and kind is Accountant.ZCDP and max_release_epsilon is None:
        # Everything fits; the check still refuses a ledger of another relation.
        check_budget(ledger, 1.0, budget, kind, neighbouring=neighbouring, log=False)
        logger.debug("largest admissible epsilon inf (unlimited), %d checks", 1)
        return NextQuery(math.inf, query_delta, AdmissionLimit.UNLIMITED)
    digits = 1 + math.ceil(-math.log10(rtol))
    checks = 0

    def refusal(epsilon: float) -> AdmissionLimit | None:
        """Why a query asking for ``epsilon`` would be refused (None: it is admitted)."""
        nonlocal checks
        checks += 1
        try:
            z = calibrate_noise_multiplier(epsilon, query_delta)
            if max_release_epsilon is not None:
                own = compose_epsilon([z], budget.delta, kind)
                if own > max_release_epsilon:
                    return AdmissionLimit.PER_QUERY_CAP
            if fits_share is not None and not fits_share(z):
                return AdmissionLimit.BUDGET
            decision = check_budget(
                ledger, z, budget, kind, neighbouring=neighbouring, cross_check=False, log=False
            )
        except CalibrationError:
            # The PLD floor (or, at absurd epsilons, no z to calibrate): refused as the
            # submission would be.
            return AdmissionLimit.NOISE_FLOOR
        if decision.fits:
            return None
        if not decision.epsilon_spent_before < budget.epsilon:
            return AdmissionLimit.EXHAUSTED  # the ledger alone fills the budget
        return AdmissionLimit.BUDGET

    lo, hi, hi_limit = 0.0, math.inf, AdmissionLimit.BUDGET
    guess = _admission_guess(ledger, budget, query_delta, kind, max_release_epsilon)
    candidate = _round_down(guess if 0 < guess < math.inf else 1.0, digits)
    width = rtol
    # Bracket the boundary from the guess, widening the step eightfold each time.
    while checks < max_checks and (lo == 0 or math.isinf(hi)):
        limit = refusal(candidate)
        if limit is AdmissionLimit.EXHAUSTED:
            return NextQuery(0.0, query_delta, limit)
        if limit is None:
            lo = candidate
        else:
            hi, hi_limit = candidate, limit
        candidate = _round_down(hi / (1 + width) if lo == 0 else lo * (1 + width), digits)
        width *= 8.0
        if not 0 < candidate < math.inf:
            break
    # Bisect (geometrically) on the decimal grid until hi is within rtol of lo, or its
    # neighbour on the grid.
    while checks < max_checks and lo > 0 and lo * (1 + rtol) < hi < math.inf:
        candidate = _round_down(math.sqrt(lo * hi), digits)
        if candidate <= lo:
            candidate = _grid_step_up(lo, digits)
        if candidate >= hi:
            break
        limit = refusal(candidate)
        if limit is None:
            lo = candidate
        else:
            hi, hi_limit = candidate, limit
    logger.debug("largest admissible epsilon %.6g (%s), %d checks", lo, hi_limit.value, checks)
    if lo == 0:
        return NextQuery(0.0, query_delta, AdmissionLimit.EXHAUSTED)
    return NextQuery(lo, query_delta, hi_limit)


def _admission_guess(
    ledger: Sequence[Release],
    budget: PrivacyParams,
    query_delta: float,
    kind: Accountant,
    max_release_epsilon: float | None,
) -> float:
    """A close first guess of :func:`largest_admissible_epsilon`, from closed forms.

    The ledger and the query compose to one Gaussian whose z_total must reach the
    budget's (zcdp: its conversion inverted; PLD: the analytic Gaussian's calibration,
    which PLD approximates), so the query may take ``z^-2 = z_total^-2 - sum z_i^-2``.
    Any failure gives 1: the search only starts from it.
    """
    floor = MIN_NOISE_MULTIPLIER if kind is Accountant.PLD_CONTINUOUS else 0.0
    invert = zcdp_noise_multiplier if kind is Accountant.ZCDP else analytic_gaussian_sigma
    try:
        z_total = z_new = floor
        gaussian_delta = budget.delta - extra_delta(ledger)
        if math.isfinite(budget.epsilon) and gaussian_delta > 0:
            z_total = max(floor, invert(budget.epsilon, gaussian_delta))
        if z_total > 0:
            multipliers = [noise_multiplier_of(r) for r in ledger]
            used = math.inf if 0 in multipliers else math.fsum(z**-2 for z in multipliers)
            room = z_total**-2 - used
            if not room > 0:
                return 1e-3  # about full: the first check says so
            z_new = max(floor, room**-0.5)
        if max_release_epsilon is not None:
            z_new = max(z_new, invert(max_release_epsilon, budget.delta))
        return zcdp_epsilon(z_new, query_delta) if z_new > 0 else 1.0
    except (CalibrationError, ConfigError, ZeroDivisionError, OverflowError):
        return 1.0


def _round_down(value: float, digits: int) -> float:
    """``value`` rounded down to ``digits`` significant decimal digits (never above it)."""
    if not (math.isfinite(value) and value > 0):
        return value
    exact = Decimal(value)
    quantum = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    # The nearest double to a decimal at most ``value`` (itself a double) is at most it.
    return float(exact.quantize(quantum, rounding=ROUND_FLOOR))


def _grid_step_up(value: float, digits: int) -> float:
    """The next number above ``value`` (a result of :func:`_round_down`) on its grid."""
    exact = Decimal(repr(value))
    return float(exact + Decimal(1).scaleb(exact.adjusted() - digits + 1))
