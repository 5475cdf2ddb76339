"""Aggregate queries in the kernel: the query, sections, sensitivities, plan and owner sums.

The sensitivities are checked against their defining property: for records at the
public bounds, outside them and in between, adding one record to real data or
swapping one for another moves each section's exact integers by at most the bound
derived in docs/privacy.md (squared bounds written out here, independently of the
code), and the add bounds are attained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from fedpca.aggregates import (
    aggregate_sections,
    fixed_point_aggregates,
    histogram_cells,
    split_parts,
)
from fedpca.dp.calibration import zcdp_noise_multiplier
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import ConfigError, LayoutError
from fedpca.exact_statistics import row_bits
from fedpca.protocol import ReleasePlan
from fedpca.query import (
    Aggregate,
    AggregateKind,
    Moments,
    Neighbouring,
    QueryKind,
    QuerySpec,
    spec_digest,
)
from fedpca.query_records import spec_from_dict, spec_to_dict
from fedpca.stats import worst_case_change
from fedpca.transport import serde
from fedpca.v1 import query_pb2 as query_pb

F = 32
G = row_bits(F)

STATS = Aggregate.statistics((0, 1, 2), (0.0, -5.0, 10.0), (1.0, 5.0, 20.0))
VARIANCE = Aggregate.statistics((1, 2), (-5.0, 10.0), (5.0, 20.0), Moments.VARIANCE)
JOINT = Aggregate.histogram(
    (0, 1), ((0.0, 0.5, 1.0), (-5.0, 0.0, 2.0, 5.0)), group_column=3, categories=(1.0, 2.0)
)
LINREG = Aggregate.linear_regression((0, 1), (0.0, -5.0), (1.0, 5.0), 2, 10.0, 20.0)

# Squared (add, swap) bounds in clip units, per section, from docs/privacy.md (d columns):
# count 1/0; sums d/4d; squares d/d; products d(d+1)/2 / d²+d/2; histogram 1/2;
# linreg y_sum 1/4, xty d/4d.
SQUARED_BOUNDS = {
    "stats": {
        "count": (1, 0),
        "sums": (3, 12),
        "products": (6, Fraction(21, 2)),
    },
    "variance": {"count": (1, 0), "sums": (2, 8), "squares": (2, 2)},
    "histogram": {"counts": (1, 2)},
    "linreg": {
        "count": (1, 0),
        "x_sums": (2, 8),
        "y_sum": (1, 4),
        "xtx": (3, 5),
        "xty": (2, 8),
    },
}
PARTS = {"stats": STATS, "variance": VARIANCE, "histogram": JOINT, "linreg": LINREG}


def query(*aggregates: Aggregate, **overrides: Any) -> QuerySpec:
    columns = sorted({c for a in aggregates for c in a.read_columns})
    fields: dict[str, Any] = {
        "query_id": "agg",
        "kind": QueryKind.AGGREGATE,
        "n_features": len(columns),
        "epsilon": 1.0,
        "delta": 1e-6,
        "n_components": 1,
        "analyst_public_key_n": 3,
        "analyst_key_fingerprint": "sha256:x",
        "aggregates": aggregates,
        "max_records_per_owner": 4096,
        "max_owners": 16,
    }
    fields.update(overrides)
    return QuerySpec(**fields)


def _table(seed: int, n: int) -> np.ndarray:
    """Columns 0-3 of the parts above: values inside and outside the bounds."""
    rng = np.random.default_rng(seed)
    return np.column_stack(
        [
            rng.uniform(-0.5, 1.5, n),
            rng.uniform(-8.0, 8.0, n),
            rng.uniform(5.0, 25.0, n),
            rng.choice([1.0, 2.0, 3.0], n),
        ]
    )


def _integers(spec: QuerySpec, rows: np.ndarray) -> dict[str, list[int]]:
    values = fixed_point_aggregates(rows[:, list(spec.aggregate_columns)], spec).values
    out: dict[str, list[int]] = {}
    start = 0
    for section in aggregate_sections(spec.aggregates):
        out[section.name.split(".", 1)[1]] = [
            int(v) for v in values[start : start + section.length]
        ]
        start += section.length
    return out


def _squared_change(a: list[int], b: list[int]) -> int:
    return sum((x - y) ** 2 for x, y in zip(a, b, strict=True))


# Corners of the public box, points outside it and in between, two categories each.
EXTREMES = [
    np.array([c0, c1, c2, cat])
    for c0, c1, c2 in itertools.product(
        (-3.0, 0.0, 0.25, 1.0, 9.0), (-50.0, -5.0, 5.0), (10.0, 20.0, 99.0)
    )
    for cat in (1.0, 3.0)
]


@pytest.mark.parametrize("frac_bits", [8, 9, 32, 33, 40, 41, 48])
@pytest.mark.parametrize("kind", list(PARTS))
def test_one_record_moves_each_section_within_its_bound(kind: str, frac_bits: int) -> None:
    """At every grid the encoding takes its own path on: shifts by f - g and f - 2g of
    either parity, and g capped at 20 from f = 41 (review: only f = 32 was tested)."""
    part = PARTS[kind]
    spec = query(part, frac_bits=frac_bits)
    sections = {s.name.split(".", 1)[1]: s for s in aggregate_sections(spec.aggregates)}
    bounds = SQUARED_BOUNDS[kind]
    assert set(sections) == set(bounds)
    # The code states the same bounds as the derivation.
    for name, (add, swap) in bounds.items():
        assert sections[name].add_change ** 2 == pytest.approx(float(add), rel=1e-12)
        assert sections[name].swap_change ** 2 == pytest.approx(float(swap), rel=1e-12)
    base = _table(1, 40)
    before = _integers(spec, base)
    attained = {name: Fraction(0) for name in bounds}
    for x in EXTREMES:
        added = _integers(spec, np.vstack([base, x]))
        for name, (add, _) in bounds.items():
            grid = 4 ** (0 if sections[name].grid_bits == 0 else frac_bits)
            change = Fraction(_squared_change(added[name], before[name]), grid)
            assert change <= add, (name, x)
            attained[name] = max(attained[name], change)
        for index in (0, 7):
            swapped = _integers(spec, np.vstack([np.delete(base, index, axis=0), x]))
            for name, (_, swap) in bounds.items():
                grid = 4 ** (0 if sections[name].grid_bits == 0 else frac_bits)
                assert Fraction(_squared_change(swapped[name], before[name]), grid) <= swap
    # An added record at a corner of the box attains every add bound exactly.
    assert attained == {name: Fraction(add) for name, (add, _) in bounds.items()}


@pytest.mark.parametrize("frac_bits", [8, 9, 17, 32, 33, 41, 48])
def test_the_recorded_noise_multiplier_covers_the_exact_worst_case(frac_bits: int) -> None:
    """The ledger records z_effective, recomputed in floating point from the integer
    noise scales; the worst neighbouring change, in exact fractions, must not exceed
    1/z_effective^2 (review: it was one ulp above, loss * z^2 = 1 + 1.1e-16)."""
    rng = np.random.default_rng(frac_bits)
    kinds = list(PARTS)
    for neighbouring, bounded in (
        (Neighbouring.ADD_REMOVE, False),
        (Neighbouring.ADD_REMOVE, True),
        (Neighbouring.REPLACE_ONE, False),
    ):
        for _ in range(4):
            weights = tuple(float(w) for w in rng.uniform(0.1, 3.0, 12))
            spec = query(
                *(PARTS[kind] for kind in kinds),
                frac_bits=frac_bits,
                neighbouring=neighbouring,
                bounded_owner_tables=bounded,
                noise_weights=weights,
            )
            plan = ReleasePlan.for_query(spec, 2048)
            add_loss, swap_loss = Fraction(0), Fraction(0)
            sections = zip(plan.statistics.sections, plan.sections, strict=True)
            for info, noise in sections:
                index, name = info.name.split(".", 1)
                add, swap = SQUARED_BOUNDS[kinds[int(index)]][name]
                if noise.sigma_int == 0:  # released exactly: it must not move
                    assert neighbouring is Neighbouring.REPLACE_ONE and swap == 0, info.name
                    continue
                per_unit = Fraction(4 ** info.bits(frac_bits)) / Fraction(noise.sigma_int) ** 2
                add_loss += Fraction(add) * per_unit
                swap_loss += Fraction(swap) * per_unit
            if neighbouring is Neighbouring.REPLACE_ONE:
                worst = swap_loss
            else:
                worst = add_loss if bounded else max(add_loss, swap_loss)
            z = Fraction(plan.noise_multiplier)
            assert worst * z * z <= 1, (neighbouring, bounded, float(worst * z * z - 1))


def test_swap_bounds_are_attained_or_nearly() -> None:
    spec = query(STATS, JOINT)
    base = _table(2, 10)
    before = _integers(spec, base)
    # Sums: one corner for the other (u = 1 replaced by u = -1): 2 sqrt(d) exactly.
    hi, lo = np.array([1.0, 5.0, 20.0, 1.0]), np.array([0.0, -5.0, 10.0, 2.0])
    low = _integers(spec, np.vstack([base, lo]))
    high = _integers(spec, np.vstack([base, hi]))
    assert _squared_change(high["sums"], low["sums"]) == 12 * 4**F
    # The histogram: one cell down, another up.
    assert _squared_change(high["counts"], low["counts"]) == 2
    # Products: u = (1, 1, 1) for (1, -1, 1) reaches 8 of the bound 10.5 (d = 3).
    mixed = np.array([1.0, -5.0, 20.0, 1.0])
    other = _integers(spec, np.vstack([base, mixed]))
    assert _squared_change(high["products"], other["products"]) == 8 * 4**F
    assert before["count"] == [10]


def test_worst_case_change_of_aggregates() -> None:
    changes = [(1.0, 0.0), (2.0, 4.0), (1.0, math.sqrt(2))]
    weights = [1.0, 0.5, 2.0]
    add = 1 + 0.5 * 4 + 2.0
    swap = 0 + 0.5 * 16 + 2.0 * 2
    kind = QueryKind.AGGREGATE
    assert worst_case_change(kind, weights, Neighbouring.ADD_REMOVE, changes) == max(add, swap)
    assert worst_case_change(kind, weights, Neighbouring.REPLACE_ONE, changes) == swap
    # Where a count dominates, add/remove takes the addition.
    assert worst_case_change(kind, [100.0, 1e-3], Neighbouring.ADD_REMOVE, changes[:2]) == (
        pytest.approx(100.0 + 4e-3)
    )
    with pytest.raises(ConfigError, match="one \\(add, swap\\) change per section"):
        worst_case_change(kind, weights, Neighbouring.ADD_REMOVE)
    with pytest.raises(ConfigError, match="bounded jointly"):
        worst_case_change(QueryKind.PCA, [1.0] * 3, Neighbouring.ADD_REMOVE, changes)


@pytest.mark.parametrize("neighbouring", list(Neighbouring))
def test_plan_of_a_combined_query_meets_the_target_exactly(neighbouring: Neighbouring) -> None:
    spec = query(STATS, JOINT, LINREG, neighbouring=neighbouring, noise_weights=tuple(range(1, 10)))
    plan = ReleasePlan.for_query(spec, 2048)
    z = plan.noise_multiplier
    assert z == pytest.approx(zcdp_noise_multiplier(1.0, 1e-6), rel=1e-9)
    # The defining equation, from the integer noise of each section and the bounds above.
    bounds = [*SQUARED_BOUNDS["stats"].values(), *SQUARED_BOUNDS["histogram"].values()]
    bounds += list(SQUARED_BOUNDS["linreg"].values())
    add = swap = 0.0
    for section, info, (a, b) in zip(plan.sections, plan.statistics.sections, bounds, strict=True):
        if section.sigma_int == 0:
            # Released exactly: only a section no replacement moves (a count whose
            # records are never left out) under replace-one.
            assert neighbouring is Neighbouring.REPLACE_ONE and b == 0, section.name
            continue
        grid = 0 if info.grid_bits == 0 else F
        inverse = (2.0**grid / section.sigma_int) ** 2
        add += inverse * float(a)
        swap += inverse * float(b)
        # Counts live on the integer grid: their integer noise is their real noise.
        if grid == 0:
            assert section.sigma_int == section.sigma
        else:
            assert section.sigma_int == pytest.approx(section.sigma * 2.0**F)
    worst = swap if neighbouring is Neighbouring.REPLACE_ONE else max(add, swap)
    assert 1 / math.sqrt(worst) == pytest.approx(z, rel=1e-12)
    # The weight of a section is its share of the worst case, in its max(add, swap) units.
    ratios = [
        (max(math.sqrt(a), math.sqrt(b)) / s.sigma) ** 2 / w
        for s, (a, b), w in zip(plan.sections, bounds, range(1, 10), strict=True)
        if s.sigma > 0
    ]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    exact = [s.name for s in plan.sections if s.sigma == 0]
    assert exact == ([] if neighbouring is Neighbouring.ADD_REMOVE else ["0.count", "2.count"])
    event = plan.privacy_event("alice")
    assert event.noise_multiplier == z and event.neighbouring is neighbouring
    with pytest.raises(ConfigError, match="noise_weights has 2 entries"):
        ReleasePlan.for_query(query(STATS, noise_weights=(1.0, 1.0)), 2048)


def test_plan_for_bounded_owner_tables_covers_one_addition_exactly() -> None:
    """Owners that never sample: the defining equation has the add case alone.

    Every section's noise then has the central curator's calibration (add/remove:
    sum_j a_j^2 / sigma_j^2 = 1/z^2 with the weights as shares in add units).
    """
    weights = tuple(range(1, 10))
    bounded = query(STATS, JOINT, LINREG, noise_weights=weights, bounded_owner_tables=True)
    plan = ReleasePlan.for_query(bounded, 2048)
    z = plan.noise_multiplier
    assert z == pytest.approx(zcdp_noise_multiplier(1.0, 1e-6), rel=1e-9)
    bounds = [*SQUARED_BOUNDS["stats"].values(), *SQUARED_BOUNDS["histogram"].values()]
    bounds += list(SQUARED_BOUNDS["linreg"].values())
    add = 0.0
    ratios = []
    for section, info, (a, _), w in zip(
        plan.sections, plan.statistics.sections, bounds, weights, strict=True
    ):
        grid = 0 if info.grid_bits == 0 else F
        add += (2.0**grid / section.sigma_int) ** 2 * float(a)
        ratios.append(float(a) / section.sigma**2 / w)
    assert 1 / math.sqrt(add) == pytest.approx(z, rel=1e-12)
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    # The histogram alone, equal shares: one added record moves one cell by 1, so its
    # counts get z itself, where covering a swap takes sqrt(2) z.
    alone = ReleasePlan.for_query(query(JOINT, bounded_owner_tables=True), 2048)
    assert alone.sections[0].sigma == pytest.approx(z, rel=1e-12)
    capped = ReleasePlan.for_query(query(JOINT), 2048)
    assert capped.sections[0].sigma == pytest.approx(math.sqrt(2) * z, rel=1e-12)
    kind = QueryKind.AGGREGATE
    changes = [(1.0, 0.0), (1.0, math.sqrt(2))]
    assert worst_case_change(
        kind, [1.0, 1.0], Neighbouring.ADD_REMOVE, changes, bounded_owner_tables=True
    ) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="add/remove calibration only"):
        worst_case_change(
            kind, [1.0, 1.0], Neighbouring.REPLACE_ONE, changes, bounded_owner_tables=True
        )
    with pytest.raises(ConfigError, match="add/remove calibration only"):
        query(JOINT, neighbouring=Neighbouring.REPLACE_ONE, bounded_owner_tables=True)


def test_noise_and_decoding_of_an_aggregate_release() -> None:
    spec = query(STATS, JOINT, epsilon=math.inf, delta=0.0)
    plan = ReleasePlan.for_query(spec, 2048)
    rows = _table(3, 25)
    integers = fixed_point_aggregates(rows[:, list(spec.aggregate_columns)], spec)
    assert plan.owner_integers(integers)["shares"].shape == (plan.statistics.value_count,)
    parts = split_parts(spec.aggregates, plan.section_values(integers.values))
    assert parts[0]["count"].tolist() == [25.0]
    assert parts[1]["counts"].sum() == np.isin(rows[:, 3], [1.0, 2.0]).sum()
    with pytest.raises(LayoutError, match="no R, v, N"):
        plan.statistics_from_integers(integers.values)


def test_owner_sums_are_exact_and_padding_changes_nothing() -> None:
    spec = query(STATS, VARIANCE, JOINT, LINREG)
    rows = _table(4, 300)
    columns = rows[:, list(spec.aggregate_columns)]
    plain = fixed_point_aggregates(columns, spec).values
    padded = fixed_point_aggregates(columns, spec, pad_to=5000).values
    np.testing.assert_array_equal(plain, padded)
    # Exactly the integer sums of the quantised scaled values.
    lo, hi = np.array(STATS.lower), np.array(STATS.upper)
    u = 2 * (np.clip(rows[:, :3], lo, hi) - lo) / (hi - lo) - 1
    q = np.trunc(u * 2.0**G).astype(object)
    sections = _integers(query(STATS), rows)
    assert sections["count"] == [300]
    assert sections["sums"] == [int(v) << (F - G) for v in q.sum(axis=0)]
    products = q.T.dot(q)
    assert sections["products"] == [
        int(products[i, j]) << (F - 2 * G) for i in range(3) for j in range(i, 3)
    ]
    with pytest.raises(LayoutError, match="reads 4 columns"):
        fixed_point_aggregates(columns[:, :2], spec)


def test_histogram_cells_follow_numpy_and_the_edge_bin_rule() -> None:
    part = Aggregate.histogram((0,), ((0.0, 1.0, 2.0, 3.0),))
    values = np.array([[-7.0], [0.0], [0.99], [1.0], [2.5], [3.0], [1e300]])
    assert histogram_cells(part, values, None).tolist() == [0, 0, 0, 1, 2, 2, 2]
    inside = values[1:6, 0]
    counts = np.bincount(histogram_cells(part, values[1:6], None), minlength=3)
    assert counts.tolist() == np.histogram(inside, bins=part.bin_edges[0])[0].tolist()
    grouped = Aggregate.histogram((0,), ((0.0, 1.0, 2.0),), group_column=1, categories=(5.0, 7.0))
    cells = histogram_cells(grouped, np.array([[0.5], [1.5], [0.5]]), np.array([7.0, 5.0, 6.0]))
    assert cells.tolist() == [2, 1, -1]  # category 7 is the second table; 6 is left out


@pytest.mark.parametrize("n_edges", [2, 3, 4, 5, 8, 9, 17, 1001])
def test_histogram_cells_are_numpys_bins_for_every_edge_count(n_edges: int) -> None:
    """The owner's bin search does the same steps for every value (review: numpy's
    searchsorted branched on the data, so the time showed how spread a column is); it
    must still give numpy's bins, edges and values outside them included."""
    rng = np.random.default_rng(n_edges)
    edges = np.sort(rng.choice(np.arange(-5000, 5001), n_edges, replace=False)) / 1000
    part = Aggregate.histogram((0,), (tuple(edges),))
    values = np.concatenate(
        [
            edges,  # exactly on every edge
            np.nextafter(edges, -np.inf),
            np.nextafter(edges, np.inf),
            rng.uniform(-6, 6, 500),
            [-1e300, 1e300, -0.0, 0.0],
        ]
    )
    expected = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, n_edges - 2)
    assert histogram_cells(part, values[:, None], None).tolist() == expected.tolist()


def test_grouped_histogram_cells_match_a_row_by_row_reading() -> None:
    rng = np.random.default_rng(3)
    categories = (2.0, -1.0, 0.0, 9.5)
    part = Aggregate.histogram(
        (0, 1), ((0.0, 1.0, 2.0), (0.0, 0.5, 1.0, 1.5)), group_column=2, categories=categories
    )
    raw = rng.uniform(-0.5, 2.5, (400, 2))
    group = rng.choice([2.0, -1.0, 0.0, -0.0, 9.5, 3.0, 0.5], 400)
    cells = histogram_cells(part, raw, group)
    for row, g, cell in zip(raw, group, cells, strict=True):
        if g not in categories:
            assert cell == -1
            continue
        first = min(max(int(np.searchsorted((0.0, 1.0, 2.0), row[0], "right")) - 1, 0), 1)
        second = min(max(int(np.searchsorted((0.0, 0.5, 1.0, 1.5), row[1], "right")) - 1, 0), 2)
        assert cell == categories.index(g) * 6 + first * 3 + second


def test_a_histogram_counts_only_the_real_rows_of_a_padded_block() -> None:
    part = Aggregate.histogram((0,), ((0.0, 1.0, 2.0),), group_column=1, categories=(0.0, 1.0))
    rows = np.array([[0.5, 0.0], [1.5, 1.0], [1.5, 1.0], [0.5, 7.0]])
    spec = query(part)
    padded = fixed_point_aggregates(rows, spec, pad_to=50).values
    assert padded.tolist() == [1, 0, 0, 2]
    assert fixed_point_aggregates(rows[:0], spec, pad_to=50).values.tolist() == [0, 0, 0, 0]


# --------------------------------------------------------------------- the query
def test_aggregate_validation_names_the_problem() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"kind": "stats", "columns": (0,), "lower": (0.0,), "upper": (1.0,)}, "moments must be"),
        (
            {
                "kind": "stats",
                "columns": (0, 0),
                "lower": (0, 0),
                "upper": (1, 1),
                "moments": "mean",
            },
            "read only once",
        ),
        (
            {"kind": "stats", "columns": (0,), "lower": (1.0,), "upper": (1.0,), "moments": "mean"},
            "lower < upper",
        ),
        (
            # Finite bounds whose span the owners' scaling would overflow: refused with
            # the query, not by each owner's encoder after its budget was reserved.
            {
                "kind": "stats",
                "columns": (0,),
                "lower": (-1e308,),
                "upper": (1e308,),
                "moments": "mean",
            },
            "span more than a float can scale",
        ),
        (
            {
                "kind": "linreg",
                "columns": (0,),
                "lower": (0.0,),
                "upper": (1.0,),
                "target_column": 1,
                "target_lower": -1e308,
                "target_upper": 1e308,
            },
            "linreg: target: bounds",
        ),
        (
            {
                "kind": "stats",
                "columns": (-1,),
                "lower": (0.0,),
                "upper": (1.0,),
                "moments": "mean",
            },
            ">= 0",
        ),
        (
            {"kind": "histogram", "columns": (0, 1, 2), "bin_edges": ((0, 1),) * 3},
            "one column, or two",
        ),
        ({"kind": "histogram", "columns": (0,), "bin_edges": ((0, 0),)}, "strictly increasing"),
        (
            {"kind": "histogram", "columns": (0,), "bin_edges": ((0, 1),), "group_column": 1},
            "go together",
        ),
        (
            {
                "kind": "histogram",
                "columns": (0,),
                "bin_edges": ((0, 1),),
                "group_column": 1,
                "categories": (1, 1),
            },
            "distinct",
        ),
        (
            {
                "kind": "histogram",
                "columns": (0,),
                "bin_edges": (tuple(range(2000)),),
                "group_column": 1,
                "categories": tuple(range(600)),
            },
            "cells",
        ),
        ({"kind": "linreg", "columns": (0,), "lower": (0,), "upper": (1,)}, "needs target_column"),
        (
            {
                "kind": "linreg",
                "columns": (0,),
                "lower": (0,),
                "upper": (1,),
                "target_column": 0,
                "target_lower": 0,
                "target_upper": 1,
            },
            r"the target column 0 is also one of the columns \(0,\): leave it out",
        ),
        (
            {
                "kind": "histogram",
                "columns": (0,),
                "bin_edges": ((0, 1),),
                "group_column": 0,
                "categories": (1, 2),
            },
            "the group column 0 is also one of the columns",
        ),
        ({"kind": "sum", "columns": (0,)}, "unknown aggregate kind"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            Aggregate(**fields)


def test_query_spec_rules_for_aggregates() -> None:
    with pytest.raises(ConfigError, match="n_features = 4, got 3"):
        query(STATS, JOINT, n_features=3)
    with pytest.raises(ConfigError, match="stats mode only"):
        query(STATS, mode="masked")
    with pytest.raises(ConfigError, match=r"leave\s+feature_lower"):
        query(STATS, clip_norm=2.0)
    with pytest.raises(ConfigError, match="at least one aggregate"):
        query(n_features=1)
    with pytest.raises(ConfigError, match="a pca query takes no aggregates"):
        QuerySpec("q", QueryKind.PCA, 3, 1.0, 1e-6, 1, 3, "sha256:x", aggregates=(STATS,))
    spec = query(STATS, JOINT, LINREG)
    assert spec.aggregate_columns == (0, 1, 2, 3)
    assert spec.release_kinds == (
        AggregateKind.STATS,
        AggregateKind.HISTOGRAM,
        AggregateKind.LINREG,
    )


def test_feature_columns_are_checked_and_enter_the_digest_only_when_named() -> None:
    def pca(**fields: Any) -> QuerySpec:
        return QuerySpec("q1", QueryKind.PCA, 3, 1.0, 1e-5, 2, 35, "sha256:x", **fields)

    named = pca(feature_columns=(4, 1.0, 2))  # as read back from JSON: 1.0 is column 1
    assert named.feature_columns == (4, 1, 2) and type(named.feature_columns[1]) is int
    from_numpy = pca(feature_columns=np.flatnonzero([0, 1, 1, 0, 1]))
    assert from_numpy.feature_columns == (1, 2, 4) and type(from_numpy.feature_columns[0]) is int
    assert spec_digest(named) != spec_digest(pca())
    assert spec_digest(named) == spec_digest(pca(feature_columns=[4, 1, 2]))
    with pytest.raises(ConfigError, match="names a column twice"):
        pca(feature_columns=(1, 1, 2))
    with pytest.raises(ConfigError, match="names 2 columns, the query has n_features = 3"):
        pca(feature_columns=(1, 2))
    with pytest.raises(ConfigError, match="whole column indices"):
        pca(feature_columns=(1, 2.5, 3))
    with pytest.raises(ConfigError, match="indices >= 0"):
        pca(feature_columns=(1, -2, 3))
    with pytest.raises(ConfigError, match="label column 0 cannot also be a feature column"):
        QuerySpec(
            "q1",
            QueryKind.DCA,
            3,
            1.0,
            1e-5,
            1,
            35,
            "sha256:x",
            label_column=0,
            class_labels=(0.0, 1.0),
            feature_columns=(0, 1, 2),
        )
    with pytest.raises(ConfigError, match="names its columns per aggregate"):
        query(STATS, feature_columns=(1, 2))


def test_pca_digest_is_unchanged_and_aggregates_enter_it() -> None:
    # The digest older analyst clients sign (fedpca before aggregates): unchanged.
    pca = QuerySpec("q1", QueryKind.PCA, 3, 1.0, 1e-5, 2, 35, "sha256:x")
    assert spec_digest(pca) == (
        "sha256:fac928c757181a5d18c55e6f6a2ed8347b38c900a20c179b91824004fb472371"
    )
    one = query(JOINT)
    moved = query(
        Aggregate.histogram((0, 1), ((0.0, 0.5, 1.0), (-5.0, 0.0, 2.5, 5.0)), 3, (1.0, 2.0))
    )
    assert spec_digest(one) != spec_digest(moved)


def test_digest_encodes_every_field_as_dataclasses_asdict_does() -> None:
    # The digest is what analysts sign: it must stay the canonical JSON of the spec as
    # dataclasses.asdict presents it, aggregates included, however it is computed. The
    # fields added later are left out at their defaults, so older clients' signatures
    # still verify.
    def reference(spec: QuerySpec) -> str:
        fields = dataclasses.asdict(spec)
        if not fields["aggregates"]:
            del fields["aggregates"]
        if not fields["bounded_owner_tables"]:
            del fields["bounded_owner_tables"]
        if fields["issued_at"] is None:
            del fields["issued_at"]
        if not fields["feature_columns"]:
            del fields["feature_columns"]
        text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    dca = QuerySpec(
        "q2",
        QueryKind.DCA,
        3,
        0.5,
        1e-6,
        1,
        35,
        "sha256:x",
        feature_lower=(-1.0, 0.0, 2.5),
        feature_upper=(1.0, 4.0, 9.0),
        class_labels=(0.0, 1.0),
        label_column=0,
    )
    combined = query(STATS, VARIANCE, JOINT, LINREG, noise_weights=tuple(range(1, 15)))
    bounded = dataclasses.replace(combined, bounded_owner_tables=True)
    stamped = dataclasses.replace(combined, issued_at=1_795_000_000.25)
    named = dataclasses.replace(dca, feature_columns=(3, 1, 2))
    for spec in (dca, combined, bounded, stamped, named):
        assert spec_digest(spec) == reference(spec)
    assert spec_digest(bounded) != spec_digest(combined)
    assert spec_digest(stamped) != spec_digest(combined)


def test_wire_and_store_round_trips_are_exact() -> None:
    spec = query(STATS, VARIANCE, JOINT, LINREG, noise_weights=tuple(range(1, 15)))
    for variant in (spec, dataclasses.replace(spec, bounded_owner_tables=True)):
        wire = serde.query_spec_to_proto(variant).SerializeToString()
        assert serde.query_spec_from_proto(query_pb.QuerySpec.FromString(wire)) == variant
        assert spec_from_dict(json.loads(json.dumps(spec_to_dict(variant)))) == variant
    stored = json.loads(json.dumps(spec_to_dict(spec)))
    # A query stored before the field existed reads back with its default.
    del stored["bounded_owner_tables"]
    assert spec_from_dict(stored) == spec
    # A peer's invalid aggregate is a protocol error naming it.
    message = serde.query_spec_to_proto(spec)
    message.aggregates[2].bin_edges[0].edges[1] = -10.0
    with pytest.raises(Exception, match=r"aggregates\[2\].*strictly increasing"):
        serde.query_spec_from_proto(message)
    stored["aggregates"][0]["colour"] = 1
    with pytest.raises(ConfigError, match="unknown keys \\['colour'\\]"):
        spec_from_dict(stored)


def test_replace_one_releases_unmoved_counts_exactly() -> None:
    # |D| and every owner's record count are public under replace-one: the count of a
    # stats aggregate gets no noise, its budget share goes to the other sections.
    spec = query(STATS, JOINT, neighbouring=Neighbouring.REPLACE_ONE)
    plan = ReleasePlan.for_query(spec, 2048)
    noise = plan.noise_values(TestOnlySeededSampler(3))
    slices = plan.statistics.section_slices()
    assert np.all(noise[slices["0.count"]] == 0)
    assert np.count_nonzero(noise[slices["0.sums"]]) == 3
    assert np.count_nonzero(noise[slices["1.counts"]]) > 0  # a replacement moves cells
    assert plan.privacy_event("alice").sensitivity > 0
    # Its sigma is 0, so the noise sd printed beside N is 0 (the summary calls N exact).
    assert {s.name: s.sigma for s in plan.sections}["0.count"] == 0.0
    add_remove = ReleasePlan.for_query(query(STATS, JOINT), 2048)
    assert all(s.sigma > 0 for s in add_remove.sections)


def test_histogram_errors_name_the_column_and_the_analysts_words() -> None:
    """bins and groupby as the analyst gives them, the column and the edges given (a
    walkthrough's analyst read 'bin_edges[0]' and did not know it for --bins)."""
    from fedpca.analyst import FederatedHistogram

    with pytest.raises(ConfigError) as caught:
        FederatedHistogram(columns=[2, 8], bins=[[0, 1], [3, 2, 1]], epsilon=1).aggregate()
    said = str(caught.value)
    assert (
        "the bins of column 8 must be at least two strictly increasing edges, got [3, 2, 1]" in said
    )
    assert "bin_edges" not in said
    with pytest.raises(ConfigError, match=r"groupby \(the group column\) and categories"):
        FederatedHistogram(columns=[8], bins=[[0, 1]], groupby=0, epsilon=1).aggregate()
