"""The owner's local policy: which tasks it is willing to answer at all.

Checked before the budget and before any computation, in this order:

1. **Key pinning.** The query must name an analyst key fingerprint the owner
   lists in ``policy.accepted_analyst_keys`` *and* the modulus the query carries
   must hash to that fingerprint. The second check is what stops a curious proxy
   that forwards a genuine fingerprint with its own modulus: the owner would
   otherwise encrypt under a key the proxy can decrypt. Both failures raise
   :class:`~fedpca.errors.UntrustedKeyError` (declined as KEY_NOT_PINNED).
2. **Privacy caps.** ``epsilon`` at most ``policy.max_epsilon_per_query``;
   ``epsilon = inf`` (no noise) only with ``policy.allow_not_private``.
3. **Data fit** (when the local table is given): the query's feature count and,
   for DCA, its label column and public class labels must fit the data.

Failures of 2 and 3 raise :class:`~fedpca.errors.PolicyError` (POLICY_REFUSAL).
"""

from __future__ import annotations

import logging
import math

from fedpca.codec.keys import key_fingerprint
from fedpca.errors import PolicyError, UntrustedKeyError
from fedpca.owner.compute import LocalTable, analyst_public_key
from fedpca.owner.config import PolicyConfig
from fedpca.query import QuerySpec

__all__ = ["check_key", "check_privacy", "check_task"]

logger = logging.getLogger(__name__)


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


def check_privacy(spec: QuerySpec, policy: PolicyConfig) -> None:
    """Refuse epsilon above the per-query cap, and epsilon = inf unless allowed.

    Raises
    ------
    PolicyError
    """
    if math.isinf(spec.epsilon):
        if not policy.allow_not_private:
            raise PolicyError(
                f"query {spec.query_id!r} asks for epsilon = inf (no noise, NOT PRIVATE); "
                "policy.allow_not_private is false"
            )
    elif spec.epsilon > policy.max_epsilon_per_query:
        raise PolicyError(
            f"query {spec.query_id!r} asks for epsilon = {spec.epsilon:g}, above "
            f"policy.max_epsilon_per_query = {policy.max_epsilon_per_query:g}"
        )


def check_task(spec: QuerySpec, policy: PolicyConfig, table: LocalTable | None = None) -> None:
    """Refuse a query this owner's policy does not allow.

    Parameters
    ----------
    spec : the public query of the task.
    policy : the owner's ``[policy]``.
    table : the owner's data; when given, the query must fit it.

    Raises
    ------
    UntrustedKeyError
        The analyst key is not pinned, or the modulus does not match the fingerprint.
    PolicyError
        Epsilon above the per-query cap, a NOT PRIVATE query without
        ``allow_not_private``, or a query that does not fit the data.
    """
    check_key(spec, policy)
    check_privacy(spec, policy)
    if table is not None:
        table.table_for(spec)
