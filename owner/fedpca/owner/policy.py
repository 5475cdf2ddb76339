"""The owner's decision to take part in a query, from public facts only.

Everything here looks at the signed query, the owner's configuration, the schema of
its table (column count and configured label column, facts the owner could publish)
and the time; never at its records. A refusal therefore reveals nothing about the
data and goes back to the analyst with its reason (docs/privacy.md, "Decisions from
public facts"). Once :func:`check_task` has passed and the budget is reserved, the
owner uploads a share of the agreed shape whatever its rows hold.

Checks, in order, with the decline reason each failure is reported under:

1. **Signature** (UNSIGNED_QUERY): the task carries a signature by one of
   ``policy.accepted_query_signers`` over exactly this query, so a malicious proxy
   cannot invent tasks.
2. **Key pinning** (KEY_NOT_PINNED): the analyst's Paillier key is pinned in
   ``policy.accepted_analyst_keys`` *and* the modulus the query carries hashes to it
   (a curious proxy forwarding a pinned fingerprint with its own modulus would
   otherwise receive shares it can decrypt).
3. **Policy** (POLICY_REFUSAL): the deployment's neighbouring relation, allowed query
   kinds (every aggregate's kind for an aggregate query), the columns the query reads
   (``policy.allowed_columns``), masked mode only if allowed, ``epsilon = inf`` only
   if allowed, delta at most the per-query cap, the query's quorum at least
   ``policy.min_quorum``, at most ``policy.max_tasks_per_day`` tasks in the last 24
   hours (releases, and the asking analyst's refunded tasks), the table's schema, a
   release plan this owner can derive, and epsilon at most
   ``policy.max_epsilon_per_query`` *measured at the owner's budget delta* from the
   release's own noise (a large stated delta cannot make a weak release look cheap).
   Every one of these but the daily task count is a rule of the owner's terms
   (:class:`fedpca.owner_terms.OwnerTerms`, :func:`stated_terms`), which the node also
   states on its task stream so that an analyst can check a query against them first.

The budget itself (BUDGET_EXHAUSTED) is checked by the ledger when the release is
reserved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from fedpca.codec.keys import key_fingerprint
from fedpca.errors import (
    CalibrationError,
    ConfigError,
    EncodingOverflowError,
    LayoutError,
    PolicyError,
    UntrustedKeyError,
)
from fedpca.messages import DeclineReason, Task
from fedpca.owner.compute import analyst_public_key
from fedpca.owner.config import OwnerConfig
from fedpca.owner.local_table import LocalTable, QueryColumns
from fedpca.owner.policy_config import PolicyConfig
from fedpca.owner_terms import MAX_STATED_COUNT, OwnerTerms
from fedpca.protocol import ReleasePlan
from fedpca.query import QuerySpec, spec_digest
from fedpca.signing import signed_deadline, verify_query

__all__ = [
    "Refusal",
    "TaskAccepted",
    "check_key",
    "check_key_signer",
    "check_signature",
    "check_task",
    "columns_outside",
    "stated_terms",
]

logger = logging.getLogger(__name__)

SECONDS_PER_DAY = 24 * 3600.0


@dataclass(frozen=True)
class Refusal:
    """Why an owner declines a task: a public reason code and one line of explanation."""

    reason: DeclineReason
    detail: str


@dataclass(frozen=True)
class TaskAccepted:
    """What :func:`check_task` derived for a task it accepts."""

    plan: ReleasePlan
    table: QueryColumns


def check_signature(task: Task, policy: PolicyConfig) -> None:
    """Refuse a task whose query is not signed by a pinned analyst.

    Raises
    ------
    UntrustedKeyError
    """
    spec = task.query
    if task.query_signer not in policy.accepted_query_signers:
        raise UntrustedKeyError(
            f"query {spec.query_id!r} is "
            + (f"signed by {task.query_signer[:80]}" if task.query_signer else "not signed")
            + ", not by a signer in policy.accepted_query_signers"
        )
    try:
        verify_query(spec, task.query_signature, task.query_signer)
    except ConfigError as exc:
        raise UntrustedKeyError(str(exc)) from None


def within_signed_deadline(task: Task, now: datetime) -> Task:
    """``task`` with an upload deadline no later than the one its analyst signed:
    ``issued_at + deadline_seconds``, plus :data:`fedpca.signing.CLOCK_ALLOWANCE_SECONDS`
    (:func:`fedpca.signing.signed_deadline`).

    A proxy chooses the task's stated deadline; the signed one bounds it, so that a
    proxy cannot keep signed queries (even cancelled or refunded ones) and deliver them
    to owners later, or keep an upload open beyond what the analyst asked for (found by
    review). Call only after :func:`check_signature`.

    A task past its signed deadline comes back with that deadline, in the past: the
    node then ends it as it ends any task that came too late (no ledger row for one it
    never saw; EXPIRED, refunded if nothing left, for one it holds, e.g. an upload a
    restart left in flight), instead of declining it while its upload is in flight.

    Raises
    ------
    PolicyError
        The query carries no signing time, or was signed in the future of its clock.
    """
    deadline = datetime.fromtimestamp(signed_deadline(task.query, now.timestamp()), UTC)
    if task.upload_deadline <= deadline:
        return task
    return replace(task, upload_deadline=deadline)


def check_key(spec: QuerySpec, policy: PolicyConfig) -> None:
    """Refuse a query whose analyst key is not pinned or does not match its fingerprint.

    Raises
    ------
    UntrustedKeyError
    """
    if spec.analyst_key_fingerprint not in policy.accepted_analyst_keys:
        raise UntrustedKeyError(
            f"query {spec.query_id!r}: analyst key {spec.analyst_key_fingerprint!r} is not in "
            "policy.accepted_analyst_keys"
        )
    actual = key_fingerprint(analyst_public_key(spec))
    if actual != spec.analyst_key_fingerprint:
        raise UntrustedKeyError(
            f"query {spec.query_id!r}: the key modulus in the query has fingerprint {actual!r}, "
            f"not the pinned {spec.analyst_key_fingerprint!r}; refusing to encrypt under a "
            "substituted key"
        )


def check_key_signer(task: Task, policy: PolicyConfig) -> None:
    """Refuse a query whose analyst key ``policy.analyst_key_signers`` pins to other
    signers than the one that signed it (nothing to check without that table).

    Budget shares are kept by key: without this check one analyst could sign a query
    naming another's key, charge that analyst's share and read its use in the decline.

    Raises
    ------
    UntrustedKeyError
    """
    pairs = policy.analyst_key_signers
    key = task.query.analyst_key_fingerprint
    if pairs and task.query_signer not in pairs.get(key, ()):
        raise UntrustedKeyError(
            f"query {task.query.query_id!r} names analyst key {key!r}, which "
            "policy.analyst_key_signers pins to other signers than the one that signed it"
        )


def check_resumed_task(task: Task, policy: PolicyConfig, reserved_digest: str | None) -> None:
    """Refuse to resume an upload for a task that is not the one it began for.

    A task that arrives again for an upload in flight is checked like a new one (the
    analyst's signature, the pinned key and its modulus) and must carry the very query
    the budget was reserved for (its ``spec_digest``): otherwise a proxy could send the
    task id again with its own key and read the kept share it then encrypts.

    Raises
    ------
    UntrustedKeyError
    """
    check_signature(task, policy)
    check_key(task.query, policy)
    check_key_signer(task, policy)
    if reserved_digest is None or spec_digest(task.query) != reserved_digest:
        raise UntrustedKeyError(
            f"query {task.query.query_id!r}: the task sent again is not the query this "
            "owner's upload began for (its digest differs from the reserved one)"
        )


def stated_terms(config: OwnerConfig, table: LocalTable) -> OwnerTerms:
    """This owner's terms: the public facts its decisions are made from, as it states
    them on its task stream."""
    policy, data = config.policy, config.data
    return OwnerTerms(
        schema=table.schema,
        neighbouring=config.privacy.neighbouring,
        allowed_kinds=policy.allowed_kinds,
        allowed_columns=policy.allowed_columns,
        allow_masked_mode=policy.allow_masked_mode,
        allow_not_private=policy.allow_not_private,
        max_delta_per_query=policy.delta_cap(config.budget),
        max_epsilon_per_query=policy.max_epsilon_per_query,
        budget_delta=config.budget.delta,
        accountant=config.privacy.accountant,
        min_quorum=min(policy.min_quorum, MAX_STATED_COUNT),
        max_tasks_per_day=min(policy.max_tasks_per_day, MAX_STATED_COUNT),
        max_records=data.max_records if data.enforce_max_records else None,
    )


def _check_tasks_per_day(config: OwnerConfig, tasks_last_day: Callable[[], int]) -> None:
    policy = config.policy
    if tasks_last_day() >= policy.max_tasks_per_day:
        # Without shares the count covers every analyst's tasks: only the limit is
        # stated. With shares it counts this analyst's own (task_processing).
        whose = "for this analyst " if config.analyst_shares else ""
        raise PolicyError(
            f"this owner has reached its limit of tasks begun {whose}in 24 hours "
            f"(policy.max_tasks_per_day = {policy.max_tasks_per_day}, this analyst's "
            "refunded tasks included)"
        )


def check_resumable(spec: QuerySpec, config: OwnerConfig, capacity: int) -> None:
    """Whether an upload begun under ``capacity`` may resume under ``config``.

    A query for bounded owner tables must not make the owner sample: it resumes only
    while the node still enforces a capacity no larger than the one the upload began
    under (the node then holds at most that many records). From public facts only:
    otherwise every resume fails the same way, whatever the records hold.

    Raises
    ------
    PolicyError
        The configuration changed so that the upload could need a sample.
    """
    data = config.data
    if spec.bounded_owner_tables and not (
        data.enforce_max_records and data.max_records <= capacity
    ):
        raise PolicyError(
            f"the upload of this query for bounded owner tables began under max_records = "
            f"{capacity} (enforced); with max_records = {data.max_records} "
            f"{'enforced' if data.enforce_max_records else 'not enforced'} it could have to "
            "sample, so it is not resumed (restore the configuration to finish it)"
        )


def columns_outside(columns: Iterable[int], width: int) -> list[int]:
    """The ``columns`` a table of ``width`` columns (the label's counted) does not have."""
    return [c for c in columns if not 0 <= c < width]


def check_allowed_columns(policy: PolicyConfig, table: LocalTable) -> None:
    """Refuse ``policy.allowed_columns`` that name a column the table does not have (a
    typo made every query that reads columns decline, while the configuration and
    ``owner probe`` said ok: review). The label column is allowed to be listed.

    Raises
    ------
    ConfigError
    """
    outside = columns_outside(policy.allowed_columns or (), table.n_columns)
    if outside:
        raise ConfigError(
            f"policy.allowed_columns names column {outside[0]} (0-based), but "
            f"{table.source} has {table.n_columns} columns (0 to {table.n_columns - 1})"
        )


def check_task(
    task: Task,
    config: OwnerConfig,
    table: LocalTable,
    *,
    tasks_last_day: Callable[[], int] = lambda: 0,
) -> TaskAccepted | Refusal:
    """Decide from public facts whether this owner takes part in ``task``.

    Parameters
    ----------
    task : the task as the proxy delivered it (query, signature, signer).
    config : the owner's configuration.
    table : the owner's table (only its schema is looked at).
    tasks_last_day : reads the tasks this owner's ledger counts against the asking
        analyst's cap in the last 24 hours (BudgetLedger.tasks_started_since); called
        only once the signature, the key and its signer have passed, so that a task
        naming another analyst's key reads nothing of its tasks.

    Returns
    -------
    TaskAccepted with the release plan and the query's columns, or the Refusal to send.
    """
    spec = task.query
    try:
        check_signature(task, config.policy)
    except UntrustedKeyError as exc:
        return Refusal(DeclineReason.UNSIGNED_QUERY, str(exc))
    try:
        check_key(spec, config.policy)
        check_key_signer(task, config.policy)
    except UntrustedKeyError as exc:
        return Refusal(DeclineReason.KEY_NOT_PINNED, str(exc))
    try:
        terms = stated_terms(config, table)
        terms.check_statement(spec)
        _check_tasks_per_day(config, tasks_last_day)
        terms.check_columns(spec)
        columns = table.table_for(spec)
        plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
        terms.check_epsilon(plan)
    except (PolicyError, ConfigError, CalibrationError, LayoutError, EncodingOverflowError) as exc:
        return Refusal(DeclineReason.POLICY_REFUSAL, str(exc))
    return TaskAccepted(plan, columns)
