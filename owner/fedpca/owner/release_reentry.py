"""Re-entering, after an owner's ledger was restored from a backup, the releases it forgot.

A ledger restored to an older copy forgets every release this owner took part in since
the copy was taken, so the analysts could spend that part of its budget again. The proxy
knows which queries with a release this owner's uploads joined; ``fedpca proxy
export-releases`` writes them, each as the analyst signed it
(:mod:`fedpca.release_exports`). This module charges them to the ledger, once each:

* the proxy's word is needed only for *which* queries; what each costs follows from the
  signed query alone, as when the node first answered it (the same release plan and
  privacy event, keyed by the proxy's task id);
* a query whose signature does not verify makes the whole import fail: the export was
  altered, or is another deployment's;
* a query signed by a key not in ``policy.accepted_query_signers`` is listed and not
  charged: this node would not have answered it (add back an analyst key removed since
  the backup to charge its queries);
* a release the ledger holds stays as it is.

Charging more is the safe direction: a proxy that lists queries this owner never took
part in can only use up its budget, which it could deny in other ways too. A proxy that
leaves some out leaves them uncharged; docs/operations.md says what else to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError, UntrustedKeyError
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.policy_config import PolicyConfig
from fedpca.protocol import ReleasePlan
from fedpca.query import spec_digest
from fedpca.release_exports import ContributedRelease
from fedpca.signing import verify_query

__all__ = ["ReentryReport", "reenter_releases"]


@dataclass
class ReentryReport:
    """What :func:`reenter_releases` did (or, in a dry run, would do)."""

    entered: list[PrivacyEvent] = field(default_factory=list)
    already_recorded: list[str] = field(default_factory=list)
    """Task ids whose release the ledger holds."""
    unaccepted: list[tuple[str, str]] = field(default_factory=list)
    """(task id, signer) of queries signed by a key this owner's policy does not accept."""


def _event_of(release: ContributedRelease) -> PrivacyEvent:
    """The release as this node recorded it when it answered the query (task_processing)."""
    spec = release.spec
    analyst, slash, query_id = release.task_id.partition("/")
    if not (analyst and slash and query_id == spec.query_id):
        raise ConfigError(
            f"release {release.task_id!r} is not the proxy's key of query {spec.query_id!r} "
            "(analyst/query): nothing was re-entered"
        )
    try:
        verify_query(spec, release.signature, release.signer)
    except (UntrustedKeyError, ConfigError) as exc:
        raise ConfigError(
            f"release {release.task_id!r}: {exc}; the export was altered or is another "
            "deployment's: nothing was re-entered"
        ) from None
    try:
        plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    except ConfigError as exc:
        raise ConfigError(f"release {release.task_id!r}: {exc}; nothing was re-entered") from None
    event = plan.privacy_event(analyst=spec.analyst_key_fingerprint)
    return replace(event, query_id=release.task_id, timestamp=release.joined_at)


def reenter_releases(
    ledger: BudgetLedger,
    releases: Iterable[ContributedRelease],
    policy: PolicyConfig,
    *,
    dry_run: bool = False,
) -> ReentryReport:
    """Charge to ``ledger`` the releases of the proxy's export it does not hold (module
    docstring). All or nothing: checked first, then written in one transaction.

    Raises
    ------
    ConfigError
        A release whose signature does not verify, whose task id does not name its
        query, or that is stated for another relation than the ledger's.
    """
    report = ReentryReport()
    charged: list[tuple[PrivacyEvent, str]] = []
    for release in releases:
        event = _event_of(release)
        if release.signer not in policy.accepted_query_signers:
            report.unaccepted.append((release.task_id, release.signer))
            continue
        charged.append((event, spec_digest(release.spec)))
    entered, report.already_recorded = ledger.reenter(charged, dry_run=dry_run)
    by_id = {event.query_id: event for event, _ in charged}
    report.entered = [by_id[query_id] for query_id in entered]
    return report
