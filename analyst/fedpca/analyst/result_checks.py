"""The analyst's checks of an encrypted result before anything is decrypted: its key,
that it echoes the submitted query, the plan's block layout, a possible owner count,
and noise described for the query's own privacy parameters."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from fedpca.codec.keys import key_fingerprint
from fedpca.codec.packing import check_owner_count
from fedpca.errors import (
    LayoutError,
    ProtocolError,
    UntrustedKeyError,
)
from fedpca.messages import (
    CiphertextBlock,
    NoiseDescription,
    NoiseMechanism,
    QueryResult,
    ResultHeader,
    blocks_of,
)
from fedpca.protocol import (
    MASKED_SUM,
    ReleasePlan,
)
from fedpca.query import ProtocolMode, QuerySpec

__all__ = ["check_noise", "check_result"]

logger = logging.getLogger("fedpca.analyst.decode")

# Relative tolerance when comparing the proxy's reported sigmas with the plan's:
# both are computed from the same public inputs with the same code, so anything
# beyond float noise means the two sides disagree on the plan.
_SIGMA_RTOL = 1e-9


def _query_differences(got: QuerySpec, expected: QuerySpec) -> list[str]:
    return [
        f"{f.name}: {getattr(got, f.name)!r} != {getattr(expected, f.name)!r}"
        for f in fields(QuerySpec)
        if getattr(got, f.name) != getattr(expected, f.name)
        # n is long and already covered by the fingerprint line.
        and f.name != "analyst_public_key_n"
    ]


def _check_key(query: QuerySpec, public_key: Any) -> str:
    fingerprint = key_fingerprint(public_key)
    if query.analyst_public_key_n != public_key.n:
        raise UntrustedKeyError(
            f"result of query {query.query_id!r} is encrypted under key "
            f"{query.analyst_key_fingerprint}, not your key {fingerprint}"
        )
    if query.analyst_key_fingerprint != fingerprint:
        raise UntrustedKeyError(
            f"result of query {query.query_id!r} declares fingerprint "
            f"{query.analyst_key_fingerprint!r}, which is not the fingerprint of its key "
            f"({fingerprint})"
        )
    return fingerprint


def check_noise(noise: NoiseDescription, plan: ReleasePlan, sigmas: Mapping[str, float]) -> None:
    """Refuse noise described for other parameters than the query's; warn on a sigma that
    differs from the analyst's own derivation (which is the one used)."""
    query = plan.spec
    problems = []
    if noise.epsilon != query.epsilon:
        problems.append(f"epsilon {noise.epsilon!r} != {query.epsilon!r}")
    if plan.private and noise.delta != query.delta:
        problems.append(f"delta {noise.delta!r} != {query.delta!r}")
    if noise.calibration is not query.calibration:
        problems.append(f"calibration {noise.calibration.value} != {query.calibration.value}")
    expected = NoiseMechanism.GAUSSIAN if plan.private else NoiseMechanism.NONE
    if noise.mechanism is not expected:
        problems.append(f"mechanism {noise.mechanism.value} != {expected.value}")
    if problems:
        raise ProtocolError(
            f"result of query {query.query_id!r} describes noise for other parameters: "
            + "; ".join(problems)
        )
    # The analyst cannot verify under encryption that noise was added at all;
    # a disagreement on sigma is reported, and the analyst's own derivation is used.
    for section in noise.sections:
        mine = sigmas.get(section.name)
        if mine is None or not math.isclose(section.sigma, mine, rel_tol=_SIGMA_RTOL):
            logger.warning(
                "proxy reports sigma %r for section %r, the analyst's plan derives %r",
                section.sigma,
                section.name,
                mine,
            )


def check_result(
    result: ResultHeader | QueryResult,
    public_key: Any,
    *,
    expected_query: QuerySpec | None = None,
) -> ReleasePlan:
    """Validate an encrypted result against the analyst's key and own plan.

    Parameters
    ----------
    result : the encrypted result as fetched.
    public_key : the analyst's phe public key.
    expected_query : the query the analyst submitted; the result must echo it
        field for field.

    Returns
    -------
    ReleasePlan derived by the analyst from ``result.query``.

    Raises
    ------
    UntrustedKeyError
        The result is not encrypted under ``public_key``.
    ProtocolError
        Another query, an impossible owner count, or noise for other parameters.
    LayoutError
        The block layout differs from the plan's.
    EncodingOverflowError
        More owners than the slots were sized for.
    """
    query = result.query
    _check_key(query, public_key)
    if expected_query is not None and query != expected_query:
        differences = _query_differences(query, expected_query)
        raise ProtocolError(
            f"result is for query {query.query_id!r}, which differs from the submitted "
            f"query {expected_query.query_id!r}: " + "; ".join(differences or ["key"])
        )
    plan = ReleasePlan.for_query(query, public_key.n.bit_length())
    expected_blocks = blocks_of(plan.result_blocks)
    got_blocks = tuple(result.blocks)
    if got_blocks != expected_blocks:
        raise LayoutError(
            f"result of query {query.query_id!r} has layout {_describe(got_blocks)}; "
            f"the plan derived from the query has {_describe(expected_blocks)}"
        )
    if query.mode is ProtocolMode.MASKED and result.masked_mean_block != MASKED_SUM:
        raise LayoutError(
            f"masked-mode result names {result.masked_mean_block!r} as the masked mean block, "
            f"expected {MASKED_SUM!r}"
        )
    if result.n_owners < 1:
        raise ProtocolError(f"result of query {query.query_id!r} aggregates no owners")
    check_owner_count(plan.bounds, result.n_owners)
    if result.n_owners < query.quorum:
        # Releasing below quorum is the proxy's violation; decrypting does not make
        # it worse, but the analyst should know the release is not what it asked for.
        logger.warning(
            "query %s: released with %d owners, below its quorum of %d",
            query.query_id,
            result.n_owners,
            query.quorum,
        )
    return plan


def _describe(blocks: Sequence[CiphertextBlock]) -> str:
    return ", ".join(
        f"{b.name}[{b.n_ciphertexts} ct, {b.value_count} values, "
        f"{b.slots_per_ciphertext}x{b.slot_bits} bits, key {b.key_bits}]"
        for b in blocks
    )
