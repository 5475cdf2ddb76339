"""Composition with dp_accounting: zCDP primary (proven), continuous PLD as an option.

Ground truth for Gaussian compositions: k releases with noise multipliers z_i
compose to exactly one Gaussian release with z = (sum z_i^-2)^(-1/2): under zCDP
because rho = 1/(2 z^2) adds up, under PLD because the privacy loss of a Gaussian is
itself Gaussian. The zCDP epsilon of one release is checked against the defining
conversion (Canonne, Kamath & Steinke 2020), minimised over a continuous order here;
the PLD epsilon against :func:`fedpca.dp.calibration.gaussian_epsilon` (closed form).
"""

from __future__ import annotations

import logging
import math
import re

import pytest

from fedpca.dp.accounting import (
    BUDGET_ROUNDING_SLACK,
    MIN_NOISE_MULTIPLIER,
    Accountant,
    BudgetDecision,
    check_budget,
    compose_epsilon,
    composed_gaussian_epsilon,
    composed_noise_multiplier,
    max_epsilon_per_release,
    require_budget,
)
from fedpca.dp.calibration import (
    calibrate_noise_multiplier,
    gaussian_epsilon,
    zcdp_epsilon,
)
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import BudgetExceededError, CalibrationError, CompositionError, ConfigError
from fedpca.query import Neighbouring

DELTA = 1e-5
PLD = Accountant.PLD_CONTINUOUS


def release(
    z: float,
    query_id: str = "q",
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
    delta_extra: float = 0.0,
) -> PrivacyEvent:
    epsilon = zcdp_epsilon(z, DELTA) if z > 0 else math.inf
    return PrivacyEvent(
        query_id,
        "alice",
        z,
        epsilon,
        DELTA,
        neighbouring=neighbouring,
        delta_extra=delta_extra,
        timestamp=1.0,
    )


def zcdp_epsilon_by_definition(z: float, delta: float) -> float:
    """min over alpha > 1 of alpha rho + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1).

    (Canonne, Kamath & Steinke 2020, Prop. 12, for rho = 1/(2 z^2).)
    """
    from scipy.optimize import minimize_scalar

    rho = 1.0 / (2.0 * z * z)

    def epsilon(log_alpha_minus_1: float) -> float:
        alpha = 1.0 + math.exp(log_alpha_minus_1)
        return (
            alpha * rho
            + math.log((alpha - 1.0) / alpha)
            - (math.log(delta) + math.log(alpha)) / (alpha - 1.0)
        )

    best = minimize_scalar(epsilon, bounds=(-12.0, 16.0), method="bounded", options={"xatol": 1e-9})
    return float(best.fun)


@pytest.mark.parametrize("z", [0.7, 1.5, 4.0, 20.0, 200.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-10])
def test_zcdp_epsilon_is_the_defining_conversion(z: float, delta: float) -> None:
    by_definition = zcdp_epsilon_by_definition(z, delta)
    computed = compose_epsilon([z], delta)
    # dp_accounting minimises over a grid of orders: never below the continuous
    # minimum, and the grid is dense enough to stay within 0.5 % of it.
    assert by_definition - 1e-9 <= computed <= by_definition * 1.005
    # The textbook conversion rho + 2 sqrt(rho log(1/delta)) is looser, never tighter.
    rho = 1.0 / (2.0 * z * z)
    assert computed <= rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    # ... and the continuous Gaussian's exact epsilon is below the zCDP bound.
    assert gaussian_epsilon(z, delta) <= computed


@pytest.mark.parametrize(("z", "k"), [(4.0, 10), (2.0, 3), (20.0, 100)])
def test_k_identical_gaussians_compose_to_one_with_z_over_sqrt_k(z: float, k: int) -> None:
    for accountant, single in ((Accountant.ZCDP, zcdp_epsilon), (PLD, gaussian_epsilon)):
        composed = compose_epsilon([z] * k, DELTA, accountant)
        exact = single(z / math.sqrt(k), DELTA)
        assert composed == pytest.approx(exact, rel=1e-5)
        # A wrong composition rule (e.g. naive epsilon addition) is far off.
        assert abs(composed - k * single(z, DELTA)) > 0.1 * composed
    # Under zCDP the curves add: k copies are one release with rho k.
    assert compose_epsilon([z] * k, DELTA) == pytest.approx(
        zcdp_epsilon_by_definition(z / math.sqrt(k), DELTA), rel=5e-3
    )


def test_different_gaussians_compose_like_their_inverse_squares() -> None:
    multipliers = [3.0, 4.5, 6.0, 9.0, 12.0]
    z_total = math.fsum(z**-2 for z in multipliers) ** -0.5
    ledger = [release(z, f"q{i}") for i, z in enumerate(multipliers)]
    assert compose_epsilon(ledger, DELTA) == pytest.approx(zcdp_epsilon(z_total, DELTA))
    assert compose_epsilon(ledger, DELTA, PLD) == pytest.approx(
        gaussian_epsilon(z_total, DELTA), rel=1e-5
    )


def test_a_ledger_is_kept_under_one_neighbouring_relation() -> None:
    add = release(4.0, "a")
    replace = release(4.0, "b", Neighbouring.REPLACE_ONE)
    with pytest.raises(ConfigError, match=r"replace-one adjacency.*kept under add-remove"):
        compose_epsilon([add, replace], DELTA, neighbouring=Neighbouring.ADD_REMOVE)
    with pytest.raises(ConfigError, match="'b'"):
        check_budget(
            [add], replace, PrivacyParams(5.0, DELTA), neighbouring=Neighbouring.ADD_REMOVE
        )
    assert compose_epsilon([replace], DELTA, neighbouring=Neighbouring.REPLACE_ONE) > 0


def test_additive_delta_terms_are_paid_from_the_budget_delta() -> None:
    plain = compose_epsilon([release(4.0)], DELTA)
    masked = compose_epsilon([release(4.0, delta_extra=DELTA / 2)], DELTA)
    assert masked == pytest.approx(zcdp_epsilon(4.0, DELTA / 2))
    assert masked > plain
    # Two releases each spending half the budget's delta outside the Gaussian use it up.
    spent = [release(4.0, "a", delta_extra=DELTA / 2), release(4.0, "b", delta_extra=DELTA / 2)]
    assert compose_epsilon(spent, DELTA) == math.inf
    assert not check_budget(spent[:1], spent[1], PrivacyParams(100.0, DELTA)).fits


def test_pld_of_the_composed_gaussian_equals_dp_accountings_own_convolution() -> None:
    # compose_epsilon accounts a ledger as the one Gaussian it equals; dp_accounting
    # convolving the releases' distributions itself must give the same epsilon.
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    multipliers = [1.0, 1.3, 2.0, 2.7, 5.0]
    convolved = PLDAccountant()
    convolved.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z) for z in multipliers]))
    assert compose_epsilon(multipliers, DELTA, PLD) == pytest.approx(
        convolved.get_epsilon(DELTA), rel=1e-6
    )


@pytest.mark.parametrize("ledger", [[5.0], [3.0] * 4, [2.0, 8.0, 8.0, 30.0], [40.0] * 50])
@pytest.mark.parametrize("delta", [1e-3, 1e-9])
def test_zcdp_never_undercuts_the_continuous_pld(ledger: list[float], delta: float) -> None:
    pld = compose_epsilon(ledger, delta, PLD)
    zcdp = compose_epsilon(ledger, delta, Accountant.ZCDP)
    assert zcdp >= pld - 1e-6 * pld
    # Both bound the continuous Gaussian; the proven conversion costs tens of percent.
    assert zcdp < 1.5 * pld


def test_empty_ledger_spent_nothing() -> None:
    assert compose_epsilon([], DELTA) == 0.0


def test_a_ledger_that_exactly_fills_the_budget_refuses_one_more() -> None:
    ledger = [release(3.0, "a"), release(5.0, "b"), release(4.0, "c")]
    budget = PrivacyParams(compose_epsilon(ledger, DELTA), DELTA)
    last = check_budget(ledger[:-1], ledger[-1], budget)
    assert last.fits
    assert last.epsilon_spent_after == budget.epsilon
    for proposed in (release(3.0, "d"), 1e4):
        refused = check_budget(ledger, proposed, budget)
        assert not refused.fits
        assert refused.epsilon_spent_before == budget.epsilon
        with pytest.raises(BudgetExceededError, match=re.escape(repr(budget.epsilon))):
            refused.raise_if_exceeded()


@pytest.mark.parametrize(
    ("calibration", "accountant"),
    [("analytic", Accountant.PLD_CONTINUOUS), ("zcdp", Accountant.ZCDP)],
)
@pytest.mark.parametrize("epsilon", [0.1, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-6])
def test_a_release_asking_for_exactly_the_budget_fits(
    calibration: str, accountant: Accountant, epsilon: float, delta: float
) -> None:
    # The release is calibrated for (epsilon, delta) and its epsilon recomputed from z by
    # the accountant: float error puts it a hair above epsilon in some cases (analytic
    # with PLD at delta 1e-6 gave 1.0000000000101565 for epsilon 1).
    z = calibrate_noise_multiplier(epsilon, delta, calibration)
    event = PrivacyEvent("q", "alice", z, epsilon, delta, timestamp=1.0)
    budget = PrivacyParams(epsilon, delta)
    decision = check_budget([], event, budget, accountant)
    assert abs(decision.epsilon_spent_after - epsilon) <= 1e-10 * epsilon  # float error only
    assert decision.fits
    # The budget is spent: nothing more fits, however weak.
    assert not check_budget([event], release(1e4, "weak"), budget, accountant).fits
    # A release that asks for more than the budget, by more than the rounding slack, is
    # refused: the slack is 1e-9 relative, nothing an analyst can use.
    z_more = calibrate_noise_multiplier(
        epsilon * (1 + 1e3 * BUDGET_ROUNDING_SLACK), delta, calibration
    )
    more = PrivacyEvent("q2", "alice", z_more, epsilon, delta, timestamp=1.0)
    assert not check_budget([], more, budget, accountant).fits


def test_the_rounding_slack_is_relative_and_tiny() -> None:
    ledger = [release(3.0, "a")]
    spent = compose_epsilon(ledger, DELTA)
    inside = PrivacyParams(spent / (1 + 0.5 * BUDGET_ROUNDING_SLACK), DELTA)
    outside = PrivacyParams(spent / (1 + 2 * BUDGET_ROUNDING_SLACK), DELTA)
    assert check_budget([], ledger[0], inside).fits
    assert not check_budget([], ledger[0], outside).fits


def test_a_decision_reports_what_is_spent_before_and_after() -> None:
    budget = PrivacyParams(1.5, DELTA)
    ledger: list[PrivacyEvent | float] = [release(6.0)]
    decision = check_budget(ledger, 6.0, budget)
    assert isinstance(decision, BudgetDecision)
    assert decision.fits and decision.accountant is Accountant.ZCDP
    assert decision.epsilon_spent_before == pytest.approx(zcdp_epsilon(6.0, DELTA))
    assert decision.epsilon_spent_after == pytest.approx(zcdp_epsilon(6.0 / math.sqrt(2), DELTA))
    assert decision.epsilon_spent_before < decision.epsilon_spent_after <= budget.epsilon
    assert decision.cross_check_epsilon_after is None  # cross-checks are for the PLD option
    pld = check_budget(ledger, 6.0, budget, PLD)
    assert pld.cross_check_epsilon_after == pytest.approx(decision.epsilon_spent_after)
    # Spending releases until refused: what is spent grows monotonically, and the
    # refused decision starts from what the last accepted one reached.
    spent = [0.0]
    while (decision := check_budget(ledger, 6.0, budget)).fits:
        assert decision.epsilon_spent_after > spent[-1]
        spent.append(decision.epsilon_spent_after)
        ledger.append(6.0)
    assert decision.epsilon_spent_before == pytest.approx(spent[-1])
    assert decision.epsilon_spent_after > budget.epsilon
    # k releases of z = 6 fit while zcdp_epsilon(6 / sqrt(k)) <= 1.5.
    fitting = [k for k in range(1, 20) if zcdp_epsilon(6.0 / math.sqrt(k), DELTA) <= 1.5]
    assert len(ledger) == max(fitting)


def test_the_continuous_pld_can_be_chosen_explicitly() -> None:
    decision = check_budget([5.0], 5.0, PrivacyParams(2.0, DELTA), "pld-continuous")
    assert decision.accountant is PLD
    assert decision.epsilon_spent_after == pytest.approx(
        gaussian_epsilon(5.0 / math.sqrt(2), DELTA), rel=1e-5
    )
    assert decision.cross_check_epsilon_after == pytest.approx(
        zcdp_epsilon(5.0 / math.sqrt(2), DELTA)
    )


def test_non_private_releases_need_an_infinite_budget() -> None:
    noiseless = release(0.0)
    assert compose_epsilon([4.0, noiseless], DELTA) == math.inf
    finite = PrivacyParams(1e6, DELTA)
    assert not check_budget([], noiseless, finite).fits
    blocked = check_budget([noiseless], 4.0, finite)
    assert not blocked.fits and blocked.epsilon_spent_before == math.inf
    unlimited = PrivacyParams(math.inf, DELTA)
    accepted = check_budget([noiseless], noiseless, unlimited)
    assert accepted.fits
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

    def broken_zcdp(
        releases: object, delta: float, accountant: object = "zcdp", **kwargs: object
    ) -> float:
        value = real(releases, delta, accountant, **kwargs)  # type: ignore[arg-type]
        return value / 2 if accountant is Accountant.ZCDP else value

    monkeypatch.setattr(accounting, "compose_epsilon", broken_zcdp)
    with caplog.at_level(logging.WARNING, logger="fedpca.dp.accounting"):
        check_budget([], 4.0, PrivacyParams(5.0, DELTA), PLD)
    assert "zcdp epsilon" in caplog.text


@pytest.mark.parametrize(
    ("releases", "delta", "accountant", "named"),
    [
        ([1.0], 0.0, "zcdp", "0.0"),
        ([1.0], DELTA, "moments", "moments"),
        ([-1.0], DELTA, "pld-continuous", "-1.0"),
    ],
)
def test_bad_accounting_arguments_are_named(
    releases: list[float], delta: float, accountant: str, named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        compose_epsilon(releases, delta, accountant)


# ------------------------------------------------- the PLD accountant's floor
def test_a_release_a_hair_below_the_floor_is_refused_with_different_numbers() -> None:
    # With 6 (and 4) significant digits this read "z=0.1 is below the minimum 0.1" and
    # "asks for epsilon=91.8173 ... at most epsilon=91.8173".
    z = MIN_NOISE_MULTIPLIER * (1 - 1e-9)
    most = max_epsilon_per_release(DELTA)
    event = PrivacyEvent("q-hair", "alice", z, most * (1 + 1e-9), DELTA, timestamp=1.0)
    with pytest.raises(CalibrationError) as info:
        check_budget([], event, PrivacyParams(math.inf, DELTA), PLD)
    shown = re.fullmatch(
        r"query 'q-hair' asks for epsilon=(\S+) at delta=1e-05: its noise multiplier z=(\S+) "
        r"is below the minimum (\S+) the PLD accountant supports \(at delta=1e-05: at most "
        r"epsilon=(\S+) per release\); ask for a smaller epsilon",
        str(info.value),
    )
    assert shown is not None, str(info.value)
    assert float(shown[1]) > float(shown[4]) and float(shown[2]) < float(shown[3])


def test_huge_epsilon_is_refused_with_the_floor_named() -> None:
    # epsilon = 1e6 calibrates to z ~ 7e-4, for which dp_accounting's PLD would try to
    # allocate a ~150 GiB array (MemoryError, INTERNAL at the proxy).
    z = calibrate_noise_multiplier(1e6, DELTA, "analytic")
    assert 0 < z < MIN_NOISE_MULTIPLIER
    huge = PrivacyEvent("q-huge", "alice", z, 1e6, DELTA, timestamp=1.0)
    for budget in (PrivacyParams(math.inf, DELTA), PrivacyParams(5.0, DELTA)):
        with pytest.raises(CalibrationError) as info:
            check_budget([4.0], huge, budget, PLD)
        message = str(info.value)
        assert "'q-huge'" in message and "epsilon=1e+06" in message
        assert f"minimum {MIN_NOISE_MULTIPLIER:g}" in message
        assert f"at most epsilon={max_epsilon_per_release(DELTA):.6g} per release" in message
    with pytest.raises(CalibrationError, match=r"z=0\.000709"):
        check_budget([], z, PrivacyParams(math.inf, DELTA), PLD)
    with pytest.raises(CalibrationError, match=r"minimum 0\.1"):
        compose_epsilon([z], DELTA, PLD)
    # The zcdp accountant is closed form: it has no floor.
    assert compose_epsilon([z], DELTA) > 1e6
    assert check_budget([], huge, PrivacyParams(math.inf, DELTA)).fits


def test_the_floor_is_the_largest_accepted_epsilon() -> None:
    largest = max_epsilon_per_release(DELTA)
    assert largest == pytest.approx(91.8, abs=0.1)
    assert calibrate_noise_multiplier(largest, DELTA, "analytic") == pytest.approx(
        MIN_NOISE_MULTIPLIER
    )
    # At the floor itself the PLD accountant still answers, and agrees with the closed form.
    assert compose_epsilon([MIN_NOISE_MULTIPLIER], DELTA, PLD) == pytest.approx(largest, rel=1e-4)
    with pytest.raises(CalibrationError, match="minimum"):
        compose_epsilon([MIN_NOISE_MULTIPLIER * 0.999], DELTA, PLD)


def test_a_composition_below_the_floor_is_refused_not_crashed() -> None:
    assert composed_noise_multiplier([3.0, 4.0]) == pytest.approx(12 / 5)
    assert composed_noise_multiplier([2.0, 0.0]) == 0.0
    assert composed_noise_multiplier([]) == math.inf
    ledger = [1.0]
    proposed = 0.1005  # accountable alone; with the ledger, z = 0.09999 < 0.1
    assert composed_noise_multiplier([*ledger, proposed]) < MIN_NOISE_MULTIPLIER
    with pytest.raises(CalibrationError, match="2 composed releases"):
        compose_epsilon([*ledger, proposed], DELTA, PLD)
    # A finite budget the composition clearly exceeds: an ordinary refusal.
    refused = check_budget(ledger, proposed, PrivacyParams(10.0, DELTA), PLD)
    assert not refused.fits
    exact = gaussian_epsilon(composed_noise_multiplier([*ledger, proposed]), DELTA)
    assert refused.epsilon_spent_after == pytest.approx(exact)
    with pytest.raises(BudgetExceededError):
        refused.raise_if_exceeded()
    # A budget the composition would fit, or an infinite one, cannot be accounted for
    # past the floor: refused, named.
    with pytest.raises(CalibrationError, match="cannot be accounted for"):
        check_budget(ledger, proposed, PrivacyParams(1000.0, DELTA), PLD)
    with pytest.raises(CalibrationError, match=r"2 composed releases: noise multiplier z=0\.0999"):
        check_budget(ledger, proposed, PrivacyParams(math.inf, DELTA), PLD)


def test_a_recorded_release_below_the_floor_is_a_composition_error() -> None:
    """Found by review: a ledger of one release below the PLD floor (recorded under
    zcdp, then the owner changed accountant) raised a plain CalibrationError naming that
    release's z, which an owner sent back with the decline to whichever analyst asked
    next. It is a CompositionError, which the owner keeps in its own log."""
    recorded = [0.05]  # another analyst's release, say
    for budget in (PrivacyParams(10.0, DELTA), PrivacyParams(math.inf, DELTA)):
        with pytest.raises(CompositionError, match=r"the ledger's one release: .*z=0\.05"):
            check_budget(recorded, 5.0, budget, PLD)
    # The asker's own release below the floor is about its own query: not a composition.
    with pytest.raises(CalibrationError) as own:
        check_budget([], 0.05, PrivacyParams(10.0, DELTA), PLD)
    assert not isinstance(own.value, CompositionError)


@pytest.mark.parametrize("multipliers", [[0.8], [2.0, 3.0, 5.0], [0.3] * 4, [40.0]])
def test_the_closed_form_gauge_meets_the_gaussians_defining_equation(
    multipliers: list[float],
) -> None:
    """What the owner's monitoring gauge reports under pld-continuous: the epsilon at
    which the Gaussian's delta curve at the composed z, written out here with scipy's
    normal CDF (Balle and Wang 2018, Theorem 8), equals the budget's delta; at or below
    both accountants' figures, and within the PLD's discretisation of it."""
    from scipy.stats import norm

    events = [release(z, f"q{i}") for i, z in enumerate(multipliers)]
    exact = composed_gaussian_epsilon(events, DELTA)
    z = composed_noise_multiplier(multipliers)

    def delta_at(epsilon: float) -> float:
        return float(
            norm.cdf(1 / (2 * z) - epsilon * z)
            - math.exp(epsilon) * norm.cdf(-1 / (2 * z) - epsilon * z)
        )

    if exact > 0:
        assert delta_at(exact) == pytest.approx(DELTA, rel=1e-6)
    else:
        assert delta_at(0.0) <= DELTA
    assert exact <= compose_epsilon(events, DELTA, PLD) <= exact * 1.01 + 1e-6
    assert exact <= compose_epsilon(events, DELTA, Accountant.ZCDP)
    assert composed_gaussian_epsilon([], DELTA) == 0.0
    assert composed_gaussian_epsilon([*events, release(0.0, "open")], DELTA) == math.inf
