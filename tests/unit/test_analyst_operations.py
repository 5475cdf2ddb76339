"""What an analyst can ask the proxy besides running a query: the deployment's public
facts, its own queries, cancelling one, and spending a budget exactly (in process, real
proxy and owner nodes over mutual TLS)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.codec import CryptoPool
from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    NotFoundError,
    OverloadError,
    QueryStateError,
)
from fedpca.messages import CANCELLED_REASON, Charge, QueryState
from fedpca.owner.policy import stated_terms
from fedpca.proxy.limits import PeerLimits
from fedpca.query import Calibration, Neighbouring, QueryKind
from helpers import SECOND_TEST_SIGNING_KEY, TEST_SIGNING_KEY, query_builder
from inprocess import deployment, labelled

M = 3
_spec = query_builder(
    n_features=M,
    n_components=1,
    epsilon=0.5,
    delta=1e-6,
    deadline_seconds=120.0,
    feature_lower=(-1.0,) * M,
    feature_upper=(1.0,) * M,
)


def _tables(*owners: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {owner: labelled(rng.uniform(-0.5, 0.5, size=(20, M))) for owner in owners}


def _wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_describe_list_and_cancel(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    with deployment(
        workdir=tmp_path,
        tables=_tables("owner-1", "owner-2"),
        pool=pool,
        public_key=public_key,
        running=("owner-1",),
        analysts=("alice", "bob"),
        analyst_budget=PrivacyParams(3.0, 1e-5),
    ) as running:
        assert running.proxy is not None
        coordinator = running.proxy.coordinator
        with running.analyst() as alice, running.analyst("bob") as bob:
            info = alice.describe()
            assert (info.owners_registered, info.owners_connected) == (2, 1)
            assert info.owners_absent == ("owner-2",)  # the allowed owner not running
            assert info.neighbouring is Neighbouring.ADD_REMOVE and info.accountant == "zcdp"
            assert info.max_delta_per_query == 1e-5 and info.analyst_id == "alice"
            assert (info.budget_epsilon, info.budget_delta) == (3.0, 1e-5)

            # A query owner-1 alone completes: DONE cannot be cancelled any more.
            alice.submit(_spec(public_key, "done", quorum=1), TEST_SIGNING_KEY)
            assert alice.wait("done", timeout=30).state is QueryState.DONE
            assert alice.status("done").charge is Charge.CHARGED
            with pytest.raises(QueryStateError, match="can no longer be cancelled"):
                alice.cancel("done")

            # quorum 2 with owner-2 absent: owner-1 uploads, the query keeps collecting.
            alice.submit(_spec(public_key, "begun", quorum=2), TEST_SIGNING_KEY)
            _wait_until(lambda: alice.status("begun").owners_contributed == 1)
            # An upload began: the charge stands whatever happens, and the status says so.
            assert alice.status("begun").charge is Charge.CHARGED
            receipt = alice.cancel("begun")
            assert receipt.status.state is QueryState.FAILED
            assert receipt.status.failure_reason == CANCELLED_REASON
            assert not receipt.refunded  # an upload began: the analyst pays
            assert receipt.status.charge is Charge.CHARGED
            with pytest.raises(QueryStateError, match=CANCELLED_REASON):
                alice.wait("begun", timeout=10)

            # No owner answers (owner-1 stopped): cancelling refunds the charge.
            running.stop_owner("owner-1")
            spent = alice.budget()
            alice.submit(_spec(public_key, "idle", quorum=2), TEST_SIGNING_KEY)
            assert alice.budget().n_releases == spent.n_releases + 1
            assert alice.status("idle").charge is Charge.RESERVED
            receipt = alice.cancel("idle")
            assert receipt.refunded and receipt.status.failure_reason == CANCELLED_REASON
            assert receipt.status.charge is Charge.REFUNDED
            assert alice.budget().n_releases == spent.n_releases
            # Cancelling again changes nothing.
            again = alice.cancel("idle")
            assert again.status.state is QueryState.FAILED and again.refunded
            # Owners that had not answered receive a cancellation naming the reason.
            (withdrawn,) = coordinator.withdrawn_tasks("owner-2", ["alice/idle"])
            assert CANCELLED_REASON in withdrawn.reason

            # Listings are the caller's own, newest first; another analyst sees nothing.
            listed = alice.list_queries()
            assert [q.status.query_id for q in listed] == ["idle", "begun", "done"]
            assert [q.status.state for q in listed] == [
                QueryState.FAILED,
                QueryState.FAILED,
                QueryState.DONE,
            ]
            # Two failed queries alike but for their charge: the listing tells them apart.
            assert [q.status.charge for q in listed] == [
                Charge.REFUNDED,
                Charge.CHARGED,
                Charge.CHARGED,
            ]
            assert listed[0].epsilon == 0.5 and listed[0].status.owners_registered == 2
            assert [q.status.query_id for q in alice.list_queries(limit=1)] == ["idle"]
            assert bob.list_queries() == []
            with pytest.raises(NotFoundError):
                bob.cancel("begun")
            # One query by id (what `analyst status` prints beside the status): the
            # caller's own only; another analyst's is as unknown as a made-up id.
            (one,) = alice.list_queries(query_id="begun")
            assert one == listed[1]
            for caller, query in ((bob, "begun"), (alice, "no-such-query")):
                with pytest.raises(NotFoundError):
                    caller.list_queries(query_id=query)


def test_connected_owners_state_their_terms_to_the_analyst(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Each owner node states its terms when it opens its task stream; the proxy passes
    the connected owners' terms to an analyst who asks for them, as the owners stated
    them, and forgets an owner's when its stream closes."""
    public_key, _ = test_only_keypair_512
    with (
        deployment(
            workdir=tmp_path,
            tables=_tables("owner-1", "owner-2", "owner-3"),
            pool=pool,
            public_key=public_key,
            owner_policies={
                "owner-2": {"allowed_kinds": (QueryKind.PCA,), "allowed_columns": (0, 1)},
                "owner-3": {"state_terms": False},  # its operator keeps them to itself
            },
        ) as running,
        running.analyst() as alice,
    ):
        _wait_until(lambda: alice.describe().owners_connected == 3)
        assert alice.describe().owner_terms == ()  # only when asked for
        info = alice.describe(with_owner_terms=True)
        stated = dict(info.owner_terms)
        assert [owner for owner, _ in info.owner_terms] == ["owner-1", "owner-2"]
        for owner in ("owner-1", "owner-2"):
            node = running.nodes[owner]
            assert stated[owner] == stated_terms(node.config, node.table)
        assert stated["owner-2"].allowed_kinds == (QueryKind.PCA,)
        assert stated["owner-2"].allowed_columns == (0, 1)
        assert stated["owner-1"].schema.n_columns == M + 1  # the label, then M features
        # The analyst reads owner-2's refusal of a DCA query before submitting it.
        dca = _spec(public_key, "dca", kind=QueryKind.DCA, label_column=0, class_labels=(1.0, 2.0))
        assert stated["owner-1"].refusal(dca) is None
        reason = stated["owner-2"].refusal(dca)
        assert reason is not None and "dca queries are not in policy.allowed_kinds" in reason

        running.stop_owner("owner-1")
        _wait_until(lambda: alice.describe().owners_connected == 2)
        after = alice.describe(with_owner_terms=True).owner_terms
        assert [owner for owner, _ in after] == ["owner-2"]


def test_a_query_for_exactly_the_remaining_budget_is_accepted(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """The analytic calibration composed by the PLD accountant lands a hair above the
    epsilon asked for (1.00000000001 > 1): the budget's rounding slack accepts it, at
    the proxy and at every owner alike."""
    public_key, _ = test_only_keypair_512
    budget = PrivacyParams(1.0, 1e-6)
    with deployment(
        workdir=tmp_path,
        tables=_tables("owner-1"),
        pool=pool,
        public_key=public_key,
        analyst_budget=budget,
        owner_budget=budget,
        accountant=Accountant.PLD_CONTINUOUS,
    ) as running:
        exact = _spec(
            public_key, "all", quorum=1, epsilon=1.0, delta=1e-6, calibration=Calibration.ANALYTIC
        )
        outcome = running.run(exact)
        assert outcome.state == "done", outcome
        with running.analyst() as client:
            status = client.budget()
            assert status.epsilon_remaining == 0.0 and status.n_releases == 1
            # Over the wire, from the proxy's own admission rule: nothing more fits.
            assert status.next_query == NextQuery(0.0, 1e-6, AdmissionLimit.EXHAUSTED)
            # Over the wire too, the refusal says the budget is exhausted now that it is.
            exhausted = (
                r"'more': refused: the privacy budget is exhausted \(epsilon \S+ spent of 1 "
            )
            with pytest.raises(BudgetExceededError, match=exhausted):
                client.submit(_spec(public_key, "more", quorum=1, epsilon=0.01), TEST_SIGNING_KEY)


def test_only_allowed_analysts_are_served_when_the_proxy_lists_them(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """With ``[analysts] allowed``, an analyst certificate the CA signed for another id
    (by mistake, or by whoever holds the CA key) is refused on every call before any
    work, and gets no budget of its own at the proxy."""
    public_key, _ = test_only_keypair_512
    with deployment(
        workdir=tmp_path,
        tables=_tables("owner-1"),
        pool=pool,
        public_key=public_key,
        running=(),
        analysts=("alice", "mallory"),
        allowed_analysts=("alice",),
    ) as running:
        with running.analyst("mallory") as stranger:
            calls = (
                stranger.describe,
                stranger.budget,
                stranger.list_queries,
                lambda: stranger.submit(_spec(public_key, "q1", quorum=1), SECOND_TEST_SIGNING_KEY),
            )
            for call in calls:
                with pytest.raises(
                    AuthenticationError, match=r"'mallory' is not in .*\[analysts\]"
                ):
                    call()
        with running.analyst("alice") as alice:
            assert alice.describe().owners_registered == 1
            alice.submit(_spec(public_key, "q1", quorum=1), TEST_SIGNING_KEY)
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        assert store.releases("mallory") == [] and len(store.releases("alice")) == 1


def test_a_proxy_limit_reaches_the_analyst_as_a_limit_not_as_an_exhausted_budget(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Both are RESOURCE_EXHAUSTED on the wire: the proxy's trailing metadata tells them
    apart, so an analyst at its bound of open queries is told to wait, not that its
    budget is gone."""
    public_key, _ = test_only_keypair_512
    with (
        deployment(
            workdir=tmp_path,
            tables=_tables("owner-1"),
            pool=pool,
            public_key=public_key,
            running=(),  # nobody answers: the first query stays open
            limits=PeerLimits(max_open_queries_per_analyst=1),
        ) as running,
        running.analyst() as client,
    ):
        client.submit(_spec(public_key, "first", quorum=1), TEST_SIGNING_KEY)
        with pytest.raises(OverloadError, match="1 queries open") as refused:
            client.submit(_spec(public_key, "second", quorum=1), TEST_SIGNING_KEY)
        assert not isinstance(refused.value, BudgetExceededError)
        assert "nothing was charged" in str(refused.value)
        assert client.budget().n_releases == 1
        assert client.cancel("first").refunded  # no owner began an upload
        client.submit(_spec(public_key, "second", quorum=1), TEST_SIGNING_KEY)
        assert client.budget().n_releases == 1
        assert client.status("second").state is QueryState.COLLECTING


def _alice_and_bob(tmp_path: Path, pool: CryptoPool, public_key: Any, limits: PeerLimits) -> Any:
    """A deployment of one owner, not serving, and two analysts, under ``limits``."""
    return deployment(
        workdir=tmp_path,
        tables=_tables("owner-1"),
        pool=pool,
        public_key=public_key,
        running=(),
        analysts=("alice", "bob"),
        limits=limits,
    )


def test_an_analysts_concurrent_submissions_are_bounded(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each submission holds one of the proxy's worker threads while it is checked: one
    analyst may not hold more than ``max_submissions_per_analyst`` of them."""
    public_key, _ = test_only_keypair_512
    limits = PeerLimits(max_submissions_per_analyst=1)
    with _alice_and_bob(tmp_path, pool, public_key, limits) as running:
        coordinator = running.proxy.coordinator
        entered, release = threading.Event(), threading.Event()
        original = coordinator.submit

        def slow_submit(analyst_id: str, signed: Any) -> Any:
            if signed.spec.query_id == "slow":
                entered.set()
                release.wait(30)
            return original(analyst_id, signed)

        monkeypatch.setattr(coordinator, "submit", slow_submit)
        with running.analyst() as client:
            first = threading.Thread(
                target=client.submit, args=(_spec(public_key, "slow", quorum=1), TEST_SIGNING_KEY)
            )
            first.start()
            assert entered.wait(30)
            try:
                with pytest.raises(OverloadError, match="submissions"):
                    client.submit(_spec(public_key, "next", quorum=1), TEST_SIGNING_KEY)
                with running.analyst("bob") as other:  # another analyst is not held up
                    other.submit(_spec(public_key, "bobs", quorum=1), SECOND_TEST_SIGNING_KEY)
            finally:
                release.set()
                first.join(30)
            client.submit(_spec(public_key, "next", quorum=1), TEST_SIGNING_KEY)
            assert {q.status.query_id for q in client.list_queries(10)} == {"slow", "next"}


def test_an_analysts_listings_are_one_at_a_time_and_bounded_per_minute(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review, stop 42: a listing of 1,000 queries reads each one's status (0.1 s of
    the proxy's CPU); one analyst listing from 16 threads kept a core busy and slowed
    another analyst's status calls 70-fold."""
    public_key, _ = test_only_keypair_512
    limits = PeerLimits(max_listings_per_analyst_per_minute=3)
    with _alice_and_bob(tmp_path, pool, public_key, limits) as running:
        coordinator = running.proxy.coordinator
        entered, release = threading.Event(), threading.Event()
        original = coordinator.status

        def slow_status(analyst_id: str, query_id: str) -> Any:
            if query_id == "slow":
                entered.set()
                release.wait(30)
            return original(analyst_id, query_id)

        with running.analyst() as client:
            client.submit(_spec(public_key, "slow", quorum=1), TEST_SIGNING_KEY)
            monkeypatch.setattr(coordinator, "status", slow_status)
            first = threading.Thread(target=client.list_queries)
            first.start()
            assert entered.wait(30)
            try:
                with pytest.raises(OverloadError, match="listings"):
                    client.list_queries()
                with running.analyst("bob") as other:  # another analyst is not held up
                    assert other.list_queries() == []
            finally:
                release.set()
                first.join(30)
            # The refused call did not count: two more listings fit the minute's three.
            assert len(client.list_queries()) == 1 and len(client.list_queries()) == 1
            with pytest.raises(OverloadError, match="alice listed its queries 3 times"):
                client.list_queries()
            # One query's lookup (`analyst status ID`) reads one status: not bounded so
            # (review, stop 42: a dashboard polling status once a second hit the bound).
            for _ in range(5):
                (one,) = client.list_queries(query_id="slow")
                assert one.status.query_id == "slow"
