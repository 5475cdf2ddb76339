"""The proxy's SQLite store: contributors and their durable marks, chunks folded exactly
once (resumed, never refolded), the exact take-out while the contributors are open,
result pages released once, group commit, declines and refunds, and migrations of
older databases."""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import ConfigError, NotFoundError, ProtocolError, QueryStateError
from fedpca.messages import (
    UPLOAD_CHUNK_BYTES,
    QueryState,
    ciphertexts_per_chunk,
)
from fedpca.owner.ledger import BudgetLedger
from fedpca.proxy import store as proxy_store
from fedpca.proxy.config import (
    BudgetConfig,
    OwnersConfig,
    PrivacySection,
    ProxyConfig,
    ProxySection,
    TlsConfig,
)
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.store import SCHEMA_VERSION, ProxyStore
from fedpca.proxy.store_records import (
    Contributor,
    Joined,
    NotContributingError,
    UploadCompletion,
)
from fedpca.query import Neighbouring

PRIME = 65521  # the toy group: Z*_p with 2-byte elements, p the largest 16-bit prime
TOTAL = 8  # ciphertexts per upload in these tests
PAGE = 3  # ciphertexts per page: uploads span pages 0-2, the last one short
V3_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "proxy_schema_v3.sql"


class ToyGroup:
    """Z*_p on 2-byte big-endian elements: a stand-in for Paillier ciphertexts whose
    group operation (multiplication) and inverses can be checked by hand."""

    width = 2

    @staticmethod
    def _values(data: bytes) -> list[int]:
        return [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]

    @staticmethod
    def _bytes(values: Sequence[int]) -> bytes:
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


def product(*uploads: Sequence[int]) -> list[int]:
    out = [1] * TOTAL
    for values in uploads:
        out = [a * b % PRIME for a, b in zip(out, values, strict=True)]
    return out


def as_bytes(values: Sequence[int]) -> bytes:
    return ToyGroup._bytes(values)


def create(store: ProxyStore, query: str = "q1", quorum: int = 2, **spec: Any) -> None:
    store.create_query(
        query,
        "alice",
        {"quorum": quorum, **spec},
        {"key_bits": 8, "result_blocks": [{"name": "shares"}]},
        deadline_at=1e12,
    )


def join(
    store: ProxyStore,
    owner: str,
    upload: str,
    query: str = "q1",
    meta: dict[str, Any] | None = None,
    public_count: int | None = None,
) -> Joined:
    def on_fixed(contributors: Sequence[Contributor]) -> dict[str, Any]:
        return meta if meta is not None else {"n_owners": len(contributors)}

    return store.join(
        query,
        owner,
        upload,
        total_ciphertexts=TOTAL,
        algebra=GROUP,
        public_count=public_count,
        on_fixed=on_fixed,
    )


def fold(
    store: ProxyStore,
    owner: str,
    upload: str,
    values: Sequence[int],
    *,
    cuts: tuple[int, ...] = (TOTAL,),
    start: int = 0,
    query: str = "q1",
) -> list[bool]:
    """Fold ``values[start:]`` as chunks ending at ``cuts``; returns which were folded."""
    folded = []
    for end in cuts:
        result = store.fold_chunk(
            query, owner, upload, start, as_bytes(values[start:end]), TOTAL, GROUP
        )
        folded.append(result.folded)
        start = end
    return folded


def complete(
    store: ProxyStore, owner: str, upload: str, digest: str, *, query: str = "q1"
) -> UploadCompletion:
    return store.complete_upload(query, owner, upload, digest, TOTAL)


def aggregate(store: ProxyStore, query: str = "q1") -> list[int]:
    return ToyGroup._values(store.aggregate(query))


@pytest.fixture
def store(tmp_path: Path) -> ProxyStore:
    s = ProxyStore(tmp_path / "proxy.sqlite3", page_ciphertexts=PAGE)
    create(s)
    return s


# ------------------------------------------------------------ contributors, folds
def test_the_first_quorum_owners_to_begin_are_the_contributors(store: ProxyStore) -> None:
    assert join(store, "o1", "u1") == Joined(covered=0)
    assert store.query("q1").state is QueryState.COLLECTING and store.query("q1").uploads_begun
    assert store.result_meta("q1") is None
    assert join(store, "o2", "u2", meta={"n_owners": 2, "mode": "stats"}) == Joined(
        covered=0, fixed=True
    )
    assert store.query("q1").state is QueryState.AGGREGATING
    assert store.result_meta("q1") == {"n_owners": 2, "mode": "stats"}
    assert [c.owner_id for c in store.contributors("q1")] == ["o1", "o2"]
    with pytest.raises(NotContributingError, match="contributors are fixed"):
        join(store, "o3", "u3")
    assert [c.owner_id for c in store.contributors("q1")] == ["o1", "o2"]


def test_chunks_cut_anywhere_fold_into_the_element_wise_product(store: ProxyStore) -> None:
    a, b = upload_values(1), upload_values(2)
    join(store, "o1", "u1")
    assert fold(store, "o1", "u1", a, cuts=(1, 5, 8)) == [True] * 3  # 1-5 spans pages 0, 1
    # Folded as the chunks arrived, before the upload completes.
    assert aggregate(store) == product(a) and store.partial_uploads("q1") == {"o1": TOTAL}
    join(store, "o2", "u2")
    fold(store, "o2", "u2", b, cuts=(4, 8))
    first = complete(store, "o1", "u1", "h1")
    second = complete(store, "o2", "u2", "h2")
    assert (first.duplicate, first.n_contributed) == (False, 1)
    assert (second.duplicate, second.n_contributed) == (False, 2)
    assert aggregate(store) == product(a, b) and store.partial_uploads("q1") == {}


def test_a_resumed_upload_skips_what_is_folded_and_continues_at_its_mark(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    create(s, quorum=1)
    a = upload_values(1)
    join(s, "o1", "u1")
    fold(s, "o1", "u1", a, cuts=(2, 5))
    s.close()  # the proxy dies here; the contributors were fixed, so nothing is taken out
    reopened = ProxyStore(path, page_ciphertexts=PAGE)
    assert reopened.discard_partial_uploads("q1", total_ciphertexts=TOTAL, algebra=GROUP) == 0
    assert join(reopened, "o1", "u1") == Joined(covered=5)
    # A resend cut at other boundaries cannot be resumed: it straddles the mark.
    with pytest.raises(ProtocolError, match="a chunk at position 4, the proxy holds the first 5"):
        fold(reopened, "o1", "u1", a, cuts=(8,), start=4)
    # The owner resends from the start: the chunks below its mark are skipped.
    assert fold(reopened, "o1", "u1", a, cuts=(2, 5, 8)) == [False, False, True]
    assert fold(reopened, "o1", "u1", a, cuts=(8,), start=7) == [False]
    assert aggregate(reopened) == product(a)
    assert complete(reopened, "o1", "u1", "h1").n_contributed == 1


def test_a_chunk_beyond_the_mark_is_refused(store: ProxyStore) -> None:
    a = upload_values(1)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a, cuts=(3,))
    with pytest.raises(ProtocolError, match="a chunk at position 5, the proxy holds the first 3"):
        fold(store, "o1", "u1", a, cuts=(8,), start=5)
    with pytest.raises(ProtocolError, match="is not a contribution to query 'q1'"):
        fold(store, "o9", "u9", a)
    with pytest.raises(ProtocolError, match="is not a contribution to query 'q1'"):
        fold(store, "o1", "u-other", a, cuts=(4,), start=3)
    assert aggregate(store) == a[:3]  # page 0 only: the others were never touched


def test_a_broken_upload_is_taken_out_exactly_while_the_set_is_open(store: ProxyStore) -> None:
    a, b = upload_values(1), upload_values(2)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    before = store.aggregate("q1")
    store.create_query("q3", "alice", {"quorum": 3}, {}, deadline_at=1e12)
    join(store, "o1", "u1", query="q3")
    join(store, "o2", "u2", query="q3")
    fold(store, "o2", "u2", b, cuts=(2, 7), query="q3")  # never finished
    assert store.abandon("q3", "o2", "u2", total_ciphertexts=TOTAL, algebra=GROUP) == 2
    assert store.aggregate("q3") == b""  # its pages were dropped, not left at "1"
    assert [c.owner_id for c in store.contributors("q3")] == ["o1"]  # its place is free
    assert join(store, "o4", "u4", query="q3") == Joined(covered=0)
    assert store.aggregate("q1") == before  # other queries untouched


def test_once_the_set_is_fixed_a_broken_upload_is_kept_for_resumption(store: ProxyStore) -> None:
    a = upload_values(1)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a, cuts=(3,))  # staged: the set is still open
    join(store, "o2", "u2")  # fixed: staged copies dropped, nothing taken out any more
    fold(store, "o1", "u1", a, cuts=(6,), start=3)
    assert store.abandon("q1", "o1", "u1", total_ciphertexts=TOTAL, algebra=GROUP) == 0
    assert store.partial_uploads("q1") == {"o1": 6, "o2": 0}
    assert aggregate(store) == a[:6]  # pages 0 and 1


def test_a_new_upload_id_starts_over_while_open_and_is_refused_once_fixed(
    store: ProxyStore,
) -> None:
    a, a2 = upload_values(1), upload_values(5)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a, cuts=(4,))
    # The owner lost its state and begins again under a new id: the old part goes.
    assert join(store, "o1", "u1-new") == Joined(covered=0)
    assert store.aggregate("q1") == b""
    fold(store, "o1", "u1-new", a2, cuts=(4,))
    join(store, "o2", "u2")  # fixed
    with pytest.raises(ProtocolError, match="resume it with the same upload id"):
        join(store, "o1", "u1-again")
    assert join(store, "o1", "u1-new") == Joined(covered=4)


def test_retry_of_an_accepted_upload_is_duplicate_and_folds_nothing(store: ProxyStore) -> None:
    a = upload_values(1)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    assert join(store, "o1", "u1") == Joined(covered=TOTAL, duplicate=True)
    retry = complete(store, "o1", "u1", "h1")
    assert (retry.duplicate, retry.n_contributed) == (True, 1)
    assert aggregate(store) == product(a) and store.query("q1").n_contributed == 1
    with pytest.raises(ProtocolError, match="different upload"):
        join(store, "o1", "u2")
    with pytest.raises(ProtocolError, match="different upload"):
        complete(store, "o1", "u2", "h2")


def test_an_incomplete_upload_cannot_complete(store: ProxyStore) -> None:
    join(store, "o1", "u1")
    fold(store, "o1", "u1", upload_values(1), cuts=(5,))
    with pytest.raises(ProtocolError, match="cover 5 of 8"):
        complete(store, "o1", "u1", "h1")
    with pytest.raises(ProtocolError, match="cover 0 of 8"):
        complete(store, "o9", "u9", "h9")
    assert store.query("q1").n_contributed == 0


def test_replay_into_another_query_is_refused(store: ProxyStore) -> None:
    create(store, "q2", quorum=1)
    a = upload_values(1)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a)
    complete(store, "o1", "u1", "h1")
    join(store, "o1", "u9", query="q2")
    fold(store, "o1", "u9", a, query="q2")
    with pytest.raises(ProtocolError, match="replayed"):
        complete(store, "o1", "u9", "h1", query="q2")
    assert store.query("q2").n_contributed == 0


def test_a_failure_inside_a_fold_leaves_the_store_untouched(store: ProxyStore) -> None:
    a = upload_values(1)
    join(store, "o1", "u1")
    fold(store, "o1", "u1", a, cuts=(2,))

    class BreaksOnSecondPage(ToyGroup):
        calls = 0

        def add(self, current: bytes, data: bytes) -> bytes:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom between two pages of one chunk")
            return super().add(current, data)

    before = store.aggregate("q1")
    with pytest.raises(RuntimeError, match="boom"):
        store.fold_chunk("q1", "o1", "u1", 2, as_bytes(a[2:8]), TOTAL, BreaksOnSecondPage())
    assert store.aggregate("q1") == before and store.partial_uploads("q1") == {"o1": 2}


def test_chunks_outside_the_layout_are_refused(store: ProxyStore) -> None:
    join(store, "o1", "u1")
    data = as_bytes(upload_values(1))
    for start, payload in ((1, data), (-1, data[:2]), (0, b""), (0, data[:3])):
        with pytest.raises(ProtocolError, match="does not fit"):
            store.fold_chunk("q1", "o1", "u1", start, payload, TOTAL, GROUP)
    assert store.aggregate("q1") == b""


def test_late_and_unknown_joins_are_refused(tmp_path: Path) -> None:
    now = [100.0]
    s = ProxyStore(tmp_path / "p.sqlite3", page_ciphertexts=PAGE, clock=lambda: now[0])
    s.create_query("q1", "alice", {"quorum": 2}, {}, deadline_at=200.0)
    join(s, "o1", "u1")
    now[0] = 200.0
    with pytest.raises(NotContributingError, match="deadline has passed"):
        join(s, "o2", "u2")
    assert join(s, "o1", "u1") == Joined(covered=0)  # a contributor may still resume
    with pytest.raises(NotFoundError):
        join(s, "o1", "u1", query="nope")
    s.set_state("q1", QueryState.FAILED, failure_reason="deadline")
    with pytest.raises(QueryStateError, match="failed: deadline"):
        join(s, "o1", "u1")


# ------------------------------------------------------------------ result pages
def noise_page(page: int, start: int, count: int) -> bytes:
    return as_bytes([7 + start + i for i in range(count)])


def test_pages_become_final_as_every_contributor_passes_them(store: ProxyStore) -> None:
    a, b = upload_values(1), upload_values(2)
    join(store, "o1", "u1")
    join(store, "o2", "u2")
    fold(store, "o1", "u1", a, cuts=(5,))
    assert store.aggregated_through("q1") == 0
    assert store.finalize_pages("q1", TOTAL, GROUP, noise_page).new_pages == 0
    fold(store, "o2", "u2", b, cuts=(4,))
    assert store.aggregated_through("q1") == 4
    first = store.finalize_pages("q1", TOTAL, GROUP, noise_page)
    assert (first.new_pages, first.pages_final, first.done) == (1, 1, False)  # page 0 only
    expected = [x * y * (7 + i) % PRIME for i, (x, y) in enumerate(zip(a, b, strict=True))]
    assert store.result_pages("q1") == [as_bytes(expected[0:3])]
    fold(store, "o1", "u1", a, cuts=(8,), start=5)
    fold(store, "o2", "u2", b, cuts=(8,), start=4)
    last = store.finalize_pages("q1", TOTAL, GROUP, noise_page)
    assert (last.new_pages, last.pages_final, last.done) == (2, 3, True)
    assert store.query("q1").state is QueryState.DONE
    assert b"".join(store.result_pages("q1")) == as_bytes(expected)
    assert store.result_pages("q1", 2) == [as_bytes(expected[6:8])]
    assert store.result_pages("q1", 0, limit=2) == [
        as_bytes(expected[0:3]),
        as_bytes(expected[3:6]),
    ]
    assert store.result_pages("q1", 1, limit=1) == [as_bytes(expected[3:6])]
    # A released page never changes; completions after DONE are still recorded.
    assert store.finalize_pages("q1", TOTAL, GROUP, None) == last.__class__(0, 3, True)
    assert complete(store, "o1", "u1", "h1").n_contributed == 1
    assert b"".join(store.result_pages("q1")) == as_bytes(expected)


def _aggregate_pages(store: ProxyStore, query_id: str) -> list[int]:
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT page FROM aggregate_pages WHERE query_id=? ORDER BY page", (query_id,)
        ).fetchall()
    return [int(row["page"]) for row in rows]


def test_the_aggregate_without_noise_is_dropped_once_its_page_is_released(
    store: ProxyStore,
) -> None:
    """The encrypted aggregate without its noise stayed on the proxy's disk beside every
    released page, for good: a page's aggregate is now deleted in the transaction that
    releases the page, and a failed query's with it."""
    a, b = upload_values(1), upload_values(2)
    join(store, "o1", "u1")
    join(store, "o2", "u2")
    fold(store, "o1", "u1", a)
    fold(store, "o2", "u2", b, cuts=(4,))
    assert store.finalize_pages("q1", TOTAL, GROUP, noise_page).pages_final == 1
    assert _aggregate_pages(store, "q1") == [1, 2]  # page 0 released, its aggregate gone
    fold(store, "o2", "u2", b, start=4)
    assert store.finalize_pages("q1", TOTAL, GROUP, noise_page).done
    assert _aggregate_pages(store, "q1") == []
    create(store, "q2", quorum=1)
    join(store, "o1", "u3", query="q2")
    fold(store, "o1", "u3", a, cuts=(5,), query="q2")
    assert _aggregate_pages(store, "q2") != []
    store.set_state("q2", QueryState.FAILED, failure_reason="test")
    assert _aggregate_pages(store, "q2") == []


def _connections_without_secure_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite as built elsewhere: secure_delete off unless a connection sets it (this
    machine's Debian build has it on by default)."""
    real = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        connection = real(*args, **kwargs)
        connection.execute("PRAGMA secure_delete=OFF")
        return connection

    monkeypatch.setattr(sqlite3, "connect", connect)


def test_a_released_aggregate_leaves_no_bytes_in_the_database_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a DELETE leaves the bytes in SQLite's free pages and in the
    write-ahead log. With secure_delete (set by the store, whatever SQLite's build
    default) and the log truncated (the proxy does it hourly), the aggregate without
    noise is in neither file once its pages are released."""
    _connections_without_secure_delete(monkeypatch)
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    create(s)
    a, b = upload_values(1), upload_values(2)
    join(s, "o1", "u1")
    join(s, "o2", "u2")
    fold(s, "o1", "u1", a)
    fold(s, "o2", "u2", b)
    aggregate = product(a, b)
    pages = [as_bytes(aggregate[0:3]), as_bytes(aggregate[3:6])]

    def on_disk() -> bytes:
        wal = path.with_name(path.name + "-wal")
        return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")

    assert all(page in on_disk() for page in pages)  # stored while it is needed
    assert s.finalize_pages("q1", TOTAL, GROUP, noise_page).done
    assert any(page in on_disk() for page in pages)  # the log still holds old frames
    s.truncate_wal()
    assert not any(page in on_disk() for page in pages)
    s.close()


def test_free_pages_left_by_an_earlier_proxy_are_scrubbed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier proxy on an SQLite without secure_delete left deleted content in free
    pages; the first open rewrites the database (VACUUM), once."""
    _connections_without_secure_delete(monkeypatch)
    path = tmp_path / "p.sqlite3"
    marker = b"fedpca-deleted-aggregate-marker" * 64
    with sqlite3.connect(path) as raw:  # an earlier proxy's leftovers, deleted plainly
        raw.execute("CREATE TABLE leftovers (data BLOB)")
        raw.executemany("INSERT INTO leftovers VALUES (?)", [(marker,)] * 400)
        raw.commit()
        raw.execute("DELETE FROM leftovers")  # the table stays: a file of no tables is refused
        raw.commit()
    assert marker in path.read_bytes()
    s = ProxyStore(path, page_ciphertexts=PAGE)
    s.truncate_wal()
    assert marker not in path.read_bytes()
    assert s._conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    s.close()
    ProxyStore(path, page_ciphertexts=PAGE).close()  # once: the flag is kept


def test_an_earlier_databases_finished_aggregates_are_dropped_when_it_opens(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    for query in ("q1", "q2"):
        create(s, query, quorum=1)
        join(s, "o1", f"u-{query}", query=query)
        fold(s, "o1", f"u-{query}", upload_values(1), cuts=(5,), query=query)
    with s.transaction() as conn:  # q1 finished under an earlier version, its pages kept
        conn.execute("UPDATE queries SET state = ? WHERE query_id = 'q1'", ("done",))
    assert _aggregate_pages(s, "q1") == [0, 1]
    s.close()
    reopened = ProxyStore(path, page_ciphertexts=PAGE)
    assert _aggregate_pages(reopened, "q1") == []
    assert _aggregate_pages(reopened, "q2") == [0, 1]  # still aggregating: kept


def test_a_completion_after_the_query_finished_keeps_its_finish_time(tmp_path: Path) -> None:
    """keep_results_days counts from the finish (updated_at): found by review, an owner's
    completion arriving after the last fold had finished the query moved it later."""
    now = [1000.0]
    s = ProxyStore(tmp_path / "p.sqlite3", page_ciphertexts=PAGE, clock=lambda: now[0])
    create(s, quorum=1)
    join(s, "o1", "u1")
    fold(s, "o1", "u1", upload_values(1))
    now[0] = 2000.0
    assert s.finalize_pages("q1", TOTAL, GROUP, None).done
    now[0] = 3000.0
    assert complete(s, "o1", "u1", "h1").n_contributed == 1
    assert s.query("q1").updated_at == 2000.0
    assert s.purge_results(2500.0) == ["q1"] and s.result_purged_at("q1") == 3000.0


def test_pages_are_not_released_while_the_contributors_are_open(store: ProxyStore) -> None:
    join(store, "o1", "u1")
    fold(store, "o1", "u1", upload_values(1))
    assert store.finalize_pages("q1", TOTAL, GROUP, None).pages_final == 0
    assert store.pages_final("q1") == 0


def test_a_masked_result_is_stored_once_as_pages_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    create(s, quorum=1)
    with pytest.raises(QueryStateError, match="cannot store a result"):
        s.store_result("q1", b"", {})
    join(s, "o1", "u1", meta={"n_owners": 1})
    fold(s, "o1", "u1", upload_values(1), query="q1")
    assert _aggregate_pages(s, "q1") != []
    s.set_state("q1", QueryState.NOISING, expect=(QueryState.AGGREGATING,))
    data = bytes(range(2 * 7))  # 7 one-byte-key "ciphertexts" of 2 bytes: pages 3, 3, 1
    s.store_result("q1", data, {"timings": {"noise_seconds": 1.0}})
    assert _aggregate_pages(s, "q1") == []  # the aggregate without the mask is gone
    with pytest.raises(QueryStateError):
        s.store_result("q1", data, {})
    s.close()
    reopened = ProxyStore(path, page_ciphertexts=PAGE)
    assert reopened.result_pages("q1") == [data[0:6], data[6:12], data[12:14]]
    assert reopened.result_meta("q1") == {"n_owners": 1, "timings": {"noise_seconds": 1.0}}
    assert reopened.query("q1").state is QueryState.DONE


# -------------------------------------------------------------------- group commit
def test_concurrent_folds_share_commits_and_all_are_durable(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path, page_ciphertexts=PAGE)
    owners = [f"o{i}" for i in range(12)]
    create(s, quorum=len(owners))
    for owner in owners:
        join(s, owner, f"u-{owner}")
    barrier = threading.Barrier(len(owners))
    errors: list[BaseException] = []

    def upload(index: int, owner: str) -> None:
        try:
            barrier.wait()
            fold(s, owner, f"u-{owner}", upload_values(index), cuts=(1, 2, 3, 4, 5, 6, 7, 8))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=upload, args=(i, o)) for i, o in enumerate(owners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    operations, commits = s.commit_stats
    assert operations == len(owners) * (TOTAL + 1)  # every join and every fold
    assert commits < operations  # some shared a commit (concurrent writers)
    s.close()
    reopened = ProxyStore(path, page_ciphertexts=PAGE)
    assert aggregate(reopened) == product(*(upload_values(i) for i in range(len(owners))))


def test_a_failing_operation_of_a_group_fails_alone(tmp_path: Path) -> None:
    s = ProxyStore(tmp_path / "p.sqlite3", page_ciphertexts=PAGE)
    create(s, quorum=2)
    join(s, "o1", "u1")
    join(s, "o2", "u2")
    started = threading.Event()
    release = threading.Event()

    class Slow(ToyGroup):
        def add(self, current: bytes, data: bytes) -> bytes:
            started.set()
            release.wait(5)
            return super().add(current, data)

    a, b = upload_values(1), upload_values(2)
    outcomes: dict[str, Any] = {}

    def slow_fold() -> None:  # leads the first group, holding the others back
        outcomes["slow"] = s.fold_chunk("q1", "o1", "u1", 0, as_bytes(a[:3]), TOTAL, Slow())

    def bad_fold() -> None:
        try:
            s.fold_chunk("q1", "o2", "u2", 5, as_bytes(b[5:8]), TOTAL, GROUP)
        except ProtocolError as exc:
            outcomes["bad"] = exc

    def good_fold() -> None:
        outcomes["good"] = s.fold_chunk("q1", "o2", "u2", 0, as_bytes(b[:3]), TOTAL, GROUP)

    leader = threading.Thread(target=slow_fold)
    leader.start()
    assert started.wait(5)
    others = [threading.Thread(target=bad_fold), threading.Thread(target=good_fold)]
    for thread in others:
        thread.start()
    release.set()
    for thread in [leader, *others]:
        thread.join()
    assert outcomes["slow"].folded and outcomes["good"].folded
    assert isinstance(outcomes["bad"], ProtocolError)
    assert s.partial_uploads("q1") == {"o1": 3, "o2": 3}


def test_without_group_commit_every_operation_commits_alone(tmp_path: Path) -> None:
    s = ProxyStore(tmp_path / "p.sqlite3", page_ciphertexts=PAGE, group_commit=False)
    create(s, quorum=1)
    join(s, "o1", "u1")
    fold(s, "o1", "u1", upload_values(1), cuts=(2, 4, 8))
    assert s.commit_stats == (4, 4)


# ------------------------------------------------------------------ the rest
def test_unknown_query_and_conflicting_resubmission(store: ProxyStore) -> None:
    with pytest.raises(NotFoundError):
        store.query("nope")
    with pytest.raises(NotFoundError):
        fold(store, "o1", "u", upload_values(1), query="nope")
    with pytest.raises(NotFoundError):
        complete(store, "o1", "u", "h", query="nope")
    assert store.create_query("q1", "alice", {"quorum": 2}, {}, 1e12).query_id == "q1"
    with pytest.raises(ProtocolError, match="different spec"):
        store.create_query("q1", "alice", {"k": 2}, {}, 1e12)


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
    from fedpca.proxy.store_records import PAGE_CIPHERTEXTS

    width = ciphertext_byte_length(2048)
    assert ciphertexts_per_chunk(width, UPLOAD_CHUNK_BYTES) == PAGE_CIPHERTEXTS


def test_a_failed_query_is_refunded_only_if_no_upload_began(store: ProxyStore) -> None:
    create(store, "q2")
    with store.transaction() as conn:
        store.record_release(conn, "alice", "q1", {"query_id": "q1"})
        store.record_release(conn, "alice", "q2", {"query_id": "q2"})
    assert not store.query("q1").uploads_begun
    join(store, "o1", "u1")
    fold(store, "o1", "u1", upload_values(1), cuts=(3,))
    assert store.query("q1").uploads_begun and not store.query("q2").uploads_begun
    store.set_state("q1", QueryState.FAILED, failure_reason="deadline")
    store.set_state("q2", QueryState.FAILED, failure_reason="deadline")
    # q2 never saw an upload begin: refunded; q1 did (owners may have spent): charged.
    assert store.releases("alice") == [{"query_id": "q1"}]
    assert store.partial_uploads("q1") == {"o1": 3}  # the mark stays; staged copies go
    with store.transaction() as conn:
        assert conn.execute("SELECT COUNT(*) FROM staged_chunks").fetchone()[0] == 0


def test_declines_are_recorded_only_while_collecting_and_before_an_upload(
    store: ProxyStore,
) -> None:
    assert store.record_decline("q1", "o2", "policy_refusal: epsilon")
    # A second decline changes nothing (review, stop 42: each was a write, at the owner's
    # rate, and rewrote the reason the analyst reads).
    assert not store.record_decline("q1", "o2", "key_not_pinned")
    assert store.declines("q1") == {"o2": "policy_refusal: epsilon"}
    # An owner that declined does not become a contributor as well (review, stop 42:
    # counted as both, it made the quorum look unreachable and failed the query).
    with pytest.raises(NotContributingError, match="'o2' declined it"):
        join(store, "o2", "u2")
    assert store.contributors("q1") == []
    create(store, "q2", quorum=1)
    join(store, "o1", "u1", query="q2")
    fold(store, "o1", "u1", upload_values(1), query="q2")
    complete(store, "o1", "u1", "h1", query="q2")
    with pytest.raises(QueryStateError, match="no longer recorded"):
        store.record_decline("q2", "o1", "policy_refusal")
    with pytest.raises(NotFoundError):
        store.record_decline("nope", "o1", "policy_refusal")
    # An owner whose upload runs is not also counted as declined (review: the quorum
    # was fixed with an owner that would never finish).
    create(store, "q3", quorum=3)
    join(store, "o1", "u1", query="q3")
    with pytest.raises(QueryStateError, match="is uploading to it"):
        store.record_decline("q3", "o1", "policy_refusal")
    assert store.declines("q3") == {}
    join(store, "o1", "u1")
    join(store, "o3", "u3")  # fixed: nobody else is needed, declines are not recorded
    with pytest.raises(QueryStateError, match="no longer recorded"):
        store.record_decline("q1", "o4", "policy_refusal")
    assert store.declines("q1") == {"o2": "policy_refusal: epsilon"}


# -------------------------------------------------------------------- migrations
def _old_database(path: Path, version: int) -> None:
    """A database as fedpca 0.2.0 (schema 3) left it, or older (fewer columns)."""
    conn = sqlite3.connect(str(path))
    with conn:
        conn.executescript(V3_SCHEMA.read_text())
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(version),))
        plan = json.dumps({"key_bits": 8, "result_blocks": [{"name": "a"}, {"name": "b"}]})
        for query, analyst, mode, state in (
            ("q-stats", "alice", "stats", "done"),
            ("q-masked", "bob", "masked", "failed"),
        ):
            key = query if version < 3 else f"{analyst}/{query}"
            conn.execute(
                "INSERT INTO queries(query_id, analyst_id, spec, plan, state, created_at, "
                "deadline_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, 2, 3)",
                (key, analyst, json.dumps({"mode": mode}), plan, state),
            )
        stats = "q-stats" if version < 3 else "alice/q-stats"
        # Blocks "a" (2 ciphertexts) and "b" (3), 2 bytes each: pages of 3 in wire order.
        conn.execute("INSERT INTO results VALUES (?, 'b', x'0b010b020b03')", (stats,))
        conn.execute("INSERT INTO results VALUES (?, 'a', x'0a010a02')", (stats,))
        conn.execute("INSERT INTO result_meta VALUES (?, '{\"n_owners\": 1}')", (stats,))
        for (analyst, query), z in _OLD_EVENTS.items():
            event = {
                "query_id": query if version < 3 else f"{analyst}/{query}",
                "analyst": analyst,
                "noise_multiplier": z,
                "epsilon": 1.0,
                "delta": 1e-5,
                "timestamp": 1.7e9,
            }
            if version >= 3:
                event["neighbouring"] = "add-remove"
            conn.execute(
                "INSERT INTO releases VALUES (?, ?, ?, 1)",
                (event["query_id"], analyst, json.dumps(event)),
            )
        if version < 3:
            for column in ("signature", "signer", "uploads_begun"):
                conn.execute(f"ALTER TABLE queries DROP COLUMN {column}")
        if version == 1:
            conn.execute("CREATE TABLE aggregates (query_id TEXT, block TEXT, data BLOB)")
    conn.close()


_OLD_EVENTS = {("alice", "q-stats"): 2.0, ("bob", "q-masked"): 4.0}


def test_a_reader_leaves_an_older_database_as_it_is(tmp_path: Path) -> None:
    """``proxy status`` opened the database as the proxy does, so the new version's
    status migrated a file that the older proxy serving it still used (review)."""
    path = tmp_path / "old.sqlite3"
    _old_database(path, 3)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=r"schema version 3, this fedpca reads 5.*proxy serve"):
        ProxyStore(path, page_ciphertexts=PAGE, read_only=True)
    assert path.read_bytes() == before
    ProxyStore(path, page_ciphertexts=PAGE).close()  # the proxy itself migrates it
    reader = ProxyStore(path, page_ciphertexts=PAGE, read_only=True)
    assert {r.query_id for r in reader.queries()} == {"alice/q-stats", "bob/q-masked"}
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.create_query("alice/q-new", "alice", {}, {}, deadline_at=10.0)
    reader.close()
    with pytest.raises(ConfigError, match="no proxy database"):
        ProxyStore(tmp_path / "missing.sqlite3", read_only=True)
    assert not (tmp_path / "missing.sqlite3").exists()


def test_an_sqlite_file_without_tables_is_not_taken_for_a_new_database(tmp_path: Path) -> None:
    """A backup taken of the wrong path is an SQLite file with no tables; a proxy
    started on it created its tables and started every budget again (review)."""
    path = tmp_path / "backup.sqlite3"
    source = sqlite3.connect(str(tmp_path / "nothing-here.sqlite3"))
    target = sqlite3.connect(str(path))
    source.backup(target)
    source.close()
    target.close()
    assert path.stat().st_size > 0
    with pytest.raises(ConfigError, match="SQLite file with no tables"):
        ProxyStore(path, page_ciphertexts=PAGE)
    with sqlite3.connect(str(path)) as check:
        assert check.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_databases_are_migrated_with_results_as_pages(tmp_path: Path, version: int) -> None:
    path = tmp_path / "old.sqlite3"
    _old_database(path, version)
    store = ProxyStore(path, page_ciphertexts=PAGE)
    assert {r.query_id for r in store.queries()} == {"alice/q-stats", "bob/q-masked"}
    # The result's blocks, in its plan's order (a then b), cut into pages of 3.
    assert store.result_pages("alice/q-stats") == [
        bytes.fromhex("0a010a020b01"),
        bytes.fromhex("0b020b03"),
    ]
    assert store.result_meta("alice/q-stats") == {"n_owners": 1}
    conn = sqlite3.connect(str(path))
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    stored = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    conn.close()
    assert not {"aggregates", "results", "upload_chunks"} & tables
    assert {"contributors", "staged_chunks", "result_pages"} <= tables
    assert stored == str(SCHEMA_VERSION) == "5"


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_database_with_a_query_in_flight_is_refused(tmp_path: Path, version: int) -> None:
    path = tmp_path / "old.sqlite3"
    _old_database(path, version)
    conn = sqlite3.connect(str(path))
    with conn:
        conn.execute("UPDATE queries SET state='collecting' WHERE query_id LIKE '%q-masked'")
    conn.close()
    with pytest.raises(QueryStateError, match=r"in flight \(.*q-masked\).*previous fedpca"):
        ProxyStore(path)
    conn = sqlite3.connect(str(path))  # untouched: the old version can still finish it
    assert conn.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 2
    conn.close()


@pytest.mark.parametrize("relation", list(Neighbouring))
def test_a_version_2_database_is_keyed_by_analyst_and_its_releases_restated(
    tmp_path: Path, relation: Neighbouring
) -> None:
    path = tmp_path / "v2.sqlite3"
    _old_database(path, 2)
    store = ProxyStore(path, page_ciphertexts=PAGE, neighbouring=relation)
    # Every query under its task id, as having had uploads (no refund for what
    # fedpca 0.1 may have let owners spend).
    records = {r.query_id: r for r in store.queries()}
    assert all(r.uploads_begun and r.signature == b"" and r.signer == "" for r in records.values())
    for old in ("q-stats", "q-masked"):
        with pytest.raises(NotFoundError):
            store.query(old)
    # Releases restated under the deployment's relation (docs/privacy.md, "Ledgers of
    # fedpca 0.1"): stats mode keeps its add/remove z, or half of it under replace-one;
    # masked mode keeps its replace-one z, or has no finite epsilon under add/remove.
    events = {
        e.query_id: e
        for analyst in ("alice", "bob")
        for e in (PrivacyEvent.from_dict(r) for r in store.releases(analyst))
    }
    assert set(events) == {"alice/q-stats", "bob/q-masked"}
    assert {e.neighbouring for e in events.values()} == {relation}
    halve = 2.0 if relation is Neighbouring.REPLACE_ONE else 1.0
    assert events["alice/q-stats"].noise_multiplier == 2.0 / halve
    masked = events["bob/q-masked"]
    if relation is Neighbouring.REPLACE_ONE:
        assert masked.noise_multiplier == 4.0 and masked.epsilon == 1.0
    else:
        assert masked.noise_multiplier == 0.0 and math.isinf(masked.epsilon)
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
    _old_database(path, 2)
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
    assert budget.n_releases == 1 and 0 < budget.epsilon_spent < math.inf


def test_an_owner_ledger_and_a_proxy_database_are_told_apart(tmp_path: Path) -> None:
    """Found by review: the proxy opened an owner's ledger, made its own tables in it,
    then said its schema version "is not supported"; an owner's ledger did the same to
    a proxy database. Each names the other's file and leaves it untouched."""
    ledger_path = tmp_path / "ledger.sqlite3"
    BudgetLedger(ledger_path)
    database_path = tmp_path / "proxy.sqlite3"
    ProxyStore(database_path).close()

    def tables(path: Path) -> set[str]:
        with sqlite3.connect(path) as raw:
            return {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}

    before = (tables(ledger_path), tables(database_path))
    with pytest.raises(ConfigError, match="is an owner's budget ledger, not a proxy database"):
        ProxyStore(ledger_path)
    with pytest.raises(ConfigError, match="is a proxy database, not an owner's budget ledger"):
        BudgetLedger(database_path)
    assert (tables(ledger_path), tables(database_path)) == before


def test_a_commit_that_fails_is_rolled_back_and_the_store_goes_on(tmp_path: Path) -> None:
    """A COMMIT that fails (here a deferred foreign key, checked only at COMMIT; in use
    a full disk or a lock) left SQLite's transaction open: every later transaction of
    the proxy then failed with "cannot start a transaction within a transaction". It is
    now rolled back, and what it wrote is gone."""
    s = ProxyStore(tmp_path / "proxy.sqlite3", page_ciphertexts=PAGE)
    with s.transaction() as conn:
        conn.execute(
            "CREATE TABLE checked_at_commit (query_id TEXT REFERENCES queries(query_id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"), s.transaction() as conn:
        conn.execute("INSERT INTO checked_at_commit VALUES ('no such query')")
    with s.transaction() as conn:  # was: OperationalError, a transaction within one
        assert conn.execute("SELECT COUNT(*) FROM checked_at_commit").fetchone()[0] == 0


def test_recent_failures_are_kept_and_read_without_waiting_for_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owners' task streams read them on the proxy's event loop: under the
    database's lock, a transaction waiting for a busy database (up to 30 s) froze every
    peer's calls for as long (red team, stop 43)."""
    monkeypatch.setattr(proxy_store, "RECENT_FAILURES_KEPT", 3)
    store = ProxyStore(tmp_path / "proxy.sqlite3")
    for index in range(5):
        store.create_query(f"a/q{index}", "a", {"quorum": 2}, {}, deadline_at=10**10)
        store.set_state(f"a/q{index}", QueryState.FAILED, failure_reason=f"reason {index}")
    store.create_query("a/open", "a", {"quorum": 2}, {}, deadline_at=10**10)
    # The latest three, in memory; older ones and queries that did not fail: None.
    assert [store.recent_failure(f"a/q{index}") for index in range(5)] == [
        None,
        None,
        "reason 2",
        "reason 3",
        "reason 4",
    ]
    assert store.recent_failure("a/open") is None
    # Read while another thread holds a transaction open.
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with store.transaction():
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        answers: list[str | None] = []
        reader = threading.Thread(target=lambda: answers.append(store.recent_failure("a/q4")))
        reader.start()
        reader.join(5)
        assert answers == ["reason 4"], "recent_failure waited for the database's lock"
    finally:
        leave.set()
        holder.join()
        store.close()
