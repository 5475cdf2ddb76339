"""A query's result: computed from its aggregate when it closes, read back for the analyst.

The aggregate itself is never modified, so a crash while the result is computed
leaves a NOISING query whose inputs are intact. Masked-mode arithmetic is in
:mod:`fedpca.proxy.masking`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fedpca.codec import (
    PackedCiphertexts,
    add_packed,
    ciphertext_byte_length,
    ciphertexts_from_bytes,
)
from fedpca.errors import LayoutError
from fedpca.messages import (
    CiphertextPayload,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    QueryResult,
)
from fedpca.messages import ciphertexts_from_bytes as wire_ciphertexts_from_bytes
from fedpca.protocol import MASKED_SUM, SHARES
from fedpca.proxy.prepared_noise import PreparedNoise
from fedpca.proxy.queries import QueryContext, result_blocks
from fedpca.proxy.store import stored_block
from fedpca.query import ProtocolMode

__all__ = ["aggregate_blocks", "stats_result", "stored_result"]

logger = logging.getLogger(__name__)


def aggregate_blocks(context: QueryContext, data: bytes) -> dict[str, bytes]:
    """Split the wire-order aggregate into the plan's owner blocks."""
    width = ciphertext_byte_length(context.public_key.n.bit_length())
    blocks = context.plan.owner_blocks
    expected = sum(block.layout.n_ciphertexts for block in blocks) * width
    if len(data) != expected:
        raise LayoutError(
            f"query {context.spec.query_id!r}: the aggregate holds {len(data)} bytes, "
            f"the plan {expected}"
        )
    out: dict[str, bytes] = {}
    start = 0
    for block in blocks:
        end = start + block.layout.n_ciphertexts * width
        out[block.name] = data[start:end]
        start = end
    return out


def stats_result(
    key: str,
    context: QueryContext,
    aggregate: Mapping[str, bytes],
    n_owners: int,
    noise_source: PreparedNoise,
) -> tuple[dict[str, bytes], list[dict[str, Any]], dict[str, float]]:
    """Add query ``key``'s encrypted noise (prepared or drawn now) to a stats-mode aggregate.

    Returns the result blocks, the noise of each section and the seconds spent.
    """
    plan = context.plan
    block = plan.owner_block(SHARES)
    layout = block.layout
    data = stored_block(aggregate, SHARES)
    # Every owner packed values bounded by block.bound, so the sum is bounded by
    # n_owners times that; add_packed then proves sum + noise fits a slot.
    total = PackedCiphertexts(
        context.public_key,
        layout,
        tuple(ciphertexts_from_bytes(data, context.public_key, layout.n_ciphertexts)),
        n_owners * block.bound,
    )
    sections = [{"name": s.name, "sigma": s.sigma, "sigma_int": s.sigma_int} for s in plan.sections]
    timings: dict[str, float] = {}
    if not plan.private:
        logger.warning("query %s: no noise added (epsilon = inf): NOT PRIVATE", plan.spec.query_id)
        return {SHARES: total.to_bytes()}, sections, timings
    noise, prepared = noise_source.take_or_draw(key, plan, context.public_key)
    if prepared:
        timings["noise_precomputed"] = 1.0
    timings["sample_seconds"] = noise.sample_seconds
    timings["encrypt_seconds"] = noise.encrypt_seconds
    return {SHARES: add_packed(total, noise.ciphertexts).to_bytes()}, sections, timings


def stored_result(
    context: QueryContext, n_contributed: int, data: Mapping[str, bytes], meta: Mapping[str, Any]
) -> QueryResult:
    """A stored result (its blocks and metadata) as the analyst fetches it."""
    spec = context.spec
    blocks = result_blocks(context.plan)
    ciphertexts: dict[str, list[int]] = {}
    for block in blocks:
        ciphertexts[block.name] = wire_ciphertexts_from_bytes(
            stored_block(data, block.name), block.ciphertext_bytes, f"result {block.name}"
        )
    private = not meta.get("not_private", False)
    noise = NoiseDescription(
        mechanism=NoiseMechanism.GAUSSIAN if private else NoiseMechanism.NONE,
        calibration=spec.calibration,
        epsilon=spec.epsilon,
        delta=spec.delta,
        sections=tuple(
            NoiseSection(name=s["name"], sigma=float(s["sigma"])) for s in meta.get("sections", [])
        ),
    )
    masked = spec.mode is ProtocolMode.MASKED
    public_n = meta.get("public_n")
    return QueryResult(
        query=spec,
        n_owners=int(meta.get("n_owners", n_contributed)),
        noise=noise,
        payload=CiphertextPayload(blocks, ciphertexts),
        masked_mean_block=MASKED_SUM if masked else None,
        # Masked mode: the analyst divides by N to unmask the scatter.
        public_record_count=int(public_n) if masked and public_n is not None else None,
    )
