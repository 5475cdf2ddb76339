"""What the proxy reports to an analyst: query state and status, results, budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from fedpca.errors import LayoutError
from fedpca.messages.ciphertexts import CiphertextPayload
from fedpca.query import Calibration, ProtocolMode, QuerySpec

__all__ = [
    "BudgetStatus",
    "NoiseDescription",
    "NoiseMechanism",
    "NoiseSection",
    "OwnerDecline",
    "QueryResult",
    "QueryState",
    "QueryStatus",
    "SignedQuery",
]


class QueryState(StrEnum):
    """Lifecycle of a query at the proxy, as stored and as reported.

    The values are what the proxy's store persists, so they must not change.
    """

    COLLECTING = "collecting"
    """Published to owners; uploads are being folded into the aggregate."""
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
class QueryResult:
    """A noised, still encrypted result as the analyst receives it.

    Attributes
    ----------
    query : the query as the proxy ran it.
    n_owners : owners whose contributions were aggregated.
    noise : the noise that was added.
    payload : the ciphertext blocks.
    masked_mean_block : masked mode only: the block holding Enc(v + b).
    public_record_count : masked mode only: the public record count N (sum of
        the owners' counts) the analyst unmasks the scatter with; None in stats
        mode, where N is a noised statistic nobody but the analyst learns.
    """

    query: QuerySpec
    n_owners: int
    noise: NoiseDescription
    payload: CiphertextPayload
    masked_mean_block: str | None = field(default=None)
    public_record_count: int | None = field(default=None)

    def __post_init__(self) -> None:
        masked = self.query.mode is ProtocolMode.MASKED
        label = f"query {self.query.query_id!r}"
        if masked and self.masked_mean_block is None:
            raise LayoutError(f"{label}: masked mode needs masked_mean_block")
        if not masked and self.masked_mean_block is not None:
            raise LayoutError(f"{label}: masked_mean_block is only valid in masked mode")
        count = self.public_record_count
        if masked and count is None:
            raise LayoutError(f"{label}: masked mode needs public_record_count")
        if not masked and count is not None:
            raise LayoutError(
                f"{label}: public_record_count is only valid in masked mode (in stats mode "
                "N is noised)"
            )
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 1
        ):
            raise LayoutError(f"{label}: public_record_count must be an int >= 1, got {count!r}")
        if self.masked_mean_block is not None and self.masked_mean_block not in {
            block.name for block in self.payload.blocks
        }:
            raise LayoutError(
                f"query {self.query.query_id!r}: masked_mean_block {self.masked_mean_block!r}"
                " is not a block of the result"
            )


@dataclass(frozen=True)
class BudgetStatus:
    """Cumulative privacy loss of one analyst.

    ``epsilon_spent`` is reported at ``delta``; ``epsilon_limit`` and
    ``epsilon_remaining`` at ``limit_delta``, the budget's own delta (None when the
    proxy did not say, e.g. an older proxy).
    """

    analyst_id: str
    delta: float
    epsilon_spent: float
    epsilon_remaining: float
    epsilon_limit: float
    n_releases: int
    limit_delta: float | None = None
