"""The largest epsilon one more query may ask for (fedpca.dp.next_query).

Every answer is judged by the admission rule itself: a query calibrated for the returned
epsilon at the query's delta passes :func:`check_budget` after the ledger, and one asking
for 0.1 % more does not. "The budget's epsilon minus the epsilon spent", the number the
budget commands printed before, fails these tests (it is far below the answer when the
query's delta is below the budget's, and not admitted in general).
"""

from __future__ import annotations

import logging
import math

import pytest

import fedpca.dp.next_query as next_query
from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.dp.accounting import (
    MIN_NOISE_MULTIPLIER,
    Accountant,
    Release,
    check_budget,
    compose_epsilon,
)
from fedpca.dp.calibration import calibrate_noise_multiplier, zcdp_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.dp.next_query import largest_admissible_epsilon
from fedpca.errors import CalibrationError, ConfigError
from fedpca.query import Neighbouring

BUDGET_DELTA = 1e-5
PLD = Accountant.PLD_CONTINUOUS
REPLACE_ONE = Neighbouring.REPLACE_ONE


def event(query_id: str, epsilon: float, delta: float = 1e-6, **extra: float) -> PrivacyEvent:
    z = calibrate_noise_multiplier(epsilon, delta)
    return PrivacyEvent(query_id, "alice", z, epsilon, delta, timestamp=1.0, **extra)


# Past releases of different sizes, one of them with an additive delta term (a masked
# release's M 2^-40): they compose to about epsilon 1.1 at the budget's delta.
LEDGER: list[Release] = [
    event("a", 0.5),
    event("b", 0.2, 1e-7),
    event("c", 0.3, delta_extra=34 * 2.0**-40),
    calibrate_noise_multiplier(0.1, 1e-6),
]


def admitted(
    ledger: list[Release],
    budget: PrivacyParams,
    epsilon: float,
    query_delta: float,
    accountant: Accountant,
) -> bool:
    """Whether a submission asking for (epsilon, query_delta) passes the budget check.

    A CalibrationError (the PLD accountant's noise floor) is raised, not read as a
    refusal: a "not admitted" assertion must see the check say no (test audit)."""
    z = calibrate_noise_multiplier(epsilon, query_delta)
    return check_budget(ledger, z, budget, accountant).fits


@pytest.mark.parametrize("accountant", [Accountant.ZCDP, PLD])
@pytest.mark.parametrize(("budget_epsilon", "query_delta"), [(2.0, 1e-6), (3.0, 1e-5), (1.5, 1e-7)])
def test_the_answer_is_admitted_and_a_little_more_is_not(
    accountant: Accountant, budget_epsilon: float, query_delta: float
) -> None:
    budget = PrivacyParams(budget_epsilon, BUDGET_DELTA)
    spent = compose_epsilon(LEDGER, BUDGET_DELTA, accountant)
    assert 0.5 < spent < 1.5
    answer = largest_admissible_epsilon(LEDGER, budget, query_delta, accountant)
    assert answer.delta == query_delta and answer.limit is AdmissionLimit.BUDGET
    assert admitted(LEDGER, budget, answer.epsilon, query_delta, accountant)
    assert not admitted(LEDGER, budget, answer.epsilon * (1 + 1e-3), query_delta, accountant)
    # Rounded down on a grid of 6 significant digits: printed with :g it is exact, and
    # a query typed from the printed value asks for exactly what was checked.
    assert float(f"{answer.epsilon:.6g}") == answer.epsilon
    # Not the old "limit - spent" (composition is not additive).
    assert abs(answer.epsilon - (budget_epsilon - spent)) > 0.05


def test_the_answer_follows_the_query_delta() -> None:
    # A smaller query delta needs more noise for the same epsilon: it may ask for more.
    budget = PrivacyParams(2.0, BUDGET_DELTA)
    answers = [largest_admissible_epsilon(LEDGER, budget, d).epsilon for d in (1e-5, 1e-6, 1e-8)]
    assert answers == sorted(answers) and answers[0] < answers[-1]


def test_a_few_checks_and_no_log_line_per_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[float] = []
    real = next_query.check_budget

    def counting(ledger: list[Release], proposed: float, *args: object, **kw: object) -> object:
        calls.append(proposed)
        return real(ledger, proposed, *args, **kw)

    monkeypatch.setattr(next_query, "check_budget", counting)
    budget = PrivacyParams(5.0, BUDGET_DELTA)
    with caplog.at_level(logging.INFO, logger="fedpca.dp.accounting"):
        answer = largest_admissible_epsilon(LEDGER, budget, 1e-6)
    # The closed-form guess lands within a step of the boundary.
    assert 2 <= len(calls) <= 6
    assert not [r for r in caplog.records if "budget check" in r.getMessage()]
    # A bounded search returns a candidate it checked and found admitted.
    calls.clear()
    coarse = largest_admissible_epsilon(LEDGER, budget, 1e-6, max_checks=2)
    assert len(calls) == 2
    assert 0 < coarse.epsilon <= answer.epsilon
    assert admitted(LEDGER, budget, coarse.epsilon, 1e-6, Accountant.ZCDP)


@pytest.mark.parametrize("accountant", [Accountant.ZCDP, PLD])
def test_an_exhausted_budget_admits_nothing(accountant: Accountant) -> None:
    full = PrivacyParams(compose_epsilon(LEDGER, BUDGET_DELTA, accountant), BUDGET_DELTA)
    answer = largest_admissible_epsilon(LEDGER, full, 1e-6, accountant)
    assert answer == NextQuery(0.0, 1e-6, AdmissionLimit.EXHAUSTED)
    assert not admitted(LEDGER, full, 1e-6, 1e-6, accountant)
    # A NOT PRIVATE release (epsilon = inf) exhausts any finite budget.
    noiseless = PrivacyEvent("v", "alice", 0.0, math.inf, 0.0, timestamp=1.0)
    large = PrivacyParams(50.0, BUDGET_DELTA)
    answer = largest_admissible_epsilon([*LEDGER, noiseless], large, 1e-6, accountant)
    assert answer.epsilon == 0.0 and answer.limit is AdmissionLimit.EXHAUSTED


def test_an_almost_full_budget_still_admits_a_small_query() -> None:
    spent = compose_epsilon(LEDGER, BUDGET_DELTA)
    budget = PrivacyParams(spent * 1.01, BUDGET_DELTA)
    answer = largest_admissible_epsilon(LEDGER, budget, 1e-6)
    assert 0 < answer.epsilon < 0.5 and answer.limit is AdmissionLimit.BUDGET
    assert admitted(LEDGER, budget, answer.epsilon, 1e-6, Accountant.ZCDP)
    assert not admitted(LEDGER, budget, answer.epsilon * (1 + 1e-3), 1e-6, Accountant.ZCDP)


def test_an_infinite_budget_under_zcdp_is_unlimited() -> None:
    for delta in (BUDGET_DELTA, 0.0):  # an unlimited budget may carry delta 0
        answer = largest_admissible_epsilon(LEDGER, PrivacyParams(math.inf, delta), 1e-6)
        assert answer == NextQuery(math.inf, 1e-6, AdmissionLimit.UNLIMITED)


def test_the_pld_floor_caps_an_infinite_budget() -> None:
    # With no budget to bind, the PLD accountant's floor on the noise multiplier does:
    # here the query's own z must reach MIN_NOISE_MULTIPLIER (seconds of PLD at z = 0.1).
    unlimited = PrivacyParams(math.inf, BUDGET_DELTA)
    answer = largest_admissible_epsilon([], unlimited, 1e-6, PLD)
    assert answer.limit is AdmissionLimit.NOISE_FLOOR
    assert answer.epsilon == pytest.approx(zcdp_epsilon(MIN_NOISE_MULTIPLIER, 1e-6), rel=1e-4)
    assert admitted([], unlimited, answer.epsilon, 1e-6, PLD)
    with pytest.raises(CalibrationError, match=r"minimum 0\.1"):
        check_budget([], calibrate_noise_multiplier(answer.epsilon * 1.001, 1e-6), unlimited, PLD)
    # A finite budget above what the floor allows is capped the same way; zcdp has no
    # floor, and its budget binds.
    large = PrivacyParams(500.0, BUDGET_DELTA)
    zcdp = largest_admissible_epsilon(LEDGER, large, 1e-6)
    assert zcdp.limit is AdmissionLimit.BUDGET and zcdp.epsilon > 4 * answer.epsilon


@pytest.mark.parametrize("accountant", [Accountant.ZCDP, PLD])
def test_a_per_release_cap_is_checked_as_owners_check_it(accountant: Accountant) -> None:
    # An owner refuses a release whose own epsilon at its budget's delta exceeds
    # policy.max_epsilon_per_query, before its ledger is consulted.
    budget = PrivacyParams(10.0, BUDGET_DELTA)
    answer = largest_admissible_epsilon(LEDGER, budget, 1e-6, accountant, max_release_epsilon=1.0)
    assert answer.limit is AdmissionLimit.PER_QUERY_CAP

    def own(epsilon: float) -> float:
        return compose_epsilon(
            [calibrate_noise_multiplier(epsilon, 1e-6)], BUDGET_DELTA, accountant
        )

    assert own(answer.epsilon) <= 1.0 < own(answer.epsilon * (1 + 1e-3))
    assert admitted(LEDGER, budget, answer.epsilon, 1e-6, accountant)
    # A tight budget binds before the cap.
    tight = PrivacyParams(compose_epsilon(LEDGER, BUDGET_DELTA, accountant) * 1.05, BUDGET_DELTA)
    capped = largest_admissible_epsilon(LEDGER, tight, 1e-6, accountant, max_release_epsilon=1.0)
    assert capped.limit is AdmissionLimit.BUDGET and capped.epsilon < answer.epsilon


def test_the_ledger_relation_and_arguments_are_checked() -> None:
    budget = PrivacyParams(2.0, BUDGET_DELTA)
    with pytest.raises(ConfigError, match="replace-one"):
        largest_admissible_epsilon(LEDGER, budget, 1e-6, neighbouring=REPLACE_ONE)
    with pytest.raises(ConfigError, match="replace-one"):  # unlimited too
        largest_admissible_epsilon(
            LEDGER, PrivacyParams(math.inf, BUDGET_DELTA), 1e-6, neighbouring=REPLACE_ONE
        )
    for delta in (0.0, 1.0, math.nan):
        with pytest.raises(ConfigError, match="query delta"):
            largest_admissible_epsilon(LEDGER, budget, delta)
    with pytest.raises(ConfigError, match="unknown accountant"):
        largest_admissible_epsilon(LEDGER, budget, 1e-6, "rdp")
    with pytest.raises(ConfigError, match="max_checks"):
        largest_admissible_epsilon(LEDGER, budget, 1e-6, max_checks=0)


def test_next_query_values_are_consistent() -> None:
    assert NextQuery(0.5, 1e-6, "budget").limit is AdmissionLimit.BUDGET
    for epsilon, limit in [
        (0.0, AdmissionLimit.BUDGET),
        (0.5, AdmissionLimit.EXHAUSTED),
        (math.inf, AdmissionLimit.BUDGET),
        (2.0, AdmissionLimit.UNLIMITED),
        (-1.0, AdmissionLimit.BUDGET),
        (math.nan, AdmissionLimit.BUDGET),
    ]:
        with pytest.raises(ConfigError, match="NextQuery"):
            NextQuery(epsilon, 1e-6, limit)
    with pytest.raises(ConfigError, match="delta"):
        NextQuery(0.5, 0.0, AdmissionLimit.BUDGET)
    with pytest.raises(ConfigError, match="unknown limit"):
        NextQuery(0.5, 1e-6, "whatever")
