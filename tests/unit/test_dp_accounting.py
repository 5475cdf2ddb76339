"""Composition with dp_accounting: PLD primary, RDP cross-check, budget decisions.

Ground truth for Gaussian compositions: k releases with noise multipliers z_i
compose to exactly one Gaussian release with z = (sum z_i^-2)^(-1/2) (the privacy
loss of a Gaussian mechanism is itself Gaussian, and independent Gaussians add), whose
epsilon :func:`fedpca.dp.calibration.gaussian_epsilon` computes in closed form.
"""

from __future__ import annotations

import logging
import math
import re

import pytest

from fedpca.dp.accounting import (
    MIN_NOISE_MULTIPLIER,
    Accountant,
    BudgetDecision,
    check_budget,
    compose_epsilon,
    composed_noise_multiplier,
    max_epsilon_per_release,
    require_budget,
)
from fedpca.dp.calibration import calibrate_noise_multiplier, gaussian_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import BudgetExceededError, CalibrationError, ConfigError

DELTA = 1e-5


def release(z: float, query_id: str = "q") -> PrivacyEvent:
    epsilon = gaussian_epsilon(z, DELTA) if z > 0 else math.inf
    return PrivacyEvent(query_id, "alice", z, epsilon, DELTA, timestamp=1.0)


@pytest.mark.parametrize(("z", "k"), [(4.0, 10), (2.0, 3), (20.0, 100)])
def test_k_identical_gaussians_compose_to_one_with_z_over_sqrt_k(z: float, k: int) -> None:
    composed = compose_epsilon([z] * k, DELTA)
    exact = gaussian_epsilon(z / math.sqrt(k), DELTA)
    assert composed == pytest.approx(exact, rel=1e-5)
    if k <= 10:
        # Distinct z's (perturbed by 1e-9) take no shortcut in the RDP accountant,
        # which composes them one by one.
        distinct = [z * (1 + 1e-9 * i) for i in range(k)]
        assert compose_epsilon(distinct, DELTA) == pytest.approx(exact, rel=1e-5)
        assert compose_epsilon(distinct, DELTA, "rdp") >= exact
    # A wrong composition rule (e.g. z / k, or naive epsilon addition) is far off.
    assert abs(composed - k * gaussian_epsilon(z, DELTA)) > 0.1 * composed


def test_different_gaussians_compose_like_their_inverse_squares() -> None:
    multipliers = [3.0, 4.5, 6.0, 9.0, 12.0]
    z_total = math.fsum(z**-2 for z in multipliers) ** -0.5
    composed = compose_epsilon([release(z, f"q{i}") for i, z in enumerate(multipliers)], DELTA)
    assert composed == pytest.approx(gaussian_epsilon(z_total, DELTA), rel=1e-5)


def test_pld_of_the_composed_gaussian_equals_dp_accountings_own_convolution() -> None:
    # compose_epsilon accounts a ledger as the one Gaussian it equals; dp_accounting
    # convolving the releases' distributions itself must give the same epsilon.
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    multipliers = [1.0, 1.3, 2.0, 2.7, 5.0]
    convolved = PLDAccountant()
    convolved.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z) for z in multipliers]))
    assert compose_epsilon(multipliers, DELTA) == pytest.approx(
        convolved.get_epsilon(DELTA), rel=1e-6
    )


@pytest.mark.parametrize("ledger", [[5.0], [3.0] * 4, [2.0, 8.0, 8.0, 30.0], [40.0] * 50])
@pytest.mark.parametrize("delta", [1e-3, 1e-9])
def test_rdp_never_undercuts_pld(ledger: list[float], delta: float) -> None:
    pld = compose_epsilon(ledger, delta, Accountant.PLD)
    rdp = compose_epsilon(ledger, delta, Accountant.RDP)
    assert rdp >= pld - 1e-6 * pld
    # Both bound the same quantity; RDP's conversion costs tens of percent, not more.
    assert rdp < 1.5 * pld


def test_empty_ledger_spent_nothing() -> None:
    assert compose_epsilon([], DELTA) == 0.0


def test_a_ledger_that_exactly_fills_the_budget_refuses_one_more() -> None:
    ledger = [release(3.0, "a"), release(5.0, "b"), release(4.0, "c")]
    budget = PrivacyParams(compose_epsilon(ledger, DELTA), DELTA)
    last = check_budget(ledger[:-1], ledger[-1], budget, cross_check=False)
    assert last.fits
    assert last.epsilon_spent_after == budget.epsilon
    assert last.epsilon_remaining == 0.0
    for proposed in (release(3.0, "d"), 1e4):
        refused = check_budget(ledger, proposed, budget, cross_check=False)
        assert not refused.fits
        assert refused.epsilon_spent_before == budget.epsilon
        assert refused.epsilon_remaining == 0.0
        with pytest.raises(BudgetExceededError, match=re.escape(repr(budget.epsilon))):
            refused.raise_if_exceeded()


def test_remaining_is_consistent_with_spent() -> None:
    budget = PrivacyParams(1.5, DELTA)
    ledger: list[PrivacyEvent | float] = [release(6.0)]
    decision = check_budget(ledger, 6.0, budget)
    assert isinstance(decision, BudgetDecision)
    assert decision.fits and decision.accountant is Accountant.PLD
    assert decision.epsilon_spent_before == pytest.approx(gaussian_epsilon(6.0, DELTA))
    assert decision.epsilon_spent_after == pytest.approx(
        gaussian_epsilon(6.0 / math.sqrt(2), DELTA), rel=1e-5
    )
    assert decision.epsilon_spent_before < decision.epsilon_spent_after <= budget.epsilon
    assert decision.epsilon_remaining == budget.epsilon - decision.epsilon_spent_after
    assert decision.cross_check_epsilon_after is not None
    assert decision.cross_check_epsilon_after >= decision.epsilon_spent_after
    # Spending releases until refused: the remaining value shrinks monotonically and
    # the refused decision reports what was left before it.
    remaining = [budget.epsilon]
    while (decision := check_budget(ledger, 6.0, budget)).fits:
        assert decision.epsilon_remaining < remaining[-1]
        remaining.append(decision.epsilon_remaining)
        ledger.append(6.0)
    assert decision.epsilon_remaining == pytest.approx(remaining[-1])
    assert decision.epsilon_spent_after > budget.epsilon
    assert len(ledger) == 5  # 5 releases of z = 6 cost 1.44 <= 1.5; a sixth costs 1.59


def test_rdp_can_be_the_primary_accountant() -> None:
    decision = check_budget([5.0], 5.0, PrivacyParams(2.0, DELTA), "rdp")
    assert decision.accountant is Accountant.RDP
    assert decision.cross_check_epsilon_after is None
    assert decision.epsilon_spent_after == pytest.approx(compose_epsilon([5.0, 5.0], DELTA, "rdp"))


def test_non_private_releases_need_an_infinite_budget() -> None:
    noiseless = release(0.0)
    assert compose_epsilon([4.0, noiseless], DELTA) == math.inf
    finite = PrivacyParams(1e6, DELTA)
    assert not check_budget([], noiseless, finite).fits
    blocked = check_budget([noiseless], 4.0, finite)
    assert not blocked.fits and blocked.epsilon_remaining == 0.0
    unlimited = PrivacyParams(math.inf, DELTA)
    accepted = check_budget([noiseless], noiseless, unlimited)
    assert accepted.fits and accepted.epsilon_remaining == math.inf
    assert accepted.epsilon_spent_after == math.inf
    assert check_budget([3.0], 3.0, PrivacyParams(math.inf, 0.0)).fits


def test_require_budget_raises_with_the_numbers() -> None:
    budget = PrivacyParams(0.5, DELTA)
    assert require_budget([], 20.0, budget).fits
    with pytest.raises(BudgetExceededError, match=r"epsilon=0\.5"):
        require_budget([], 2.0, budget)


def test_cross_check_disagreement_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import fedpca.dp.accounting as accounting

    real = accounting.compose_epsilon

    def broken_rdp(releases: object, delta: float, accountant: object = "pld") -> float:
        value = real(releases, delta, accountant)  # type: ignore[arg-type]
        return value / 2 if accountant is Accountant.RDP else value

    monkeypatch.setattr(accounting, "compose_epsilon", broken_rdp)
    with caplog.at_level(logging.WARNING, logger="fedpca.dp.accounting"):
        check_budget([], 4.0, PrivacyParams(5.0, DELTA))
    assert "RDP epsilon" in caplog.text


@pytest.mark.parametrize(
    ("releases", "delta", "accountant", "named"),
    [
        ([1.0], 0.0, "pld", "0.0"),
        ([1.0], DELTA, "moments", "moments"),
        ([-1.0], DELTA, "pld", "-1.0"),
    ],
)
def test_bad_accounting_arguments_are_named(
    releases: list[float], delta: float, accountant: str, named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        compose_epsilon(releases, delta, accountant)


# ------------------------------------------------- the PLD accountant's floor
def test_huge_epsilon_is_refused_with_the_floor_named() -> None:
    # epsilon = 1e6 calibrates to z ~ 7e-4, for which dp_accounting's PLD would try to
    # allocate a ~150 GiB array (MemoryError, INTERNAL at the proxy).
    z = calibrate_noise_multiplier(1e6, DELTA)
    assert 0 < z < MIN_NOISE_MULTIPLIER
    huge = PrivacyEvent("q-huge", "alice", z, 1e6, DELTA, timestamp=1.0)
    for budget in (PrivacyParams(math.inf, DELTA), PrivacyParams(5.0, DELTA)):
        with pytest.raises(CalibrationError) as info:
            check_budget([4.0], huge, budget)
        message = str(info.value)
        assert "'q-huge'" in message and "epsilon=1e+06" in message
        assert f"minimum {MIN_NOISE_MULTIPLIER:g}" in message
        assert f"{max_epsilon_per_release(DELTA):.4g}" in message
    with pytest.raises(CalibrationError, match=r"z=0\.000709"):
        check_budget([], z, PrivacyParams(math.inf, DELTA))
    with pytest.raises(CalibrationError, match=r"minimum 0\.1"):
        compose_epsilon([z], DELTA)
    # The RDP accountant is closed form: it has no floor.
    assert compose_epsilon([z], DELTA, Accountant.RDP) > 1e6
    assert check_budget([], huge, PrivacyParams(math.inf, DELTA), Accountant.RDP).fits


def test_the_floor_is_the_largest_accepted_epsilon() -> None:
    largest = max_epsilon_per_release(DELTA)
    assert largest == pytest.approx(91.8, abs=0.1)
    assert calibrate_noise_multiplier(largest, DELTA) == pytest.approx(MIN_NOISE_MULTIPLIER)
    # At the floor itself the PLD accountant still answers, and agrees with the closed form.
    assert compose_epsilon([MIN_NOISE_MULTIPLIER], DELTA) == pytest.approx(largest, rel=1e-4)
    with pytest.raises(CalibrationError, match="minimum"):
        compose_epsilon([MIN_NOISE_MULTIPLIER * 0.999], DELTA)


def test_a_composition_below_the_floor_is_refused_not_crashed() -> None:
    assert composed_noise_multiplier([3.0, 4.0]) == pytest.approx(12 / 5)
    assert composed_noise_multiplier([2.0, 0.0]) == 0.0
    assert composed_noise_multiplier([]) == math.inf
    ledger = [1.0]
    proposed = 0.1005  # accountable alone; with the ledger, z = 0.09999 < 0.1
    assert composed_noise_multiplier([*ledger, proposed]) < MIN_NOISE_MULTIPLIER
    with pytest.raises(CalibrationError, match="2 composed releases"):
        compose_epsilon([*ledger, proposed], DELTA)
    # A finite budget the composition clearly exceeds: an ordinary refusal.
    refused = check_budget(ledger, proposed, PrivacyParams(10.0, DELTA))
    assert not refused.fits
    exact = gaussian_epsilon(composed_noise_multiplier([*ledger, proposed]), DELTA)
    assert refused.epsilon_spent_after == pytest.approx(exact)
    with pytest.raises(BudgetExceededError):
        refused.raise_if_exceeded()
    # A budget the composition would fit, or an infinite one, cannot be accounted for
    # past the floor: refused, named.
    with pytest.raises(CalibrationError, match="cannot be accounted for"):
        check_budget(ledger, proposed, PrivacyParams(1000.0, DELTA))
    with pytest.raises(CalibrationError, match=r"2 composed releases: noise multiplier z=0\.0999"):
        check_budget(ledger, proposed, PrivacyParams(math.inf, DELTA))
