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
* a query this node's policy would not have answered (signed by a key not in
  ``policy.accepted_query_signers``, for an analyst key not pinned or not paired with
  that signer, or NOT PRIVATE where ``policy.allow_not_private`` is false) is listed and
  not charged: it did not take part (put back a key removed since the backup to charge
  its queries);
* two different queries under one task id fail the import (a proxy that lists a cheaper
  query under the id of a costlier one);
* a release the ledger holds keeps its cost, and its task is made final as begun, so
  that no later withdrawal refunds it (the backup may predate the upload's start).

Charging more is the safe direction: a proxy that lists queries this owner never took
part in can only use up its budget, which it could deny in other ways too. A proxy that
leaves some out leaves them uncharged; docs/operations.md says what else to do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError, UntrustedKeyError
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.policy import check_key
from fedpca.owner.policy_config import PolicyConfig
from fedpca.protocol import ReleasePlan
from fedpca.query import spec_digest
from fedpca.release_exports import ContributedRelease
from fedpca.signing import CLOCK_ALLOWANCE_SECONDS, verify_query

__all__ = ["ReentryReport", "reenter_releases"]


@dataclass
class ReentryReport:
    """What :func:`reenter_releases` did (or, in a dry run, would do)."""

    entered: list[PrivacyEvent] = field(default_factory=list)
    already_recorded: list[str] = field(default_factory=list)
    """Task ids whose release the ledger holds."""
    kept_charged: list[str] = field(default_factory=list)
    """Task ids the ledger held as not yet begun: now never refunded."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(task id, why) of queries this owner's policy would not have answered."""


def _policy_refusal(release: ContributedRelease, policy: PolicyConfig) -> str | None:
    """Why this node would not have answered the query (None: it would have)."""
    spec = release.spec
    if release.signer not in policy.accepted_query_signers:
        return f"signed by {release.signer[:80]}, not in policy.accepted_query_signers"
    try:
        check_key(spec, policy)
    except UntrustedKeyError as exc:
        return str(exc)
    pairs = policy.analyst_key_signers
    if pairs and release.signer not in pairs.get(spec.analyst_key_fingerprint, ()):
        return "policy.analyst_key_signers pins its analyst key to other signers"
    if math.isinf(spec.epsilon) and not policy.allow_not_private:
        return "NOT PRIVATE (epsilon = inf) and policy.allow_not_private is false"
    return None


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
    if not math.isfinite(release.joined_at) or release.joined_at > (
        time.time() + CLOCK_ALLOWANCE_SECONDS
    ):
        # Kept as the release's time: a future one would count towards
        # policy.max_tasks_per_day for ever.
        raise ConfigError(
            f"release {release.task_id!r}: its upload joined in the future "
            f"({release.joined_at!r}); nothing was re-entered"
        )
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
    charged: dict[str, tuple[PrivacyEvent, str]] = {}
    listed: dict[str, str] = {}  # task id -> digest, of every release (refused ones too)
    for release in releases:
        event, digest = _event_of(release), spec_digest(release.spec)
        if listed.setdefault(release.task_id, digest) != digest:
            raise ConfigError(
                f"the export lists two different queries under task {release.task_id!r}: "
                "nothing was re-entered"
            )
        if (why := _policy_refusal(release, policy)) is not None:
            report.refused.append((release.task_id, why))
            continue
        charged[release.task_id] = (event, digest)
    recorded = ledger.reenter(list(charged.values()), dry_run=dry_run)
    report.already_recorded = recorded.already_recorded
    report.kept_charged = recorded.kept_charged
    report.entered = [charged[task_id][0] for task_id in recorded.entered]
    return report
