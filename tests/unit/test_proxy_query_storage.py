"""What one analyst's queries may cost the proxy in storage and reading them.

Found by review: cancelled, refunded histogram queries of 125,000 public bin edges
(2.2 MiB each as stored) filled 1.1 GiB of the database a day and were never deleted,
and listing 30 of them took 14.5 s a call while other analysts' calls waited: every
listed query was read back and planned. Now a query's status and listing come from a
small summary stored beside it, an analyst's queries of the last 24 hours may take at
most ``limits.max_query_mib_per_analyst_per_day``, and a query that failed refunded is
deleted after the days results are kept.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_proxy_coordinator import Clock, key, make_config, make_coordinator, make_spec
from test_release_import import _event, _owner_export

from fedpca.codec import CryptoPool
from fedpca.errors import OverloadError, ProtocolError
from fedpca.messages import QueryState
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.proxy import catalog, coordinator_core
from fedpca.proxy.config import AnalystsConfig, OwnersConfig, ProxySection
from fedpca.proxy.coordinator import Coordinator
from fedpca.proxy.coordinator_core import QueryContext
from fedpca.proxy.limits import PeerLimits
from fedpca.proxy.queries import result_blocks
from fedpca.proxy.release_import import import_releases
from fedpca.proxy.store_records import UNREACHABLE_QUORUM, QueryRecord, page_count
from fedpca.query import Aggregate, AggregateKind, Neighbouring, QueryKind, QuerySpec
from fedpca.release_exports import read_owner_releases
from helpers import SECOND_TEST_SIGNING_KEY, signed

ANALYST = "alice"
DAY = 86_400.0


def _histogram(public_key: Any, query_id: str, edges: int) -> QuerySpec:
    """An aggregate query of one histogram with ``edges`` public bin edges."""
    bins = tuple(float(i) + 0.123456789 for i in range(edges))
    return make_spec(
        public_key,
        query_id,
        kind=QueryKind.AGGREGATE,
        n_features=1,
        n_components=1,
        feature_lower=(),
        feature_upper=(),
        epsilon=0.5,
        quorum=1,
        aggregates=(Aggregate.histogram([1], [bins]),),
    )


def _stored_bytes(coordinator: Coordinator, query_id: str) -> int:
    with sqlite3.connect(coordinator.store.path) as conn:
        row = conn.execute(
            "SELECT stored_bytes FROM queries WHERE query_id=?", (key(query_id),)
        ).fetchone()
    return int(row[0])


def _as_schema_4(conn: sqlite3.Connection) -> None:
    """Turn a database of this version into one as schema 4 left it."""
    conn.execute("ALTER TABLE queries DROP COLUMN summary")
    conn.execute("ALTER TABLE queries DROP COLUMN stored_bytes")
    conn.execute("UPDATE meta SET value='4' WHERE key='schema_version'")


def _uploads_began(coordinator: Coordinator, query_id: str) -> None:
    """As if an owner had begun its upload: the query's charge then stands."""
    with coordinator.store.transaction() as conn:
        conn.execute("UPDATE queries SET uploads_begun=1 WHERE query_id=?", (key(query_id),))


def test_status_and_listing_do_not_read_the_queries(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(10.0))
    histogram = _histogram(public_key, "h1", 20_000)
    pca = make_spec(public_key, "p1", epsilon=0.25, delta=1e-6)
    for spec in (histogram, pca):
        coordinator.submit(ANALYST, signed(spec))
    assert coordinator.cancel(ANALYST, "h1").refunded
    pages = {
        spec.query_id: page_count(
            sum(block.n_ciphertexts for block in result_blocks(QueryContext.of(spec).plan)),
            coordinator.store.page_ciphertexts,
        )
        for spec in (histogram, pca)
    }
    assert pages["h1"] > pages["p1"] >= 1

    def read(*_: Any) -> Any:
        raise AssertionError("a query was read back to show its status")

    coordinator._contexts.clear()
    monkeypatch.setattr(QueryRecord, "spec", property(read))
    monkeypatch.setattr(coordinator_core.QueryContext, "of", read)
    monkeypatch.setattr(type(coordinator.store), "query_spec", read)
    listed = {q.status.query_id: q for q in catalog.list_queries(coordinator, ANALYST, 10)}
    assert set(listed) == {"h1", "p1"}
    assert listed["h1"].kind is QueryKind.AGGREGATE
    assert listed["h1"].aggregates == (AggregateKind.HISTOGRAM,)
    assert (listed["h1"].epsilon, listed["h1"].delta) == (0.5, histogram.delta)
    assert listed["p1"].kind is QueryKind.PCA and listed["p1"].aggregates == ()
    assert (listed["p1"].epsilon, listed["p1"].delta) == (0.25, 1e-6)
    for query_id, summary in listed.items():
        status = coordinator.status(ANALYST, query_id)
        assert status.pages_total == summary.status.pages_total == pages[query_id]
        assert status.quorum == {"h1": 1, "p1": 3}[query_id]
    assert listed["h1"].status.state is QueryState.FAILED
    assert listed["p1"].status.state is QueryState.COLLECTING


def test_an_analysts_queries_take_a_bounded_size_a_day(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    limits = PeerLimits(max_query_mib_per_analyst_per_day=0.5)
    clock = Clock()
    coordinator = make_coordinator(
        tmp_path, pool, replace(make_config(10.0), limits=limits), clock=clock
    )
    coordinator.submit(ANALYST, signed(_histogram(public_key, "h1", 20_000)))
    assert coordinator.cancel(ANALYST, "h1").refunded
    stored = _stored_bytes(coordinator, "h1")
    with sqlite3.connect(coordinator.store.path) as conn:
        spec, plan, signature = conn.execute(
            "SELECT length(spec), length(plan), length(signature) FROM queries WHERE query_id=?",
            (key("h1"),),
        ).fetchone()
    conn.close()
    assert stored == spec + plan + signature and 0.25 * 2**20 < stored < 0.5 * 2**20
    # A second such query would take the analyst past its allowance: refused before
    # anything, whatever is left of it.
    second = signed(_histogram(public_key, "h2", 20_000))
    with pytest.raises(OverloadError, match=r"take 0\.\d MiB .* with this one \(0\.\d MiB\)"):
        coordinator.submit(ANALYST, second)
    assert not coordinator.store.has_query(key("h2"))
    assert coordinator.budget(ANALYST).n_releases == 0
    # A small one still fits, and another analyst's allowance is its own.
    coordinator.submit(ANALYST, signed(make_spec(public_key, "p1", epsilon=0.25)))
    bob = signed(_histogram(public_key, "h2", 20_000), SECOND_TEST_SIGNING_KEY)
    coordinator.submit("bob", bob)
    # 24 hours after the first, there is room again.
    clock.now += DAY + 1.0
    coordinator.submit(ANALYST, second)


def test_a_refunded_failure_keeps_only_its_summary_after_the_days_results_are_kept(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    config = replace(make_config(10.0), proxy=ProxySection(keep_results_days=2.0))
    coordinator = make_coordinator(tmp_path, pool, config)
    clock = coordinator.clock
    assert isinstance(clock, Clock)
    free = signed(_histogram(public_key, "free", 20_000))
    coordinator.submit(ANALYST, free)
    for query_id in ("paid", "open"):
        coordinator.submit(ANALYST, signed(make_spec(public_key, query_id, epsilon=0.25)))
    coordinator.store.record_decline(key("free"), "owner-1", "policy_refusal: epsilon")
    _uploads_began(coordinator, "paid")
    assert coordinator.cancel(ANALYST, "free").refunded
    assert not coordinator.cancel(ANALYST, "paid").refunded
    before = {q: coordinator.status(ANALYST, q) for q in ("free", "paid", "open")}
    large = _stored_bytes(coordinator, "free")
    clock.now += 2 * DAY - 60
    coordinator.purge_results()
    assert _stored_bytes(coordinator, "free") == large  # not yet
    clock.now += 120
    coordinator.purge_results()
    assert _stored_bytes(coordinator, "free") < 200 < large
    with sqlite3.connect(coordinator.store.path) as conn:
        statement = conn.execute("SELECT spec, plan FROM queries WHERE query_id=?", (key("free"),))
        assert statement.fetchone() == ("{}", "{}")
    conn.close()
    # Its status, declines included, and its listing are what they were.
    assert {q: coordinator.status(ANALYST, q) for q in ("free", "paid", "open")} == before
    listed = {q.status.query_id: q for q in catalog.list_queries(coordinator, ANALYST, 10)}
    assert listed["free"].kind is QueryKind.AGGREGATE and listed["free"].epsilon == 0.5
    # Its id stays taken: the same signed query is not a new one, charged anew.
    with pytest.raises(ProtocolError, match="already exists with a different spec"):
        coordinator.submit(ANALYST, free)
    # An owner's export listing it (reserved, no upload begun) does not charge it.
    export = _owner_export(
        tmp_path, "owner-1", [_event("free", 2.0)], {key("free"): TaskOutcome.RESERVED}
    )
    releases = read_owner_releases(json.loads(export.read_text()), str(export))
    report = import_releases(coordinator.store, releases, Neighbouring.ADD_REMOVE, dry_run=True)
    assert report.refunded == [key("free")] and report.entered == []
    # A charged failure keeps its statement (owners may import it), an open one too.
    assert coordinator.store.query_spec(key("paid"))["query_id"] == "paid"
    assert coordinator.store.query_spec(key("open"))["query_id"] == "open"


def test_a_refunded_failure_is_kept_whole_a_day_at_least(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """With results kept less than a day, the daily allowance of stored bytes still
    counts every query of the last 24 hours: none is shrunk sooner."""
    public_key, _ = test_only_keypair_512
    config = replace(make_config(10.0), proxy=ProxySection(keep_results_days=0.1))
    coordinator = make_coordinator(tmp_path, pool, config)
    clock = coordinator.clock
    assert isinstance(clock, Clock)
    coordinator.submit(ANALYST, signed(make_spec(public_key, "q1", epsilon=0.25)))
    assert coordinator.cancel(ANALYST, "q1").refunded
    size = _stored_bytes(coordinator, "q1")
    clock.now += DAY - 60
    coordinator.purge_results()
    assert _stored_bytes(coordinator, "q1") == size
    clock.now += 120
    coordinator.purge_results()
    assert _stored_bytes(coordinator, "q1") < size


def test_a_version_4_database_gets_its_queries_summarised(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """Schema 5 adds each query's summary and stored size; a database of schema 4 is
    migrated with its queries in flight (nothing in them changes)."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(10.0))
    coordinator.submit(ANALYST, signed(_histogram(public_key, "h1", 100)))
    expected = catalog.list_queries(coordinator, ANALYST, 10)
    coordinator.store.close()
    path = tmp_path / "proxy.sqlite3"
    with sqlite3.connect(path) as conn:
        _as_schema_4(conn)
        spec, plan, signature = conn.execute("SELECT spec, plan, signature FROM queries").fetchone()
    conn.close()
    migrated = make_coordinator(tmp_path, pool, make_config(10.0))
    assert catalog.list_queries(migrated, ANALYST, 10) == expected
    assert expected[0].aggregates == (AggregateKind.HISTOGRAM,)
    assert _stored_bytes(migrated, "h1") == len(spec) + len(plan) + len(signature)
    assert migrated.store.query(key("h1")).state is QueryState.COLLECTING
    with sqlite3.connect(path) as conn:
        version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        summary = json.loads(conn.execute("SELECT summary FROM queries").fetchone()[0])
    conn.close()
    assert version[0] == "5" and summary["kind"] == "aggregate"


def test_a_status_names_the_owners_registered_when_the_query_was_asked(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """An operator's walkthrough: `analyst list` showed an old query as "0/3 of 2"
    after the allow-list shrank to 2 owners, today's count beside its quorum of 3."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(10.0))
    coordinator.submit(ANALYST, signed(make_spec(public_key, "q1", epsilon=0.25)))
    assert coordinator.cancel(ANALYST, "q1").refunded
    assert coordinator.status(ANALYST, "q1").owners_registered == 3
    coordinator.store.close()
    fewer = replace(make_config(10.0), owners=OwnersConfig(frozenset({"owner-1", "owner-2"})))
    shrunk = make_coordinator(tmp_path, pool, fewer)
    assert shrunk.status(ANALYST, "q1").owners_registered == 3
    assert len(shrunk.registered_owners) == 2  # what the deployment has today


def test_a_row_the_migration_cannot_summarise_neither_stops_the_proxy_nor_loses_its_quorum(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """Review: a stored plan with an infinite count stopped the migration (and the
    proxy's start); an empty summary read as quorum 1, so one owner's upload would
    have finished a query of quorum 3."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(10.0))
    for query_id in ("odd-plan", "odd-quorum"):
        coordinator.submit(ANALYST, signed(make_spec(public_key, query_id, epsilon=0.25)))
    coordinator.store.close()
    path = tmp_path / "proxy.sqlite3"
    with sqlite3.connect(path) as conn:
        _as_schema_4(conn)
        conn.execute(
            "UPDATE queries SET plan=? WHERE query_id=?",
            ('{"owner_blocks": [{"n_ciphertexts": Infinity}]}', key("odd-plan")),
        )
        conn.execute(
            "UPDATE queries SET plan=?, spec=json_set(spec, '$.quorum', 'three') WHERE query_id=?",
            ("[]", key("odd-quorum")),
        )
    conn.close()
    migrated = make_coordinator(tmp_path, pool, make_config(10.0))
    assert migrated.store.query(key("odd-plan")).quorum == 3  # read from the statement
    assert migrated.store.query(key("odd-quorum")).quorum == UNREACHABLE_QUORUM
    assert migrated.status(ANALYST, "odd-plan").quorum == 3


def test_queries_of_an_analyst_taken_off_the_list_are_no_longer_handed_to_owners(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """Review: after a restart with alice removed from [analysts] allowed, her open
    queries were still handed to owners, who spent budget on results she cannot fetch."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(10.0))
    coordinator.submit(ANALYST, signed(make_spec(public_key, "q1", epsilon=0.25)))
    assert [task.task_id for task in coordinator.pending_tasks("owner-1")] == [key("q1")]
    coordinator.store.close()
    for allowed, expected in (({"bob"}, []), ({"alice", "bob"}, [key("q1")])):
        config = replace(make_config(10.0), analysts=AnalystsConfig(frozenset(allowed)))
        restarted = make_coordinator(tmp_path, pool, config)
        assert [task.task_id for task in restarted.pending_tasks("owner-1")] == expected
        restarted.store.close()
