"""What the proxy reports to an analyst: query state and status, results, budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from fedpca.admission import NextQuery
from fedpca.errors import LayoutError
from fedpca.messages.ciphertexts import CiphertextBlock, CiphertextPayload
from fedpca.query import Calibration, ProtocolMode, QuerySpec

__all__ = [
    "REFUSAL_METADATA",
    "BudgetStatus",
    "Charge",
    "NoiseDescription",
    "NoiseMechanism",
    "NoiseSection",
    "OwnerDecline",
    "QueryResult",
    "QueryState",
    "QueryStatus",
    "Refusal",
    "ResultHeader",
    "SignedQuery",
]


REFUSAL_METADATA = "fedpca-refusal"
"""Trailing metadata key of a call the proxy answered RESOURCE_EXHAUSTED, naming which
of the two it was (:class:`Refusal`): gRPC has one status code for both, and an analyst
told "budget exhausted" when the proxy only asked it to wait would give up a budget it
still has. A RESOURCE_EXHAUSTED without the key comes from gRPC itself (its bound on
calls in flight), an overload."""


class Refusal(StrEnum):
    """Values of :data:`REFUSAL_METADATA`."""

    BUDGET = "budget"
    """The release would exceed the analyst's privacy budget: final for that budget."""
    OVERLOAD = "overload"
    """A per-peer bound of the proxy (calls, watches, open queries, queries a day):
    nothing was done or charged; the same call may succeed later."""


class QueryState(StrEnum):
    """Lifecycle of a query at the proxy, as stored and as reported.

    The values are what the proxy's store persists, so they must not change.
    """

    COLLECTING = "collecting"
    """Published to owners; the first ``quorum`` owners to begin an upload become its
    contributors, and their chunks are folded into the aggregate as they arrive."""
    AGGREGATING = "aggregating"
    """The contributors are fixed (no other owner may join); their chunks are still
    arriving, and each result page is final (noise added, ready to fetch) as soon as
    every contributor's chunks covering it are folded."""
    NOISING = "noising"
    """Uploads closed; noise (and in masked mode the mask) is being added."""
    DONE = "done"
    """The noise-added result is stored and can be fetched by the analyst."""
    FAILED = "failed"
    """The query ended without a result; ``failure_reason`` says why."""

    @property
    def terminal(self) -> bool:
        """True for states a query never leaves."""
        return self in (QueryState.DONE, QueryState.FAILED)


class Charge(StrEnum):
    """Where a query's epsilon stands on its analyst's ledger at the proxy.

    The proxy charges a query when it accepts it, and refunds the charge when the query
    fails before any owner began an upload (docs/privacy.md, "Refunds").
    """

    RESERVED = "reserved"
    """Charged, but refunded should the query fail before any owner begins an upload."""
    CHARGED = "charged"
    """Charged for good: an owner began an upload (or the query is done)."""
    REFUNDED = "refunded"
    """The query failed before any owner began an upload; nothing is charged."""
    UNKNOWN = "unknown"
    """Not reported (a proxy older than this field)."""

    def describe(self, state: QueryState) -> str:
        """One line for a query in ``state``, e.g. ``refunded (no owner had begun an
        upload)``."""
        if self is Charge.RESERVED:
            return (
                "reserved (refunded if the query fails before any owner begins an upload; "
                "charged for good once one does)"
            )
        if self is Charge.CHARGED:
            if state is QueryState.DONE:
                return "charged"
            tense = "had" if state is QueryState.FAILED else "has"
            return f"charged (an owner {tense} begun an upload: the charge stands)"
        if self is Charge.REFUNDED:
            return "refunded (no owner had begun an upload)"
        return "not reported by this proxy (an older version)"


@dataclass(frozen=True)
class SignedQuery:
    """A query as the analyst submits it: the spec and the analyst's signature over it."""

    spec: QuerySpec
    signature: bytes = b""
    signer: str = ""
    """``ed25519:<hex>`` (:func:`fedpca.signing.signer_id`); empty when unsigned."""


@dataclass(frozen=True)
class OwnerDecline:
    """One owner's refusal of a query with its public reason code and one line of detail."""

    owner_id: str
    reason: str
    detail: str = ""

    def line(self) -> str:
        """``owner: reason: detail`` for a progress display."""
        return f"{self.owner_id}: {self.reason}" + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class QueryStatus:
    """Progress of one query as the proxy reports it.

    Attributes
    ----------
    query_id : the query.
    state : lifecycle state.
    owners_contributed : accepted uploads so far.
    quorum : owners required.
    owners_declined : owners that declined the task.
    deadline : when collection closes (timezone-aware), None before publication.
    failure_reason : set only in state FAILED.
    owners_uploading : owners whose upload is streaming in, not yet complete.
    declines : every decline so far, with its public reason.
    owners_registered : owners the proxy accepts (the most that can contribute).
    pages_final : result pages final so far (noise added; the analyst may fetch them).
    pages_total : result pages the query's result has.
    charge : whether the query's epsilon is reserved, charged or refunded on the
        analyst's ledger (UNKNOWN from a proxy older than this field).
    result_deleted_at : when the proxy deleted the query's result (its pages can no
        longer be fetched; the charge stands), None while it is kept.
    """

    query_id: str
    state: QueryState
    owners_contributed: int
    quorum: int
    owners_declined: int = 0
    deadline: datetime | None = None
    failure_reason: str | None = None
    owners_uploading: int = 0
    declines: tuple[OwnerDecline, ...] = ()
    owners_registered: int = 0
    pages_final: int = 0
    pages_total: int = 0
    charge: Charge = Charge.UNKNOWN
    result_deleted_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class NoiseMechanism(StrEnum):
    """Noise-generating mechanism applied to a result."""

    GAUSSIAN = "gaussian"
    NONE = "none"
    """No noise (epsilon = inf, verification only; NOT PRIVATE)."""


@dataclass(frozen=True)
class NoiseSection:
    """Noise added to one section, sigma in real (decoded) units."""

    name: str
    sigma: float


@dataclass(frozen=True)
class NoiseDescription:
    """Everything public about the noise in a result."""

    mechanism: NoiseMechanism
    calibration: Calibration
    epsilon: float
    delta: float
    sections: tuple[NoiseSection, ...] = ()


@dataclass(frozen=True)
class ResultHeader:
    """Everything about a noised, still encrypted result but its ciphertexts.

    The proxy sends it as soon as the query's contributors are fixed; the result's
    pages follow as they become final.

    Attributes
    ----------
    query : the query as the proxy ran it.
    n_owners : owners whose contributions are aggregated.
    noise : the noise that was (or is being) added.
    blocks : the result's ciphertext blocks, in wire order.
    total_chunks : chunks (result pages) that follow.
    masked_mean_block : masked mode only: the block holding Enc(v + b).
    public_record_count : masked mode only: the public record count N (sum of
        the owners' counts) the analyst unmasks the scatter with; None in stats
        mode, where N is a noised statistic nobody but the analyst learns.
    query_signature, query_signer : the analyst's signature over ``query`` and its
        signing key, as submitted (empty from a proxy older than this field).
    """

    query: QuerySpec
    n_owners: int
    noise: NoiseDescription
    blocks: tuple[CiphertextBlock, ...]
    total_chunks: int
    masked_mean_block: str | None = field(default=None)
    public_record_count: int | None = field(default=None)
    query_signature: bytes = field(default=b"")
    query_signer: str = field(default="")

    def __post_init__(self) -> None:
        _check_result_fields(
            self.query, self.blocks, self.masked_mean_block, self.public_record_count
        )


@dataclass(frozen=True)
class QueryResult:
    """A whole noised, still encrypted result (its header and every ciphertext).

    Attributes
    ----------
    query, n_owners, noise, masked_mean_block, public_record_count : as in
        :class:`ResultHeader`.
    payload : the ciphertext blocks.
    """

    query: QuerySpec
    n_owners: int
    noise: NoiseDescription
    payload: CiphertextPayload
    masked_mean_block: str | None = field(default=None)
    public_record_count: int | None = field(default=None)

    def __post_init__(self) -> None:
        _check_result_fields(
            self.query, self.payload.blocks, self.masked_mean_block, self.public_record_count
        )

    @property
    def blocks(self) -> tuple[CiphertextBlock, ...]:
        return tuple(self.payload.blocks)


def _check_result_fields(
    query: QuerySpec,
    blocks: tuple[CiphertextBlock, ...],
    masked_mean_block: str | None,
    count: int | None,
) -> None:
    masked = query.mode is ProtocolMode.MASKED
    label = f"query {query.query_id!r}"
    if masked and masked_mean_block is None:
        raise LayoutError(f"{label}: masked mode needs masked_mean_block")
    if not masked and masked_mean_block is not None:
        raise LayoutError(f"{label}: masked_mean_block is only valid in masked mode")
    if masked and count is None:
        raise LayoutError(f"{label}: masked mode needs public_record_count")
    if not masked and count is not None:
        raise LayoutError(
            f"{label}: public_record_count is only valid in masked mode (in stats mode N is noised)"
        )
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise LayoutError(f"{label}: public_record_count must be an int >= 1, got {count!r}")
    if masked_mean_block is not None and masked_mean_block not in {b.name for b in blocks}:
        raise LayoutError(
            f"{label}: masked_mean_block {masked_mean_block!r} is not a block of the result"
        )


@dataclass(frozen=True)
class BudgetStatus:
    """Cumulative privacy loss of one analyst.

    ``epsilon_spent`` is reported at ``delta``; ``epsilon_limit`` and
    ``epsilon_remaining`` at ``limit_delta``, the budget's own delta (None when the
    proxy did not say, e.g. an older proxy). ``epsilon_remaining`` is the limit minus
    the epsilon spent: composition is not additive, so it is not what the next query
    may ask for, and it is only kept on the wire for the analysts of earlier versions,
    which print it. ``next_query`` is that number, computed with the proxy's admission
    rule (None from an older proxy).
    """

    analyst_id: str
    delta: float
    epsilon_spent: float
    epsilon_remaining: float
    epsilon_limit: float
    n_releases: int
    limit_delta: float | None = None
    next_query: NextQuery | None = None
