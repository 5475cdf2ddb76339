"""Per-analyst shares of one owner's privacy budget.

An owner's ledger composes every analyst's releases, so whether it admits a query
depends on what all analysts together have spent there, and a decline tells one analyst
something about the others (docs/privacy.md, "What budget declines say about other
analysts"). With shares, each pinned analyst key ``a`` holds a fraction ``w_a`` of the
budget (the fractions add up to at most 1), and a release is admitted only while that
analyst's *own* releases stay within ``w_a`` of two resources that add up exactly under
composition:

* the Gaussian part, rho = sum of 1 / (2 z_i^2) over the releases (both accountants are
  functions of it: the composition of Gaussian releases is one Gaussian release with
  that rho), against ``w_a * rho_max``, where ``rho_max`` is the largest rho whose
  conversion at ``delta - extra_delta_cap`` is within the budget's epsilon;
* the additive delta terms (the masked mode's mask), against ``w_a * extra_delta_cap``,
  with ``extra_delta_cap`` = :data:`EXTRA_DELTA_FRACTION` of the budget's delta.

While every analyst is within its share, the whole ledger has rho <= rho_max and additive
terms <= extra_delta_cap, and a composition's epsilon grows with rho and falls with the
delta left to the Gaussian part, so the owner-wide check (the ledger's composition of
every release against the whole budget) is implied by the share check: the owner's
ledger then makes the share check only, from the analyst's own releases, and a decline,
its figures and the time it takes are functions of those and of public configuration.
:meth:`BudgetShares.over_share` names the analysts for which this does not hold
(releases recorded before the shares were set, or a share cut below what was used):
while it is not empty, the ledger makes the owner-wide check after the share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fedpca.dp.accounting import MIN_NOISE_MULTIPLIER, Accountant, compose_epsilon
from fedpca.dp.calibration import analytic_gaussian_sigma, zcdp_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import CalibrationError, ConfigError, ShareExceededError

__all__ = [
    "EXTRA_DELTA_FRACTION",
    "BudgetShares",
    "ShareCheck",
    "check_fractions",
    "fractions_from_config",
]

EXTRA_DELTA_FRACTION = 0.01
"""Part of the budget's delta set aside for additive delta terms when shares are used
(the masked mode's M * 2^-40 per release); the Gaussian part is converted at the rest."""

_PLD_ROUNDS = 200
"""Most steps of 10^-4 by which a PLD calibration is raised until the accountant agrees."""


def check_fractions(fractions: Mapping[str, float], accepted_keys: Iterable[str]) -> None:
    """Validate the configured shares against the pinned analyst keys.

    A share may name a key that is no longer pinned: a retired key, whose releases stay
    on the ledger and are counted against its share (it can take no new ones). Without
    it they would count as beyond any share, and the ledger would compose every
    analyst's releases for good.

    Raises
    ------
    ConfigError
        A fraction outside (0, 1], a pinned key without a share, or fractions that add
        up to more than 1.
    """
    accepted = set(accepted_keys)
    for key, fraction in fractions.items():
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ConfigError(f"budget.analyst_shares[{key!r}] must be a number, got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ConfigError(f"budget.analyst_shares[{key!r}] must be in (0, 1], got {fraction!r}")
    missing = sorted(accepted - set(fractions))
    if missing:
        raise ConfigError(
            f"budget.analyst_shares has no share for the pinned analyst key {missing[0]!r}: "
            "with shares, every key in policy.accepted_analyst_keys needs one"
        )
    # fsum rounds the exact sum once: k copies of 1/k (as `owner init` writes them) add
    # up to 1.0, and what rounding leaves above 1 (< 2^-52) is within the accountant's
    # 1e-9 rounding slack (docs/privacy.md, "Per-analyst shares").
    total = math.fsum(fractions.values())
    if total > 1:
        raise ConfigError(f"budget.analyst_shares add up to {total:.6g}, more than 1")


def fractions_from_config(
    value: object, accepted_keys: Iterable[str], budget: PrivacyParams, *, allow_not_private: bool
) -> dict[str, float]:
    """``[budget] analyst_shares`` of an owner's configuration, validated ({}: no shares).

    Raises
    ------
    ConfigError
        Not a table of fractions, fractions that :func:`check_fractions` refuses, an
        infinite budget, or shares together with ``policy.allow_not_private``.
    """
    if not isinstance(value, Mapping):
        raise ConfigError(
            'budget.analyst_shares must be a table of fractions, e.g. { "sha256:..." = 0.5 }'
        )
    if not value:
        return {}
    check_fractions(value, accepted_keys)
    if not budget.private:
        raise ConfigError("budget.analyst_shares needs a finite budget.epsilon")
    if allow_not_private:
        # An epsilon = inf release fills every share at once: declines would again
        # depend on another analyst's releases.
        raise ConfigError("budget.analyst_shares cannot be combined with policy.allow_not_private")
    return {str(key): float(fraction) for key, fraction in value.items()}


def _rho(event: PrivacyEvent) -> float:
    z = event.noise_multiplier
    return math.inf if z == 0 else 1.0 / (2.0 * z * z)


@dataclass(frozen=True)
class ShareCheck:
    """Whether one more release fits its analyst's share, and how much of it is used.

    ``used_before`` and ``used_after`` are fractions of the analyst's share (1 = all of
    it), the larger of the Gaussian part's and the additive delta's.
    """

    fits: bool
    analyst: str
    share: float
    used_before: float
    used_after: float


@dataclass(frozen=True)
class BudgetShares:
    """Fractions of one budget, per analyst key, in the two additive resources.

    Build with :meth:`for_budget`.
    """

    fractions: Mapping[str, float]
    rho_max: float
    extra_delta_cap: float
    budget: PrivacyParams
    """The budget the shares divide (a ledger refuses to check them against another)."""

    @classmethod
    def for_budget(
        cls,
        fractions: Mapping[str, float],
        budget: PrivacyParams,
        accountant: Accountant | str = Accountant.ZCDP,
    ) -> BudgetShares:
        """The shares of ``budget`` under ``accountant``.

        Raises
        ------
        ConfigError
            An infinite budget (nothing to share), or fractions out of range.
        """
        if not budget.private:
            raise ConfigError("budget.analyst_shares needs a finite budget.epsilon")
        check_fractions(fractions, fractions)
        extra_cap = budget.delta * EXTRA_DELTA_FRACTION
        try:
            z = _least_noise_multiplier(
                budget.epsilon, budget.delta - extra_cap, Accountant(accountant)
            )
        except CalibrationError as exc:
            raise ConfigError(f"budget.analyst_shares: {exc}") from None
        return cls(dict(fractions), 1.0 / (2.0 * z * z), extra_cap, budget)

    def share_of(self, analyst: str) -> float:
        """The analyst's fraction (0 for a key without a share)."""
        return float(self.fractions.get(analyst, 0.0))

    def used(self, events: Iterable[PrivacyEvent], analyst: str) -> float:
        """How much of ``analyst``'s share its releases in ``events`` use (inf: no share)."""
        own = [e for e in events if e.analyst == analyst]
        return self._used(own, self.share_of(analyst))

    def check(self, past: Sequence[PrivacyEvent], event: PrivacyEvent) -> ShareCheck:
        """Whether ``event`` fits its analyst's share after that analyst's ``past`` releases.

        Only the releases of ``event.analyst`` are read: the answer does not depend on
        any other analyst's.
        """
        own = [e for e in past if e.analyst == event.analyst]
        share = self.share_of(event.analyst)
        before = self._used(own, share)
        after = self._used([*own, event], share)
        return ShareCheck(after <= 1.0, event.analyst, share, before, after)

    def require(self, past: Sequence[PrivacyEvent], event: PrivacyEvent) -> ShareCheck:
        """:meth:`check`, refusing ``event`` beyond its analyst's share.

        Raises
        ------
        ShareExceededError
            With the analyst's own figures (its share used before and after).
        """
        check = self.check(past, event)
        if not check.fits:
            raise ShareExceededError(
                f"query {event.query_id!r} refused: it would bring analyst {check.analyst}'s "
                f"use of its share ({check.share:g} of the budget) from "
                f"{check.used_before:.4%} to {check.used_after:.4%}"
            )
        return check

    def admits(self, past: Sequence[PrivacyEvent], analyst: str, noise_multiplier: float) -> bool:
        """Whether a stats-mode release with this z (no additive delta) fits ``analyst``'s
        share after its ``past`` releases (for "what may the next query ask for")."""
        share = self.share_of(analyst)
        if share == 0 or noise_multiplier == 0:
            return False
        own = [e for e in past if e.analyst == analyst]
        rhos = [*(_rho(e) for e in own), 1.0 / (2.0 * noise_multiplier**2)]
        extras = [e.delta_extra for e in own]
        return self._fraction(rhos, extras, share) <= 1.0

    def over_share(self, events: Iterable[PrivacyEvent]) -> list[str]:
        """Analysts whose recorded releases exceed their share (or who have none).

        Empty: every release fits its analyst's share, so the owner-wide check cannot
        bind while the analysts stay within their shares.
        """
        listed = list(events)
        analysts = sorted({e.analyst for e in listed})
        return [a for a in analysts if self.used(listed, a) > 1.0]

    def _used(self, own: Sequence[PrivacyEvent], share: float) -> float:
        if not own:
            return 0.0
        return self._fraction([_rho(e) for e in own], [e.delta_extra for e in own], share)

    def _fraction(self, rhos: Sequence[float], extras: Sequence[float], share: float) -> float:
        """The part of a share that releases of these rho and additive deltas use."""
        if share == 0:
            return math.inf
        rho = math.fsum(rhos)
        if math.isinf(rho):
            return math.inf
        extra = math.fsum(extras)
        return max(rho / (share * self.rho_max), extra / (share * self.extra_delta_cap))


def _least_noise_multiplier(epsilon: float, delta: float, accountant: Accountant) -> float:
    """Smallest z whose single release ``compose_epsilon`` puts within ``epsilon`` at ``delta``.

    zcdp: the closed-form inverse (checked by the accountant inside). pld-continuous:
    the analytic Gaussian's exact calibration, raised in steps of 10^-4 until the PLD
    accountant (a pessimistic discretisation) agrees, and never below its floor. Within
    ``epsilon`` itself, without the budget's rounding slack: that slack is left to the
    owner-wide check, for the rounding of adding up the analysts' parts.
    """
    if accountant is Accountant.ZCDP:
        return zcdp_noise_multiplier(epsilon, delta)
    z = max(analytic_gaussian_sigma(epsilon, delta), MIN_NOISE_MULTIPLIER)
    for _ in range(_PLD_ROUNDS):
        if compose_epsilon([z], delta, accountant) <= epsilon:
            return z
        z *= 1 + 1e-4
    raise ConfigError(
        f"no noise multiplier found for the shares of epsilon={epsilon:g} at delta={delta:g}"
    )
