"""The protocol's release computed in plaintext: every step but the transport and Paillier.

Packed Paillier is exact on the fixed-point grid: homomorphic addition adds slot values
as integers, and the plan's slot widths rule out any carry (an overflow is refused,
never wrapped). The integers the analyst decrypts are therefore a deterministic function
of the owners' integers and the proxy's noise and mask. This module computes them
without encrypting anything, with the roles' own code for every other step:

* owners — :func:`fedpca.owner.compute.encode_share`: the public record cap and the
  owner's uniform sample, public-bound scaling, the row clip, quantisation, exact
  fixed-point statistics padded to the cap, the plan's block layout;
* proxy — the fold is an integer sum of the owners' blocks (what multiplying their
  ciphertexts adds); stats mode adds :meth:`fedpca.protocol.ReleasePlan.noise_values`
  (the discrete Gaussian per section that ``fedpca.proxy.prepared_noise`` encrypts);
  masked mode draws a uniform mask b of the plan's width and the scatter noise E with
  :func:`fedpca.dp.noise.symmetric_noise` as ``fedpca.proxy.masking`` does, and forms
  the slots T = N 2^f R + v bᵀ + b vᵀ + b bᵀ + N 2^f E + F (F the uniform residue
  of :func:`fedpca.masked_release.masked_residue`) and v + b that its exponentiations
  produce under encryption;
* analyst — :func:`fedpca.analyst.decode.decode_values`, the decoding step after
  decryption, so :meth:`DecodedRelease.pca` runs the same solver.

What is left out is exactly what cannot change the numbers: the gRPC transport, the
encryption and decryption, and the proxy's and owners' durable state (budgets are not
spent). Used by the benchmarks to measure utility over many repetitions;
``tests/unit/test_plaintext_release.py`` checks that the release equals the one a real
deployment decrypts, bit for bit, with the same seeded noise (masked mode: up to its
residues F, drawn from ``secrets``, which move each entry by less than 2^-f).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedpca.analyst.decode import DecodedRelease, decode_values, noise_description
from fedpca.dp.noise import NoiseSampler, symmetric_noise
from fedpca.errors import ConfigError
from fedpca.masked_release import mask_width, masked_residue, row_aligned_positions
from fedpca.owner.compute import encode_share, record_cap
from fedpca.owner.local_table import QueryColumns
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    SUM_SINGLE,
    ReleasePlan,
    masked_sigma,
)
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.tables import OwnerTable

__all__ = [
    "FoldedShares",
    "fold_owner_shares",
    "plaintext_pca_query",
    "plaintext_release",
    "release_from_folded",
]

ObjectArray = npt.NDArray[np.object_]


@dataclass(frozen=True, eq=False)
class FoldedShares:
    """What the proxy holds once every owner's share is folded in, as plain integers.

    Attributes
    ----------
    plan : the release plan the owners encoded for.
    blocks : owner block name -> the sum of the owners' slot values (Python ints).
    n_owners : owners folded in.
    public_count : masked mode: N, the sum of the owners' public record counts.
    """

    plan: ReleasePlan
    blocks: Mapping[str, ObjectArray]
    n_owners: int
    public_count: int | None


def plaintext_pca_query(
    n_features: int,
    epsilon: float,
    delta: float,
    n_components: int,
    mode: ProtocolMode,
    *,
    bounds: tuple[float, float] | None = None,
    max_owners: int = 256,
) -> QuerySpec:
    """A PCA query for the plaintext path, which encrypts nothing (no analyst key).

    ``stats`` is stated for add/remove adjacency, ``masked`` for replace-one, the only
    relation under which it has a finite epsilon (docs/privacy.md). ``bounds`` is one
    public (low, high) range for every feature, or None (rows are only clipped).
    """
    lower = () if bounds is None else (bounds[0],) * n_features
    upper = () if bounds is None else (bounds[1],) * n_features
    return QuerySpec(
        query_id="plaintext",
        kind=QueryKind.PCA,
        n_features=n_features,
        epsilon=epsilon,
        delta=delta,
        n_components=n_components,
        analyst_public_key_n=3,  # a placeholder: the plan takes the key size separately
        analyst_key_fingerprint="sha256:plaintext",
        feature_lower=lower,
        feature_upper=upper,
        mode=mode,
        neighbouring=(
            Neighbouring.REPLACE_ONE if mode is ProtocolMode.MASKED else Neighbouring.ADD_REMOVE
        ),
        max_owners=max_owners,
    )


def fold_owner_shares(
    spec: QuerySpec,
    owner_tables: Sequence[OwnerTable],
    *,
    key_bits: int = 2048,
    capacities: Sequence[int] | None = None,
    rng: np.random.Generator | None = None,
) -> FoldedShares:
    """Encode every owner's share of ``spec`` and fold them, as the proxy does.

    Parameters
    ----------
    spec : the public query.
    owner_tables : per owner, its features (N_l, M) and, for DCA, labels.
    key_bits : the analyst key's size (it fixes the plan's slot layout).
    capacities : each owner's declared capacity in records (default: its row count,
        as :class:`fedpca.app.cluster.LocalCluster` declares it).
    rng : the owners' sampling randomness when a table exceeds its cap (tests only).
    """
    if not owner_tables:
        raise ConfigError("at least one owner table is needed")
    caps = [len(t.features) for t in owner_tables] if capacities is None else list(capacities)
    if len(caps) != len(owner_tables):
        raise ConfigError(f"{len(caps)} capacities for {len(owner_tables)} owners")
    plan = ReleasePlan.for_query(spec, key_bits)
    totals: dict[str, ObjectArray] = {}
    for table, capacity in zip(owner_tables, caps, strict=True):
        columns = QueryColumns.of_table(table, spec)
        share = encode_share(spec, columns, plan, capacity=capacity, rng=rng)
        for name, values in share.items():
            # Python ints: the folded sums may leave int64 (the slots hold them exactly).
            as_ints = values.astype(object)
            totals[name] = as_ints if name not in totals else totals[name] + as_ints
    public_count = None
    if spec.mode is ProtocolMode.MASKED:
        # What each owner reports in the clear (fedpca.owner.node), summed by the proxy.
        public_count = sum(
            min(len(t.features), record_cap(spec, c))
            for t, c in zip(owner_tables, caps, strict=True)
        )
    return FoldedShares(plan, totals, len(owner_tables), public_count)


def release_from_folded(
    folded: FoldedShares, *, sampler: NoiseSampler | None = None
) -> DecodedRelease:
    """Noise (and in masked mode mask) the folded shares and decode them as the analyst.

    Each call draws fresh noise: call it once per repetition of an experiment.

    Parameters
    ----------
    folded : :func:`fold_owner_shares`.
    sampler : the noise sampler (default: the production discrete Gaussian).
    """
    plan = folded.plan
    spec = plan.spec
    if spec.mode is ProtocolMode.MASKED:
        assert folded.public_count is not None
        values = _masked_values(folded, sampler)
    else:
        shares = folded.blocks[SHARES]
        if plan.private:
            shares = shares + plan.noise_values(sampler).astype(object)
        values = {SHARES: shares.tolist()}
    return decode_values(
        plan,
        values,
        n_owners=folded.n_owners,
        key_fingerprint=spec.analyst_key_fingerprint,
        public_count=folded.public_count,
        noise=noise_description(plan, folded.public_count),
    )


def plaintext_release(
    spec: QuerySpec,
    owner_tables: Sequence[OwnerTable],
    *,
    key_bits: int = 2048,
    capacities: Sequence[int] | None = None,
    sampler: NoiseSampler | None = None,
    rng: np.random.Generator | None = None,
) -> DecodedRelease:
    """:func:`fold_owner_shares` then :func:`release_from_folded`: one release."""
    folded = fold_owner_shares(
        spec, owner_tables, key_bits=key_bits, capacities=capacities, rng=rng
    )
    return release_from_folded(folded, sampler=sampler)


def _masked_values(folded: FoldedShares, sampler: NoiseSampler | None) -> dict[str, list[int]]:
    """The masked-mode result slots: row-aligned T and v + b (see fedpca.proxy.masking)."""
    plan = folded.plan
    spec = plan.spec
    m, f = spec.n_features, spec.frac_bits
    assert folded.public_count is not None
    n = folded.public_count
    rows_layout = plan.result_block(SCATTER_ROWS).layout
    positions = row_aligned_positions(m, rows_layout.slots_per_ciphertext)
    scatter = folded.blocks[SCATTER_ROWS].tolist()
    sums = [int(v) for v in folded.blocks[SUM_SINGLE]]
    # The mask's width from the plan's bound on the summed sum vector, as the proxy's.
    width = mask_width(spec.max_owners * plan.owner_block(SUM_SINGLE).bound)
    mask = [secrets.randbelow(width) for _ in range(m)]
    _, sigma_int = masked_sigma(plan, n)
    if sigma_int > 0:
        noise = symmetric_noise(m, sigma_int, sampler=sampler, bound=plan.bounds.noise_headroom)
    else:
        noise = np.zeros(m * (m + 1) // 2, dtype=np.int64)
    scale = n << f
    triangle_row_start = [i * m - i * (i - 1) // 2 for i in range(m)]
    masked: list[int] = []
    for value, position in zip(scatter, positions, strict=True):
        if position is None:
            masked.append(0)
            continue
        i, j = position
        e = int(noise[triangle_row_start[i] + (j - i)])
        masked.append(
            scale * int(value)
            + sums[i] * mask[j]
            + mask[i] * sums[j]
            + mask[i] * mask[j]
            + scale * e
            + (masked_residue(scale) if sigma_int > 0 else 0)
        )
    return {SCATTER_ROWS: masked, MASKED_SUM: [v + b for v, b in zip(sums, mask, strict=True)]}
