"""An owner's releases as a file: what ``fedpca owner budget --json`` writes and
``fedpca proxy import-releases`` reads.

The file holds the privacy events of the owner's ledger (query id, analyst, noise
multiplier, the epsilon and delta the query asked for, relation, sensitivity, time) and
what became of each task: public facts of the queries, nothing derived from the rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError

__all__ = [
    "OWNER_RELEASES_FORMAT",
    "OwnerRelease",
    "owner_releases_document",
    "read_owner_releases",
]

OWNER_RELEASES_FORMAT = "fedpca-owner-releases/1"
"""The ``format`` field of an export."""


UNSENT_OUTCOME = "reserved"
"""The one outcome of a ledger entry whose upload never began: the owner keeps an entry
after a task ends only while it stays charged, i.e. once an upload began."""


class OwnerRelease(NamedTuple):
    """One release of an owner's export and what became of its task."""

    event: PrivacyEvent
    outcome: str

    @property
    def upload_began(self) -> bool:
        """Whether this owner began an upload of its share (an unknown outcome counts as
        begun: that charges more, never less)."""
        return self.outcome != UNSENT_OUTCOME


def owner_releases_document(
    owner_id: str, releases: Iterable[tuple[PrivacyEvent, str]]
) -> dict[str, Any]:
    """The export of an owner's ledger: each release's event and its task's outcome.

    Infinite epsilons (NOT PRIVATE releases) are written as ``"inf"``, so that the
    document is strict JSON. Timestamps are cut to whole seconds: the import only
    orders releases by them, and the ledger's finer time (taken just before the owner
    reserved its budget) would help whoever holds the file time the owner's work
    before its upload header (docs/privacy.md, "Work padded to a public size").
    """
    records = []
    for event, outcome in releases:
        record = event.to_strict_dict()
        record["timestamp"] = float(math.floor(event.timestamp))
        records.append({"event": record, "outcome": outcome})
    return {"format": OWNER_RELEASES_FORMAT, "owner": owner_id, "releases": records}


def read_owner_releases(document: Mapping[str, Any], source: str) -> list[OwnerRelease]:
    """The releases of one owner's export (``fedpca owner budget --json``).

    Raises
    ------
    ConfigError
        Not such an export, or a release that is not a valid privacy event or has no
        outcome (named with ``source``).
    """
    if document.get("format") != OWNER_RELEASES_FORMAT:
        raise ConfigError(
            f"{source}: not an export of `fedpca owner budget --json` (format "
            f"{OWNER_RELEASES_FORMAT!r} expected)"
        )
    releases = document.get("releases")
    if not isinstance(releases, list):
        raise ConfigError(f"{source}: 'releases' must be a list")
    read = []
    for position, record in enumerate(releases):
        if not isinstance(record, dict) or not isinstance(record.get("event"), dict):
            raise ConfigError(f"{source}: release {position} has no 'event' object")
        outcome = record.get("outcome")
        if not isinstance(outcome, str) or not outcome:
            raise ConfigError(f"{source}: release {position} has no 'outcome'")
        try:
            read.append(OwnerRelease(PrivacyEvent.from_dict(record["event"]), outcome))
        except ConfigError as exc:
            raise ConfigError(f"{source}: release {position}: {exc}") from None
    return read
