"""Re-entering, after a restore, the releases a proxy database forgot.

A proxy database restored from a backup forgets every release charged since the backup
was taken: the analysts could spend that budget again. The owners' ledgers still hold
those releases (each owner records every release it took part in, with the same
privacy event the proxy charged: the query's noise multiplier under the deployment's
relation). ``fedpca owner budget --json`` exports them
(:mod:`fedpca.release_exports`); this module reads such exports
and charges to the proxy's ledgers every release of a query the database does not know,
once, however many owners list it:

* a release the database already has is left as it is, and if its query is still
  running there, its charge is made final (the owners took part after the backup);
* a query the database knows without a release was refunded (no owner began an upload
  before the backup, and a refund is final): it is not charged again;
* a query the database does not know at all was submitted after the backup: its release
  is re-entered, as the owners recorded it. (An owner may still hold the reservation of
  a query whose charge the proxy refunded after the backup; re-entering it costs more
  than the query did, never less.)

Where owners' records of one query differ, the one with the smallest noise multiplier
(the largest cost) is charged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.proxy.store import ProxyStore
from fedpca.query import Neighbouring
from fedpca.transport.certs import validate_node_id

__all__ = ["ImportReport", "import_releases"]


@dataclass
class ImportReport:
    """What :func:`import_releases` did (or, in a dry run, would do)."""

    entered: list[PrivacyEvent] = field(default_factory=list)
    """Releases charged now: their queries were unknown to the database."""
    already_recorded: list[str] = field(default_factory=list)
    """Query ids whose release the database has (and whose query has ended)."""
    kept_charged: list[str] = field(default_factory=list)
    """Query ids the database holds as still running, with their release: their charge
    is made final (the owners took part, so a failure must not refund it)."""
    refunded: list[str] = field(default_factory=list)
    """Query ids the database knows without a release (refunded): not charged."""
    disagreements: list[str] = field(default_factory=list)
    """Query ids the owners recorded with different noise multipliers."""


def _analyst_of(query_id: str) -> str:
    """The analyst a proxy query id names (``analyst/query``)."""
    analyst, slash, query = query_id.partition("/")
    if not (slash and query):
        raise ConfigError(
            f"release {query_id!r} does not name its analyst (the proxy names queries "
            "analyst/query): nothing was imported"
        )
    try:
        validate_node_id(analyst)
    except ConfigError as exc:
        raise ConfigError(f"release {query_id!r}: {exc}; nothing was imported") from None
    return analyst


def _costliest(events: Iterable[PrivacyEvent]) -> tuple[dict[str, PrivacyEvent], list[str]]:
    """One event per query id, the smallest noise multiplier (0, NOT PRIVATE, wins), and
    the ids whose events differ in it."""
    chosen: dict[str, PrivacyEvent] = {}
    differing: set[str] = set()
    for event in events:
        kept = chosen.get(event.query_id)
        if kept is not None and kept.noise_multiplier != event.noise_multiplier:
            differing.add(event.query_id)
        if kept is None or event.noise_multiplier < kept.noise_multiplier:
            chosen[event.query_id] = event
    return chosen, sorted(differing)


def import_releases(
    store: ProxyStore,
    events: Iterable[PrivacyEvent],
    neighbouring: Neighbouring,
    *,
    dry_run: bool = False,
) -> ImportReport:
    """Charge the releases of queries ``store`` does not know (module docstring).

    Owners record a release under the analyst's key fingerprint; the proxy's ledgers are
    kept by analyst id, which the query id names: the event is charged to that analyst.
    A query the database holds as still running, with its release, gets its charge made
    final, as if an upload had begun there: the owners' exports show they took part
    after the backup, and the restored query will fail (their uploads are not sent
    again), which would otherwise refund a release the analyst may have read.

    All or nothing: one transaction. The proxy must not be running (the caller holds
    the database's lock).

    Raises
    ------
    ConfigError
        A release stated under another relation than the deployment's (an export of
        another deployment), or whose query id does not name an analyst.
    """
    chosen, differing = _costliest(events)
    charged: dict[str, PrivacyEvent] = {}
    for query_id, event in chosen.items():
        if event.neighbouring is not Neighbouring(neighbouring):
            raise ConfigError(
                f"release {query_id} is accounted under {event.neighbouring.value}, "
                f"this deployment under {Neighbouring(neighbouring).value}: an export of "
                "another deployment? Nothing was imported"
            )
        charged[query_id] = replace(event, analyst=_analyst_of(query_id))
    report = ImportReport(disagreements=differing)
    with store.transaction() as conn:
        for query_id, event in sorted(charged.items(), key=lambda item: item[1].timestamp):
            known = store.query_progress(conn, query_id)
            if store.release_recorded(conn, query_id):
                if known is None or known.state.terminal or known.uploads_begun:
                    report.already_recorded.append(query_id)
                else:
                    report.kept_charged.append(query_id)
                    if not dry_run:
                        store.mark_uploads_begun(conn, query_id)
            elif known is not None:
                report.refunded.append(query_id)
            else:
                report.entered.append(event)
                if not dry_run:
                    store.record_release(conn, event.analyst, query_id, json.loads(event.to_json()))
    return report
