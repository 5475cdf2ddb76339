"""What the proxy tells an analyst about the deployment and the analyst's own queries.

Everything here is public: the deployment's configuration as the analyst needs it to
state a query (owners registered, relation, delta cap, its own budget) and the
lifecycle of the analyst's own queries, which it already observes one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from fedpca.formatting import first_of, printable
from fedpca.messages.queries import QueryStatus
from fedpca.query import AggregateKind, Neighbouring, ProtocolMode, QueryKind

if TYPE_CHECKING:
    from fedpca.owner_terms import OwnerTerms

__all__ = [
    "ABSENT_OWNERS_SHOWN",
    "CANCELLED_REASON",
    "CancelReceipt",
    "DeploymentInfo",
    "QuerySummary",
]

ABSENT_OWNERS_SHOWN = 10
"""Owners a message names as not connected; it counts the others (a deployment of
hundreds of owners would otherwise print them all)."""


@dataclass(frozen=True)
class DeploymentInfo:
    """The public facts of a deployment, as its proxy reports them to one analyst.

    Attributes
    ----------
    proxy_id, software_version, protocol_version : the proxy.
    owners_registered : owners on the proxy's allow-list: the most that can
        contribute, and the default quorum of the analyst's tools.
    owners_connected : allowed owners with a task stream open at this moment.
    neighbouring : the relation every query must state.
    max_delta_per_query : the largest delta a query of this analyst may state.
    accountant : how the proxy composes the analyst's releases.
    analyst_id : the caller, as its certificate names it.
    budget_epsilon, budget_delta : the caller's total budget.
    server_time : the proxy's clock.
    owners_absent : the allowed owners without a task stream open at this moment, by
        node id, sorted (empty from a proxy too old to say; then only the counts do).
    owner_terms : when asked for, the terms each connected owner stated, as (node id,
        terms) sorted by node id (an owner too old to state them is not listed).
    """

    proxy_id: str
    software_version: str
    protocol_version: int
    owners_registered: int
    owners_connected: int
    neighbouring: Neighbouring
    max_delta_per_query: float
    accountant: str
    analyst_id: str
    budget_epsilon: float
    budget_delta: float
    server_time: datetime
    owners_absent: tuple[str, ...] = ()
    owner_terms: tuple[tuple[str, OwnerTerms], ...] = ()

    def absent_owners_note(self, shown: int = ABSENT_OWNERS_SHOWN) -> str:
        """Which allowed owners are not connected, for a message: ``"not connected:
        owner-a, owner-b"``, the first ``shown`` of them and how many more; with no
        names (none absent, or a proxy too old to name them) how many, or ``""``."""
        offline = self.owners_registered - self.owners_connected
        if not self.owners_absent:
            return f"{offline} not connected" if offline > 0 else ""
        return f"not connected: {first_of([printable(n) for n in self.owners_absent], shown)}"


@dataclass(frozen=True)
class QuerySummary:
    """One of the analyst's queries in a listing."""

    status: QueryStatus
    kind: QueryKind
    mode: ProtocolMode
    epsilon: float
    delta: float
    created_at: datetime
    aggregates: tuple[AggregateKind, ...] = ()
    """An aggregate query's kinds, each once, in query order (empty for PCA, DCA)."""

    @property
    def what(self) -> str:
        """What the query releases, e.g. ``pca`` or ``aggregate:stats+histogram``."""
        if self.aggregates:
            return f"{self.kind.value}:{'+'.join(kind.value for kind in self.aggregates)}"
        return self.kind.value


CANCELLED_REASON = "cancelled by the analyst"
"""The failure reason of a query its analyst cancelled (any other reason: the query
had failed before it was cancelled)."""


@dataclass(frozen=True)
class CancelReceipt:
    """The outcome of cancelling a query.

    Attributes
    ----------
    status : the query's status afterwards (FAILED, "cancelled by the analyst").
    refunded : the analyst's charge was refunded (no owner had begun an upload);
        otherwise the analyst pays for what the owners may have spent.
    """

    status: QueryStatus
    refunded: bool
