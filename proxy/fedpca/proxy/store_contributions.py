"""Contributions to a query: owners joining, chunks folded into the paged encrypted
aggregate with their marks, uploads completed, taken out or resumed, and result pages
made final (see :mod:`fedpca.proxy.store` for the crash-safety rules).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedpca.errors import ProtocolError, QueryStateError
from fedpca.messages import QueryState
from fedpca.proxy.store_database import StoreDatabase
from fedpca.proxy.store_records import (
    OPEN_STATES,
    CiphertextAlgebra,
    Contributor,
    Finalized,
    Folded,
    Joined,
    NotContributingError,
    QueryClosedError,
    QueryRecord,
    UploadCompletion,
    UploadRecord,
    page_count,
    quorum_of,
)

__all__ = ["ContributionStore"]

logger = logging.getLogger(__name__)


class ContributionStore(StoreDatabase):
    """The contributions part of the proxy's store (joins, folds, uploads, pages)."""

    def join(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        *,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        public_count: int | None = None,
        on_fixed: Callable[[Sequence[Contributor]], Mapping[str, Any]] | None = None,
    ) -> Joined:
        """Let an owner begin (or resume) its upload to a query.

        The first ``quorum`` owners to begin become the query's contributors; the one
        that completes the set moves the query to AGGREGATING, drops the staged chunks
        (nothing is taken out from now on) and stores ``on_fixed(contributors)`` as the
        result's metadata, in the same transaction. A contributor that comes back with
        the same upload id resumes after its mark; with another upload id it starts over
        while the set is open (its chunks are taken out) and is refused once it is fixed.

        Raises
        ------
        NotFoundError
            Unknown query.
        NotContributingError
            The owner is not a contributor and the query no longer takes new ones
            (contributors fixed, ended, or past its deadline), or the owner declined it.
        QueryClosedError
            The query failed (for a contributor).
        QueryStateError
            The store is inconsistent (an aggregate page missing when an upload that
            starts over is taken out).
        ProtocolError
            Another upload of this owner was accepted or is being aggregated.
        """

        def operation(conn: sqlite3.Connection) -> Joined:
            query = self._query_row(conn, query_id)
            state = QueryState(query["state"])
            accepted = conn.execute(
                "SELECT upload_id FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if accepted is not None:
                if accepted["upload_id"] == upload_id:
                    return Joined(covered=total_ciphertexts, duplicate=True)
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            mine = self._contributor(conn, query_id, owner_id)
            if mine is not None:
                if state is QueryState.FAILED:
                    raise QueryClosedError(
                        f"query {query_id!r} failed: {query['failure_reason'] or 'no reason'}"
                    )
                if mine.upload_id == upload_id:
                    return Joined(covered=mine.covered)
                if state is not QueryState.COLLECTING:
                    raise ProtocolError(
                        f"upload {mine.upload_id!r} of owner {owner_id!r} is being aggregated "
                        f"into query {query_id!r}; resume it with the same upload id (a new "
                        f"upload {upload_id!r} cannot replace it)"
                    )
                self._take_out(conn, query_id, owner_id, total_ciphertexts, algebra)
                conn.execute(
                    "UPDATE contributors SET upload_id=?, covered=0, public_count=?, "
                    "joined_at=? WHERE query_id=? AND owner_id=?",
                    (upload_id, public_count, self._clock(), query_id, owner_id),
                )
                return Joined(covered=0)
            if self._has_owner_row(conn, "declines", query_id, owner_id):
                # Counted as declined and as a contributor, it failed the query early
                # (quorum unreachable) though it could still be reached (review, stop 42).
                raise NotContributingError(f"query {query_id!r}: owner {owner_id!r} declined it")
            if state is not QueryState.COLLECTING:
                raise NotContributingError(
                    f"query {query_id!r} is {state.value}: its contributors are fixed"
                    if state is QueryState.AGGREGATING
                    else f"query {query_id!r} is {state.value}: uploads are no longer accepted"
                )
            if self._clock() >= float(query["deadline_at"]):
                raise NotContributingError(f"query {query_id!r}: the upload deadline has passed")
            conn.execute(
                "INSERT INTO contributors(query_id, owner_id, upload_id, covered, public_count, "
                "joined_at) VALUES (?, ?, ?, 0, ?, ?)",
                (query_id, owner_id, upload_id, public_count, self._clock()),
            )
            conn.execute("UPDATE queries SET uploads_begun=1 WHERE query_id=?", (query_id,))
            quorum = quorum_of(json.loads(query["summary"]))
            if self._contributor_count(conn, query_id) < quorum:
                return Joined(covered=0)
            contributors = self._contributors(conn, query_id)
            conn.execute("DELETE FROM staged_chunks WHERE query_id=?", (query_id,))
            conn.execute(
                "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                (QueryState.AGGREGATING.value, self._clock(), query_id),
            )
            if on_fixed is not None:
                conn.execute(
                    "INSERT INTO result_meta(query_id, meta) VALUES (?, ?) "
                    "ON CONFLICT(query_id) DO UPDATE SET meta=excluded.meta",
                    (query_id, json.dumps(dict(on_fixed(contributors)), sort_keys=True)),
                )
            return Joined(covered=0, fixed=True)

        return self._group.run(operation)

    def contributors(self, query_id: str) -> list[Contributor]:
        """The query's contributors so far, in the order they joined."""
        with self._lock:
            return self._contributors(self._conn, query_id)

    def abandon(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        *,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> int:
        """An upload's stream broke: while the contributors are not fixed, take its chunks
        out and give its place up (it may join again); afterwards keep them, so it
        resumes. Returns the number of chunks taken out."""
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.COLLECTING:
                return 0
            mine = self._contributor(conn, query_id, owner_id)
            completed = self._has_owner_row(conn, "uploads", query_id, owner_id)
            if mine is None or mine.upload_id != upload_id or completed:
                return 0
            removed = self._take_out(conn, query_id, owner_id, total_ciphertexts, algebra)
            conn.execute(
                "DELETE FROM contributors WHERE query_id=? AND owner_id=?", (query_id, owner_id)
            )
            return removed

    def discard_partial_uploads(
        self, query_id: str, *, total_ciphertexts: int, algebra: CiphertextAlgebra
    ) -> int:
        """Proxy start-up: the streams of a COLLECTING query died with the previous
        process; take their chunks out and free their places. Returns the chunks taken
        out (0 once the contributors are fixed: they resume instead)."""
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.COLLECTING:
                return 0
            removed = 0
            for mine in self._contributors(conn, query_id):
                if self._has_owner_row(conn, "uploads", query_id, mine.owner_id):
                    continue
                removed += self._take_out(conn, query_id, mine.owner_id, total_ciphertexts, algebra)
                conn.execute(
                    "DELETE FROM contributors WHERE query_id=? AND owner_id=?",
                    (query_id, mine.owner_id),
                )
            return removed

    def partial_uploads(self, query_id: str) -> dict[str, int]:
        """owner id -> ciphertexts folded, for contributors whose upload is not complete."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT c.owner_id, c.covered FROM contributors c WHERE c.query_id=? AND NOT "
                "EXISTS (SELECT 1 FROM uploads u WHERE u.query_id=c.query_id AND "
                "u.owner_id=c.owner_id)",
                (query_id,),
            ).fetchall()
        return {str(r["owner_id"]): int(r["covered"]) for r in rows}

    def fold_chunk(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        offset: int,
        data: bytes,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> Folded:
        """Fold one checked chunk of a contributor's upload into the aggregate, durably.

        A chunk ending at or below the contributor's mark was folded before (a retry or
        a resumed upload) and is skipped; a chunk starting at the mark is multiplied
        into the aggregate pages and the mark moves past it in the same transaction
        (while the contributors are not fixed, a copy is staged for a take-out).
        Concurrent folds share one commit.

        Raises
        ------
        NotFoundError, QueryClosedError
            Unknown query, or it no longer aggregates.
        ProtocolError
            The owner is not a contributor with this upload, or the chunk does not
            start at its mark or lies outside the layout.
        """
        count, rest = divmod(len(data), algebra.width)
        if rest or count < 1 or offset < 0 or offset + count > total_ciphertexts:
            raise ProtocolError(
                f"upload {upload_id!r}: a chunk of {len(data)} bytes at position {offset} "
                f"does not fit {total_ciphertexts} ciphertexts of {algebra.width} bytes"
            )

        def operation(conn: sqlite3.Connection) -> Folded:
            query = self._query_row(conn, query_id)
            mine = self._contributor(conn, query_id, owner_id)
            if mine is None or mine.upload_id != upload_id:
                raise ProtocolError(
                    f"upload {upload_id!r} of owner {owner_id!r} is not a contribution to "
                    f"query {query_id!r} (begin the upload again)"
                )
            if offset + count <= mine.covered:
                return Folded(folded=False, covered=mine.covered)
            if offset != mine.covered:
                raise ProtocolError(
                    f"upload {upload_id!r}: a chunk at position {offset}, the proxy holds "
                    f"the first {mine.covered} ciphertexts of this upload"
                )
            state = QueryState(query["state"])
            if state not in OPEN_STATES:
                raise QueryClosedError(
                    f"query {query_id!r} is {state.value}: uploads are no longer accepted"
                )
            self._apply(conn, query_id, offset, data, total_ciphertexts, algebra, inverse=False)
            if state is QueryState.COLLECTING:
                conn.execute(
                    "INSERT INTO staged_chunks(query_id, owner_id, start_index, data) "
                    "VALUES (?, ?, ?, ?)",
                    (query_id, owner_id, offset, data),
                )
            covered = offset + count
            conn.execute(
                "UPDATE contributors SET covered=? WHERE query_id=? AND owner_id=?",
                (covered, query_id, owner_id),
            )
            return Folded(folded=True, covered=covered)

        return self._group.run(operation)

    def complete_upload(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        content_sha256: str,
        n_ciphertexts: int,
        *,
        public_count: int | None = None,
        resent: bool = False,
    ) -> UploadCompletion:
        """Record a contributor's fully received upload as accepted, exactly once.

        A retry of an already accepted upload (same owner, upload id and ciphertexts)
        changes nothing and returns ``duplicate=True``; so does one whose stream joined
        after that upload was accepted (``resent``: nothing of it was folded), whatever
        its ciphertexts (an owner that restarted before recording the acceptance
        encrypts its kept share again, with fresh randomness: found by review).

        Raises
        ------
        ProtocolError
            A different upload of this owner was accepted, the folded chunks do not
            cover the layout, or these ciphertexts were accepted for another query
            (a replay; its chunks stay folded, so the query cannot finish).
        QueryClosedError
            The query failed.
        """
        now = self._clock()

        def operation(conn: sqlite3.Connection) -> UploadCompletion:
            query = self._query_row(conn, query_id)
            previous = conn.execute(
                "SELECT upload_id, content_sha256 FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if previous is not None:
                if previous["upload_id"] == upload_id:
                    if previous["content_sha256"] != content_sha256 and not resent:
                        raise ProtocolError(
                            f"upload {upload_id!r} was accepted with other ciphertexts; a "
                            "retry must resend the very same upload"
                        )
                    return UploadCompletion(
                        duplicate=True, n_contributed=int(query["n_contributed"])
                    )
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            if QueryState(query["state"]) is QueryState.FAILED:
                raise QueryClosedError(
                    f"query {query_id!r} failed: {query['failure_reason'] or 'no reason'}"
                )
            mine = self._contributor(conn, query_id, owner_id)
            covered = 0 if mine is None or mine.upload_id != upload_id else mine.covered
            if covered != n_ciphertexts:
                raise ProtocolError(
                    f"upload {upload_id!r}: its folded chunks cover {covered} of "
                    f"{n_ciphertexts} ciphertexts"
                )
            replay = conn.execute(
                "SELECT query_id FROM uploads WHERE content_sha256=?", (content_sha256,)
            ).fetchone()
            if replay is not None:
                raise ProtocolError(
                    f"these ciphertexts were already accepted for query {replay['query_id']!r}: "
                    "replayed uploads are refused"
                )
            conn.execute(
                "INSERT INTO uploads(query_id, owner_id, upload_id, content_sha256, "
                "n_ciphertexts, public_count, accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (query_id, owner_id, upload_id, content_sha256, n_ciphertexts, public_count, now),
            )
            n_contributed = int(query["n_contributed"]) + 1
            # A completion after the query finished (its last fold finished it first)
            # leaves updated_at at the finish, which [proxy] keep_results_days counts from.
            finished = QueryState(query["state"]).terminal
            conn.execute(
                "UPDATE queries SET n_contributed=?, updated_at=? WHERE query_id=?",
                (n_contributed, query["updated_at"] if finished else now, query_id),
            )
            return UploadCompletion(duplicate=False, n_contributed=n_contributed)

        completion = self._group.run(operation)
        if not completion.duplicate:
            logger.info(
                "query %s: accepted upload from %s (%d owners)",
                query_id,
                owner_id,
                completion.n_contributed,
            )
        return completion

    def has_upload(self, query_id: str, owner_id: str) -> bool:
        """Whether an upload of this owner to the query was accepted (one indexed row)."""
        with self._lock:
            return self._has_owner_row(self._conn, "uploads", query_id, owner_id)

    def uploads(self, query_id: str) -> list[UploadRecord]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM uploads WHERE query_id=? ORDER BY accepted_at", (query_id,)
            ).fetchall()
        return [
            UploadRecord(
                query_id=str(r["query_id"]),
                owner_id=str(r["owner_id"]),
                upload_id=str(r["upload_id"]),
                content_sha256=str(r["content_sha256"]),
                n_ciphertexts=int(r["n_ciphertexts"]),
                public_count=None if r["public_count"] is None else int(r["public_count"]),
                accepted_at=float(r["accepted_at"]),
            )
            for r in rows
        ]

    def aggregate(self, query_id: str) -> bytes:
        """The query's encrypted aggregate: all pages, in wire order (b"" before any fold).

        Whole only until pages are released: a stats-mode page's aggregate is deleted
        when its result page is written (masked mode reads this before its result)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT page, data FROM aggregate_pages WHERE query_id=? ORDER BY page",
                (query_id,),
            ).fetchall()
        if [int(r["page"]) for r in rows] != list(range(len(rows))):
            raise QueryStateError(f"query {query_id!r}: its aggregate has missing pages")
        return b"".join(bytes(r["data"]) for r in rows)

    def aggregated_through(self, query_id: str) -> int:
        """Ciphertexts (from the start) that every contributor has folded; 0 before the
        contributors are fixed."""
        with self._lock:
            query = self._query_row(self._conn, query_id)
            if QueryState(query["state"]) is QueryState.COLLECTING:
                return 0
            row = self._conn.execute(
                "SELECT MIN(covered) AS lowest FROM contributors WHERE query_id=?", (query_id,)
            ).fetchone()
        return int(row["lowest"] or 0)

    def finalize_pages(
        self,
        query_id: str,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        page_noise: Callable[[int, int, int], bytes] | None,
        *,
        limit: int | None = None,
    ) -> Finalized:
        """Release every page of an AGGREGATING query that all contributors have covered
        (and, with ``limit``, only the first ``limit`` pages: those whose noise is drawn).

        Page ``p``'s result is its aggregate times ``page_noise(p, start, count)`` (the
        encoded noise of wire positions ``start .. start + count - 1``; None: no noise,
        epsilon = inf). A released page is never changed. When the last page is final
        the query is DONE.
        """
        size = self.page_ciphertexts
        pages = page_count(total_ciphertexts, size)
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            existing = int(
                conn.execute(
                    "SELECT COUNT(*) AS n FROM result_pages WHERE query_id=?", (query_id,)
                ).fetchone()["n"]
            )
            if QueryState(query["state"]) is not QueryState.AGGREGATING:
                return Finalized(0, existing, QueryState(query["state"]) is QueryState.DONE)
            lowest = int(
                conn.execute(
                    "SELECT MIN(covered) AS lowest FROM contributors WHERE query_id=?",
                    (query_id,),
                ).fetchone()["lowest"]
                or 0
            )
            ready = pages if lowest >= total_ciphertexts else lowest // size
            if limit is not None:
                ready = min(ready, limit)
            for page in range(existing, ready):
                row = conn.execute(
                    "SELECT data FROM aggregate_pages WHERE query_id=? AND page=?",
                    (query_id, page),
                ).fetchone()
                if row is None:
                    raise QueryStateError(f"query {query_id!r}: aggregate page {page} is missing")
                data = bytes(row["data"])
                start = page * size
                count = min(size, total_ciphertexts - start)
                if page_noise is not None:
                    data = algebra.add(data, page_noise(page, start, count))
                conn.execute(
                    "INSERT INTO result_pages(query_id, page, data) VALUES (?, ?, ?)",
                    (query_id, page, data),
                )
                # The aggregate without its noise is never needed again (a final page is
                # never recomputed): it does not stay on the proxy's disk beside it.
                conn.execute(
                    "DELETE FROM aggregate_pages WHERE query_id=? AND page=?", (query_id, page)
                )
            done = ready == pages
            if done:
                conn.execute(
                    "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                    (QueryState.DONE.value, self._clock(), query_id),
                )
        return Finalized(max(0, ready - existing), max(ready, existing), done)

    def store_result(self, query_id: str, data: bytes, meta: Mapping[str, Any]) -> QueryRecord:
        """Store a whole result computed at the end (masked mode) as pages and mark the
        query DONE, in one transaction. Only a NOISING query can receive one, so a result
        is never overwritten (a restarted proxy that already finished finds DONE)."""
        size = self.page_ciphertexts
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.NOISING:
                raise QueryStateError(
                    f"query {query_id!r} is {query['state']}: cannot store a result"
                )
            width = 2 * ((int(json.loads(query["summary"])["key_bits"]) + 7) // 8)
            step = size * width
            for page, start in enumerate(range(0, len(data), step)):
                conn.execute(
                    "INSERT INTO result_pages(query_id, page, data) VALUES (?, ?, ?)",
                    (query_id, page, data[start : start + step]),
                )
            conn.execute("DELETE FROM aggregate_pages WHERE query_id=?", (query_id,))
            self._merge_meta(conn, query_id, meta)
            conn.execute(
                "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                (QueryState.DONE.value, self._clock(), query_id),
            )
        return self.query(query_id)

    def update_result_meta(self, query_id: str, meta: Mapping[str, Any]) -> None:
        """Merge ``meta`` into the metadata stored with a query's result."""
        with self.transaction() as conn:
            self._merge_meta(conn, query_id, meta)

    def result_meta(self, query_id: str) -> dict[str, Any] | None:
        """The metadata stored with a query's result (None before its contributors are
        fixed)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT meta FROM result_meta WHERE query_id=?", (query_id,)
            ).fetchone()
        return None if row is None else dict(json.loads(row["meta"]))

    def result_pages(self, query_id: str, start: int = 0, limit: int | None = None) -> list[bytes]:
        """The final result pages from ``start`` on, in order (at most ``limit``)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT page, data FROM result_pages WHERE query_id=? AND page>=? ORDER BY page "
                "LIMIT ?",
                (query_id, start, -1 if limit is None else limit),
            ).fetchall()
        pages = []
        for expected, row in enumerate(rows, start):
            if int(row["page"]) != expected:
                break
            pages.append(bytes(row["data"]))
        return pages

    def pages_final(self, query_id: str) -> int:
        """How many result pages are final."""
        with self._lock:
            row = self._conn.execute(
                "SELECT COUNT(*) AS n FROM result_pages WHERE query_id=?", (query_id,)
            ).fetchone()
        return int(row["n"])

    def _take_out(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        owner_id: str,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> int:
        """Multiply the inverses of an owner's staged chunks into the aggregate."""
        rows = conn.execute(
            "SELECT start_index, data FROM staged_chunks WHERE query_id=? AND owner_id=?",
            (query_id, owner_id),
        ).fetchall()
        for row in rows:
            self._apply(
                conn,
                query_id,
                int(row["start_index"]),
                bytes(row["data"]),
                total_ciphertexts,
                algebra,
                inverse=True,
            )
        conn.execute(
            "DELETE FROM staged_chunks WHERE query_id=? AND owner_id=?", (query_id, owner_id)
        )
        if rows:
            logger.info(
                "query %s: the unfinished upload of %s taken out of the aggregate (%d chunks)",
                query_id,
                owner_id,
                len(rows),
            )
        return len(rows)

    def _apply(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        offset: int,
        data: bytes,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        *,
        inverse: bool,
    ) -> None:
        """Multiply ``data`` (or its inverse) into the aggregate pages it overlaps.

        A page holds ``page_ciphertexts`` consecutive wire positions (the last one
        fewer). It starts as encryptions of zero with unit randomness (the integer
        1, the identity of Z*_{n^2}), so chunks cut at any boundary fold in, and
        ``n_folded`` counts the chunks folded into it: a page that drops back to
        zero is deleted, leaving the store exactly as if the chunks never came.
        """
        width = algebra.width
        size = self.page_ciphertexts
        count = len(data) // width
        identity = (1).to_bytes(width, "big")
        for page in range(offset // size, (offset + count - 1) // size + 1):
            page_start = page * size
            page_length = min(size, total_ciphertexts - page_start)
            lo = max(offset, page_start)
            hi = min(offset + count, page_start + page_length)
            row = conn.execute(
                "SELECT n_folded, data FROM aggregate_pages WHERE query_id=? AND page=?",
                (query_id, page),
            ).fetchone()
            if row is None:
                if inverse:
                    raise QueryStateError(
                        f"query {query_id!r}: aggregate page {page} is missing while taking "
                        "an upload out"
                    )
                current, n_folded = identity * page_length, 0
            else:
                current, n_folded = bytes(row["data"]), int(row["n_folded"])
            a, b = (lo - page_start) * width, (hi - page_start) * width
            segment = data[(lo - offset) * width : (hi - offset) * width]
            combine = algebra.subtract if inverse else algebra.add
            updated = current[:a] + combine(current[a:b], segment) + current[b:]
            n_folded += -1 if inverse else 1
            if n_folded == 0:
                conn.execute(
                    "DELETE FROM aggregate_pages WHERE query_id=? AND page=?", (query_id, page)
                )
            else:
                conn.execute(
                    "INSERT INTO aggregate_pages(query_id, page, n_folded, data) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT(query_id, page) DO UPDATE SET "
                    "n_folded=excluded.n_folded, data=excluded.data",
                    (query_id, page, n_folded, updated),
                )
