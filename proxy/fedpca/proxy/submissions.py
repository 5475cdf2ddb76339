"""The proxy's acceptance of a signed query: what it checks, in which order, and how the
analyst's budget is charged exactly once, even under concurrent submissions.

Checks that need no ledger come first (public facts of the deployment, the signature,
the release plan, the analyst's bounds on open and daily queries), so that a refused
submission costs the proxy no accounting work; the budget is composed outside the
store's transaction and the query inserted only if the ledger did not change meanwhile.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    ConfigError,
    FedpcaError,
    OverloadError,
    PolicyError,
    QueryStateError,
)
from fedpca.formatting import distinct
from fedpca.messages import QueryState, SignedQuery
from fedpca.proxy.analyst_requests import next_query_for
from fedpca.proxy.coordinator_core import CoordinatorCore, task_id
from fedpca.proxy.queries import validate_query
from fedpca.proxy.store_records import QueryRecord, stored_size
from fedpca.query import Calibration, ProtocolMode, QuerySpec
from fedpca.query_records import spec_to_dict
from fedpca.signing import CLOCK_ALLOWANCE_SECONDS, signed_deadline, verify_query

if TYPE_CHECKING:
    from fedpca.dp.accounting import BudgetDecision

__all__ = ["Submissions", "budget_refusal"]

logger = logging.getLogger("fedpca.proxy.coordinator")

_BUDGET_CHECK_ATTEMPTS = 5
"""Times a submission recomposes its analyst's ledger if another one changed it meanwhile."""


class _LedgerChanged(Exception):
    """Another submission changed the analyst's ledger during a budget check."""


def _check_signing_time(spec: QuerySpec) -> None:
    """Refuse a new query no owner would answer: without a signing time, signed in the
    future, or past its signed deadline (:func:`fedpca.signing.signed_deadline`), by
    this machine's clock as owners check it by theirs. Owners enforce it whatever the
    proxy does; here an analyst whose clock is wrong learns it at once, not from owners
    ending its task as too late."""
    now = time.time()
    try:
        last = signed_deadline(spec, now)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    if last <= now:
        signed = datetime.fromtimestamp(spec.issued_at or 0.0, UTC).isoformat(timespec="seconds")
        raise ConfigError(
            f"query {spec.query_id!r} was signed at {signed}, and its deadline "
            f"({spec.deadline_seconds:g} s, plus {CLOCK_ALLOWANCE_SECONDS:g} s for clocks) "
            f"passed before it reached this proxy "
            f"({datetime.fromtimestamp(now, UTC).isoformat(timespec='seconds')}): owners "
            "would not answer it; check the analyst's clock, then sign and submit it again"
        )


class Submissions(CoordinatorCore):
    """How the coordinator takes a signed query in (see :meth:`submit`)."""

    def submit(self, analyst_id: str, signed: SignedQuery) -> QueryRecord:
        """Validate a signed query, charge the analyst's budget and publish it to owners.

        Resubmitting the same query id with the same spec returns the existing
        record without charging again. The query is stored under
        :func:`task_id` ``(analyst_id, query_id)``.

        Raises
        ------
        ConfigError
            Short or malformed analyst key, fingerprint mismatch, invalid deadline,
            a relation other than the deployment's, a delta above the per-query cap,
            a quorum larger than the allow-list, a missing or invalid signature, or a
            query the release plan cannot serve (also LayoutError /
            EncodingOverflowError / CalibrationError from the plan).
        BudgetExceededError
            The release would exceed the analyst's total budget.
        ProtocolError
            The query id exists with a different spec.
        """
        spec = signed.spec
        self._check_public_facts(signed, analyst_id)
        # A malformed query is told so precisely, whatever the analyst's bounds.
        context = validate_query(
            spec,
            allow_insecure_test_keys=self.allow_insecure_test_keys,
            max_upload_mib=self.config.proxy.max_upload_mib,
        )
        key = task_id(analyst_id, spec.query_id)
        # Refused before it is serialised and its ledger composed (seconds under the PLD
        # accountant) when the analyst is at a bound; a resubmission of a query it has
        # creates nothing.
        new = not self.store.has_query(key)
        if new:
            if self.store.has_release(key):
                raise QueryStateError(_re_entered(spec.query_id))
            _check_signing_time(spec)
            self._check_query_bounds(None, analyst_id, 0)
        spec_record, plan_record = spec_to_dict(spec), context.plan.describe()
        size = stored_size(
            json.dumps(spec_record, sort_keys=True),
            json.dumps(plan_record, sort_keys=True),
            signed.signature,
        )
        if new:  # and with its own size
            self._check_query_bounds(None, analyst_id, size)
        plan = context.plan
        budget = self.config.budget.for_analyst(analyst_id)
        event = plan.privacy_event(analyst_id)
        event = PrivacyEvent.from_dict({**event.to_dict(), "query_id": key})
        event_record = event.to_strict_dict()
        deadline_at = self.clock() + spec.deadline_seconds
        self.store.set_analyst_budget(analyst_id, budget.epsilon, budget.delta)
        record: QueryRecord | None = None
        for _ in range(_BUDGET_CHECK_ATTEMPTS):
            # Composing a ledger takes a while: do it outside the store's transaction
            # (which every other call waits for), then insert only if the ledger did
            # not change meanwhile, else compose again.
            rows = self.store.releases(analyst_id)
            decision = self._check_budget(rows, event, budget)
            # Worded outside the transaction too (a refusal may name what still fits).
            refusal = None if decision.fits else self._budget_refusal(rows, spec, event, decision)

            def charge(
                conn: Any, rows: list[dict[str, Any]] = rows, refusal: str | None = refusal
            ) -> None:
                self._check_signer(conn, analyst_id, signed.signer)
                self._check_query_bounds(conn, analyst_id, size)
                if self.store.release_ids(conn, analyst_id) != [r["query_id"] for r in rows]:
                    raise _LedgerChanged
                if refusal is not None:
                    raise BudgetExceededError(refusal)
                if self.store.release_recorded(conn, key):
                    raise QueryStateError(_re_entered(spec.query_id))
                self.store.record_release(conn, analyst_id, key, event_record)

            try:
                record = self.store.create_query(
                    key,
                    analyst_id,
                    spec_record,
                    plan_record,
                    deadline_at,
                    signature=signed.signature,
                    signer=signed.signer,
                    before_insert=charge,
                    owners_registered=len(self.registered_owners),
                )
                break
            except _LedgerChanged:
                continue
        if record is None:
            raise QueryStateError(
                "the analyst's ledger kept changing during the budget check; submit again"
            )
        self._contexts.put(key, context)
        if record.state is QueryState.COLLECTING:
            self._prepare_noise(key, context)
        if not spec.private:
            logger.warning("query %s: epsilon = inf, the result will be NOT PRIVATE", key)
        logger.info(
            "query %s: %s %s, M=%d, quorum %d of %d owners, deadline in %.0f s",
            key,
            spec.kind.value,
            spec.mode.value,
            spec.n_features,
            spec.quorum,
            len(self.registered_owners),
            spec.deadline_seconds,
        )
        self._notify()
        return record

    def _check_signer(self, conn: Any, analyst_id: str, signer: str) -> None:
        """Refuse a query signed by another analyst's key. A signing key belongs to the
        analyst that first submitted with it: owners see every signed query, so without
        this another analyst could submit a copy first and have owners decline the
        original as a replay (review)."""
        owner = self.store.bind_signer(conn, signer, analyst_id)
        if owner != analyst_id:
            raise AuthenticationError(
                f"the query is signed by {signer[:80]}, the signing key of another analyst; "
                "submit queries signed with your own key (fedpca analyst keygen)"
            )

    def _check_query_bounds(self, conn: Any, analyst_id: str, size: int) -> None:
        """Refuse a new query beyond the analyst's open or daily bound: before any work,
        and again inside the submission's transaction (``conn``), so two submissions
        cannot both take the last place.

        Every query costs the proxy its noise draw and a row even when it is cancelled
        and refunded, so these bound what a small budget can make the proxy do."""
        limits = self.config.limits
        open_queries, recent, stored_bytes = self.store.analyst_query_counts(
            analyst_id, self.clock() - 86_400.0, conn
        )
        if open_queries >= limits.max_open_queries_per_analyst:
            raise OverloadError(
                f"analyst {analyst_id!r} already has {open_queries} queries open, the most "
                f"this proxy allows (limits.max_open_queries_per_analyst): wait for one to "
                "finish or cancel one"
            )
        if recent >= limits.max_queries_per_analyst_per_day:
            raise OverloadError(
                f"analyst {analyst_id!r} submitted {recent} queries in the last 24 hours, the "
                "most this proxy allows (limits.max_queries_per_analyst_per_day)"
            )
        if stored_bytes + size > limits.max_query_mib_per_analyst_per_day * 2**20:
            raise OverloadError(
                f"analyst {analyst_id!r}'s queries of the last 24 hours take "
                f"{stored_bytes / 2**20:.1f} MiB at the proxy; with this one "
                f"({size / 2**20:.1f} MiB) they would take more than it keeps for an analyst "
                "(limits.max_query_mib_per_analyst_per_day): wait, or ask smaller queries"
            )

    def _check_public_facts(self, signed: SignedQuery, analyst_id: str) -> None:
        """Refuse, before anything is charged, what the deployment can never serve."""
        spec = signed.spec
        privacy = self.config.privacy
        if spec.neighbouring is not privacy.neighbouring:
            # Masked mode is stated for replace-one whatever the analyst asks: say so,
            # rather than leave the analyst to guess why (found by an analyst's walkthrough).
            masked = (
                " (a masked-mode query always is: it has a finite epsilon under replace-one "
                "only, docs/privacy.md; ask in stats mode here)"
                if spec.mode is ProtocolMode.MASKED
                else ""
            )
            raise ConfigError(
                f"the query is stated for {spec.neighbouring.value} adjacency{masked}; this "
                f"deployment accounts under {privacy.neighbouring.value}"
            )
        cap = privacy.delta_cap(self.config.budget.for_analyst(analyst_id))
        if spec.private and spec.delta > cap:
            delta, cap_text = distinct(spec.delta, cap)
            raise ConfigError(
                f"delta = {delta} is above this proxy's per-query cap {cap_text} "
                "(privacy.max_delta_per_query)"
            )
        registered = len(self.registered_owners)
        if spec.quorum > registered:
            raise ConfigError(
                f"quorum {spec.quorum} is more than the {registered} owners this proxy accepts"
            )
        if not signed.signer:
            raise ConfigError(
                "the query is not signed; owners answer only queries signed by an analyst "
                "key they pin (fedpca analyst keygen creates one)"
            )
        try:
            verify_query(spec, signed.signature, signed.signer)
        except FedpcaError as exc:
            raise ConfigError(f"invalid query signature: {exc}") from None

    def _check_budget(self, rows: list[dict[str, Any]], event: PrivacyEvent, budget: Any) -> Any:
        from fedpca.dp.accounting import check_budget  # slow import (dp_accounting)

        return check_budget(
            [PrivacyEvent.from_dict(r) for r in rows],
            event,
            budget,
            self.config.privacy.accountant,
            neighbouring=self.config.privacy.neighbouring,
        )

    def _budget_refusal(
        self,
        rows: list[dict[str, Any]],
        spec: QuerySpec,
        event: PrivacyEvent,
        decision: BudgetDecision,
    ) -> str:
        """Why the budget refuses ``event``, with what still fits when that is cheap.

        Under the zcdp accountant the largest epsilon still admitted takes a few
        closed-form compositions (:func:`next_query_for`, kept per ledger); under
        pld-continuous it takes up to seconds, so the refusal only points to
        ``fedpca analyst budget``, which finds it. The search assumes the default
        calibration and no additive delta term in the next query: masked mode's mask
        (M 2^-40) would make it overstate what fits, so it is left out there; a stats
        query's headroom refusal term (n 2^-100) is below the rounding of any delta the
        accountant computes with, and the suggestion is checked by the admission rule
        like any query.
        """
        from fedpca.dp.accounting import Accountant  # slow import (dp_accounting)

        privacy = self.config.privacy
        next_query = None
        if (
            privacy.accountant is Accountant.ZCDP
            and spec.private
            and spec.calibration is Calibration.ZCDP
            and spec.mode is ProtocolMode.STATS
            and decision.epsilon_spent_before < decision.budget.epsilon
        ):
            next_query = next_query_for(
                [PrivacyEvent.from_dict(r) for r in rows],
                decision.budget,
                spec.delta,
                privacy.accountant,
                privacy.neighbouring,
            )
        return budget_refusal(spec, decision, next_query)


def _re_entered(query_id: str) -> str:
    """Why a query id charged but not held is refused: only `proxy import-releases`
    charges a query the database does not hold, one answered after the backup this
    database was restored from."""
    return (
        f"query {query_id!r} was answered before this proxy's database was restored from "
        "a backup (its charge was re-entered); its result is not here: submit it again "
        "under a new query id"
    )


def budget_refusal(spec: QuerySpec, decision: BudgetDecision, next_query: NextQuery | None) -> str:
    """The message of a submission the analyst's budget refuses.

    "Exhausted" only when the ledger alone fills the budget (then nothing is admitted);
    otherwise the query asked for more than is left, and the message says what was
    spent, what the query would bring it to, and either ``next_query`` (the largest
    epsilon a query at this query's delta is admitted with now) or where to find it.
    Every number is printed so that different values never print alike.
    """
    budget = decision.budget
    at = f"{budget.delta:g}"
    query_delta = repr(float(spec.delta))
    command = f"fedpca analyst budget --query-delta {query_delta}"
    before, total = distinct(decision.epsilon_spent_before, budget.epsilon)
    if not decision.epsilon_spent_before < budget.epsilon:
        return (
            f"the privacy budget is exhausted (epsilon {before} spent of {total} at delta "
            f"{at}); no query is admitted any more"
        )
    if not spec.private:
        return (
            f"epsilon = inf (NOT PRIVATE) does not fit a finite privacy budget (epsilon "
            f"{total} at delta {at})"
        )
    before, after, total = distinct(
        decision.epsilon_spent_before, decision.epsilon_spent_after, budget.epsilon
    )
    text = (
        "not enough privacy budget left for this query "
        f"(it would bring the epsilon spent from {before} to {after} at delta {at}, over the "
        f"budget {total}; {decision.accountant.value} accountant)"
    )
    if (
        next_query is not None
        and next_query.limit is AdmissionLimit.BUDGET
        and next_query.epsilon < spec.epsilon
    ):
        asked, most = distinct(spec.epsilon, next_query.epsilon)
        return (
            f"{text}; it asks for epsilon {asked} at delta {query_delta}, and a query at "
            f"that delta may ask for epsilon up to {most} now ({command})"
        )
    return f"{text}; `{command}` shows the largest epsilon that still fits"
