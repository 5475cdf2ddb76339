"""An owner's releases as files, one for each side's restore.

* What ``fedpca owner budget --json`` writes and ``fedpca proxy import-releases`` reads
  (a proxy database restored from a backup): the privacy events of the owner's ledger
  (query id, analyst, noise multiplier, the epsilon and delta the query asked for,
  relation, sensitivity, time) and what became of each task.
* What ``fedpca proxy export-releases`` writes and ``fedpca owner import-releases``
  reads (an owner's ledger restored from a backup): each query with a release that the
  owner contributed an upload to, as the analyst signed it, with its signature and the
  time the owner's upload joined. The owner derives each release's cost from the signed
  query itself, so the proxy's word on it is not needed.

Both hold public facts of the queries, nothing derived from the rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.query import QuerySpec
from fedpca.query_records import spec_from_dict, spec_to_dict

__all__ = [
    "CONTRIBUTED_RELEASES_FORMAT",
    "OWNER_RELEASES_FORMAT",
    "ContributedRelease",
    "OwnerRelease",
    "charged_lines",
    "contributed_releases_document",
    "owner_releases_document",
    "read_contributed_releases",
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


CONTRIBUTED_RELEASES_FORMAT = "fedpca-proxy-contributed-releases/1"
"""The ``format`` field of a proxy's export of one owner's releases."""


class ContributedRelease(NamedTuple):
    """A query with a release that one owner's upload joined, as the proxy holds it."""

    task_id: str
    """The proxy's key of the query (``analyst/query``): what the owner's ledger keys it by."""
    spec: QuerySpec
    signature: bytes
    signer: str
    joined_at: float
    """When the proxy accepted the owner's upload header (POSIX seconds)."""


def contributed_releases_document(
    owner_id: str, releases: Iterable[ContributedRelease]
) -> dict[str, Any]:
    """The proxy's export of the releases ``owner_id`` contributed to (module docstring)."""
    records = [
        {
            "task": release.task_id,
            "query": spec_to_dict(release.spec),
            "signature": release.signature.hex(),
            "signer": release.signer,
            "joined_at": float(math.floor(release.joined_at)),
        }
        for release in releases
    ]
    return {"format": CONTRIBUTED_RELEASES_FORMAT, "owner": owner_id, "releases": records}


def read_contributed_releases(
    document: Mapping[str, Any], source: str
) -> tuple[str, list[ContributedRelease]]:
    """The owner an export of ``fedpca proxy export-releases`` is for, and its releases.

    Raises
    ------
    ConfigError
        Not such an export, or a release whose fields are missing or malformed (named
        with ``source``). Signatures are not checked here: the owner checks them against
        its own policy.
    """
    if document.get("format") != CONTRIBUTED_RELEASES_FORMAT:
        raise ConfigError(
            f"{source}: not an export of `fedpca proxy export-releases` (format "
            f"{CONTRIBUTED_RELEASES_FORMAT!r} expected)"
        )
    owner = document.get("owner")
    releases = document.get("releases")
    if not isinstance(owner, str) or not owner:
        raise ConfigError(f"{source}: 'owner' must name the owner the export is for")
    if not isinstance(releases, list):
        raise ConfigError(f"{source}: 'releases' must be a list")
    read = []
    for position, record in enumerate(releases):
        try:
            if not isinstance(record, dict):
                raise ConfigError("not an object")
            task_id, signer = record.get("task"), record.get("signer")
            joined_at, query = record.get("joined_at"), record.get("query")
            if not isinstance(task_id, str) or not isinstance(signer, str):
                raise ConfigError("'task' and 'signer' must be strings")
            if not isinstance(query, dict):
                raise ConfigError("'query' must be an object")
            if isinstance(joined_at, bool) or not isinstance(joined_at, int | float):
                raise ConfigError("'joined_at' must be a number")
            signature = bytes.fromhex(str(record.get("signature")))
            spec = spec_from_dict(query)
            joined = float(joined_at)
        except (
            ConfigError,
            ValueError,
            TypeError,
            AttributeError,
            KeyError,
            OverflowError,
        ) as exc:
            raise ConfigError(f"{source}: release {position}: {exc}") from None
        read.append(ContributedRelease(task_id, spec, signature, signer, joined))
    return owner, read


def charged_lines(events: Iterable[PrivacyEvent], *, dry_run: bool, not_private: str) -> list[str]:
    """One line per release an import charges (``import-releases`` of either role):
    its query id and cost; ``not_private`` says what an epsilon = inf release does."""
    verb = "would charge" if dry_run else "charged"
    lines = []
    for event in events:
        cost = (
            f"NOT PRIVATE (epsilon=inf{not_private})"
            if event.noise_multiplier == 0
            else f"epsilon={event.epsilon:g} delta={event.delta:g} z={event.noise_multiplier:.6g}"
        )
        lines.append(f"{verb:<13}{event.query_id}  {cost}")
    return lines
