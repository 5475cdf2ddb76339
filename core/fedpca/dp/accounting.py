"""Composition of Gaussian releases against a total (epsilon, delta) budget.

Each release in a ledger is a Gaussian mechanism characterised by its noise
multiplier z (see :mod:`fedpca.dp.mechanisms`), stated under one neighbouring
relation. The budget question "may this analyst (or this owner's data) take one more
release?" is answered by composing every past release plus the proposed one and
reading off epsilon at the budget's delta:

* **zcdp** (the default, proven for the mechanism fedpca runs): each release is
  rho-zCDP with rho = 1/(2 z^2), for the discrete Gaussian exactly as for the
  continuous one (Canonne, Kamath & Steinke 2020); rho adds up under composition, so
  a ledger is one Gaussian with z = (sum z_i^-2)^(-1/2), converted to (epsilon, delta)
  by dp_accounting's RDP accountant with the best known conversion.
* **pld-continuous** (labelled option): dp_accounting's privacy-loss-distribution
  accountant, numerically tight for the *continuous* Gaussian; for the discrete
  sampler it is a close approximation, not a proof (docs/privacy.md).

Additive delta terms (``PrivacyEvent.delta_extra``, e.g. the masked mode's
statistical mask) are subtracted from the budget's delta before the Gaussian part is
converted: the total failure probability is the Gaussian part's delta plus theirs.

A ledger is kept under one neighbouring relation (the deployment's); an event
recorded under another relation is refused, never mixed in.

Epsilon is not additive under composition, so a budget's epsilon minus the epsilon
spent is not what one more release may ask for: every check recomposes the whole
ledger, and that question is answered with the check itself
(:func:`fedpca.dp.next_query.largest_admissible_epsilon`).

A release with z = 0 (epsilon = inf, the NOT PRIVATE verification mode) composes to
an infinite epsilon: such a ledger only fits an infinite budget.

The PLD accountant has a floor, :data:`MIN_NOISE_MULTIPLIER`: a release (or a
composition) with less noise than that is refused with a
:class:`~fedpca.errors.CalibrationError` that names the limit, instead of exhausting
the memory of the process that checks the budget. The zcdp accountant is closed form
and has no floor.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from fedpca.dp.calibration import gaussian_epsilon, zcdp_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import BudgetExceededError, CalibrationError, CompositionError, ConfigError
from fedpca.formatting import distinct
from fedpca.query import Accountant, Neighbouring

__all__ = [
    "BUDGET_ROUNDING_SLACK",
    "MIN_NOISE_MULTIPLIER",
    "Accountant",
    "BudgetDecision",
    "check_budget",
    "compose_epsilon",
    "compose_recorded",
    "composed_gaussian_epsilon",
    "composed_noise_multiplier",
    "extra_delta",
    "max_epsilon_per_release",
    "noise_multiplier_of",
    "require_budget",
    "to_dp_event",
]

logger = logging.getLogger(__name__)

BUDGET_ROUNDING_SLACK = 1e-9
"""Relative slack of the budget comparison: a release composes to at most
``epsilon_total * (1 + BUDGET_ROUNDING_SLACK)``. It absorbs the floating-point error of
calibrating a release for exactly the remaining epsilon and recomputing its epsilon
(measured at most 3e-11 relative; docs/privacy.md, "Rounding slack of the accountant")."""

# RDP below PLD by more than this (absolute + relative) signals a numerical problem.
# dp_accounting's PLD grid is 1e-4 in privacy-loss units; measured PLD errors on
# Gaussian compositions are far below that.
CROSS_CHECK_SLACK_ABS = 1e-3
CROSS_CHECK_SLACK_REL = 1e-3

MIN_NOISE_MULTIPLIER = 0.1
"""Least noise multiplier z the PLD accountant accepts, for one release and for a
composition (whose z is ``composed_noise_multiplier``).

dp_accounting discretises a Gaussian's privacy loss on a grid of 1e-4 over a range
that grows like 1/z, and its cost grows faster still. Measured on 2 shared cores:
z = 1 (epsilon 4.4 at delta 1e-5) composes in 0.35 s, z = 0.1 (epsilon 92) in 3-4 s,
z = 0.02 (epsilon 1460) in 50 s, and z = 7.1e-4 (epsilon = 1e6) asks for a 150 GiB
array. Below z = 0.1 a release protects next to nothing (epsilon above 90 at
delta 1e-5, see :func:`max_epsilon_per_release`), so such queries are refused with a
CalibrationError naming this limit. The RDP accountant (closed form) has no floor.
"""


Release: TypeAlias = PrivacyEvent | float
"""A ledger entry: a recorded event, or just its noise multiplier z."""


def extra_delta(releases: Iterable[Release]) -> float:
    """Sum of the additive delta terms of the releases (plain z values have none)."""
    return math.fsum(r.delta_extra for r in releases if isinstance(r, PrivacyEvent))


def _gaussian_delta(releases: Sequence[Release], delta: float) -> float:
    """The delta left for the Gaussian part once the additive terms are paid (may be <= 0)."""
    return delta - extra_delta(releases)


def _check_relation(releases: Iterable[Release], neighbouring: Neighbouring | None) -> None:
    if neighbouring is None:
        return
    for release in releases:
        if isinstance(release, PrivacyEvent) and release.neighbouring is not neighbouring:
            raise ConfigError(
                f"release {release.query_id!r} is accounted under {release.neighbouring.value} "
                f"adjacency, but this ledger is kept under {neighbouring.value}; the two are "
                "never composed"
            )


def noise_multiplier_of(release: Release) -> float:
    """A release's noise multiplier z (its own, or the float given), checked."""
    if isinstance(release, PrivacyEvent):
        return release.noise_multiplier
    z = float(release)
    if not (math.isfinite(z) and z >= 0):
        raise ConfigError(f"a release's noise multiplier must be finite and >= 0, got {z!r}")
    return z


def _accountant(accountant: Accountant | str) -> Accountant:
    try:
        return Accountant(accountant)
    except ValueError:
        choices = ", ".join(a.value for a in Accountant)
        raise ConfigError(f"unknown accountant {accountant!r}; choose one of {choices}") from None


def to_dp_event(noise_multipliers: Iterable[float]) -> dp_event.DpEvent:
    """The dp_accounting event of a sequence of Gaussian releases.

    Identical multipliers are grouped into a ``SelfComposedDpEvent``: composition is
    commutative, and both accountants treat k copies of a Gaussian in closed form
    (PLD as one Gaussian with z / sqrt(k), RDP by multiplying its curve by k), which
    is exact and much faster than k convolutions. ``z = 0`` becomes a
    ``NonPrivateDpEvent`` (infinite epsilon).
    """
    counts = Counter(noise_multipliers)
    events: list[dp_event.DpEvent] = []
    for z, count in sorted(counts.items()):
        single: dp_event.DpEvent = (
            dp_event.NonPrivateDpEvent() if z == 0 else dp_event.GaussianDpEvent(z)
        )
        events.append(single if count == 1 else dp_event.SelfComposedDpEvent(single, count))
    if not events:
        return dp_event.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events)


def composed_noise_multiplier(noise_multipliers: Iterable[float]) -> float:
    """z of the one Gaussian release equal to the composition: ``(sum z_i^-2)^(-1/2)``.

    Exact for Gaussian mechanisms (their privacy loss distributions are Gaussian and
    add up). ``0.0`` if any release had z = 0, ``inf`` for an empty sequence.
    """
    multipliers = list(noise_multipliers)
    if any(z == 0 for z in multipliers):
        return 0.0
    # 1/z squared, not 1/(z*z): z*z underflows to 0 below 1e-162 (a ZeroDivisionError
    # from `fedpca dp compose 1e-300`, found by review); beyond the float range it is inf.
    inverse_squares = math.fsum(
        (1.0 / z) ** 2 if 1.0 / z < 1e154 else math.inf for z in multipliers
    )
    return math.inf if inverse_squares == 0 else 1.0 / math.sqrt(inverse_squares)


def max_epsilon_per_release(delta: float) -> float:
    """Largest per-release epsilon at ``delta`` the PLD accountant accepts.

    The epsilon of one Gaussian release with z = :data:`MIN_NOISE_MULTIPLIER`
    (analytic calibration): about 91.8 at delta = 1e-5.
    """
    return gaussian_epsilon(MIN_NOISE_MULTIPLIER, delta)


def _floor_message(z: float, delta: float, asked: float = math.nan) -> str:
    """Why z is refused; the most epsilon per release is told apart from ``asked``."""
    z_text, floor = distinct(z, MIN_NOISE_MULTIPLIER)
    limit = f"below the minimum {floor} the PLD accountant supports"
    if math.isnan(delta) or not 0 < delta < 1:
        return f"noise multiplier z={z_text} is {limit}"
    most = distinct(max_epsilon_per_release(delta), asked)[0]
    return (
        f"noise multiplier z={z_text} is {limit} (at delta={delta:g}: at most "
        f"epsilon={most} per release)"
    )


def _check_release_floor(release: Release, z: float, fallback_delta: float) -> None:
    """Refuse one release below the accountant's floor, naming its epsilon."""
    if not 0 < z < MIN_NOISE_MULTIPLIER:
        return
    if isinstance(release, PrivacyEvent):
        asked = release.epsilon
        if 0 < release.delta < 1:
            asked_text = distinct(asked, max_epsilon_per_release(release.delta))[0]
        else:
            asked_text = f"{asked:g}"
        raise CalibrationError(
            f"query {release.query_id!r} asks for epsilon={asked_text} at delta="
            f"{release.delta:g}: its {_floor_message(z, release.delta, asked)}; "
            "ask for a smaller epsilon"
        )
    raise CalibrationError(f"the proposed release's {_floor_message(z, fallback_delta)}")


def compose_epsilon(
    releases: Iterable[Release],
    delta: float,
    accountant: Accountant | str = Accountant.ZCDP,
    *,
    neighbouring: Neighbouring | None = None,
) -> float:
    """Epsilon at ``delta`` of the composition of Gaussian releases.

    Parameters
    ----------
    releases : iterable of PrivacyEvent or float
        Past releases, or their noise multipliers z.
    delta : float
        In ``(0, 1)``: the total delta; the releases' additive terms are paid from it.
    accountant : {"zcdp", "pld-continuous"}
    neighbouring : the ledger's relation; events of another relation are refused.

    Returns
    -------
    float
        ``0.0`` for an empty ledger, ``inf`` if any release had z = 0 or the additive
        delta terms use up ``delta``.

    Raises
    ------
    CalibrationError
        pld-continuous only: the composition's noise multiplier is below
        :data:`MIN_NOISE_MULTIPLIER`.
    ConfigError
        An event of another neighbouring relation than ``neighbouring``.
    """
    if math.isnan(delta) or not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    kind = _accountant(accountant)
    composition = _composition(releases, delta, neighbouring)
    if isinstance(composition, float):
        return composition
    z_composed, gaussian_delta, count = composition
    if kind is Accountant.ZCDP:
        # rho adds up: the ledger is one Gaussian with z_composed, for every order alpha.
        return zcdp_epsilon(z_composed, gaussian_delta)
    if z_composed < MIN_NOISE_MULTIPLIER:
        if count == 1:
            raise CalibrationError(f"one release: {_floor_message(z_composed, gaussian_delta)}")
        raise CompositionError(
            f"{count} composed releases: {_floor_message(z_composed, gaussian_delta)}"
        )
    # The composition of Gaussian releases *is* one Gaussian release with z_composed
    # (their privacy-loss distributions are Gaussian and add), so PLD accounts for
    # that single event: exact, and one PLD per check whatever the ledger's length.
    engine = PLDAccountant()
    engine.compose(dp_event.GaussianDpEvent(z_composed))
    return float(engine.get_epsilon(gaussian_delta))


def composed_gaussian_epsilon(
    releases: Iterable[Release], delta: float, *, neighbouring: Neighbouring | None = None
) -> float:
    """The epsilon at ``delta`` of the composition of ``releases`` as Gaussian releases,
    from the Gaussian's closed (epsilon, delta) curve at the composed z (the composition
    of Gaussian releases is one Gaussian with that z; the additive delta terms are taken
    off ``delta`` as :func:`compose_epsilon` does).

    The figure the pld-continuous accountant computes numerically, which it
    approximates from above within its discretisation (zcdp's conversion bounds it
    loosely); a monitoring figure, never what a ledger admits by. Its cost does not
    grow with the composed rho, as a PLD composition's does: an owner's monitoring gauge
    reads it, so a scrape takes the same time whatever analysts have spent.
    """
    composition = _composition(releases, delta, neighbouring)
    if isinstance(composition, float):
        return composition
    z_composed, gaussian_delta, _ = composition
    return gaussian_epsilon(z_composed, gaussian_delta)


def _composition(
    releases: Iterable[Release], delta: float, neighbouring: Neighbouring | None
) -> float | tuple[float, float, int]:
    """(composed z, the delta left to the Gaussian part, number of releases), or the
    epsilon itself where no accountant is needed: 0 for no release, infinity with a
    release without noise or additive delta terms that use up ``delta``."""
    listed = list(releases)
    _check_relation(listed, neighbouring)
    multipliers = [noise_multiplier_of(r) for r in listed]
    if not multipliers:
        return 0.0
    if any(z == 0 for z in multipliers):
        return math.inf
    gaussian_delta = _gaussian_delta(listed, delta)
    if gaussian_delta <= 0:
        return math.inf
    return composed_noise_multiplier(multipliers), gaussian_delta, len(multipliers)


def compose_recorded(
    ledger: Sequence[Release],
    delta: float,
    kind: Accountant | str,
    *,
    neighbouring: Neighbouring | None = None,
) -> float:
    """:func:`compose_epsilon` of the releases already recorded. A ledger of one release
    below the PLD floor (recorded under zcdp before the owner changed accountant) raises
    :class:`~fedpca.errors.CompositionError`, as a composition does: its message
    describes a recorded release, perhaps another analyst's, and an owner keeps it in
    its own log instead of sending it back with the decline."""
    try:
        return compose_epsilon(ledger, delta, kind, neighbouring=neighbouring)
    except CompositionError:
        raise
    except CalibrationError as exc:
        raise CompositionError(f"the ledger's {exc}") from None


@dataclass(frozen=True)
class BudgetDecision:
    """Whether one more release fits a total budget, and what it leaves.

    Attributes
    ----------
    fits : bool
        True if the ledger plus the proposed release stays within the budget.
    budget : PrivacyParams
        The total (epsilon, delta) the ledger is checked against.
    epsilon_spent_before, epsilon_spent_after : float
        Composed epsilon at ``budget.delta`` without / with the proposed release.
        A refused composition beyond the PLD floor (:data:`MIN_NOISE_MULTIPLIER`)
        reports the closed-form epsilon of the composed Gaussian as "after".
    accountant : Accountant
        Which accountant produced the spent values.
    cross_check_epsilon_after : float or None
        RDP's epsilon for the ledger plus the release when PLD was primary.
    """

    fits: bool
    budget: PrivacyParams
    epsilon_spent_before: float
    epsilon_spent_after: float
    accountant: Accountant
    cross_check_epsilon_after: float | None = None

    def raise_if_exceeded(self) -> None:
        """Raise :class:`BudgetExceededError` unless the release fits."""
        if not self.fits:
            raise BudgetExceededError(
                f"release refused: it would bring epsilon from {self.epsilon_spent_before!r} to "
                f"{self.epsilon_spent_after!r} at delta={self.budget.delta!r}, over the budget "
                f"epsilon={self.budget.epsilon!r} ({self.accountant.value} accountant)"
            )


def check_budget(
    ledger: Sequence[Release],
    proposed: Release,
    budget: PrivacyParams,
    accountant: Accountant | str = Accountant.ZCDP,
    *,
    neighbouring: Neighbouring | None = None,
    cross_check: bool = True,
    log: bool = True,
) -> BudgetDecision:
    """Decide whether ``proposed`` may be released after ``ledger`` within ``budget``.

    Parameters
    ----------
    ledger : sequence of PrivacyEvent or float
        Past releases to the same analyst from the same data (or their z).
    proposed : PrivacyEvent or float
        The release being asked for (or its z).
    budget : PrivacyParams
        Total (epsilon, delta). ``epsilon = inf`` accepts everything.
    accountant : {"zcdp", "pld-continuous"}
        Primary accountant (zcdp by default).
    neighbouring : the ledger's relation; events of another relation are refused.
    cross_check : bool
        With pld-continuous primary, also compose with zcdp and log a warning if it
        reports a smaller epsilon than PLD beyond the numerical slack (both bound the
        continuous Gaussian's epsilon from above; a smaller zcdp value means a numerical
        problem in the PLD).
    log : bool
        Log the decision (INFO). A search that makes many checks to answer one
        question (:func:`fedpca.dp.next_query.largest_admissible_epsilon`) passes False.

    Returns
    -------
    BudgetDecision

    Raises
    ------
    CalibrationError
        pld-continuous only: the proposed release has a noise multiplier below
        :data:`MIN_NOISE_MULTIPLIER` (whatever the budget), or its composition with
        the ledger has, and the budget is not already exceeded by that composition
        (e.g. an infinite budget).
    ConfigError
        An event of another neighbouring relation than ``neighbouring``.
    """
    kind = _accountant(accountant)
    _check_relation([*ledger, proposed], neighbouring)
    multipliers = [noise_multiplier_of(r) for r in ledger]
    z_new = noise_multiplier_of(proposed)
    after_releases = [*ledger, proposed]
    if kind is Accountant.PLD_CONTINUOUS:
        _check_release_floor(proposed, z_new, budget.delta)
    if math.isinf(budget.epsilon):
        # An unlimited budget accepts everything; spent values are still reported when
        # the budget's delta allows computing them (it may be 0 or 1 here).
        spent = (math.nan, math.nan)
        if 0 < budget.delta < 1:
            spent = (
                compose_recorded(ledger, budget.delta, kind),
                compose_epsilon(after_releases, budget.delta, kind),
            )
        return BudgetDecision(True, budget, spent[0], spent[1], kind)
    before = compose_recorded(ledger, budget.delta, kind)
    z_after = composed_noise_multiplier([*multipliers, z_new])
    beyond_pld = kind is Accountant.PLD_CONTINUOUS and 0 < z_after < MIN_NOISE_MULTIPLIER
    gaussian_delta = _gaussian_delta(after_releases, budget.delta)
    if beyond_pld and gaussian_delta > 0:
        # Each release is accountable but the composition is not. Its epsilon is that
        # of one Gaussian with z_after (closed form, exact for Gaussians); a budget
        # below it refuses the release as usual, anything else cannot be accounted.
        after = gaussian_epsilon(z_after, gaussian_delta)
        if after <= budget.epsilon:
            raise CompositionError(
                f"{len(multipliers) + 1} composed releases: "
                f"{_floor_message(z_after, gaussian_delta)}; a budget of epsilon="
                f"{budget.epsilon:g} cannot be accounted for"
            )
    else:
        after = compose_epsilon(after_releases, budget.delta, kind)
    # A release asking for exactly what is left lands within float error of the total
    # (calibration and accounting each round): BUDGET_ROUNDING_SLACK, docs/privacy.md.
    # Requiring before < total as well keeps an exactly-full ledger closed even if
    # a very weak release did not move the composed epsilon in floating point.
    fits = after <= budget.epsilon * (1.0 + BUDGET_ROUNDING_SLACK) and before < budget.epsilon
    cross: float | None = None
    if (
        cross_check
        and kind is Accountant.PLD_CONTINUOUS
        and math.isfinite(after)
        and not beyond_pld
    ):
        cross = compose_epsilon(after_releases, budget.delta, Accountant.ZCDP)
        if cross < after - CROSS_CHECK_SLACK_ABS - CROSS_CHECK_SLACK_REL * after:
            logger.warning(
                "zcdp epsilon %.6g is below PLD epsilon %.6g at delta=%g: numerical problem "
                "in the PLD accountant",
                cross,
                after,
                budget.delta,
            )
    decision = BudgetDecision(
        fits=fits,
        budget=budget,
        epsilon_spent_before=before,
        epsilon_spent_after=after,
        accountant=kind,
        cross_check_epsilon_after=cross,
    )
    if log:
        logger.info(
            "budget check: %s (epsilon %.6g -> %.6g of %.6g at delta=%g, %s)",
            "fits" if fits else "refused",
            before,
            after,
            budget.epsilon,
            budget.delta,
            kind.value,
        )
    return decision


def require_budget(
    ledger: Sequence[Release],
    proposed: Release,
    budget: PrivacyParams,
    accountant: Accountant | str = Accountant.ZCDP,
    *,
    neighbouring: Neighbouring | None = None,
) -> BudgetDecision:
    """:func:`check_budget`, raising :class:`BudgetExceededError` if it does not fit."""
    decision = check_budget(ledger, proposed, budget, accountant, neighbouring=neighbouring)
    decision.raise_if_exceeded()
    return decision
