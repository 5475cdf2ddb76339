"""What the proxy tells an analyst besides single query statuses: the deployment's
public facts and the analyst's own queries.

Read-only views over the coordinator's configuration and store (no gRPC here). Both
answer from public facts only: the allow-list's size and the relation are part of the
deployment an analyst states its queries against, and an analyst only ever sees its
own queries (query ids are scoped by analyst, :func:`~fedpca.proxy.coordinator.task_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from fedpca.messages import PROTOCOL_VERSION, DeploymentInfo, QuerySummary
from fedpca.owner_terms import OwnerTerms
from fedpca.proxy.coordinator import Coordinator, task_id
from fedpca.query import AggregateKind, ProtocolMode, QueryKind
from fedpca.version import __version__

__all__ = ["DEFAULT_LISTED_QUERIES", "describe_deployment", "list_queries"]

DEFAULT_LISTED_QUERIES = 50
"""Queries :func:`list_queries` returns when the analyst names no limit."""


def describe_deployment(
    coordinator: Coordinator,
    analyst_id: str,
    *,
    proxy_id: str,
    connected: frozenset[str],
    stated_terms: Mapping[str, OwnerTerms] | None = None,
) -> DeploymentInfo:
    """The deployment as analyst ``analyst_id`` may know it.

    Parameters
    ----------
    coordinator : the proxy's coordinator (configuration and store).
    analyst_id : the caller, from its certificate.
    proxy_id : this proxy's node id.
    connected : the owners with a task stream open now.
    stated_terms : the terms connected owners stated, by node id (passed on to the
        analyst as the owners stated them: they are public facts of the owners'
        configuration and schema, fedpca.owner_terms).
    """
    config = coordinator.config
    budget = config.budget.for_analyst(analyst_id)
    return DeploymentInfo(
        proxy_id=proxy_id,
        software_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        owners_registered=len(coordinator.registered_owners),
        owners_connected=len(connected),
        neighbouring=config.privacy.neighbouring,
        max_delta_per_query=config.privacy.delta_cap(budget),
        accountant=config.privacy.accountant.value,
        analyst_id=analyst_id,
        budget_epsilon=budget.epsilon,
        budget_delta=budget.delta,
        server_time=datetime.now(UTC),
        owners_absent=tuple(sorted(coordinator.registered_owners - connected)),
        owner_terms=tuple(sorted((stated_terms or {}).items())),
    )


def list_queries(
    coordinator: Coordinator,
    analyst_id: str,
    limit: int | None = None,
    query_id: str | None = None,
) -> list[QuerySummary]:
    """The analyst's newest queries (``limit``, default :data:`DEFAULT_LISTED_QUERIES`),
    or only its query ``query_id`` (NotFoundError unless the analyst has it).

    A stored query this version cannot read (it failed at start, saying so) is left
    out: ``status ID`` shows it, and the list of every other query still works.
    """
    if query_id is not None:
        records = [coordinator.store.query(task_id(analyst_id, query_id))]
    else:
        records = coordinator.store.analyst_queries(analyst_id, limit or DEFAULT_LISTED_QUERIES)
    summaries = []
    prefix = f"{analyst_id}/"
    for record in records:
        # From the stored summary (the query itself can be megabytes of JSON: a review
        # listed 30 large ones in 14.5 s a call).
        summary = record.summary
        try:
            kind = QueryKind(summary["kind"])
            mode = ProtocolMode(summary["mode"])
            epsilon = float(summary["epsilon"])
            delta = float(summary["delta"])
            aggregates = tuple(AggregateKind(name) for name in summary["aggregates"])
        except (KeyError, TypeError, ValueError):
            continue
        listed_id = record.query_id.removeprefix(prefix)
        summaries.append(
            QuerySummary(
                status=coordinator.status(analyst_id, listed_id),
                kind=kind,
                mode=mode,
                epsilon=epsilon,
                delta=delta,
                created_at=datetime.fromtimestamp(record.created_at, UTC),
                aggregates=aggregates,
            )
        )
    return summaries
