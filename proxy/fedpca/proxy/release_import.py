"""Re-entering, after a restore, the releases a proxy database forgot.

A proxy database restored from a backup forgets every release charged since the backup
was taken: the analysts could spend that budget again. The owners' ledgers still hold
those releases (each owner records every release it took part in, with the same
privacy event the proxy charged: the query's noise multiplier under the deployment's
relation). ``fedpca owner budget --json`` exports them
(:mod:`fedpca.release_exports`); this module reads such exports
and charges to the proxy's ledgers every release of a query the database does not know,
once, however many owners list it:

* a release the database already has is left as it is;
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
from dataclasses import dataclass, field

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.proxy.store import ProxyStore
from fedpca.query import Neighbouring

__all__ = ["ImportReport", "import_releases"]


@dataclass
class ImportReport:
    """What :func:`import_releases` did (or, in a dry run, would do)."""

    entered: list[PrivacyEvent] = field(default_factory=list)
    """Releases charged now: their queries were unknown to the database."""
    already_recorded: list[str] = field(default_factory=list)
    """Query ids whose release the database has."""
    refunded: list[str] = field(default_factory=list)
    """Query ids the database knows without a release (refunded): not charged."""


def _costliest(events: Iterable[PrivacyEvent]) -> dict[str, PrivacyEvent]:
    """One event per query id: the smallest noise multiplier (0, NOT PRIVATE, wins)."""
    chosen: dict[str, PrivacyEvent] = {}
    for event in events:
        kept = chosen.get(event.query_id)
        if kept is None or event.noise_multiplier < kept.noise_multiplier:
            chosen[event.query_id] = event
    return chosen


def import_releases(
    store: ProxyStore,
    events: Iterable[PrivacyEvent],
    neighbouring: Neighbouring,
    *,
    dry_run: bool = False,
) -> ImportReport:
    """Charge the releases of queries ``store`` does not know (module docstring).

    All or nothing: one transaction. The proxy must not be running (the caller holds
    the database's lock).

    Raises
    ------
    ConfigError
        A release stated under another relation than the deployment's (an export of
        another deployment), or one whose query id does not name its analyst.
    """
    chosen = _costliest(events)
    for event in chosen.values():
        if event.neighbouring is not Neighbouring(neighbouring):
            raise ConfigError(
                f"release {event.query_id} is accounted under {event.neighbouring.value}, "
                f"this deployment under {Neighbouring(neighbouring).value}: an export of "
                "another deployment? Nothing was imported"
            )
        if not event.query_id.startswith(f"{event.analyst}/"):
            raise ConfigError(
                f"release {event.query_id} is not a query of its analyst {event.analyst!r} "
                "(the proxy names queries analyst/query): nothing was imported"
            )
    report = ImportReport()
    with store.transaction() as conn:
        for query_id, event in sorted(chosen.items(), key=lambda item: item[1].timestamp):
            if store.release_recorded(conn, query_id):
                report.already_recorded.append(query_id)
            elif store.query_known(conn, query_id):
                report.refunded.append(query_id)
            else:
                report.entered.append(event)
                if not dry_run:
                    store.record_release(conn, event.analyst, query_id, json.loads(event.to_json()))
    return report
