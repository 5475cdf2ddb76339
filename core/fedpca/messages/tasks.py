"""The owner's session with the proxy: hello, tasks on the task stream, declines."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from fedpca.query import QuerySpec
from fedpca.version import PROTOCOL_VERSION

__all__ = [
    "DECLINES_CLOSED",
    "PROTOCOL_VERSION",
    "DeclineReason",
    "Heartbeat",
    "ObfuscationVariant",
    "OwnerHello",
    "ProxyInfo",
    "Task",
    "TaskCancellation",
    "TaskDecline",
    "TaskEvent",
]


class ObfuscationVariant(StrEnum):
    """How an owner randomises Paillier encryptions."""

    FULL = "full"
    """Uniform r, obfuscator r^n mod n^2 (textbook Paillier)."""
    DJN = "djn"
    """Damgård-Jurik-Nielsen h_s^a with a short exponent a (extra assumption)."""


@dataclass(frozen=True)
class OwnerHello:
    """What an owner announces (informational; identity comes from its certificate)."""

    node_id: str
    software_version: str
    obfuscation_variants: tuple[ObfuscationVariant, ...] = ()


@dataclass(frozen=True)
class ProxyInfo:
    """The proxy's answer to an owner's hello."""

    proxy_id: str
    software_version: str
    authenticated_node_id: str
    heartbeat_interval_seconds: float
    max_message_bytes: int
    server_time: datetime
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Heartbeat:
    """Application-level keep-alive on the task stream."""

    sent_at: datetime


@dataclass(frozen=True)
class Task:
    """A request to an owner to contribute to one query.

    ``query_signature`` and ``query_signer`` are the analyst's, forwarded unchanged by
    the proxy: the owner answers only queries signed by a signer it pins
    (:mod:`fedpca.signing`).
    """

    query: QuerySpec
    upload_deadline: datetime
    accepted_obfuscation_variants: tuple[ObfuscationVariant, ...] = (
        ObfuscationVariant.FULL,
        ObfuscationVariant.DJN,
    )
    query_signature: bytes = b""
    query_signer: str = ""
    task_id: str = ""
    """The proxy's key of this query (``analyst/query``); owners answer with it. Empty
    only for tasks built without a proxy: then the query id is used."""

    @property
    def key(self) -> str:
        """What the owner names this task by towards the proxy and in its ledger."""
        return self.task_id or self.query.query_id


@dataclass(frozen=True)
class TaskCancellation:
    """Withdraws a previously delivered task (``query_id`` is the task's key)."""

    query_id: str
    reason: str

    @classmethod
    def failed(cls, query_id: str, failure_reason: str | None) -> TaskCancellation:
        """The withdrawal of a task whose query failed (:attr:`query_failed`)."""
        return cls(query_id, f"{QUERY_FAILED_PREFIX}{failure_reason or 'no reason'}")

    @property
    def query_failed(self) -> bool:
        """Whether the query failed: no upload of it is taken any more, so an owner
        stops one in flight at once. Other withdrawals (the quorum reached, an upload
        that cannot go on here) leave an upload in flight to finish: its chunks may all
        be folded, and its resend is then acknowledged."""
        return self.reason.startswith(QUERY_FAILED_PREFIX)


QUERY_FAILED_PREFIX = "query failed: "
"""How the reason of a withdrawal for a failed query begins (:meth:`TaskCancellation.failed`)."""


TaskEvent = Heartbeat | Task | TaskCancellation
"""One event on an owner's task stream."""


class DeclineReason(StrEnum):
    """Why an owner refuses a task."""

    POLICY_REFUSAL = "policy_refusal"
    KEY_NOT_PINNED = "key_not_pinned"
    BUDGET_EXHAUSTED = "budget_exhausted"
    UNSIGNED_QUERY = "unsigned_query"


MAX_DECLINE_DETAIL = 300
"""Characters of a decline's detail the proxy keeps and shows the analyst."""


DECLINES_CLOSED = "declines are no longer recorded"
"""What the proxy says when a query that has left COLLECTING is declined: the owner
logs that expected race quietly (an owner's decline that failed the query first)."""


@dataclass(frozen=True)
class TaskDecline:
    """An owner's refusal of one task, for a public reason.

    Owners decide from public facts only (docs/privacy.md), so reason and detail go to
    the analyst; ``detail`` must not contain anything derived from the owner's records.
    """

    query_id: str
    reason: DeclineReason
    detail: str = ""
