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
    scatter, class sums, class counts for DCA), in 2^-f clip units
    (:func:`fedpca.exact_statistics.fixed_point_statistics`). The proxy adds discrete Gaussian
    noise per section under encryption. Adjacency: the query's (add/remove by
    default, or replace-one); the noise covers every change the relation allows
    (:func:`fedpca.stats.worst_case_change`).

``masked``
    The corrected Wang & Chang protocol, PCA only. Owners upload the scatter upper
    triangle packed *row-aligned* (every row of the triangle starts a new packed
    ciphertext), their sum vector once unpacked (one value per ciphertext) and once
    as packed windows ``v[t : t + k]`` for every t, and their record count in the
    clear. N is public: the adjacency must be replace-one record (a query stated
    for add/remove adjacency is refused: N would have infinite epsilon). The proxy returns
    ``Enc(N 2^f R + v bᵀ + b vᵀ + b bᵀ + N 2^f E)`` (all in 2^(2f) units) and
    ``Enc(v + b)`` for a uniformly random mask b, 2^40 times wider than |v|.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.aggregates import AggregateIntegers
from fedpca.codec.packing import PackingBounds, SlotLayout, owner_value_bound
from fedpca.dp.allocation import normalise_weights
from fedpca.dp.calibration import calibrate_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.dp.noise import (
    FLOAT_MARGIN,
    MAX_NOISE_BOUND,
    NoiseSampler,
    noise_headroom,
    refusal_delta,
    vector_noise,
)
from fedpca.errors import ConfigError, EncodingOverflowError, LayoutError
from fedpca.exact_statistics import FixedPointStatistics
from fedpca.masked_release import (
    MASK_SECURITY_BITS,
    mask_width,
    masked_release_sensitivity,
    masked_rounding_slack,
    masked_scatter_sensitivity,
    masked_sum_bound,
    row_aligned_length,
    row_aligned_positions,
)
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import Section, StatisticsSpec, SufficientStatistics, upper_triangle_length

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


INT64_VALUE_LIMIT = 1 << 62
"""Owners compute their statistics in int64: the plan refuses bounds that could reach it."""


@dataclass(frozen=True)
class SectionNoise:
    """The Gaussian noise one released section receives."""

    name: str
    length: int
    l2_sensitivity: float
    """Per-record add/remove L2 sensitivity in real units."""
    sigma: float
    """Standard deviation in real units (0 = not private)."""
    sigma_int: float
    """Standard deviation in the section's integer units (2^-f clip units; counts of
    aggregate queries: plain counts)."""


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
        """The ledger record of this release, under the query's neighbouring relation."""
        return PrivacyEvent(
            query_id=self.spec.query_id,
            analyst=analyst,
            noise_multiplier=self.noise_multiplier,
            epsilon=self.spec.epsilon,
            delta=self.spec.delta if self.private else 0.0,
            neighbouring=self.spec.neighbouring,
            sensitivity=self.sensitivity,
            delta_extra=self.delta_extra if self.private else 0.0,
        )

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the release in the units of its first noised section's noise.

        With per-section noise sigma_j the release is accounted by z alone; this is
        sigma_0 / z (section 0: the first with noise), i.e. the sensitivity of the
        release once every section is rescaled to that section's noise (the plain L2
        sensitivity when all sections get the same sigma, as by default at clip norm 1).
        Masked mode: the scatter's sensitivity at N = 1 (its noise uses the public N,
        which only lowers it).
        """
        spec = self.spec
        c2 = spec.clip_norm * spec.clip_norm
        if spec.mode is ProtocolMode.MASKED:
            return masked_release_sensitivity(spec, 1)
        if not self.private:
            statistics = StatisticsSpec.from_query(spec)
            return (
                statistics.l2_sensitivity_under(
                    spec.neighbouring, bounded_owner_tables=spec.bounded_owner_tables
                )
                * c2
            )
        first = next(s for s in self.sections if s.sigma > 0)
        return first.sigma / self.noise_multiplier

    @property
    def delta_extra(self) -> float:
        """delta spent outside the Gaussian part: refusing draws beyond the headroom
        (n 2^-100 over the n values that may be noised), and masked mode's mean mask
        (M 2^-40)."""
        m = self.spec.n_features
        if self.spec.mode is ProtocolMode.MASKED:
            return m * 2.0**-MASK_SECURITY_BITS + refusal_delta(upper_triangle_length(m))
        return refusal_delta(self.statistics.value_count)

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
    def owner_integers(
        self, statistics: FixedPointStatistics | AggregateIntegers
    ) -> dict[str, IntArray]:
        """Fixed-point values of every owner block, laid out from exact statistics.

        Masked mode uploads v several times (unpacked and as overlapping windows); the
        mask terms b·v only cancel at the analyst because every copy is the same integer.
        """
        if statistics.frac_bits != self.spec.frac_bits:
            raise LayoutError(
                f"statistics on a 2^-{statistics.frac_bits} grid, the query uses "
                f"2^-{self.spec.frac_bits}"
            )
        if self.spec.mode is ProtocolMode.MASKED:
            if not isinstance(statistics, FixedPointStatistics):
                raise LayoutError("masked mode releases a PCA scatter, not aggregates")
            return _masked_blocks(self, statistics.scatter, statistics.sums)
        return {SHARES: statistics.to_vector(self.statistics)}

    def noise_values(self, sampler: NoiseSampler | None = None) -> IntArray:
        """Stats mode: discrete Gaussian noise for the ``shares`` block, per section.

        Each section gets i.i.d. integer noise of its own ``sigma_int``; the scatter
        section is the upper triangle of a symmetric noise matrix (the analyst
        mirrors it). Every draw is checked against the block's headroom.
        """
        return np.concatenate([np.zeros(0, dtype=np.int64), *self.noise_pieces(sampler)])

    def noise_pieces(
        self, sampler: NoiseSampler | None = None, piece_values: int | None = None
    ) -> Iterator[IntArray]:
        """:meth:`noise_values` drawn piece by piece, in order (whole sections by default).

        With ``piece_values``, each section's noise is drawn in consecutive pieces of at
        most that many values: the same independent draws of the same distribution,
        each checked against the section's headroom (the bound for all the section's
        values at once), so a consumer that packs the pieces as they come never holds
        the whole vector, nor the sampler's buffers for it.
        """
        for draw in self.noise_piece_draws(sampler, piece_values):
            yield draw()

    def noise_piece_draws(
        self, sampler: NoiseSampler | None = None, piece_values: int | None = None
    ) -> Iterator[Callable[[], IntArray]]:
        """The draws of :meth:`noise_pieces`, in order, not yet made: each call draws
        its piece. The pieces are independent, so they may be drawn concurrently (with
        a sampler that allows it) and used in this order."""
        if self.spec.mode is not ProtocolMode.STATS:
            raise ConfigError("noise_values is for stats mode; masked mode noises the scatter")
        if piece_values is not None and piece_values < 1:
            raise ConfigError(f"piece_values must be >= 1, got {piece_values}")
        for s in self.sections:
            step = s.length if piece_values is None else piece_values
            for start in range(0, s.length, max(step, 1)):
                size = min(step, s.length - start)
                # A private release's section without noise is one no change can move
                # (released exactly, see _unmoved): not a NOT PRIVATE release.
                if s.sigma_int == 0 and self.private:
                    yield functools.partial(_no_noise, size)
                else:
                    yield functools.partial(
                        vector_noise,
                        size,
                        s.sigma_int,
                        sampler=sampler,
                        bound=_headroom(s.sigma_int, s.length, self.noise_multiplier),
                    )

    def section_values(self, values: npt.ArrayLike) -> dict[str, npt.NDArray[np.float64]]:
        """Stats mode: the decrypted ``shares`` integers in real units, by section name."""
        integers = self._shares_integers(values)
        sections = {}
        for section, part in self.statistics.section_slices().items():
            out = np.empty(part.stop - part.start, dtype=np.float64)
            self._section_reals(integers, section, part, out)
            sections[section] = out
        return sections

    def released_values(
        self, values: npt.ArrayLike, *, overwrite: bool = False
    ) -> npt.NDArray[np.float64]:
        """Stats mode, PCA and DCA: the decrypted ``shares`` integers as one real vector.

        The sections in the plan's order, the scatter as its row-major upper triangle
        (:meth:`SufficientStatistics.from_vector` is the matrix form). With
        ``overwrite``, a writeable contiguous int64 ``values`` array becomes the result:
        its memory is reused for the float64 values (the integers are gone), so the
        analyst holds one vector of the release instead of two.
        """
        if self.spec.kind is QueryKind.AGGREGATE:
            raise LayoutError("an aggregate release has no R, v, N: use section_values")
        integers = self._shares_integers(values)
        reuse = (
            overwrite
            and integers.dtype == np.int64
            and integers.flags.c_contiguous
            and integers.flags.writeable
        )
        real = integers.view(np.float64) if reuse else np.empty(integers.size, dtype=np.float64)
        for section, part in self.statistics.section_slices().items():
            self._section_reals(integers, section, part, real[part])
        return real

    def statistics_from_integers(self, values: npt.ArrayLike) -> SufficientStatistics:
        """Stats mode, PCA and DCA: the decrypted ``shares`` integers as real statistics."""
        return SufficientStatistics.from_vector(self.statistics, self.released_values(values))

    def _shares_integers(self, values: npt.ArrayLike) -> npt.NDArray[Any]:
        integers = np.asarray(values)
        if integers.shape != (self.statistics.value_count,):
            raise LayoutError(
                f"expected {self.statistics.value_count} values, got shape {integers.shape}"
            )
        return integers

    def _section_reals(
        self,
        integers: npt.NDArray[Any],
        section: str,
        part: slice,
        out: npt.NDArray[np.float64],
    ) -> None:
        """Write one section's integers, in real units, into ``out`` (which may be the
        integers' own memory: each piece is read into a temporary before it is written)."""
        info = self.statistics.section(section)
        unit, bits = info.clip_unit, info.bits(self.spec.frac_bits)
        chunk = integers[part]
        if chunk.dtype.kind == "i":
            # int64 -> float64 rounds to nearest (ties to even) like float() of a
            # Python int, and ldexp is exact: the same numbers as the loop below.
            for start in range(0, chunk.size, _REALS_PIECE):
                piece = slice(start, start + _REALS_PIECE)
                reals = np.ldexp(chunk[piece].astype(np.float64), -bits)
                reals *= unit
                out[piece] = reals
            return
        # Python ints may exceed 2^63 after noise and summing: convert one by one.
        out[:] = [math.ldexp(float(v), -bits) * unit for v in chunk.tolist()]


_REALS_PIECE = 1 << 16
"""Values converted at a time (a 512 KiB temporary), so that the conversion can overwrite
its own input."""


# --------------------------------------------------------------------- stats mode
def _no_noise(size: int) -> IntArray:
    return np.zeros(size, dtype=np.int64)


def _headroom(sigma_int: float, length: int, z: float) -> int:
    """The largest |draw| of a section's noise that is used (a larger one is refused):
    the tail bound of :func:`noise_headroom` plus ``sigma_int / z``, the most one
    coordinate can move between neighbours (sum over coordinates of (change/sigma)^2 is
    at most 1/z^2). With that margin a refusal can tell neighbours apart only when a
    draw passes the tail bound, which :func:`refusal_delta` charges."""
    if sigma_int <= 0 or length <= 0:
        return 0
    # FLOAT_MARGIN: the rounded-up move is at least the real sigma_int / z.
    return noise_headroom(sigma_int) + math.ceil(sigma_int / z * FLOAT_MARGIN)


def _noise_multiplier(spec: QuerySpec, statistics: StatisticsSpec) -> float:
    """z for the query's (epsilon, delta), the headroom refusal's delta paid first."""
    delta = spec.delta - refusal_delta(statistics.value_count) if spec.private else spec.delta
    return calibrate_noise_multiplier(spec.epsilon, delta, spec.calibration)


def _stats_plan(spec: QuerySpec, key_bits: int, statistics: StatisticsSpec) -> ReleasePlan:
    z = _noise_multiplier(spec, statistics)
    names = [s.name for s in statistics.sections]
    weights = list(spec.noise_weights) or [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(
            f"noise_weights has {len(weights)} entries; this query releases "
            f"{len(names)} sections ({', '.join(names)})"
        )
    omegas = normalise_weights(weights)
    f = spec.frac_bits
    sections = []
    if z > 0:
        # In clip units a section's change is at most its allocation unit (1 for PCA
        # and DCA), so the weights give reference sigmas unit_j/sqrt(omega_j); the worst
        # change the relation allows then fixes the one scale that makes the release's
        # noise multiplier exactly z. A section no neighbouring change can move (the
        # count of a stats or linreg aggregate under replace-one) is released exactly.
        # Bounded owner tables never swap: a section's unit is then its add change.
        bounded = spec.bounded_owner_tables
        exact = [_unmoved(statistics, s, spec.neighbouring) for s in statistics.sections]
        reference = [
            0.0 if unmoved else (s.add_change if bounded else s.allocation_unit) / math.sqrt(w)
            for s, w, unmoved in zip(statistics.sections, omegas, exact, strict=True)
        ]
        worst = statistics.worst_case_change(
            [math.inf if r == 0 else 1.0 / (r * r) for r in reference],
            spec.neighbouring,
            bounded_owner_tables=bounded,
        )
        # A few ulps more than exact, so that the rounding of the sigmas and of the
        # recomputed worst case can never leave the release with less noise than z
        # (its epsilon a hair above the one asked for, which an owner's cap refuses).
        scale = z * math.sqrt(worst) * (1.0 + 2.0**-48)
        for section, r in zip(statistics.sections, reference, strict=True):
            sigma_clip = r * scale
            sections.append(
                SectionNoise(
                    section.name,
                    section.length,
                    section.l2_sensitivity,
                    sigma_clip * section.clip_unit,
                    math.ldexp(sigma_clip, section.bits(f)),
                )
            )
        # Rounded down by 2^-50, more than the few ulps the floating-point sum can be
        # high by (review: one ulp above the exact worst case), and far less than the
        # 2^-48 added to the scale above, so z_effective stays at or above z.
        z_effective = (1.0 - 2.0**-50) / math.sqrt(
            statistics.worst_case_change(
                [
                    math.inf
                    if s.sigma_int == 0
                    else math.ldexp(1.0, 2 * info.bits(f)) / (s.sigma_int * s.sigma_int)
                    for info, s in zip(statistics.sections, sections, strict=True)
                ],
                spec.neighbouring,
                bounded_owner_tables=bounded,
            )
        )
    else:
        sections = [
            SectionNoise(s.name, s.length, s.l2_sensitivity, 0.0, 0.0) for s in statistics.sections
        ]
        z_effective = 0.0
    headroom = max(_headroom(s.sigma_int, s.length, z_effective) for s in sections)
    bounds = PackingBounds(
        max_abs_per_record=1.0,  # clip units
        # DCA caps every class at max_records_per_owner (docs/privacy.md).
        # (Aggregate queries cap all records together; their counts sit on the integer
        # grid, below the K 2^f every other value is bounded by.)
        max_records_per_owner=spec.max_records_per_owner * max(1, statistics.n_classes),
        max_owners=spec.max_owners,
        frac_bits=f,
        noise_headroom=headroom,
    )
    _check_int64(bounds)
    layout = SlotLayout.from_bounds(bounds, key_bits, statistics.value_count)
    block = Block(SHARES, layout, owner_value_bound(bounds))
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


def _unmoved(statistics: StatisticsSpec, section: Section, neighbouring: Neighbouring) -> bool:
    """Whether no change of the relation moves ``section`` (it then needs no noise)."""
    return (
        statistics.kind is QueryKind.AGGREGATE
        and neighbouring is Neighbouring.REPLACE_ONE
        and section.swap_change == 0
    )


def _check_int64(bounds: PackingBounds) -> None:
    """Refuse, at planning time, bounds whose owner values or noise could leave int64.

    Both are checked here, when the proxy and each owner build the plan, so that such a
    query is refused before anything is charged: found only when the proxy draws the
    noise, after the owners have uploaded, it would be charged and release nothing.
    """
    if owner_value_bound(bounds) >= INT64_VALUE_LIMIT:
        raise EncodingOverflowError(
            f"max_records_per_owner={bounds.max_records_per_owner} at frac_bits="
            f"{bounds.frac_bits} lets one owner's values reach 2^62; lower either"
        )
    if bounds.noise_headroom > MAX_NOISE_BOUND:
        raise EncodingOverflowError(
            f"at frac_bits={bounds.frac_bits} this epsilon needs noise whose bound "
            f"{bounds.noise_headroom} exceeds 2^62, the range the noise sampler draws in; "
            "lower frac_bits or raise epsilon"
        )


# -------------------------------------------------------------------- masked mode
def masked_sigma(plan: ReleasePlan, n_records: int) -> tuple[float, float]:
    """(sigma, sigma_int) of the scatter noise once the public N is known."""
    spec = plan.spec
    if plan.noise_multiplier == 0:
        return 0.0, 0.0
    sigma = plan.noise_multiplier * masked_release_sensitivity(spec, n_records)
    # Owners send the scatter in clip units (c^2): the integer noise is in the same units.
    sigma_clip = sigma / (spec.clip_norm * spec.clip_norm)
    return sigma, math.ldexp(sigma_clip, spec.frac_bits)


def _masked_plan(spec: QuerySpec, key_bits: int, statistics: StatisticsSpec) -> ReleasePlan:
    if spec.kind is not QueryKind.PCA:
        raise ConfigError(
            "masked mode is the published PCA protocol; run DCA in stats mode (--mode stats)"
        )
    if spec.neighbouring is not Neighbouring.REPLACE_ONE:
        raise ConfigError(
            "masked mode publishes the record count N, which has no finite epsilon under "
            "add-remove adjacency; it needs a deployment (and query) stated for replace-one"
        )
    m = spec.n_features
    # The mask hides v only statistically: the analyst's view of v + b moves by at most
    # M·2^-40 in total variation between neighbours, which is added to delta.
    mask_delta = m * 2.0**-MASK_SECURITY_BITS
    if spec.private and spec.delta <= mask_delta:
        raise ConfigError(
            f"masked mode spends delta {mask_delta:.3g} on the mean mask; delta must exceed it"
        )
    additive = mask_delta + refusal_delta(upper_triangle_length(m))
    z = calibrate_noise_multiplier(
        spec.epsilon, spec.delta - additive if spec.private else spec.delta, spec.calibration
    )
    f = spec.frac_bits
    # Worst case N = 1 sizes the headroom; the actual sigma uses the public N. Clip
    # units (c = 1): owners send R in c^2 and v in c.
    worst = masked_scatter_sensitivity(1.0, 1) + masked_rounding_slack(1.0, m, f)
    worst_sigma_int = math.ldexp(z * worst, f)
    headroom = _headroom(worst_sigma_int, upper_triangle_length(m), z)
    n_total = spec.max_owners * spec.max_records_per_owner
    # An owner's R and v entries have one bound (clip units), the sum's W is sized from v.
    per_owner = owner_value_bound(PackingBounds(1.0, spec.max_records_per_owner, 1, f, 0))
    r_bound = spec.max_owners * per_owner
    v_bound = masked_sum_bound(spec)
    width = mask_width(v_bound)
    # |T| <= N 2^f |R| + 2 |v| W + W^2 + N 2^f |E| + |F| in 2^(2f) units (|F| <= N 2^f).
    t_bound = (n_total << f) * r_bound + 2 * v_bound * width + width * width
    t_bound += (n_total << f) * (headroom + 1)
    slot_bits = max(t_bound, v_bound + width).bit_length() + 1
    k = (key_bits - 1) // slot_bits
    if k < 1:
        raise LayoutError(
            f"masked mode needs {slot_bits}-bit slots, more than a {key_bits}-bit key holds; "
            "lower max_records_per_owner, max_owners or frac_bits"
        )
    bounds = PackingBounds(
        max_abs_per_record=1.0,  # clip units
        max_records_per_owner=spec.max_records_per_owner,
        max_owners=spec.max_owners,
        frac_bits=f,
        noise_headroom=headroom,
    )
    _check_int64(bounds)
    rows = SlotLayout(key_bits, slot_bits, k, row_aligned_length(m, k))
    owner_blocks = (
        Block(SCATTER_ROWS, rows, per_owner),
        Block(SUM_SINGLE, SlotLayout(key_bits, slot_bits, 1, m), per_owner),
        Block(SUM_WINDOWS, SlotLayout(key_bits, slot_bits, k, m * k), per_owner),
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
