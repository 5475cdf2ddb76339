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
  not charged unless the ledger holds it: it did not take part (put back a key removed
  since the backup to charge its queries);
* two different queries under one task id fail the import (a proxy that lists a cheaper
  query under the id of a costlier one), and so does one query under two task ids, in
  the export or beside the ledger's own (a node answers a signed query once);
* a task id whose analyst part is not a node id, and a join time outside the query's
  signed life (from its signing to its deadline, with the clock allowance), fail it;
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
from fedpca.formatting import printable
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.policy import check_key
from fedpca.owner.policy_config import PolicyConfig
from fedpca.protocol import ReleasePlan
from fedpca.query import spec_digest
from fedpca.release_exports import ContributedRelease
from fedpca.signing import CLOCK_ALLOWANCE_SECONDS, verify_query
from fedpca.transport.certs import validate_node_id

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
    analyst, _, query_id = release.task_id.rpartition("/")
    try:
        validate_node_id(analyst)  # as a live task's id is checked (found by review)
        named = query_id == spec.query_id
    except ConfigError:
        named = False
    if not named:
        raise ConfigError(
            f"release {printable(release.task_id[:200])} is not the proxy's key of query "
            f"{spec.query_id!r} (analyst/query): nothing was re-entered"
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
    # Kept as the release's time, which policy.max_tasks_per_day counts: a future one
    # would count for ever, one long past not at all (found by review). An upload
    # joins after the analyst signed the query and before its signed deadline.
    earliest, latest = 0.0, time.time()
    if spec.issued_at is not None:
        earliest = spec.issued_at
        latest = min(latest, spec.issued_at + spec.deadline_seconds)
    joined = release.joined_at
    # The join is on the proxy's clock, the deadline on the analyst's and the owner's
    # answer on its own: twice the allowance for clocks (a review).
    slack = 2 * CLOCK_ALLOWANCE_SECONDS
    if not (math.isfinite(joined) and earliest - slack <= joined <= latest + slack):
        raise ConfigError(
            f"release {release.task_id!r}: its upload joined at {joined!r}, outside the "
            "time from the query's signing to its deadline (or in the future); nothing "
            "was re-entered"
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
    listed: dict[str, tuple[PrivacyEvent, str, bool]] = {}
    refusals: dict[str, str] = {}
    task_of_digest: dict[str, str] = {}
    for release in releases:
        event, digest = _event_of(release), spec_digest(release.spec)
        kept = listed.get(release.task_id)
        if kept is not None and kept[1] != digest:
            raise ConfigError(
                f"the export lists two different queries under task {release.task_id!r}: "
                "nothing was re-entered"
            )
        if task_of_digest.setdefault(digest, release.task_id) != release.task_id:
            # A node answers a signed query once, whatever its task id (found by
            # review: one query under 300 ids drained a budget).
            raise ConfigError(
                f"the export lists one query under tasks {task_of_digest[digest]!r} and "
                f"{release.task_id!r}: nothing was re-entered"
            )
        why = _policy_refusal(release, policy)
        if why is not None:
            refusals[release.task_id] = why
        # A refused query is still made final where the ledger holds its release (a
        # key rotated since the backup must not let a withdrawal refund it).
        listed[release.task_id] = (event, digest, why is None)
    recorded = ledger.reenter(list(listed.values()), dry_run=dry_run)
    report.already_recorded = recorded.already_recorded
    report.kept_charged = recorded.kept_charged
    report.entered = [listed[task_id][0] for task_id in recorded.entered]
    report.refused = [(task_id, refusals[task_id]) for task_id in recorded.left_out]
    return report
