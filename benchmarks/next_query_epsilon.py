"""How long the budget commands take to find the largest epsilon the next query may ask for.

``fedpca analyst budget`` (at the proxy) and ``fedpca owner budget`` run
:func:`fedpca.dp.next_query.largest_admissible_epsilon`: a bisection on the query's
epsilon in which every step is one admission check (the ledger composed with and without
the query). Under zcdp a check is closed form; under pld-continuous it is two PLD
compositions, slower the less noise they hold (the budget's size sets that).

For a ledger of 10 releases (epsilon 0.1 to 0.5 at delta 1e-6) and several budgets at
delta 1e-5 (the last but one just 2 % above what the ledger has spent, where the search's
first guess is least precise), the script prints, per accountant: the answer at query
delta 1e-6, the old "limit - spent" figure beside it, the limit, the number of admission
checks and the median wall time of a few runs.

Usage: python benchmarks/next_query_epsilon.py [--runs 3]

The last line reads ``zcdp_seconds_max=… pld_seconds_max=… checks_max=…``.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

from fedpca.dp.accounting import Accountant, compose_epsilon
from fedpca.dp.calibration import calibrate_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.dp.next_query import largest_admissible_epsilon

QUERY_DELTA = 1e-6
BUDGETS = (3.0, 10.0, 50.0)
NEARLY_FULL = 1.02
"""A budget this much above the epsilon the ledger has spent is also measured."""
LEDGER = [
    PrivacyEvent(f"q{i}", "alice", calibrate_noise_multiplier(e, 1e-6), e, 1e-6, timestamp=1.0)
    for i, e in enumerate((0.1, 0.2, 0.3, 0.5, 0.1, 0.2, 0.3, 0.5, 0.1, 0.2))
]


class _Checks(logging.Handler):
    """Reads the number of admission checks from the search's debug line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last = 0

    def emit(self, record: logging.LogRecord) -> None:
        assert isinstance(record.args, tuple)
        self.last = int(record.args[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs per case (median time).")
    args = parser.parse_args()
    checks = _Checks()
    logger = logging.getLogger("fedpca.dp.next_query")
    logger.addHandler(checks)
    logger.setLevel(logging.DEBUG)
    print(f"ledger: {len(LEDGER)} releases; query delta {QUERY_DELTA:g}; budget delta 1e-05")
    print(
        f"{'accountant':<16}{'budget':>8}{'limit-spent':>13}{'next query':>12}  {'limit':<13}"
        f"{'checks':>6}{'seconds':>9}"
    )
    seconds: dict[Accountant, list[float]] = {a: [] for a in Accountant}
    most_checks = 0
    for accountant in Accountant:
        spent = compose_epsilon(LEDGER, 1e-5, accountant)
        for epsilon in (*BUDGETS, NEARLY_FULL * spent, math.inf):
            budget = PrivacyParams(epsilon, 1e-5)
            times = []
            checks.last = 0
            for _ in range(args.runs):
                start = time.perf_counter()
                answer = largest_admissible_epsilon(LEDGER, budget, QUERY_DELTA, accountant)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            seconds[accountant].append(median)
            most_checks = max(most_checks, checks.last)
            print(
                f"{accountant.value:<16}{epsilon:>8.4g}{epsilon - spent:>13.4g}"
                f"{answer.epsilon:>12.6g}  {answer.limit.value:<13}{checks.last:>6}{median:>9.3f}"
            )
    print(
        f"zcdp_seconds_max={max(seconds[Accountant.ZCDP]):.3f} "
        f"pld_seconds_max={max(seconds[Accountant.PLD_CONTINUOUS]):.3f} checks_max={most_checks}"
    )


if __name__ == "__main__":
    main()
