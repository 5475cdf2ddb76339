"""Decrypting and decoding a release: from ciphertexts to noisy statistics.

Pure: no grpc, no files.  Input is the encrypted result as the proxy streams it
(a :class:`fedpca.messages.ResultHeader` and its ciphertexts page by page, or a whole
:class:`fedpca.messages.QueryResult`) and the analyst's private key; output is a
:class:`DecodedRelease` that the solvers turn into PCA/DCA. Pages are decrypted as
they arrive (:func:`decrypt_stream`), while the proxy is still finalising later ones.

Before decrypting anything the analyst re-derives the release plan from the
query itself (:meth:`fedpca.protocol.ReleasePlan.for_query`) and refuses a
result that

* is encrypted under another key than the analyst's own
  (:class:`~fedpca.errors.UntrustedKeyError`),
* is not the query the analyst submitted (:class:`~fedpca.errors.ProtocolError`),
* has a block layout other than the plan's (:class:`~fedpca.errors.LayoutError`),
* aggregates more owners than the slots were sized for
  (:class:`~fedpca.errors.EncodingOverflowError`), or
* describes noise for other privacy parameters than the query's
  (:class:`~fedpca.errors.ProtocolError`).

Every packed plaintext must then decode into its slots within the declared
bound (the codec refuses otherwise), so a slot that wrapped is an error, never a
silently wrong statistic.

Stats mode
    One block ``shares``: decrypt, unpack, decode fixed point (2^-f clip units:
    c² for the scatter, c for sums, 1 for counts) and read back the noisy
    :class:`~fedpca.stats.SufficientStatistics`; for an aggregate query, the noisy
    sections of every aggregate (:func:`fedpca.aggregates.split_parts`).

Masked mode
    ``scatter_rows`` holds T = N 2^f R + v bᵀ + b vᵀ + b bᵀ + N 2^f E (2^(2f)
    units, row-aligned upper triangle, R and E in c², v in c) and ``masked_sum``
    holds v′ = v + b (2^f units).  Then T − v′v′ᵀ = 2^(2f) (N R − v vᵀ + N E), so

        (S + E)_ij = c² (T_ij − v′_i v′_j) / (N · 2^(2f)),

    computed in exact integer arithmetic with one correctly rounded division,
    where N is the public record count the proxy reports with the result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.aggregates import split_parts
from fedpca.analyst.result_checks import check_noise, check_result
from fedpca.analyst.solvers import (
    Covariance,
    DCAResult,
    PCAResult,
    covariance_from_centred_scatter,
    covariance_from_statistics,
    covariance_from_upper_triangle,
    dca_from_statistics,
    pca_from_covariance,
)
from fedpca.codec.keys import key_fingerprint
from fedpca.codec.packing import owner_value_bound, unpack_range
from fedpca.codec.paillier import CryptoPool
from fedpca.errors import (
    ConfigError,
    EncodingOverflowError,
    LayoutError,
    ProtocolError,
)
from fedpca.masked_release import row_aligned_positions
from fedpca.messages import (
    CiphertextPayload,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    QueryResult,
    ResultHeader,
    blocks_of,
)
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    ReleasePlan,
    masked_sigma,
)
from fedpca.query import ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import CLASS_COUNTS, COUNT, SCATTER, SUM, SufficientStatistics

__all__ = [
    "DecodedRelease",
    "ProgressCallback",
    "decode_values",
    "decrypt_result",
    "decrypt_stream",
    "noise_description",
    "result_from_packed",
    "unmask_scatter",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
ProgressCallback = Callable[[int], None]
"""Called with the number of ciphertexts decrypted so far."""
SlotValues = Sequence[int] | npt.NDArray[Any]
"""A result block's signed slot values: Python ints, or an int64 (object) array."""


@dataclass(frozen=True, eq=False)
class DecodedRelease:
    """A decrypted, still differentially private release.

    Attributes
    ----------
    query : the query the release answers.
    plan : the release plan the analyst derived from ``query`` itself.
    n_owners : owners whose contributions were aggregated.
    key_fingerprint : fingerprint of the analyst key the result was encrypted under.
    values : stats mode (PCA and DCA): the noisy release as one real vector, the plan's
        sections in order, R as its row-major upper triangle (M(M+1)/2 values: the
        analyst keeps no M x M matrix of it; :attr:`statistics` is the matrix form).
        None in masked mode and for aggregates.
    centred_scatter : masked mode: S + E (M, M), symmetric; None in stats mode.
    public_count : masked mode: the exact record count N, public under the
        replace-one adjacency of that mode; None in stats mode.
    sigmas : section name -> standard deviation of the Gaussian noise, as the
        analyst's own plan derives it (0 = no noise), in the section's decoded units
        (not fixed point): records for counts, the features scaled by their public
        bounds for sums and products (not the data's own units).
    noise : the noise description the proxy sent, if any.
    aggregates : aggregate queries: per aggregate, its noisy sections by name (real
        units of the scaled space, see :mod:`fedpca.aggregates`); empty otherwise.
    """

    query: QuerySpec
    plan: ReleasePlan
    n_owners: int
    key_fingerprint: str
    values: FloatArray | None
    centred_scatter: FloatArray | None
    public_count: int | None
    sigmas: Mapping[str, float]
    noise: NoiseDescription | None = None
    aggregates: tuple[Mapping[str, FloatArray], ...] = ()

    @property
    def mode(self) -> ProtocolMode:
        return self.query.mode

    @property
    def kind(self) -> QueryKind:
        return self.query.kind

    @property
    def private(self) -> bool:
        """False only for epsilon = inf (no noise: NOT PRIVATE)."""
        return self.plan.private

    @cached_property
    def statistics(self) -> SufficientStatistics | None:
        """Stats mode: the noisy R (M, M), v (M,), N (and class sums (C, M) and counts
        (C,) for DCA), made from :attr:`values` at the first use; None otherwise."""
        if self.values is None:
            return None
        return SufficientStatistics.from_vector(self.plan.statistics, self.values)

    def _section(self, name: str) -> FloatArray:
        assert self.values is not None
        return self.values[self.plan.statistics.section_slices()[name]]

    @property
    def n_samples(self) -> float:
        """N: the noisy count in stats mode, the exact public count in masked mode."""
        if self.values is not None:
            if self.kind is QueryKind.DCA:
                return float(self._section(CLASS_COUNTS).sum())
            return float(self._section(COUNT)[0])
        if self.public_count is None:
            raise ConfigError(
                f"query {self.query.query_id!r} is an aggregate release: each aggregate "
                "carries its own count"
            )
        return float(self.public_count)

    @property
    def n_samples_noise_sd(self) -> float:
        """The noise sd of :attr:`n_samples`: the count section's sigma, or for DCA
        (N the sum of C noisy class counts) that sigma times √C; 0 where N is exact."""
        if not self.n_samples_is_noisy:
            return 0.0
        if self.kind is QueryKind.DCA:
            classes = len(self.query.class_labels)
            return float(self.sigmas.get(CLASS_COUNTS, 0.0)) * math.sqrt(classes)
        return float(self.sigmas.get(COUNT, 0.0))

    @property
    def n_samples_is_noisy(self) -> bool:
        """True when :attr:`n_samples` carries DP noise (stats mode with finite epsilon)."""
        return self.values is not None and self.private

    def pca(self, n_components: int | None = None) -> PCAResult:
        """PCA of the release (k = the query's n_components unless given).

        A DCA release holds the noisy R, v and N of the records of its classes (v and
        N as sums over the classes), so it gives their principal components too, as
        post-processing at no further charge."""
        k = self.query.n_components if n_components is None else n_components
        return pca_from_covariance(self.pca_covariance(), k, overwrite=True)

    def pca_covariance(self) -> Covariance:
        """The sample covariance :meth:`pca` decomposes (a new one at each call)."""
        if self.kind is QueryKind.DCA and self.statistics is not None:
            return covariance_from_statistics(self.statistics)
        if self.kind is not QueryKind.PCA:
            raise ConfigError(f"query {self.query.query_id!r} is a {self.kind.value} release")
        if self.centred_scatter is not None:
            assert self.public_count is not None
            return covariance_from_centred_scatter(self.centred_scatter, self.public_count)
        return covariance_from_upper_triangle(
            self._section(SCATTER), self._section(SUM), self._section(COUNT)[0]
        )

    def dca(
        self,
        n_components: int | None = None,
        rho: float | None = None,
        rho_prime: float | None = None,
    ) -> DCAResult:
        """Kung's DCA of the release (k = the query's n_components unless given)."""
        if self.kind is not QueryKind.DCA or self.statistics is None:
            raise ConfigError(f"query {self.query.query_id!r} is not a DCA release")
        k = self.query.n_components if n_components is None else n_components
        return dca_from_statistics(self.statistics, k, rho=rho, rho_prime=rho_prime)


# ------------------------------------------------------------------ decryption
def _plan_sigmas(plan: ReleasePlan, public_count: int | None) -> dict[str, float]:
    if plan.spec.mode is ProtocolMode.MASKED:
        assert public_count is not None
        return {"scatter": masked_sigma(plan, public_count)[0]}
    return {section.name: section.sigma for section in plan.sections}


def _public_count(result: ResultHeader | QueryResult, plan: ReleasePlan) -> int:
    public_count = result.public_record_count
    if public_count is None:
        raise ProtocolError(
            f"masked-mode result of query {plan.spec.query_id!r} carries no public record "
            "count N; the analyst cannot unmask the scatter without it"
        )
    most = result.n_owners * plan.spec.max_records_per_owner
    if not 2 <= public_count <= most:
        raise ProtocolError(
            f"masked-mode record count N={public_count} is impossible for "
            f"{result.n_owners} owners of at most {plan.spec.max_records_per_owner} records"
        )
    return public_count


def _decrypt_blocks(
    batches: Iterable[Sequence[int]],
    private_key: Any,
    plan: ReleasePlan,
    bounds: Mapping[str, int],
    pool: CryptoPool | None,
    progress: ProgressCallback | None,
) -> dict[str, npt.NDArray[Any]]:
    """Decrypt ciphertexts arriving batch by batch (wire order); return each block's
    signed slot values.

    Each batch goes to the workers as it arrives and its plaintexts are unpacked as
    they come back, into one array per block: int64 where the block's bound allows
    (every stats-mode release; 8 bytes a value where a Python int takes about 36),
    Python ints otherwise (masked mode's wide slots).
    """
    owned = pool is None
    active = CryptoPool() if pool is None else pool
    n = private_key.public_key.n
    blocks = plan.result_blocks
    expected = sum(block.layout.n_ciphertexts for block in blocks)
    values = {
        block.name: np.empty(
            block.layout.value_count,
            dtype=np.int64 if bounds[block.name] <= _INT64_MAX else object,
        )
        for block in blocks
    }
    done = 0
    undecodable: EncodingOverflowError | None = None
    try:
        for decrypted in active.decrypt_stream(private_key, batches):
            if done + len(decrypted) > expected:
                raise ProtocolError(
                    f"result of query {plan.spec.query_id!r}: more than {expected} "
                    f"ciphertexts, the plan has {expected}"
                )
            try:
                _unpack_wire_range(decrypted, done, plan, n, bounds, values)
            except EncodingOverflowError as exc:
                # Raised only after the last page: where the analyst stopped reading
                # told a proxy which page first failed, a decryption oracle for any
                # ciphertext (an owner's share) it built pages from (found by review).
                undecodable = undecodable or exc
            done += len(decrypted)
            if progress is not None:
                progress(done)
    finally:
        if owned:
            active.close()
    if done != expected:
        raise ProtocolError(
            f"result of query {plan.spec.query_id!r}: {done} ciphertexts, the plan has {expected}"
        )
    if undecodable is not None:
        raise undecodable
    return values


_INT64_MAX = (1 << 63) - 1


def _unpack_wire_range(
    plaintexts: Sequence[int],
    start: int,
    plan: ReleasePlan,
    n: int,
    bounds: Mapping[str, int],
    values: Mapping[str, npt.NDArray[Any]],
) -> None:
    """Unpack the plaintexts of wire positions ``start ..`` into their blocks' values."""
    stop = start + len(plaintexts)
    offset = 0
    for block in plan.result_blocks:
        count = block.layout.n_ciphertexts
        low, high = max(start, offset), min(stop, offset + count)
        if low < high:
            first = low - offset
            part = unpack_range(
                plaintexts[low - start : high - start], block.layout, n, bounds[block.name], first
            )
            slot = first * block.layout.slots_per_ciphertext
            values[block.name][slot : slot + len(part)] = part
        offset += count


def unmask_scatter(
    masked_scatter: SlotValues,
    masked_sums: SlotValues,
    n_features: int,
    slots_per_ciphertext: int,
    count: int,
    frac_bits: int,
) -> FloatArray:
    """S + E from the masked-mode slot values.

    Parameters
    ----------
    masked_scatter : row-aligned upper triangle of T (2^(2f) units), the layout of
        :func:`fedpca.protocol.row_aligned_positions`; padding slots are ignored.
    masked_sums : (M,) v′ = v + b (2^f units).
    n_features : M.
    slots_per_ciphertext : k of the row-aligned layout.
    count : the public record count N.
    frac_bits : f.

    Returns
    -------
    (M, M) symmetric float64: (T_ij − v′_i v′_j) / (N 2^(2f)), each entry the
    correctly rounded value of the exact rational.
    """
    positions = row_aligned_positions(n_features, slots_per_ciphertext)
    if len(masked_scatter) != len(positions):
        raise LayoutError(
            f"masked scatter has {len(masked_scatter)} slots, the row-aligned layout "
            f"for M={n_features}, k={slots_per_ciphertext} has {len(positions)}"
        )
    if len(masked_sums) != n_features:
        raise LayoutError(f"masked sums have {len(masked_sums)} values, expected {n_features}")
    if count < 1:
        raise ConfigError(f"record count must be >= 1, got {count}")
    sums = [int(v) for v in masked_sums]
    scale = count << (2 * frac_bits)
    scatter = np.zeros((n_features, n_features), dtype=np.float64)
    for value, position in zip(masked_scatter, positions, strict=True):
        if position is None:
            continue
        i, j = position
        # Python int / int is correctly rounded however large both sides are;
        # T and v′v′ᵀ are ~2^200 here and cancel to ~2^(2f) N |S|, so the
        # subtraction must happen before any conversion to float.
        entry = (int(value) - sums[i] * sums[j]) / scale
        scatter[i, j] = entry
        scatter[j, i] = entry
    return scatter


def decrypt_result(
    result: QueryResult,
    private_key: Any,
    *,
    expected_query: QuerySpec | None = None,
    pool: CryptoPool | None = None,
    progress: ProgressCallback | None = None,
) -> DecodedRelease:
    """Validate, decrypt and decode a whole encrypted result (:func:`decrypt_stream`
    with its ciphertexts in 32 batches or so, so that ``progress`` moves: in one batch
    `fetch` reported nothing until the end, 12 s at madelon's width; a new analyst's
    walkthrough)."""
    ciphertexts = list(result.payload.in_wire_order())
    size = max(16, -(-len(ciphertexts) // 32))
    return decrypt_stream(
        result,
        [ciphertexts[start : start + size] for start in range(0, len(ciphertexts), size)],
        private_key,
        expected_query=expected_query,
        pool=pool,
        progress=progress,
    )


def decrypt_stream(
    header: ResultHeader | QueryResult,
    batches: Iterable[Sequence[int]],
    private_key: Any,
    *,
    expected_query: QuerySpec | None = None,
    pool: CryptoPool | None = None,
    progress: ProgressCallback | None = None,
) -> DecodedRelease:
    """Validate a result's header, then decrypt its ciphertexts as they arrive and decode.

    Parameters
    ----------
    header : the result's header (:func:`fedpca.transport.serde.read_result_stream`);
        in masked mode it carries the public record count N the proxy reported.
    batches : the result's ciphertexts in wire order, batch by batch (e.g. one per
        page as it arrives); each is handed to the pool's workers at once.
    private_key : the analyst's phe private key.
    expected_query : the submitted query; the result must echo it exactly.
    pool : a crypto pool to decrypt on (default: a temporary one on all cores).
    progress : called with the number of ciphertexts decrypted so far.

    Returns
    -------
    DecodedRelease

    Raises
    ------
    UntrustedKeyError, ProtocolError, LayoutError, EncodingOverflowError
        See :func:`check_result` (checked before anything is decrypted);
        EncodingOverflowError also when a decrypted plaintext does not decode into its
        slots within the declared bound.
    CiphertextError
        A ciphertext is not an element of Z*_{n^2}.
    """
    public_key = private_key.public_key
    plan = check_result(header, public_key, expected_query=expected_query)
    query = plan.spec
    fingerprint = key_fingerprint(public_key)
    if query.mode is ProtocolMode.MASKED:
        count: int | None = _public_count(header, plan)
        check_noise(header.noise, plan, _plan_sigmas(plan, count))
        bounds = {block.name: block.bound for block in plan.result_blocks}
    else:
        count = None
        check_noise(header.noise, plan, _plan_sigmas(plan, None))
        # The sum of n_owners shares plus noise: tighter than the slot capacity, so a
        # share that broke its declared bound shows up as an error here.
        bound = header.n_owners * owner_value_bound(plan.bounds) + plan.bounds.noise_headroom
        bounds = {SHARES: bound}
    values = _decrypt_blocks(batches, private_key, plan, bounds, pool, progress)
    return decode_values(
        plan,
        values,
        n_owners=header.n_owners,
        key_fingerprint=fingerprint,
        public_count=count,
        noise=header.noise,
        overwrite=True,  # the decrypted integers are ours: reuse their memory
    )


def decode_values(
    plan: ReleasePlan,
    values: Mapping[str, SlotValues],
    *,
    n_owners: int,
    key_fingerprint: str,
    public_count: int | None = None,
    noise: NoiseDescription | None = None,
    overwrite: bool = False,
) -> DecodedRelease:
    """Decode the signed slot values of every result block into a release.

    The step after decryption and unpacking, shared by :func:`decrypt_result` and by
    anything that holds the result's integers another way (``fedpca.app.plaintext_release``
    computes them without encryption, which is exact on the fixed-point grid).

    Parameters
    ----------
    plan : the release plan.
    values : result block name -> its slot values (Python ints, in layout order).
    n_owners : owners aggregated.
    key_fingerprint : fingerprint of the key the result was encrypted under.
    public_count : masked mode: the public record count N.
    noise : the noise description that came with the result, if any.
    overwrite : stats mode: an int64 ``shares`` array becomes the release's
        :attr:`DecodedRelease.values` (its integers are overwritten), instead of a copy.
    """
    query = plan.spec
    if query.mode is ProtocolMode.MASKED:
        if public_count is None:
            raise ConfigError("decoding a masked-mode result needs the public record count")
        scatter = unmask_scatter(
            values[SCATTER_ROWS],
            values[MASKED_SUM],
            query.n_features,
            plan.result_block(SCATTER_ROWS).layout.slots_per_ciphertext,
            public_count,
            query.frac_bits,
        )
        scatter *= query.clip_norm * query.clip_norm  # clip units -> real units
        scatter.setflags(write=False)
        return DecodedRelease(
            query=query,
            plan=plan,
            n_owners=n_owners,
            key_fingerprint=key_fingerprint,
            values=None,
            centred_scatter=scatter,
            public_count=public_count,
            sigmas=_plan_sigmas(plan, public_count),
            noise=noise,
        )
    if query.kind is QueryKind.AGGREGATE:
        parts = split_parts(query.aggregates, plan.section_values(values[SHARES]))
        for part in parts:
            for array in part.values():
                array.setflags(write=False)
        return DecodedRelease(
            query=query,
            plan=plan,
            n_owners=n_owners,
            key_fingerprint=key_fingerprint,
            values=None,
            centred_scatter=None,
            public_count=None,
            sigmas=_plan_sigmas(plan, None),
            noise=noise,
            aggregates=tuple(parts),
        )
    return DecodedRelease(
        query=query,
        plan=plan,
        n_owners=n_owners,
        key_fingerprint=key_fingerprint,
        values=_read_only(plan.released_values(values[SHARES], overwrite=overwrite)),
        centred_scatter=None,
        public_count=None,
        sigmas=_plan_sigmas(plan, None),
        noise=noise,
    )


def _read_only(array: FloatArray) -> FloatArray:
    array.setflags(write=False)
    return array


# -------------------------------------------------------- building results
def noise_description(plan: ReleasePlan, public_count: int | None = None) -> NoiseDescription:
    """The noise description a proxy following ``plan`` reports.

    Parameters
    ----------
    plan : the release plan.
    public_count : masked mode: the public N the scatter sigma depends on.
    """
    query = plan.spec
    if query.mode is ProtocolMode.MASKED and public_count is None:
        raise ConfigError("a masked-mode noise description needs the public record count")
    sigmas = _plan_sigmas(plan, public_count)
    return NoiseDescription(
        mechanism=NoiseMechanism.GAUSSIAN if plan.private else NoiseMechanism.NONE,
        calibration=query.calibration,
        epsilon=query.epsilon,
        delta=query.delta,
        sections=tuple(NoiseSection(name, sigma) for name, sigma in sigmas.items()),
    )


def result_from_packed(
    query: QuerySpec,
    n_owners: int,
    blocks: Mapping[str, Any],
    *,
    key_bits: int | None = None,
    noise: NoiseDescription | None = None,
    public_count: int | None = None,
) -> QueryResult:
    """Assemble an encrypted result from codec packed ciphertexts, without a proxy.

    For tests, demos and offline use: the proxy builds the same object before
    streaming it.

    Parameters
    ----------
    query : the query.
    n_owners : owners aggregated.
    blocks : block name -> :class:`fedpca.codec.CiphertextPayload` (or a plain
        sequence of ciphertext ints), one entry per result block of the plan.
    key_bits : size of the analyst key (default: that of ``query.analyst_public_key_n``).
    noise : the noise description (default: :func:`noise_description` of the plan).
    public_count : masked mode: N, carried as the result's ``public_record_count``
        and used for the default noise description.
    """
    bits = query.analyst_public_key_n.bit_length() if key_bits is None else key_bits
    plan = ReleasePlan.for_query(query, bits)
    layout = blocks_of(plan.result_blocks)
    ciphertexts: dict[str, Sequence[int]] = {}
    for block in layout:
        if block.name not in blocks:
            raise LayoutError(f"no ciphertexts given for result block {block.name!r}")
        given = blocks[block.name]
        ciphertexts[block.name] = tuple(getattr(given, "ciphertexts", given))
    extra = sorted(set(blocks) - set(ciphertexts))
    if extra:
        raise LayoutError(f"blocks {extra} are not result blocks of this query")
    if noise is None:
        noise = noise_description(plan, public_count)
    return QueryResult(
        query=query,
        n_owners=n_owners,
        noise=noise,
        payload=CiphertextPayload(layout, ciphertexts),
        masked_mean_block=MASKED_SUM if query.mode is ProtocolMode.MASKED else None,
        public_record_count=public_count if query.mode is ProtocolMode.MASKED else None,
    )
