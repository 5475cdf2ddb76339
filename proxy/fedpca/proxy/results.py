"""A query's result as the analyst receives it: its header, then its pages.

Stats-mode pages become final one by one as the contributors' chunks are folded
(:meth:`fedpca.proxy.store.ProxyStore.finalize_pages`, noise from
:mod:`fedpca.proxy.prepared_noise`); a masked-mode result is computed at the end by
:mod:`fedpca.proxy.masking` from the whole aggregate, which is never modified, so a
crash while it is computed leaves a NOISING query whose inputs are intact.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fedpca.codec import ciphertext_byte_length
from fedpca.errors import LayoutError
from fedpca.messages import (
    CiphertextPayload,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    QueryResult,
    ResultHeader,
)
from fedpca.messages import ciphertexts_from_bytes as wire_ciphertexts_from_bytes
from fedpca.protocol import MASKED_SUM, ReleasePlan, masked_sigma
from fedpca.proxy.queries import QueryContext, result_blocks
from fedpca.proxy.store_records import page_count
from fedpca.query import ProtocolMode

__all__ = ["aggregate_blocks", "result_header", "result_meta", "whole_result"]

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


def result_meta(
    plan: ReleasePlan, n_owners: int, public_counts: Sequence[int | None]
) -> dict[str, Any]:
    """What the proxy stores about a result once its contributors are fixed.

    Everything in it is public: the owner count, the plan, each section's noise scale,
    and in masked mode the owners' public record counts' sum N.
    """
    meta: dict[str, Any] = {
        "n_owners": n_owners,
        "mode": plan.spec.mode.value,
        "not_private": not plan.private,
        "sections": [
            {"name": s.name, "sigma": s.sigma, "sigma_int": s.sigma_int} for s in plan.sections
        ],
        "plan": plan.describe(),
    }
    if plan.spec.mode is ProtocolMode.MASKED:
        public_n = sum(count or 0 for count in public_counts)
        # The scatter noise scales with the public N, known once the contributors are.
        sigma, sigma_int = masked_sigma(plan, public_n)
        meta["public_n"] = public_n
        meta["sections"] = [{"name": "scatter", "sigma": sigma, "sigma_int": sigma_int}]
    return meta


def result_header(
    context: QueryContext,
    meta: Mapping[str, Any],
    page_ciphertexts: int,
    *,
    signature: bytes = b"",
    signer: str = "",
) -> ResultHeader:
    """The header of a result whose contributors are fixed (its pages follow), with the
    analyst's ``signature`` over the query by ``signer`` as it was submitted."""
    spec = context.spec
    blocks = result_blocks(context.plan)
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
    total = sum(block.n_ciphertexts for block in blocks)
    return ResultHeader(
        query=spec,
        n_owners=int(meta["n_owners"]),
        noise=noise,
        blocks=blocks,
        total_chunks=page_count(total, page_ciphertexts),
        masked_mean_block=MASKED_SUM if masked else None,
        # Masked mode: the analyst divides by N to unmask the scatter.
        public_record_count=int(public_n) if masked and public_n is not None else None,
        query_signature=signature,
        query_signer=signer,
    )


def whole_result(header: ResultHeader, pages: Sequence[bytes]) -> QueryResult:
    """A complete result from its header and every page (tools and tests)."""
    if len(pages) != header.total_chunks:
        raise LayoutError(
            f"query {header.query.query_id!r}: {len(pages)} of {header.total_chunks} pages"
        )
    width = header.blocks[0].ciphertext_bytes
    flat = wire_ciphertexts_from_bytes(b"".join(pages), width, "result pages")
    return QueryResult(
        query=header.query,
        n_owners=header.n_owners,
        noise=header.noise,
        payload=CiphertextPayload.from_wire_order(header.blocks, flat),
        masked_mean_block=header.masked_mean_block,
        public_record_count=header.public_record_count,
    )
