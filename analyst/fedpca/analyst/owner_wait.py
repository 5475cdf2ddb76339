"""Before a query is submitted: the owners its quorum needs, connected and accepting it.

Found by a new user's walkthrough: with an owner offline, a query of the default quorum
(every owner) was submitted with a warning, the connected owners began their uploads at
once, and its deadline failed it charged in full (the proxy's refund rule,
docs/privacy.md, "Refunds"), with nothing released. So a query command asks the proxy
each second, for up to :data:`OWNERS_CONNECT_SECONDS`, until enough owners are
connected, saying which are not (the proxy names them) and whenever that changes; then
it submits, or refuses with nothing submitted.

Then :func:`check_owner_terms` judges the query by the terms each connected owner
stated (fedpca.owner_terms): an owner that would decline it is named with its reason,
and a query too few owners would accept is refused before it is submitted (it would
fail for want of its quorum, charged in full once any owner began an upload).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fedpca.analyst.interrupts import interrupted_by
from fedpca.errors import OwnersNotConnectedError, OwnersWouldDeclineError
from fedpca.formatting import printable
from fedpca.messages import DeploymentInfo
from fedpca.owner_terms import OwnerTerms
from fedpca.query import QuerySpec

__all__ = [
    "DECLINING_OWNERS_SHOWN",
    "OWNERS_CONNECT_SECONDS",
    "check_owner_terms",
    "wait_for_quorum",
]

DECLINING_OWNERS_SHOWN = 10
"""Owners :func:`check_owner_terms` names with their reasons; it counts the others."""

logger = logging.getLogger("fedpca.analyst.estimators")

OWNERS_CONNECT_SECONDS = 40.0
"""How long ``fit`` waits for the owners a query needs to be connected to the proxy
before it refuses to submit (unless ``wait_for_owners``). Longer than an owner waits
between two reconnections (``fedpca.owner.retry.Retry.reconnect_max``, 30 s): at 15 s, a
query sent in the half-minute after a proxy restart was refused while owners were still
coming back (a new analyst's walkthrough, stop 43). It returns as soon as they are."""

_pause = time.sleep
"""How that wait sleeps between two questions (tests replace it, not time.sleep)."""


def _absent(deployment: DeploymentInfo) -> str:
    note = deployment.absent_owners_note()
    return f" ({note})" if note else ""


def wait_for_quorum(
    client: Any, deployment: DeploymentInfo, spec: QuerySpec, wait_for_owners: bool
) -> DeploymentInfo:
    """The deployment once at least ``spec.quorum`` owners are connected, asked again
    each second for up to :data:`OWNERS_CONNECT_SECONDS` (they may be starting).

    Raises
    ------
    OwnersNotConnectedError
        Still too few after the wait, unless ``wait_for_owners`` (then a warning and
        the query waits for them until its deadline). Nothing was submitted.
    """
    short = deployment.owners_connected < spec.quorum
    if wait_for_owners or not short:
        if short:
            logger.warning(
                "only %d of the %d owners this query needs (quorum %d of %d registered) are "
                "connected to the proxy now%s; it waits for the others until its deadline "
                "(%g s). If it fails there after any owner began an upload (the connected "
                "ones may begin at once), its epsilon stays charged in full although "
                "nothing is released; it is refunded only if no owner began one",
                deployment.owners_connected,
                spec.quorum,
                spec.quorum,
                deployment.owners_registered,
                _absent(deployment),
                spec.deadline_seconds,
            )
        return deployment
    # Said at once, and again whenever an owner comes or goes: the wait is otherwise a
    # silent pause (a review; a walkthrough of stop 45 waited 40 s in silence).
    logger.warning(
        "only %d of the %d owners this query needs are connected to the proxy%s; "
        "waiting up to %g s for them before submitting",
        deployment.owners_connected,
        spec.quorum,
        _absent(deployment),
        OWNERS_CONNECT_SECONDS,
    )
    waited_until = time.monotonic() + OWNERS_CONNECT_SECONDS
    try:
        while deployment.owners_connected < spec.quorum:
            _wait_once(deployment, spec, waited_until)
            said = _absent(deployment)
            deployment = client.describe()
            if deployment.owners_connected < spec.quorum and _absent(deployment) != said:
                logger.warning(
                    "%d of the %d owners connected%s; still waiting",
                    deployment.owners_connected,
                    spec.quorum,
                    _absent(deployment),
                )
    except KeyboardInterrupt as exc:
        # Said: after a Ctrl-C here an analyst could not tell whether a query was sent.
        logger.warning("%s while waiting for owners: nothing was submitted", interrupted_by(exc))
        raise
    return deployment


def _wait_once(deployment: DeploymentInfo, spec: QuerySpec, waited_until: float) -> None:
    """Pause a second before asking again, or refuse once the wait is over."""
    if time.monotonic() >= waited_until:
        raise OwnersNotConnectedError(
            f"only {deployment.owners_connected} of the {spec.quorum} owners this "
            f"query needs (quorum {spec.quorum} of {deployment.owners_registered} "
            f"registered) are connected to the proxy{_absent(deployment)}: nothing was "
            "submitted. A query that fails for want of its quorum after a connected owner "
            "began its upload stays charged in full. Ask a smaller quorum (--quorum N), or "
            "pass --wait-for-owners (wait_for_owners=True) to submit anyway and let it wait "
            "for them until its deadline"
        )
    _pause(1.0)


def check_owner_terms(
    deployment: DeploymentInfo, spec: QuerySpec, wait_for_owners: bool
) -> dict[str, str]:
    """Judge ``spec`` by the terms the connected owners stated (``deployment`` asked
    with them): a warning names each owner that would decline it, and why.

    An owner that stated no terms (older than them), and with ``wait_for_owners`` an
    owner not connected yet, is counted as accepting. The proxy passes the terms on, so
    they are advice: each owner still judges the signed query itself.

    Returns
    -------
    The reason each declining owner would give, by node id.

    Raises
    ------
    OwnersWouldDeclineError
        The owners that could accept are fewer than the quorum: nothing was submitted.
    """
    judged: dict[OwnerTerms, str | None] = {}  # owners mostly state alike terms
    declining: dict[str, str] = {}
    for owner_id, terms in deployment.owner_terms:
        if terms not in judged:
            judged[terms] = terms.refusal(spec)
        reason = judged[terms]
        if reason is not None:
            declining[owner_id] = reason
    if not declining:
        return declining
    for owner_id in sorted(declining)[:DECLINING_OWNERS_SHOWN]:
        logger.warning(
            "owner %s states terms this query does not meet: %s",
            printable(owner_id),
            declining[owner_id],
        )
    if len(declining) > DECLINING_OWNERS_SHOWN:
        logger.warning("and %d more owners", len(declining) - DECLINING_OWNERS_SHOWN)
    reachable = deployment.owners_registered if wait_for_owners else deployment.owners_connected
    accepting = reachable - len(declining)
    if accepting < spec.quorum:
        absent = deployment.owners_registered - deployment.owners_connected
        waiting = (
            f", or pass --wait-for-owners (wait_for_owners=True) to let it wait for the {absent} "
            "owners not connected, which may accept it"
            if absent > 0 and not wait_for_owners
            else ""
        )
        raise OwnersWouldDeclineError(
            f"by the terms the owners stated, {len(declining)} of the "
            f"{deployment.owners_connected} connected owners would decline this query "
            f"(reasons above), which leaves {max(accepting, 0)} for its quorum of "
            f"{spec.quorum}: nothing was submitted. Change the query to meet their terms, "
            f"or ask a smaller quorum (--quorum N){waiting}; `fedpca analyst deployment` "
            "shows every owner's terms"
        )
    return declining
