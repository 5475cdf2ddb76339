"""The release plan: what every role derives from a query before anything is encrypted.

Given a public :class:`~fedpca.query.QuerySpec` and the size of the analyst's key,
:class:`ReleasePlan` fixes

* the noise: the noise multiplier from (epsilon, delta), split across the released
  sections, in real and in fixed-point integer units;
* the packed-ciphertext blocks the owners upload and the proxy returns, with their
  slot layouts sized from the query's public bounds and the noise headroom.

Owners, proxy and analyst compute the plan independently from the same public
inputs; the proxy sends its layout with every task and an owner refuses a task
whose layout differs from the one it derives itself.

Two protocol modes (see docs/privacy.md for the proofs):

``stats``
    One block ``shares``: the concatenated sections of
    :class:`~fedpca.stats.StatisticsSpec` (scatter upper triangle, sum, count; or
    scatter, class sums, class counts for DCA). The proxy adds discrete Gaussian
    noise per section under encryption. Adjacency: add/remove one record.

``masked``
    The corrected Wang & Chang protocol, PCA only. Owners upload the scatter upper
    triangle packed *row-aligned* (every row of the triangle starts a new packed
    ciphertext), their sum vector once unpacked (one value per ciphertext) and once
    as packed windows ``v[t : t + k]`` for every t, and their record count in the
    clear. N is public: the adjacency is replace-one record. The proxy returns
    ``Enc(N 2^f R + v bᵀ + b vᵀ + b bᵀ + N 2^f E)`` (all in 2^(2f) units) and
    ``Enc(v + b)`` for a uniformly random mask b, 2^40 times wider than |v|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.codec.fixed_point import encode_fixed_point
from fedpca.codec.packing import PackingBounds, SlotLayout, owner_value_bound
from fedpca.dp.allocation import allocate_noise, effective_noise_multiplier
from fedpca.dp.calibration import calibrate_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.dp.noise import NoiseSampler, integer_grid_sensitivity, noise_headroom, vector_noise
from fedpca.errors import ConfigError, LayoutError
from fedpca.query import ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import (
    CLASS_COUNTS,
    COUNT,
    StatisticsSpec,
    SufficientStatistics,
    upper_triangle_length,
)

IntArray = npt.NDArray[np.int64]

SHARES = "shares"
"""Stats mode: the single block of concatenated sections."""
SCATTER_ROWS = "scatter_rows"
"""Masked mode: row-aligned packed upper triangle of R (owners) / of T (result)."""
SUM_SINGLE = "sum_single"
"""Masked mode: v_i alone in one ciphertext per feature."""
SUM_WINDOWS = "sum_windows"
"""Masked mode: packed windows v[t : t + k] for every start t."""
MASKED_SUM = "masked_sum"
"""Masked mode result: packed v + b."""

MASK_SECURITY_BITS = 40
"""Statistical hiding of the mean mask: each coordinate of v + b is within total
variation distance 2^-40 of the same for a neighbouring v (see mask_width)."""


@dataclass(frozen=True)
class SectionNoise:
    """The Gaussian noise one released section receives."""

    name: str
    length: int
    l2_sensitivity: float
    """Per-record L2 sensitivity in real units."""
    sigma: float
    """Standard deviation in real units (0 = not private)."""
    sigma_int: float
    """Standard deviation in fixed-point integer units, rounding slack included."""


@dataclass(frozen=True)
class Block:
    """One packed-ciphertext block of an upload or a result."""

    name: str
    layout: SlotLayout
    bound: int
    """Declared bound on |slot value| of the values packed into this block."""


@dataclass(frozen=True)
class ReleasePlan:
    """Everything public about one release, derived from the query and the key size."""

    spec: QuerySpec
    key_bits: int
    statistics: StatisticsSpec
    noise_multiplier: float
    """z of the whole release (sigma / sensitivity); 0 = NOT PRIVATE."""
    sections: tuple[SectionNoise, ...]
    bounds: PackingBounds
    owner_blocks: tuple[Block, ...]
    result_blocks: tuple[Block, ...]

    # ------------------------------------------------------------ construction
    @classmethod
    def for_query(cls, spec: QuerySpec, key_bits: int) -> ReleasePlan:
        """Derive the plan of ``spec`` for a ``key_bits``-bit analyst key.

        Raises
        ------
        ConfigError
            If the query combines options the protocol does not support.
        EncodingOverflowError
            If the declared bounds do not fit a slot of the key.
        """
        statistics = StatisticsSpec.from_query(spec)
        if spec.mode is ProtocolMode.MASKED:
            return _masked_plan(spec, key_bits, statistics)
        return _stats_plan(spec, key_bits, statistics)

    # ---------------------------------------------------------------- helpers
    @property
    def private(self) -> bool:
        return self.noise_multiplier > 0

    def owner_block(self, name: str) -> Block:
        return _find(self.owner_blocks, name)

    def result_block(self, name: str) -> Block:
        return _find(self.result_blocks, name)

    def privacy_event(self, analyst: str) -> PrivacyEvent:
        """The ledger record of this release."""
        return PrivacyEvent(
            query_id=self.spec.query_id,
            analyst=analyst,
            noise_multiplier=self.noise_multiplier,
            epsilon=self.spec.epsilon,
            delta=self.spec.delta if self.private else 0.0,
        )

    def describe(self) -> dict[str, Any]:
        """JSON-ready public description (stored by the proxy, shown to the analyst)."""
        return {
            "mode": self.spec.mode.value,
            "key_bits": self.key_bits,
            "noise_multiplier": self.noise_multiplier,
            "sections": [
                {
                    "name": s.name,
                    "length": s.length,
                    "l2_sensitivity": s.l2_sensitivity,
                    "sigma": s.sigma,
                }
                for s in self.sections
            ],
            "owner_blocks": [_block_dict(b) for b in self.owner_blocks],
            "result_blocks": [_block_dict(b) for b in self.result_blocks],
        }

    # ------------------------------------------------------------- stats mode
    def owner_values(self, statistics: SufficientStatistics) -> dict[str, npt.NDArray[np.float64]]:
        """Real-valued values of every owner block (before fixed-point encoding)."""
        if self.spec.mode is ProtocolMode.MASKED:
            scatter = np.asarray(statistics.scatter, dtype=np.float64)
            return _masked_blocks(self, scatter, np.asarray(statistics.sums, dtype=np.float64))
        return {SHARES: statistics.to_vector(self.statistics)}

    def owner_integers(
        self, statistics: SufficientStatistics, rng: np.random.Generator | None = None
    ) -> dict[str, IntArray]:
        """Fixed-point values of every owner block, each statistic rounded exactly once.

        Masked mode uploads v several times (unpacked and as overlapping windows). The
        mask terms b·v only cancel at the analyst if every copy is the *same* integer,
        so v is stochastically rounded once and then laid out, never rounded per copy.
        """
        f = self.spec.frac_bits
        if self.spec.mode is ProtocolMode.MASKED:
            scatter = encode_fixed_point(np.asarray(statistics.scatter), f, rng=rng)
            sums = encode_fixed_point(np.asarray(statistics.sums), f, rng=rng)
            return _masked_blocks(self, scatter, sums)
        return {SHARES: encode_fixed_point(statistics.to_vector(self.statistics), f, rng=rng)}

    def noise_values(self, sampler: NoiseSampler | None = None) -> IntArray:
        """Stats mode: discrete Gaussian noise for the ``shares`` block, per section.

        Each section gets i.i.d. integer noise of its own ``sigma_int``; the scatter
        section is the upper triangle of a symmetric noise matrix (the analyst
        mirrors it). Every draw is checked against the block's headroom.
        """
        if self.spec.mode is not ProtocolMode.STATS:
            raise ConfigError("noise_values is for stats mode; masked mode noises the scatter")
        parts = [
            vector_noise(
                s.length, s.sigma_int, sampler=sampler, bound=_headroom(s.sigma_int, s.length)
            )
            for s in self.sections
        ]
        return np.concatenate(parts).astype(np.int64)

    def statistics_from_values(self, values: npt.NDArray[np.float64]) -> SufficientStatistics:
        """Stats mode: decoded ``shares`` values (real units) back to statistics."""
        return SufficientStatistics.from_vector(self.statistics, values)


# --------------------------------------------------------------------- stats mode
def _headroom(sigma_int: float, length: int) -> int:
    return noise_headroom(sigma_int) if sigma_int > 0 and length > 0 else 0


def _noise_multiplier(spec: QuerySpec) -> float:
    return calibrate_noise_multiplier(spec.epsilon, spec.delta, spec.calibration)


def _stats_plan(spec: QuerySpec, key_bits: int, statistics: StatisticsSpec) -> ReleasePlan:
    z = _noise_multiplier(spec)
    names = [s.name for s in statistics.sections]
    sensitivities = [s.l2_sensitivity for s in statistics.sections]
    weights = list(spec.noise_weights) or [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(
            f"noise_weights has {len(weights)} entries; this query releases "
            f"{len(names)} sections ({', '.join(names)})"
        )
    sigmas = allocate_noise(sensitivities, weights, z) if z > 0 else (0.0,) * len(names)
    sections = []
    for section, sigma in zip(statistics.sections, sigmas, strict=True):
        # Noise is added to fixed-point integers: calibrate to the integer query's
        # sensitivity, which includes the owners' rounding (fedpca.dp.noise).
        rounded = 0 if section.name in (COUNT, CLASS_COUNTS) else section.length
        sigma_int = 0.0
        if sigma > 0:
            grid = integer_grid_sensitivity(section.l2_sensitivity, spec.frac_bits, rounded)
            sigma_int = sigma / section.l2_sensitivity * grid
        sections.append(
            SectionNoise(section.name, section.length, section.l2_sensitivity, sigma, sigma_int)
        )
    headroom = max(_headroom(s.sigma_int, s.length) for s in sections)
    bounds = PackingBounds(
        max_abs_per_record=statistics.max_abs_per_record,
        max_records_per_owner=spec.max_records_per_owner,
        max_owners=spec.max_owners,
        frac_bits=spec.frac_bits,
        noise_headroom=headroom,
    )
    layout = SlotLayout.from_bounds(bounds, key_bits, statistics.value_count)
    block = Block(SHARES, layout, owner_value_bound(bounds))
    z_effective = effective_noise_multiplier(sensitivities, sigmas) if z > 0 else 0.0
    return ReleasePlan(
        spec=spec,
        key_bits=key_bits,
        statistics=statistics,
        noise_multiplier=z_effective,
        sections=tuple(sections),
        bounds=bounds,
        owner_blocks=(block,),
        result_blocks=(block,),
    )


# -------------------------------------------------------------------- masked mode
def masked_scatter_sensitivity(clip_norm: float, n_records: int, frac_bits: int, m: int) -> float:
    """L2 sensitivity of the released centred scatter under replace-one adjacency.

    Replacing record x by x' in a dataset of N records (μ its mean, y = x − μ,
    y' = x' − μ, d = x' − x) changes S = R − v vᵀ/N by y'y'ᵀ − y yᵀ − d dᵀ/N.
    ‖y'y'ᵀ − y yᵀ‖_F² = ‖y'‖⁴ + ‖y‖⁴ − 2(yᵀy')² <= 2 (2c)⁴ and ‖d dᵀ‖_F/N <= (2c)²/N,
    so ‖ΔS‖_F <= 4√2 c² + 4c²/N; the upper triangle's L2 norm is at most that.
    The analyst computes S from fixed-point sums rounded once per owner; with
    coupled rounding coins every rounded upper-triangle entry moves by at most
    2^-f (2 + 6c) more, which adds sqrt(M(M+1)/2) 2^-f (2 + 6c).
    """
    c2 = clip_norm * clip_norm
    core = 4.0 * math.sqrt(2.0) * c2 + 4.0 * c2 / max(n_records, 1)
    slack = math.sqrt(upper_triangle_length(m)) * math.ldexp(2.0 + 6.0 * clip_norm, -frac_bits)
    return math.nextafter(core + slack, math.inf)


def mask_width(sum_bound: int) -> int:
    """Masks are uniform on [0, W) with W = 2^(κ+1) · |v|max.

    For |v|, |v'| <= V the distributions of v + b and v' + b differ in total
    variation by |v − v'|/W <= 2V/W = 2^-κ per coordinate.
    """
    return sum_bound << (MASK_SECURITY_BITS + 1)


def masked_sigma(plan: ReleasePlan, n_records: int) -> tuple[float, float]:
    """(sigma, sigma_int) of the scatter noise once the public N is known."""
    spec = plan.spec
    if plan.noise_multiplier == 0:
        return 0.0, 0.0
    sensitivity = masked_scatter_sensitivity(
        spec.clip_norm, n_records, spec.frac_bits, spec.n_features
    )
    sigma = plan.noise_multiplier * sensitivity
    return sigma, math.ldexp(sigma, spec.frac_bits)


def row_aligned_length(m: int, k: int) -> int:
    """Values in the row-aligned upper triangle: every row padded to a multiple of k."""
    return k * sum(-(-(m - i) // k) for i in range(m))


def _masked_plan(spec: QuerySpec, key_bits: int, statistics: StatisticsSpec) -> ReleasePlan:
    if spec.kind is not QueryKind.PCA:
        raise ConfigError(
            "masked mode is the published PCA protocol; run DCA in stats mode (--mode stats)"
        )
    m = spec.n_features
    # The mask hides v only statistically: the analyst's view of v + b moves by at most
    # M·2^-40 in total variation between neighbours, which is added to delta.
    mask_delta = m * 2.0**-MASK_SECURITY_BITS
    if spec.private and spec.delta <= mask_delta:
        raise ConfigError(
            f"masked mode spends delta {mask_delta:.3g} on the mean mask; delta must exceed it"
        )
    z = calibrate_noise_multiplier(
        spec.epsilon, spec.delta - mask_delta if spec.private else spec.delta, spec.calibration
    )
    c = spec.clip_norm
    f = spec.frac_bits
    # Worst case N = 1 sizes the headroom; the actual sigma uses the public N.
    worst_sensitivity = masked_scatter_sensitivity(c, 1, f, m)
    worst_sigma_int = math.ldexp(z * worst_sensitivity, f)
    headroom = _headroom(worst_sigma_int, upper_triangle_length(m))
    n_total = spec.max_owners * spec.max_records_per_owner
    per_owner = {
        "scatter": PackingBounds(c * c, spec.max_records_per_owner, 1, f, 0),
        "sum": PackingBounds(c, spec.max_records_per_owner, 1, f, 0),
    }
    r_bound = spec.max_owners * owner_value_bound(per_owner["scatter"])
    v_bound = spec.max_owners * owner_value_bound(per_owner["sum"])
    width = mask_width(v_bound)
    # |T| <= N 2^f |R| + 2 |v| W + W^2 + N 2^f |E| in 2^(2f) units.
    t_bound = (n_total << f) * r_bound + 2 * v_bound * width + width * width
    t_bound += (n_total << f) * headroom
    slot_bits = max(t_bound, v_bound + width).bit_length() + 1
    k = (key_bits - 1) // slot_bits
    if k < 1:
        raise LayoutError(
            f"masked mode needs {slot_bits}-bit slots, more than a {key_bits}-bit key holds; "
            "lower max_records_per_owner, max_owners or frac_bits"
        )
    bounds = PackingBounds(
        max_abs_per_record=statistics.max_abs_per_record,
        max_records_per_owner=spec.max_records_per_owner,
        max_owners=spec.max_owners,
        frac_bits=f,
        noise_headroom=headroom,
    )
    scatter_bound = owner_value_bound(per_owner["scatter"])
    sum_bound = owner_value_bound(per_owner["sum"])
    rows = SlotLayout(key_bits, slot_bits, k, row_aligned_length(m, k))
    owner_blocks = (
        Block(SCATTER_ROWS, rows, scatter_bound),
        Block(SUM_SINGLE, SlotLayout(key_bits, slot_bits, 1, m), sum_bound),
        Block(SUM_WINDOWS, SlotLayout(key_bits, slot_bits, k, m * k), sum_bound),
    )
    result_blocks = (
        Block(SCATTER_ROWS, rows, (1 << (slot_bits - 1)) - 1),
        Block(MASKED_SUM, SlotLayout(key_bits, slot_bits, k, m), v_bound + width),
    )
    sensitivity = statistics.section("scatter").l2_sensitivity
    section = SectionNoise("scatter", upper_triangle_length(m), sensitivity, 0.0, 0.0)
    return ReleasePlan(
        spec=spec,
        key_bits=key_bits,
        statistics=statistics,
        noise_multiplier=z,
        sections=(section,),
        bounds=bounds,
        owner_blocks=owner_blocks,
        result_blocks=result_blocks,
    )


def row_aligned_positions(m: int, k: int) -> list[tuple[int, int] | None]:
    """(i, j) of every slot of the row-aligned upper triangle; None for padding."""
    positions: list[tuple[int, int] | None] = []
    for i in range(m):
        columns = list(range(i, m))
        padded = -(-len(columns) // k) * k
        positions.extend((i, j) for j in columns)
        positions.extend([None] * (padded - len(columns)))
    return positions


def _masked_blocks(
    plan: ReleasePlan, scatter: npt.NDArray[Any], sums: npt.NDArray[Any]
) -> dict[str, npt.NDArray[Any]]:
    """Lay out the masked-mode owner blocks from one scatter matrix and one sum vector."""
    m = plan.spec.n_features
    k = plan.owner_block(SCATTER_ROWS).layout.slots_per_ciphertext
    zero = np.zeros(1, dtype=sums.dtype)[0]
    rows = np.array(
        [zero if p is None else scatter[p[0], p[1]] for p in row_aligned_positions(m, k)],
        dtype=sums.dtype,
    )
    padded = np.concatenate([sums, np.zeros(k, dtype=sums.dtype)])
    windows = np.concatenate([padded[t : t + k] for t in range(m)])
    return {SCATTER_ROWS: rows, SUM_SINGLE: sums.copy(), SUM_WINDOWS: windows}


def _find(blocks: tuple[Block, ...], name: str) -> Block:
    for block in blocks:
        if block.name == name:
            return block
    raise LayoutError(f"no block named {name!r} (have {', '.join(b.name for b in blocks)})")


def _block_dict(block: Block) -> dict[str, Any]:
    return {
        "name": block.name,
        "key_bits": block.layout.key_bits,
        "slot_bits": block.layout.slot_bits,
        "slots_per_ciphertext": block.layout.slots_per_ciphertext,
        "value_count": block.layout.value_count,
        "n_ciphertexts": block.layout.n_ciphertexts,
        "bound": block.bound,
    }
