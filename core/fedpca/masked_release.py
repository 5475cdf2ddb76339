"""Masked mode's arithmetic that needs no release plan: the sensitivity of its release,
the mask's width, the residue that hides v vᵀ mod N 2^f, and the row-aligned layout.

:mod:`fedpca.protocol` builds the masked plan from these; the proxy
(:mod:`fedpca.proxy.masking`) and the analyst (:mod:`fedpca.analyst.decode`) use them
directly. docs/privacy.md has the analysis.
"""

from __future__ import annotations

import math
import secrets

from fedpca.codec.packing import PackingBounds, owner_value_bound
from fedpca.query import QuerySpec

MASK_SECURITY_BITS = 40
"""Statistical hiding of the mean mask: each coordinate of v + b is within total
variation distance 2^-40 of the same for a neighbouring v (see mask_width)."""


def masked_scatter_sensitivity(clip_norm: float, n_records: int) -> float:
    """L2 sensitivity of the released centred scatter under replace-one adjacency.

    Replacing record x by x' in a dataset of N records (μ its mean, y = x − μ,
    y' = x' − μ, d = x' − x) changes S = R − v vᵀ/N by y'y'ᵀ − y yᵀ − d dᵀ/N.
    ‖y'y'ᵀ − y yᵀ‖_F² = ‖y'‖⁴ + ‖y‖⁴ − 2(yᵀy')² <= 2 (2c)⁴ and ‖d dᵀ‖_F/N <= (2c)²/N,
    so ‖ΔS‖_F <= 4√2 c² + 4c²/N; the upper triangle's L2 norm is at most that.
    The owners' statistics are exact integers of rows quantised with ‖x‖ <= c
    (:func:`fedpca.exact_statistics.fixed_point_statistics`); what the release adds to
    this is :func:`masked_rounding_slack`.
    """
    c2 = clip_norm * clip_norm
    return math.nextafter(4.0 * math.sqrt(2.0) * c2 + 4.0 * c2 / max(n_records, 1), math.inf)


def masked_rounding_slack(clip_norm: float, n_features: int, frac_bits: int) -> float:
    """L2 slack, in the units of S, of the rounding the masked release applies to v vᵀ/N.

    The analyst's T − v′v′ᵀ is N 2^f (R + E) − v vᵀ + F on the unit grid, with F a
    uniform residue the proxy adds to every entry (:mod:`fedpca.proxy.masking`):
    without it the noise, a multiple of N 2^f, left v vᵀ mod N 2^f exact. Writing
    F − v vᵀ = N 2^f Q + ρ, ρ is uniform and independent of the data, and Q rounds
    −v vᵀ/(N 2^f) to an integer at a threshold ρ/(N 2^f). Given ρ the release is the
    discrete Gaussian of R − round(v vᵀ/(N 2^f)), whose rounding differs between
    neighbours by less than one grid step (2^-f c²) per entry: at most √(M(M+1)/2)
    steps in L2 over the upper triangle.
    """
    steps = math.sqrt(n_features * (n_features + 1) / 2)
    return math.nextafter(math.ldexp(steps * clip_norm * clip_norm, -frac_bits), math.inf)


def masked_residue(scale: int) -> int:
    """One uniform draw from the ``scale`` integers around 0 (:func:`masked_rounding_slack`).

    From ``secrets``: like the mask, it must be unpredictable to the analyst.
    """
    return secrets.randbelow(scale) - scale // 2


def masked_release_sensitivity(spec: QuerySpec, n_records: int) -> float:
    """The masked release's L2 sensitivity: the centred scatter's, plus its rounding."""
    return masked_scatter_sensitivity(spec.clip_norm, n_records) + masked_rounding_slack(
        spec.clip_norm, spec.n_features, spec.frac_bits
    )


def mask_width(sum_bound: int) -> int:
    """Masks are uniform on [0, W) with W = 2^(κ+1) · |v|max.

    For |v|, |v'| <= V the distributions of v + b and v' + b differ in total
    variation by |v − v'|/W <= 2V/W = 2^-κ per coordinate.
    """
    return sum_bound << (MASK_SECURITY_BITS + 1)


def masked_sum_bound(spec: QuerySpec) -> int:
    """|v|max of the summed sum vector in masked mode, in clip units (c = 1: owners send
    v in units of c) on the 2^-f grid: the plan sizes its slots with it and the proxy its
    mean mask, so both read it here (the proxy used c itself, and refused a query with
    c != 1 after its owners had uploaded; found by review)."""
    per_owner = PackingBounds(1.0, spec.max_records_per_owner, 1, spec.frac_bits, 0)
    return spec.max_owners * owner_value_bound(per_owner)


def row_aligned_length(m: int, k: int) -> int:
    """Values in the row-aligned upper triangle: every row padded to a multiple of k."""
    return k * sum(-(-(m - i) // k) for i in range(m))


def row_aligned_positions(m: int, k: int) -> list[tuple[int, int] | None]:
    """(i, j) of every slot of the row-aligned upper triangle; None for padding."""
    positions: list[tuple[int, int] | None] = []
    for i in range(m):
        columns = list(range(i, m))
        padded = -(-len(columns) // k) * k
        positions.extend((i, j) for j in columns)
        positions.extend([None] * (padded - len(columns)))
    return positions
