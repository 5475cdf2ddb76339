"""Re-entering, after a restore, the releases a proxy database forgot.

A proxy database restored from a backup forgets every release charged since the backup
was taken: the analysts could spend that budget again. The owners' ledgers still hold
those releases (each owner records every release it took part in, with the same
privacy event the proxy charged: the query's noise multiplier under the deployment's
relation). ``fedpca owner budget --json`` exports them
(:mod:`fedpca.release_exports`); this module reads such exports
and charges to the proxy's ledgers every release of a query the database does not know,
once, however many owners list it:

* a query the database does not know at all was submitted after the backup: its release
  is re-entered, as the owners recorded it;
* where an owner's export shows that it began an upload (any outcome but ``reserved``),
  the query's charge is made final: re-entered if the database refunded it (a proxy
  started before the import fails the restored queries whose owners answered after the
  backup), marked as begun if the query still runs there (its failure would refund it);
* otherwise what the database holds stands: a release it has, and a refund of a query
  no owner shows an upload of.

An owner may still hold a charge for a query whose charge the proxy refunded after the
backup: re-entering it costs more than the query did, never less. An owner whose
export is missing can leave a release uncharged: import every owner's.

Where owners' records of one query differ, the one with the smallest noise multiplier
(the largest cost) is charged.

A copy written by ``fedpca proxy backup`` is marked as such; the proxy refuses to
serve it until an import (not a dry run) has run on it, which removes the mark.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_database import clear_restore_pending, restore_pending_since
from fedpca.query import Neighbouring
from fedpca.release_exports import OwnerRelease
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
    """Query ids the database knows without a release (refunded) and no owner shows an
    upload of: not charged."""
    refund_undone: list[str] = field(default_factory=list)
    """Query ids the database refunded although an owner's export shows an upload
    began: charged again."""
    disagreements: list[str] = field(default_factory=list)
    """Query ids the owners recorded with different noise multipliers."""
    backup_taken_at: str | None = None
    """When the backup the database was restored from was taken (``fedpca proxy
    backup`` marks its copies), None if not marked; the proxy serves the database once
    the import has run (not a dry run)."""


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
    releases: Iterable[OwnerRelease],
    neighbouring: Neighbouring,
    *,
    dry_run: bool = False,
) -> ImportReport:
    """Charge what the owners' exports show was released and ``store`` forgot (module
    docstring).

    Owners record a release under the analyst's key fingerprint; the proxy's ledgers are
    kept by analyst id, which the query id names: the event is charged to that analyst.
    Where an owner's export shows it began an upload of a query (any outcome but
    ``reserved``), the query's charge is made final: charged again if the restored
    database refunded it (a proxy started before the import fails the restored queries
    whose owners answered after the backup), or marked as begun if it is still running
    there (its failure would otherwise refund a release the analyst may have read).

    All or nothing: one transaction. The proxy must not be running (the caller holds
    the database's lock).

    Raises
    ------
    ConfigError
        A release stated under another relation than the deployment's (an export of
        another deployment), or whose query id does not name an analyst.
    """
    listed = list(releases)
    chosen, differing = _costliest(release.event for release in listed)
    begun = {release.event.query_id for release in listed if release.upload_began}
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
        report.backup_taken_at = restore_pending_since(conn)
        if not dry_run:
            clear_restore_pending(conn)
        for query_id, event in sorted(charged.items(), key=lambda item: item[1].timestamp):
            known = store.query_progress(conn, query_id)
            if store.release_recorded(conn, query_id):
                # Charged and still running with no upload begun there, but an owner
                # began one: it stays charged for good. Otherwise the charge stands as is.
                if (
                    known is not None
                    and not known.state.terminal
                    and not known.uploads_begun
                    and query_id in begun
                ):
                    report.kept_charged.append(query_id)
                    if not dry_run:
                        store.mark_uploads_begun(conn, query_id)
                else:
                    report.already_recorded.append(query_id)
            elif known is not None and query_id not in begun:
                report.refunded.append(query_id)
            else:
                if known is not None:
                    report.refund_undone.append(query_id)
                else:
                    report.entered.append(event)
                if not dry_run:
                    store.record_release(conn, event.analyst, query_id, event.to_strict_dict())
                    if known is not None:
                        store.mark_uploads_begun(conn, query_id)
    return report
