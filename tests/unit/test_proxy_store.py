"""The proxy's SQLite store: chunk folds taken out exactly when an upload does not
complete, idempotent uploads, replay refusal, durability, declines and refunds, and
migrations of older databases."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import NotFoundError, ProtocolError, QueryStateError
from fedpca.messages import (
    UPLOAD_CHUNK_BYTES,
    QueryState,
    ciphertexts_per_chunk,
)
from fedpca.proxy.config import (
    BudgetConfig,
    OwnersConfig,
    PrivacySection,
    ProxyConfig,
    ProxySection,
    TlsConfig,
)
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.store import SCHEMA_VERSION, ProxyStore, UploadCompletion
from fedpca.query import Neighbouring

PRIME = 65521  # the toy group: Z*_p with 2-byte elements, p the largest 16-bit prime
TOTAL = 8  # ciphertexts per upload in these tests
PAGE = 3  # ciphertexts per page: uploads span pages 0-2, the last one short


class ToyGroup:
    """Z*_p on 2-byte big-endian elements: a stand-in for Paillier ciphertexts whose
    group operation (multiplication) and inverses can be checked by hand."""

    width = 2

    @staticmethod
    def _values(data: bytes) -> list[int]:
        return [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]

    @staticmethod
    def _bytes(values: list[int]) -> bytes:
        return b"".join(v.to_bytes(2, "big") for v in values)

    def add(self, current: bytes, data: bytes) -> bytes:
        pairs = zip(self._values(current), self._values(data), strict=True)
        return self._bytes([a * b % PRIME for a, b in pairs])

    def subtract(self, current: bytes, data: bytes) -> bytes:
        pairs = zip(self._values(current), self._values(data), strict=True)
        return self._bytes([a * pow(b, -1, PRIME) % PRIME for a, b in pairs])


GROUP = ToyGroup()


def upload_values(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (PRIME - 1) + 1 for i in range(TOTAL)]


def product(*uploads: list[int]) -> bytes:
    out = [1] * TOTAL
    for values in uploads:
        out = [a * b % PRIME for a, b in zip(out, values, strict=True)]
    return ToyGroup._bytes(out)


def fold(
    store: ProxyStore,
    owner: str,
    upload: str,
    values: list[int],
    *,
    stream: int = 1,
    cuts: tuple[int, ...] = (TOTAL,),
    query: str = "q1",
) -> None:
    """Fold ``values`` as chunks ending at ``cuts``."""
    start = 0
    for end in cuts:
        store.fold_chunk(
            query, owner, upload, stream, start, ToyGroup._bytes(values[start:end]), TOTAL, GROUP
        )
        start = end


def complete(
    store: ProxyStore,
    owner: str,
    upload: str,
    digest: str,
    *,
    query: str = "q1",
    stream: int = 1,
    before_accept: Callable[[int], None] | None = None,
) -> UploadCompletion:
    return store.complete_upload(
        query, owner, upload, stream, digest, TOTAL, GROUP, before_accept=before_accept
    )


@pytest.fixture
def store(tmp_path: Path) -> ProxyStore:
    s = ProxyStore(tmp_path / "proxy.sqlite3", page_ciphertexts=PAGE)
    s.create_query("q1", "alice", {"k": 1}, {"blocks": []}, deadline_at=1e12)
    return s


def test_chunks_cut_anywhere_fold_into_the_element_wise_product(store: ProxyStore) -> None:
    a, b = upload_values(1), upload_values(2)
    fold(store, "o1", "u1", a, cuts=(1, 5, 8))  # chunk 1-5 spans pages 0 and 1
    # Folded as the chunks arrived, before the upload completes.
    assert store.aggregate("q1") == product(a) and store.partial_uploads("q1") == {"o1": 3}
    fold(store, "o2", "u2", b, cuts=(4, 8))
    first = complete(store, "o1", "u1", "h1")
    second = complete(store, "o2", "u2", "h2")
    assert (first.duplicate, first.n_contributed) == (False, 1)
    assert (second.duplicate, second.n_contributed) == (False, 2)
    assert store.aggregate("q1") == product(a, b)
    assert store.partial_uploads("q1") == {}


def test_retry_of_an_accepted_upload_is_duplicate_and_folds_nothing(store: ProxyStore) -> None:
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    # The retry resends its chunks (they are not folded) and completes as duplicate.
    assert not store.fold_chunk("q1", "o1", "u1", 2, 0, ToyGroup._bytes(a), TOTAL, GROUP)
    retry = complete(store, "o1", "u1", "h1", stream=2)
    assert (retry.duplicate, retry.n_contributed) == (True, 1)
    assert store.aggregate("q1") == product(a) and store.query("q1").n_contributed == 1


def test_abandoned_upload_is_taken_out_byte_for_byte(store: ProxyStore) -> None:
    fold(store, "o2", "u2", upload_values(2), cuts=(2, 7))  # never finished: its only part
    assert store.discard_stream("q1", "o2", 1, GROUP) == 2
    assert store.aggregate("q1") == b""  # its pages were dropped, not left at "1"
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    before = store.aggregate("q1")
    fold(store, "o2", "u2", upload_values(2), cuts=(5,))
    assert store.aggregate("q1") != before
    assert store.discard_stream("q1", "o2", 1, GROUP) == 1
    assert store.aggregate("q1") == before
    with pytest.raises(ProtocolError, match="cover 0 of 8"):
        complete(store, "o2", "u2", "h2")
    assert store.query("q1").n_contributed == 1


def test_a_newer_stream_takes_over_and_the_older_is_refused(store: ProxyStore) -> None:
    a = upload_values(1)
    fold(store, "o1", "u1", a, stream=1, cuts=(3,))
    fold(store, "o1", "u1", a, stream=2, cuts=(3,))  # reconnected: the old part goes
    assert store.aggregate("q1") == ToyGroup._bytes(a[:3])
    with pytest.raises(ProtocolError, match="superseded"):
        store.fold_chunk("q1", "o1", "u1", 1, 3, ToyGroup._bytes(a[3:]), TOTAL, GROUP)
    with pytest.raises(ProtocolError, match="cover 0 of 8"):
        complete(store, "o1", "u1", "h1", stream=1)
    assert store.aggregate("q1") == ToyGroup._bytes(a[:3])  # the refusal took out nothing
    store.fold_chunk("q1", "o1", "u1", 2, 3, ToyGroup._bytes(a[3:]), TOTAL, GROUP)
    assert complete(store, "o1", "u1", "h1", stream=2).n_contributed == 1
    assert store.aggregate("q1") == product(a)


def test_second_different_upload_from_same_owner_is_refused(store: ProxyStore) -> None:
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    with pytest.raises(ProtocolError, match="different upload"):
        fold(store, "o1", "u2", upload_values(2))
    with pytest.raises(ProtocolError, match="different upload"):
        complete(store, "o1", "u2", "h2", stream=2)
    assert store.aggregate("q1") == product(a)


def test_replay_into_another_query_is_refused_and_taken_out(store: ProxyStore) -> None:
    store.create_query("q2", "alice", {"k": 2}, {"blocks": []}, deadline_at=1e12)
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    fold(store, "o1", "u9", a, query="q2")
    with pytest.raises(ProtocolError, match="replayed"):
        complete(store, "o1", "u9", "h1", query="q2")
    assert store.aggregate("q2") == b"" and store.partial_uploads("q2") == {}
    assert store.query("q2").n_contributed == 0


def test_before_accept_sees_the_count_and_a_refusal_is_taken_out(store: ProxyStore) -> None:
    seen: list[int] = []

    def at_most_one(n_contributed: int) -> None:
        seen.append(n_contributed)
        if n_contributed >= 1:
            raise QueryStateError("full")

    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1", before_accept=at_most_one)
    fold(store, "o2", "u2", upload_values(2), cuts=(4, 8))
    with pytest.raises(QueryStateError, match="full"):
        complete(store, "o2", "u2", "h2", before_accept=at_most_one)
    assert seen == [0, 1]
    assert store.aggregate("q1") == product(a) and store.partial_uploads("q1") == {}
    assert [u.owner_id for u in store.uploads("q1")] == ["o1"]
    # A retry of the accepted upload is a duplicate, not refused by the hook.
    assert complete(store, "o1", "u1", "h1", before_accept=at_most_one).duplicate
    assert seen == [0, 1]


def test_a_failure_inside_a_fold_leaves_the_store_untouched(store: ProxyStore) -> None:
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")

    class BreaksOnSecondPage(ToyGroup):
        calls = 0

        def add(self, current: bytes, data: bytes) -> bytes:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom between two pages of one chunk")
            return super().add(current, data)

    with pytest.raises(RuntimeError, match="boom"):
        data = ToyGroup._bytes(upload_values(2))
        store.fold_chunk("q1", "o2", "u2", 1, 0, data, TOTAL, BreaksOnSecondPage())
    assert store.aggregate("q1") == product(a) and store.partial_uploads("q1") == {}


def test_closing_takes_uploads_in_progress_out(store: ProxyStore) -> None:
    a = upload_values(1)
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    fold(store, "o2", "u2", upload_values(2), cuts=(4,))
    with pytest.raises(QueryStateError, match="algebra"):
        store.set_state("q1", QueryState.NOISING, expect=(QueryState.COLLECTING,))
    store.set_state("q1", QueryState.NOISING, expect=(QueryState.COLLECTING,), algebra=GROUP)
    assert store.aggregate("q1") == product(a) and store.partial_uploads("q1") == {}
    with pytest.raises(QueryStateError, match="no longer accepted"):
        fold(store, "o2", "u2", upload_values(2), cuts=(4, 8), stream=2)
    with pytest.raises(QueryStateError, match="no longer accepted"):
        complete(store, "o2", "u2", "h2", stream=2)
    # The accepted upload's retry is still answered "duplicate" after closing.
    assert not store.fold_chunk("q1", "o1", "u1", 3, 0, ToyGroup._bytes(a), TOTAL, GROUP)
    assert complete(store, "o1", "u1", "h1", stream=3).duplicate


def test_a_failing_query_drops_uploads_in_progress(store: ProxyStore) -> None:
    fold(store, "o2", "u2", upload_values(2), cuts=(4,))
    store.set_state("q1", QueryState.FAILED, expect=(QueryState.COLLECTING,), failure_reason="x")
    assert store.partial_uploads("q1") == {}


def test_uploads_in_progress_survive_a_crash_until_discarded(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    s.create_query("q", "alice", {}, {}, deadline_at=1e12)
    a = upload_values(1)
    fold(s, "o1", "u1", a, query="q")
    complete(s, "o1", "u1", "h1", query="q")
    fold(s, "o2", "u2", upload_values(2), cuts=(2, 6), query="q")
    s.close()  # the process dies here
    reopened = ProxyStore(path, page_ciphertexts=PAGE)
    assert reopened.partial_uploads("q") == {"o2": 2}
    assert reopened.discard_partial_uploads("q", GROUP) == 2
    assert reopened.aggregate("q") == product(a) and reopened.query("q").n_contributed == 1


def test_chunks_outside_the_layout_are_refused(store: ProxyStore) -> None:
    data = ToyGroup._bytes(upload_values(1))
    for start, payload in ((1, data), (-1, data[:2]), (0, b""), (0, data[:3])):
        with pytest.raises(ProtocolError, match="does not fit"):
            store.fold_chunk("q1", "o1", "u1", 1, start, payload, TOTAL, GROUP)
    assert store.aggregate("q1") == b""


def test_result_is_stored_once_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path)
    s.create_query("q", "alice", {}, {}, deadline_at=1e12)
    s.set_state("q", QueryState.NOISING, expect=(QueryState.COLLECTING,))
    s.store_result("q", {"scatter": b"noised"}, {"n_owners": 1})
    with pytest.raises(QueryStateError):
        s.store_result("q", {"scatter": b"again"}, {"n_owners": 1})
    s.close()
    reopened = ProxyStore(path)
    blocks, meta = reopened.result("q")
    assert blocks == {"scatter": b"noised"} and meta == {"n_owners": 1}
    assert reopened.query("q").state is QueryState.DONE


def test_unknown_query_and_conflicting_resubmission(store: ProxyStore) -> None:
    with pytest.raises(NotFoundError):
        store.query("nope")
    with pytest.raises(NotFoundError):
        fold(store, "o1", "u", upload_values(1), query="nope")
    with pytest.raises(NotFoundError):
        complete(store, "o1", "u", "h", query="nope")
    assert store.create_query("q1", "alice", {"k": 1}, {"blocks": []}, 1e12).query_id == "q1"
    with pytest.raises(ProtocolError, match="different spec"):
        store.create_query("q1", "alice", {"k": 2}, {"blocks": []}, 1e12)


def test_before_insert_runs_in_the_same_transaction(store: ProxyStore) -> None:
    def refuse(conn: sqlite3.Connection) -> None:
        raise PermissionError("over budget")

    with pytest.raises(PermissionError):
        store.create_query("q3", "alice", {}, {}, 1e12, before_insert=refuse)
    with pytest.raises(NotFoundError):
        store.query("q3")


def test_wal_mode_is_on(store: ProxyStore) -> None:
    conn = sqlite3.connect(str(store.path))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_owner_chunk_is_one_aggregate_page_at_2048_bits() -> None:
    from fedpca.codec import ciphertext_byte_length
    from fedpca.proxy.store import PAGE_CIPHERTEXTS

    width = ciphertext_byte_length(2048)
    assert ciphertexts_per_chunk(width, UPLOAD_CHUNK_BYTES) == PAGE_CIPHERTEXTS


def _as_version_1(path: Path, *, collecting: bool) -> None:
    """Turn a fresh database into what fedpca with schema version 1 left behind."""
    store = ProxyStore(path)
    store.create_query("q-old", "alice", {}, {}, deadline_at=1e12)
    if not collecting:
        store.set_state("q-old", QueryState.FAILED, failure_reason="old")
    store.close()
    conn = sqlite3.connect(str(path))
    with conn:
        conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
        conn.execute("CREATE TABLE aggregates (query_id TEXT, block TEXT, data BLOB)")
        conn.execute("INSERT INTO aggregates VALUES ('q-old', 'shares', x'01')")
    conn.close()


def test_a_version_1_database_is_migrated_when_nothing_is_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    _as_version_1(path, collecting=False)
    store = ProxyStore(path)
    # Through version 2 to the current one: the query is keyed by its analyst now.
    assert store.query("alice/q-old").state is QueryState.FAILED
    with pytest.raises(NotFoundError):
        store.query("q-old")
    conn = sqlite3.connect(str(path))
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    conn.close()
    assert "aggregates" not in tables and {"aggregate_pages", "upload_chunks"} <= tables
    assert version == str(SCHEMA_VERSION) == "3"


def test_a_version_1_database_with_a_query_in_flight_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    _as_version_1(path, collecting=True)
    with pytest.raises(QueryStateError, match=r"in flight \(q-old\).*previous fedpca version"):
        ProxyStore(path)
    conn = sqlite3.connect(str(path))  # untouched: the old version can still finish it
    assert conn.execute("SELECT COUNT(*) FROM aggregates").fetchone()[0] == 1
    conn.close()


# ---------------------------------------------------------------- refunds, declines
def test_a_failed_query_is_refunded_only_if_no_upload_began(store: ProxyStore) -> None:
    store.create_query("q2", "alice", {"k": 2}, {"blocks": []}, deadline_at=1e12)
    with store.transaction() as conn:
        store.record_release(conn, "alice", "q1", {"query_id": "q1"})
        store.record_release(conn, "alice", "q2", {"query_id": "q2"})
    assert not store.query("q1").uploads_begun
    store.mark_upload_begun("q1")
    assert store.query("q1").uploads_begun and not store.query("q2").uploads_begun
    store.set_state("q1", QueryState.FAILED, failure_reason="deadline", algebra=GROUP)
    store.set_state("q2", QueryState.FAILED, failure_reason="deadline", algebra=GROUP)
    # q2 never saw an upload begin: refunded; q1 did (owners may have spent): charged.
    assert store.releases("alice") == [{"query_id": "q1"}]


def test_declines_are_recorded_only_while_collecting_and_before_an_upload(
    store: ProxyStore,
) -> None:
    store.record_decline("q1", "o2", "policy_refusal: epsilon")
    store.record_decline("q1", "o2", "key_not_pinned")  # a second decline replaces the first
    assert store.declines("q1") == {"o2": "key_not_pinned"}
    fold(store, "o1", "u1", upload_values(1))
    complete(store, "o1", "u1", "h1")
    with pytest.raises(QueryStateError, match="already uploaded"):
        store.record_decline("q1", "o1", "policy_refusal")
    with pytest.raises(NotFoundError):
        store.record_decline("nope", "o1", "policy_refusal")
    store.set_state("q1", QueryState.NOISING, expect=(QueryState.COLLECTING,), algebra=GROUP)
    with pytest.raises(QueryStateError, match="no longer recorded"):
        store.record_decline("q1", "o3", "policy_refusal")
    assert store.declines("q1") == {"o2": "key_not_pinned"}


# ---------------------------------------------------------------- version 2 -> 3
_V2_EVENTS = {
    # (analyst, query): noise multiplier z; epsilon 1, delta 1e-5 as fedpca 0.1 stored them.
    ("alice", "q-stats"): 2.0,
    ("alice", "q-open"): 3.0,
    ("bob", "q-masked"): 4.0,
}


def _as_version_2(path: Path, *, open_query: bool = True) -> dict[str, Any]:
    """A database as fedpca with schema version 2 left it, and what it held.

    Query ids not scoped by analyst; no signature, signer or uploads_begun column;
    releases without a neighbouring relation (nor sensitivity and delta_extra).
    ``open_query=False`` leaves q-open out (its spec is no real query: a proxy
    starting on the database would try to recover it).
    """
    store = ProxyStore(path, page_ciphertexts=PAGE)
    store.create_query("q-stats", "alice", {"mode": "stats"}, {}, deadline_at=1e12)
    store.create_query("q-masked", "bob", {"mode": "masked"}, {}, deadline_at=1e12)
    store.create_query("q-open", "alice", {"mode": "stats"}, {}, deadline_at=1e12)
    fold(store, "o1", "u1", upload_values(1), query="q-stats")
    complete(store, "o1", "u1", "h1", query="q-stats")
    store.set_state("q-stats", QueryState.NOISING, expect=(QueryState.COLLECTING,), algebra=GROUP)
    store.store_result("q-stats", {"shares": b"noised"}, {"n_owners": 1})
    store.set_state("q-masked", QueryState.FAILED, failure_reason="old", algebra=GROUP)
    fold(store, "o1", "u1", upload_values(2), query="q-open")
    complete(store, "o1", "u1", "h2", query="q-open")
    fold(store, "o2", "u2", upload_values(3), cuts=(2,), query="q-open")  # in flight
    store.record_decline("q-open", "o3", "policy_refusal")
    if not open_query:
        store.set_state("q-open", QueryState.FAILED, failure_reason="old", algebra=GROUP)
    with store.transaction() as conn:
        for (analyst, query), z in _V2_EVENTS.items():
            event = {
                "query_id": query,
                "analyst": analyst,
                "noise_multiplier": z,
                "epsilon": 1.0,
                "delta": 1e-5,
                "timestamp": 1.7e9,
            }
            store.record_release(conn, analyst, query, event)
    held = {"aggregate": store.aggregate("q-open"), "result": store.result("q-stats")}
    store.close()
    conn = sqlite3.connect(str(path))
    with conn:
        for column in ("signature", "signer", "uploads_begun"):
            conn.execute(f"ALTER TABLE queries DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    conn.close()
    return held


@pytest.mark.parametrize("relation", list(Neighbouring))
def test_a_version_2_database_is_keyed_by_analyst_and_its_releases_restated(
    tmp_path: Path, relation: Neighbouring
) -> None:
    path = tmp_path / "v2.sqlite3"
    held = _as_version_2(path)
    store = ProxyStore(path, page_ciphertexts=PAGE, neighbouring=relation)
    # Every query under its task id, with all it held, as having had uploads (no
    # refund for what fedpca 0.1 may have let owners spend).
    records = {r.query_id: r for r in store.queries()}
    assert set(records) == {"alice/q-stats", "bob/q-masked", "alice/q-open"}
    assert all(r.uploads_begun and r.signature == b"" and r.signer == "" for r in records.values())
    assert store.result("alice/q-stats") == held["result"]
    assert store.aggregate("alice/q-open") == held["aggregate"]
    assert [u.owner_id for u in store.uploads("alice/q-open")] == ["o1"]
    assert store.partial_uploads("alice/q-open") == {"o2": 1}
    assert store.declines("alice/q-open") == {"o3": "policy_refusal"}
    for old in ("q-stats", "q-masked", "q-open"):
        with pytest.raises(NotFoundError):
            store.query(old)
    # Releases restated under the deployment's relation (docs/privacy.md, "Ledgers of
    # fedpca 0.1"): stats mode keeps its add/remove z, or half of it under replace-one;
    # masked mode keeps its replace-one z, or has no finite epsilon under add/remove.
    events = {
        (analyst, e.query_id): e
        for analyst in ("alice", "bob")
        for e in (PrivacyEvent.from_dict(r) for r in store.releases(analyst))
    }
    assert set(events) == {
        ("alice", "alice/q-stats"),
        ("alice", "alice/q-open"),
        ("bob", "bob/q-masked"),
    }
    assert {e.neighbouring for e in events.values()} == {relation}
    halve = 2.0 if relation is Neighbouring.REPLACE_ONE else 1.0
    assert events["alice", "alice/q-stats"].noise_multiplier == 2.0 / halve
    assert events["alice", "alice/q-open"].noise_multiplier == 3.0 / halve
    masked = events["bob", "bob/q-masked"]
    if relation is Neighbouring.REPLACE_ONE:
        assert masked.noise_multiplier == 4.0 and masked.epsilon == 1.0
    else:
        assert masked.noise_multiplier == 0.0 and math.isinf(masked.epsilon)
    # The open query fails later: its charge stands (an upload began long ago).
    store.set_state("alice/q-open", QueryState.FAILED, failure_reason="deadline", algebra=GROUP)
    assert len(store.releases("alice")) == 2
    ledgers = {a: json.dumps(store.releases(a), sort_keys=True) for a in ("alice", "bob")}
    store.close()
    # Reopening migrates nothing twice (no second halving, no second renaming).
    again = ProxyStore(path, page_ciphertexts=PAGE, neighbouring=relation)
    assert {a: json.dumps(again.releases(a), sort_keys=True) for a in ledgers} == ledgers
    assert {r.query_id for r in again.queries()} == set(records)


def test_the_proxy_migrates_its_database_under_its_configured_relation(
    tmp_path: Path, pool: CryptoPool
) -> None:
    path = tmp_path / "v2.sqlite3"
    _as_version_2(path, open_query=False)
    config = ProxyConfig(
        proxy=ProxySection(listen="127.0.0.1:0", database=path),
        tls=TlsConfig(insecure=True),
        budget=BudgetConfig(PrivacyParams(100.0, 1e-5)),
        owners=OwnersConfig(frozenset({"o1", "o2", "o3"})),
        privacy=PrivacySection(neighbouring=Neighbouring.REPLACE_ONE),
    )
    server = ProxyServer(config, pool=pool)
    server.start()
    try:
        releases = server.coordinator.store.releases("alice")
        budget = server.coordinator.budget("alice")
    finally:
        server.stop(grace=1.0)
    assert {r["neighbouring"] for r in releases} == {"replace-one"}
    assert budget.n_releases == 2 and 0 < budget.epsilon_spent < math.inf
