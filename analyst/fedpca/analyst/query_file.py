"""Several aggregates of one release, read from a TOML file.

``fedpca analyst combined FILE`` runs a :class:`~fedpca.analyst.aggregate_estimators.FederatedQuery`
of the aggregates the file lists: one release, one charge (an analyst who wanted the
means, a histogram and a regression of one table from the command line paid three
releases). The file lists the aggregates in order; each takes the parameters of its
estimator other than the privacy and connection ones, which the command's options set
for the whole release::

    [[aggregate]]
    kind = "stats"                # stats | histogram | linreg
    columns = [1, 6]
    bounds = "0:17,0:70"          # or [[0, 17], [0, 70]]
    moments = "variance"

    [[aggregate]]
    kind = "histogram"
    weight = 2                    # its share of the budget (default 1)
    columns = [8]
    bins = [[20, 30, 40, 50, 60, 90]]

Every value is checked before keys or the network (:func:`read_query_file`).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpca.analyst.aggregate_estimators import PRIVACY_PARAMETERS, AggregateEstimator
from fedpca.analyst.aggregate_report import ESTIMATOR_OF
from fedpca.errors import ConfigError
from fedpca.toml_config import did_you_mean, load_toml_config, reject_unknown_keys

__all__ = ["ESTIMATOR_KINDS", "QueryFile", "read_query_file"]

ESTIMATOR_KINDS: dict[str, type[AggregateEstimator]] = {
    kind.value: estimator for kind, estimator in ESTIMATOR_OF.items()
}
"""The ``kind`` of an ``[[aggregate]]`` table and the estimator it makes."""


def _set_by_options(keys: list[str]) -> str:
    """``epsilon is`` / ``epsilon and quorum are``: the start of the sentence saying the
    command's options set these keys for the whole release."""
    return f"{' and '.join(keys)} {'is' if len(keys) == 1 else 'are'} set for the whole release"


@dataclass(frozen=True)
class QueryFile:
    """The aggregates of a query file, in order, and their budget weights."""

    estimators: tuple[AggregateEstimator, ...]
    weights: tuple[float, ...]


def _known_keys(kind: type[AggregateEstimator]) -> list[str]:
    own = set(kind().get_params(deep=False)) - set(PRIVACY_PARAMETERS)
    return sorted(own | {"kind", "weight"})


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where}: weight must be a number > 0, got {value!r}")
    weight = float(value)
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(f"{where}: weight must be a number > 0, got {value!r}")
    return weight


def _estimator(entry: Any, position: int) -> tuple[AggregateEstimator, float]:
    where = f"aggregate {position}"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a table of the aggregate's parameters")
    kind = entry.get("kind")
    if kind not in ESTIMATOR_KINDS:
        got = "it has none" if kind is None else f"got {kind!r}"
        close = did_you_mean([kind], ESTIMATOR_KINDS) if isinstance(kind, str) else ""
        raise ConfigError(
            f"{where}: kind must be one of {', '.join(ESTIMATOR_KINDS)}; {got}{close}"
        )
    where = f"{where} ({kind})"
    known = _known_keys(ESTIMATOR_KINDS[kind])
    unknown = sorted(set(entry) - set(known))
    if unknown:
        privacy = [key for key in unknown if key in PRIVACY_PARAMETERS]
        hint = f"; {_set_by_options(privacy)}, by the command's options" if privacy else ""
        raise ConfigError(
            f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(known)}){hint}"
            + did_you_mean(unknown, known)
        )
    weight = _weight(entry.get("weight", 1.0), where)
    parameters = {key: value for key, value in entry.items() if key not in ("kind", "weight")}
    try:
        estimator = ESTIMATOR_KINDS[kind](**parameters)
        estimator.aggregate()  # columns, bounds, bins, target: checked here
        estimator.check_post_processing()
        estimator.section_weights()  # budget_split
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:  # e.g. bounds = 5, bins = "a"
        raise ConfigError(f"{where}: {exc}") from None
    return estimator, weight


def _build(document: Mapping[str, Any], _base_dir: Path) -> QueryFile:
    privacy = sorted(set(document) & set(PRIVACY_PARAMETERS))
    if privacy:
        raise ConfigError(f"{_set_by_options(privacy)} by the command's options, not in the file")
    reject_unknown_keys(document, ("aggregate",))
    entries = document.get("aggregate")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            "no aggregates: list each as an [[aggregate]] table with its kind "
            f"({', '.join(ESTIMATOR_KINDS)}) and parameters"
        )
    made = [_estimator(entry, position) for position, entry in enumerate(entries, 1)]
    return QueryFile(tuple(e for e, _ in made), tuple(w for _, w in made))


def read_query_file(path: str | os.PathLike[str]) -> QueryFile:
    """The aggregates a query file lists, each checked as its estimator checks it.

    Raises
    ------
    ConfigError
        Naming the file and the aggregate (its position and kind): a missing or
        unknown kind, an unknown key (a privacy or connection parameter, which the
        command sets for the whole release, says so), a weight that is not a number
        > 0, or a parameter its estimator refuses.
    """
    return load_toml_config(path, "query", _build)
