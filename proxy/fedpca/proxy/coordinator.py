"""The proxy's query lifecycle: submission, uploads, quorum, deadlines and the result.

Pure domain code: no gRPC here (:mod:`fedpca.proxy.servicer` translates), and
every durable change goes through :class:`~fedpca.proxy.store.ProxyStore`.

Lifecycle of one query::

    submit ─▶ COLLECTING ─(quorum owners began)─▶ AGGREGATING ─(stats: last page final)─▶ DONE
                  │                                   └─(masked: all folded)─▶ NOISING ─▶ DONE
                  └─(deadline, or declines leave the quorum out of reach; from
                     AGGREGATING: a contributor did not finish by the deadline)─▶ FAILED

The first ``quorum`` owners to begin an upload are the query's contributors; while the
set is open, an upload whose stream breaks is taken out and its place freed. Once it
is fixed, each result page is final (noise added under encryption) as soon as every
contributor's chunks covering it are folded, and the analyst fetches and decrypts it
while the owners still encrypt the later ones; an interrupted upload resumes where its
durable mark stands.

Queries are keyed by analyst: the proxy stores analyst ``a``'s query ``q`` under the
*task id* ``a/q``, which is also what owners see and answer with, so one analyst's
query ids say nothing about another's. Only owners on the allow-list
(``[owners] allowed``) are offered tasks or may upload and decline.

The noise of a stats-mode query is drawn while owners encrypt
(:mod:`fedpca.proxy.prepared_noise`) and added page by page; a masked-mode result is
computed at the end by :mod:`fedpca.proxy.masking`. Why each step is safe against concurrent
submissions, broken streams and crashes, and what the noise step costs, is in
docs/architecture.md ("The proxy's query lifecycle").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from fedpca.errors import (
    FedpcaError,
    NotFoundError,
    QueryStateError,
)
from fedpca.messages import (
    QueryState,
    UploadHeader,
)
from fedpca.proxy.analyst_requests import AnalystRequests
from fedpca.proxy.coordinator_core import OpenUpload, task_id, total_ciphertexts
from fedpca.proxy.masking import masked_result
from fedpca.proxy.owner_tasks import OwnerTasks
from fedpca.proxy.prepared_noise import PageNoise
from fedpca.proxy.results import aggregate_blocks, result_meta
from fedpca.proxy.store_database import storage_unavailable
from fedpca.proxy.store_records import Contributor, QueryRecord, page_count
from fedpca.proxy.submissions import Submissions
from fedpca.proxy.uploads import UploadStream, check_upload_header
from fedpca.query import ProtocolMode

__all__ = ["Coordinator", "task_id"]

logger = logging.getLogger(__name__)

DEFAULT_TIMER_INTERVAL = 0.5
"""Seconds between deadline checks of :meth:`Coordinator.run_timers`."""

PROXY_WORK_LIMIT_SECONDS = 86_400.0
"""How long after its deadline a query whose every chunk arrived may wait for the
proxy's own work (noise, result pages) before it fails: a day."""

PURGE_INTERVAL_SECONDS = 3600.0
"""How often finished queries' old results are looked for (:meth:`Coordinator.purge_results`)."""
SECONDS_PER_DAY = 86_400.0


class Coordinator(Submissions, OwnerTasks, AnalystRequests):
    """Runs every query's lifecycle on top of the durable store (constructor parameters:
    :class:`~fedpca.proxy.coordinator_core.CoordinatorCore`)."""

    # ----------------------------------------------------------------- uploads
    def check_upload_header(self, owner_id: str, header: UploadHeader) -> None:
        """:func:`fedpca.proxy.uploads.check_upload_header` against the stored query."""
        self.require_owner(owner_id)
        check_upload_header(self._context(header.query_id), header)

    def begin_upload(self, owner_id: str, header: UploadHeader) -> UploadStream:
        """Check an upload's header, let the owner join the query's contributors (or
        resume its upload), and open the stream its chunks are folded through.

        From here on the owner may have spent budget on the query, so it is marked as
        never to be refunded.

        Raises the errors of :meth:`check_upload_header` and of
        :meth:`fedpca.proxy.store.ProxyStore.join` (NotContributingError for an owner
        that is not, and can no longer become, a contributor).
        """
        self.check_upload_header(owner_id, header)
        key = header.query_id
        context = self._context(key)
        total = total_ciphertexts(context)

        def meta_when_fixed(contributors: Sequence[Contributor]) -> dict[str, Any]:
            return result_meta(
                context.plan, len(contributors), [c.public_count for c in contributors]
            )

        # Per upload id: another upload's stream must not keep this one in when it breaks.
        # Counted before the join, which holds the upload's turn: a broken stream of the
        # same upload takes it out either before the join (which then starts over) or
        # not at all (it sees this stream open).
        stream_key = (key, owner_id, header.upload_id)
        with self._lock:
            upload = self._open_streams.setdefault(stream_key, OpenUpload())
            upload.streams += 1

        def ended() -> None:
            with self._lock:
                upload.streams -= 1
                if upload.streams <= 0:
                    del self._open_streams[stream_key]

        def streams_open() -> int:
            with self._lock:
                return upload.streams

        try:
            with upload.turn:
                joined = self.store.join(
                    key,
                    owner_id,
                    header.upload_id,
                    total_ciphertexts=total,
                    algebra=self._algebra(key),
                    public_count=header.public_record_count,
                    on_fixed=meta_when_fixed,
                )
        except BaseException:
            ended()
            raise
        if joined.fixed:
            logger.info(
                "query %s: its %d contributors are fixed; pages become final as they complete",
                key,
                context.spec.quorum,
            )
            # Its noise is needed now: drawn in the background even beyond the analyst's
            # bound on noise drawn in advance (it is then not being drawn yet).
            self._prepare_noise(key, context, bounded=False)
            self._notify()
        elif joined.covered and not joined.duplicate:
            logger.info(
                "query %s: %s resumes upload %s after %d folded ciphertexts",
                key,
                owner_id,
                header.upload_id,
                joined.covered,
            )
        return UploadStream(
            self.store,
            owner_id,
            header,
            context,
            joined,
            on_folded=self._folded,
            on_completed=self._completed,
            on_ended=ended,
            streams_open=streams_open,
            turn=upload.turn,
        )

    def share_released(self, query_id: str, owner_id: str) -> bool:
        """Whether a result of the query can hold anything of this owner's share.

        False for an owner that is not one of the query's contributors (nothing of it
        was ever folded into what is released), and for every owner of a query that
        failed before any page of its result was released.
        """
        try:
            record = self.store.query(query_id)
        except NotFoundError:
            return False
        if self.store.contributor(query_id, owner_id) is None:
            return False
        released = (
            self.store.pages_final(query_id) > 0
            or self.store.result_purged_at(query_id) is not None  # released, since deleted
        )
        return not (record.state is QueryState.FAILED and not released)

    def _folded(self, query_id: str, fold_cpu_seconds: float) -> None:
        with self._lock:
            self._last_chunk_at[query_id] = time.time()
            self._fold_cpu_seconds[query_id] = (
                self._fold_cpu_seconds.get(query_id, 0.0) + fold_cpu_seconds
            )
        if self.observer is not None:
            self.observer.chunk_folded(fold_cpu_seconds)
        self.advance(query_id)
        self._notify()

    def _completed(self, query_id: str) -> None:
        self._notify()

    def advance(self, query_id: str) -> None:
        """Make final whatever the folded chunks allow: result pages of a stats-mode
        query, or (masked mode) the whole result once every contribution is in.

        Called after every fold and noise piece, and at start-up; concurrent calls for
        one query collapse into one pass that repeats while more folds arrived
        meanwhile. A pass that met a store that could not be written is tried again by
        :meth:`run_timers`.
        """
        with self._lock:
            self._dirty.add(query_id)
            if query_id in self._finalizing:
                return
            self._finalizing.add(query_id)
        try:
            while True:
                with self._lock:
                    if query_id not in self._dirty:
                        self._finalizing.discard(query_id)
                        step = self._stalled.get(query_id)
                        # A whole pass went through; a failed noise step of masked
                        # mode, stalled during it, is still to be tried again (found
                        # by review: the pass cleared it, and the query was never
                        # retried).
                        if step is not None and not step.noise_step:
                            del self._stalled[query_id]
                        return
                    self._dirty.discard(query_id)
                self._advance_once(query_id)
        except BaseException as exc:
            with self._lock:
                self._finalizing.discard(query_id)
            if storage_unavailable(exc):
                # The fold that called this is durable: without a retry, the last one's
                # pages would never be made final (found by review).
                self._stall(query_id)
            raise

    def _advance_once(self, query_id: str) -> None:
        context = self._context(query_id)
        total = total_ciphertexts(context)
        through = self.store.aggregated_through(query_id)
        if context.spec.mode is ProtocolMode.MASKED:
            if through >= total:
                self.close(query_id)
            return
        size = self.store.page_ciphertexts
        ready = page_count(total, size) if through >= total else through // size
        with self._lock:
            final = self._pages_final.get(query_id, 0)
        if ready <= final:
            return
        noise: PageNoise | None = None
        if context.plan.private and self.store.query(query_id).state is not QueryState.AGGREGATING:
            # Done or failed (a late noise report or fold): its noise is discarded, and
            # asking for it would draw a whole vector again for nothing.
            return
        try:
            if context.plan.private:
                try:
                    noise = self._noise.get(query_id, context.plan, context.public_key.n)
                    # Pages whose noise is still being drawn wait for it (_noise_drawn).
                    drawn = noise.pages_drawn(size)
                except FedpcaError:
                    raise
                except Exception as exc:  # the sampler's own error: the draw failed
                    self._fail(
                        query_id, f"adding noise failed ({type(exc).__name__}); see the proxy log"
                    )
                    logger.error("query %s: the noise draw failed: %r", query_id, exc)
                    return
                ready = min(ready, drawn)
                if ready <= final:
                    return
            finalized = self.store.finalize_pages(
                query_id,
                total,
                self._algebra(query_id),
                None if noise is None else lambda _page, start, count: noise.encoded(start, count),
                limit=ready,
            )
        except FedpcaError as exc:
            self._fail(query_id, f"adding noise failed ({type(exc).__name__}); see the proxy log")
            logger.error("query %s: noise step failed: %s", query_id, type(exc).__name__)
            return
        with self._lock:
            self._pages_final[query_id] = finalized.pages_final
        if finalized.new_pages:
            logger.debug(
                "query %s: %d of %d result pages final",
                query_id,
                finalized.pages_final,
                page_count(total, size),
            )
            self._notify()
        if finalized.done and finalized.new_pages:
            # This pass made the last pages final (a later pass finds the query DONE
            # with nothing new, and must not report it done again).
            self._done(query_id, noise)

    def _noise_drawn(self, key: str) -> None:
        if self._stopping.is_set():
            return
        try:
            self.advance(key)
        except Exception:  # the draw goes on; the next fold or piece tries again
            logger.exception("query %s: making pages final after a noise piece failed", key)

    def _done(self, query_id: str, noise: PageNoise | None) -> None:
        with self._lock:
            last_chunk = self._last_chunk_at.pop(query_id, None)
            fold_cpu_seconds = self._fold_cpu_seconds.pop(query_id, None)
            self._pages_final.pop(query_id, None)
        timings: dict[str, float] = {}
        if noise is not None:
            timings["sample_cpu_seconds"] = noise.sample_cpu_seconds
            if noise.prepared:
                timings["noise_precomputed"] = 1.0
        if fold_cpu_seconds is not None:
            timings["fold_cpu_seconds"] = fold_cpu_seconds
        if last_chunk is not None:
            timings["final_after_last_chunk_seconds"] = max(0.0, time.time() - last_chunk)
        self.store.update_result_meta(query_id, {"timings": timings})
        if self.observer is not None and "sample_cpu_seconds" in timings:
            self.observer.noise_added(timings["sample_cpu_seconds"])
        self._noise.discard(query_id)
        record = self.store.query(query_id)
        logger.info(
            "query %s done: %d contributors, every page final, %.3f CPU-s checking and "
            "folding chunks, %.3f CPU-s drawing noise%s",
            query_id,
            record.quorum,
            timings.get("fold_cpu_seconds", 0.0),
            timings.get("sample_cpu_seconds", 0.0),
            f", {timings['final_after_last_chunk_seconds']:.3f} s after the last chunk arrived"
            if "final_after_last_chunk_seconds" in timings
            else "",
        )
        self._notify()

    # --------------------------------------------------------- masked results
    def close(self, query_id: str) -> None:
        """Every contribution of a masked-mode query is in: AGGREGATING → NOISING, then
        compute its result (on the background thread, or here without one). A no-op
        if another thread closed it first."""
        try:
            self.store.set_state(query_id, QueryState.NOISING, expect=(QueryState.AGGREGATING,))
        except QueryStateError:
            return
        logger.info("query %s: every contribution folded, masking and adding noise", query_id)
        self._notify()
        self._schedule(query_id)

    def _schedule(self, query_id: str) -> None:
        if self._executor is None:
            self.finish(query_id)
            return
        try:
            self._executor.submit(self.finish, query_id)
        except RuntimeError:
            # Shutting down: the query stays NOISING and recover() finishes it.
            logger.info("query %s: shutting down, noise step deferred to restart", query_id)

    def finish(self, query_id: str) -> QueryRecord:
        """Compute and store a NOISING (masked-mode) query's result; idempotent.

        A DONE or FAILED query is returned as is. Errors while adding noise fail the
        query (the reason names the error class only: messages may carry noise
        values), except a store that cannot be written now (locked, full, failing),
        after which :meth:`run_timers` tries again. A crash (process death) leaves it
        NOISING for :meth:`recover`.
        """
        with self._lock:
            if query_id in self._finishing:
                return self.store.query(query_id)
            self._finishing.add(query_id)
        try:
            record = self.store.query(query_id)
            if record.state is not QueryState.NOISING:
                self._unstall(query_id)
                return record
            try:
                data, meta = self._masked_result(record)
                record = self.store.store_result(query_id, data, meta)
            except Exception as exc:
                if self._stopping.is_set():
                    # Interrupted by shutdown (e.g. the pool was closed under us):
                    # leave NOISING, the next start finishes it from the intact aggregate.
                    logger.warning(
                        "query %s: noise step interrupted by shutdown (%s); it will be "
                        "finished on restart",
                        query_id,
                        type(exc).__name__,
                    )
                    return self.store.query(query_id)
                if storage_unavailable(exc):
                    # Nothing was stored (the transaction rolled back): the timer tries
                    # again, later each time; the query must not fail, charged, for a
                    # locked or full database. (Stalled before _finishing is cleared
                    # below: its first retry is due half a second later.)
                    failures = self._stall(query_id, noise_step=True)
                    if failures & (failures - 1) == 0:  # logged the 1st, 2nd, 4th, ... time
                        logger.warning(
                            "query %s: its result could not be stored (%s; %d time(s) so "
                            "far); trying again",
                            query_id,
                            exc,
                            failures,
                        )
                    return self.store.query(query_id)
                self._unstall(query_id)
                if isinstance(exc, FedpcaError):
                    logger.error("query %s: noise step failed: %s", query_id, type(exc).__name__)
                else:
                    logger.exception("query %s: noise step failed", query_id)
                self._fail(
                    query_id, f"adding noise failed ({type(exc).__name__}); see the proxy log"
                )
                return self.store.query(query_id)
            self._unstall(query_id)
            logger.info(
                "query %s done: %d owners, noise step %.2f s",
                query_id,
                record.quorum,
                meta["timings"]["noise_seconds"],
            )
            if self.observer is not None:
                self.observer.noise_added(meta["timings"]["noise_seconds"])
            self._notify()
            return record
        finally:
            with self._lock:
                self._finishing.discard(query_id)

    def _masked_result(self, record: QueryRecord) -> tuple[bytes, dict[str, Any]]:
        context = self._context(record.query_id)
        meta = self.store.result_meta(record.query_id) or {}
        aggregate = aggregate_blocks(context, self.store.aggregate(record.query_id))
        started = time.perf_counter()
        blocks, _sections, timings = masked_result(
            context.plan,
            context.public_key,
            aggregate,
            int(meta.get("public_n", 0)),
            self.pool,
            self.noise_sampler,
        )
        timings["noise_seconds"] = time.perf_counter() - started
        data = b"".join(blocks[block.name] for block in context.plan.result_blocks)
        return data, {"timings": timings}

    def prepared_noise(self, query_id: str) -> Future[PageNoise] | None:
        """TEST AID: the query's noise being (or already) drawn, if any (not removed)."""
        return self._noise.pending(query_id)

    # -------------------------------------------------------------- deadlines
    def check_deadlines(self) -> list[str]:
        """Fail the queries whose deadline passed before they could finish; returns
        their ids.

        A COLLECTING query fails when fewer than ``quorum`` owners began an upload in
        time; an AGGREGATING one when a contributor did not deliver all its chunks (one
        whose every chunk is folded waits for its noise and pages, however late), and
        such a query, or a NOISING one, once :data:`PROXY_WORK_LIMIT_SECONDS` past
        its deadline. Result pages already released stay released (and charged, like every query
        some owner began an upload for).
        """
        now = self.clock()
        due = []
        unfinished = (
            f"every chunk arrived, but the proxy could not finish the result within "
            f"{PROXY_WORK_LIMIT_SECONDS / 3600:g} h after the deadline; see the proxy log"
        )
        states = (QueryState.COLLECTING, QueryState.AGGREGATING, QueryState.NOISING)
        for record in self.store.queries(*states):
            if record.deadline_at > now:
                continue
            if record.state is QueryState.NOISING:
                # Masked mode's last step, retried while it fails; bounded like the
                # pages of an aggregating query (found by review: it was retried for
                # ever, holding one of its analyst's open-query places). Only a step
                # that failed and is not being tried: one queued or running (at a
                # restart long after the deadline) finishes (review of that fix).
                with self._lock:
                    failing = (
                        record.query_id in self._stalled and record.query_id not in self._finishing
                    )
                if failing and now >= record.deadline_at + PROXY_WORK_LIMIT_SECONDS:
                    due.append(record.query_id)
                    self._fail(record.query_id, unfinished)
                continue
            if record.state is QueryState.COLLECTING:
                joined = self.store.contributor_count(record.query_id)
                reason = (
                    f"deadline passed with {joined} of {record.quorum} required owners uploading"
                )
            else:
                total = total_ciphertexts(self._context(record.query_id))
                late = sorted(
                    owner
                    for owner, covered in self.store.partial_uploads(record.query_id).items()
                    if covered < total
                )
                if not late and now < record.deadline_at + PROXY_WORK_LIMIT_SECONDS:
                    # Every chunk is in: what is left (noise, pages) is the proxy's own
                    # work, which the owners' deadline does not bound (found by review:
                    # a restart's fresh noise draw failed such queries, charged). Its
                    # step is tried again, backing off, whatever stopped it.
                    with self._lock:
                        stalled = record.query_id in self._stalled
                    if not stalled:
                        self._stall(record.query_id)
                    continue
                if not late:
                    due.append(record.query_id)
                    self._fail(record.query_id, unfinished)
                    continue
                reason = (
                    f"deadline passed before contributors {', '.join(late)} delivered all "
                    "their chunks"
                )
            due.append(record.query_id)
            self._fail(record.query_id, reason)
        return due

    def retry_stalled(self) -> list[str]:
        """Try again the stalled steps that are due (making a stats-mode query's pages
        final, storing a masked-mode result); returns the queries tried. One that fails
        again is tried later (:meth:`_stall`); one that succeeds, or whose query ended,
        is forgotten."""
        now = time.monotonic()
        with self._lock:
            due = sorted(q for q, step in self._stalled.items() if step.due <= now)
            for query_id in due:
                self._stalled[query_id].due = math.inf  # being tried
        for query_id in due:
            try:
                state = self.store.query(query_id).state
                if state is QueryState.NOISING:
                    self._schedule(query_id)  # finish() stalls or forgets it
                elif state is QueryState.AGGREGATING:
                    self.advance(query_id)  # likewise
                else:
                    self._unstall(query_id)
            except Exception as exc:
                with self._lock:
                    step = self._stalled.get(query_id)
                    again = step is not None and math.isinf(step.due)
                if again:  # failed before its step could record it (e.g. reading it)
                    self._stall(query_id)
                logger.warning("query %s: retrying its last step failed: %s", query_id, exc)
        return due

    def purge_results(self) -> list[str]:
        """Delete the result pages of queries finished more than ``[proxy]
        keep_results_days`` ago (none when it is 0) and the statements of queries failed
        refunded as long ago (a day at least), truncate the write-ahead log,
        which may hold frames of deleted aggregates; returns the purged results' keys."""
        days = self.config.proxy.keep_results_days
        if days <= 0:
            self.store.truncate_wal()
            return []
        purged = self.store.purge_results(self.clock() - days * SECONDS_PER_DAY)
        cutoff = self.clock() - max(days, 1) * SECONDS_PER_DAY
        if dropped := self.store.drop_refunded_statements(cutoff):
            logger.info("dropped the statements of %d refunded failures: %s", len(dropped), dropped)
        self.store.truncate_wal()
        if purged:
            logger.info(
                "deleted the results of %d queries finished more than %g days ago "
                "([proxy] keep_results_days): %s",
                len(purged),
                days,
                ", ".join(purged),
            )
        return purged

    def run_timers(
        self, stop_event: threading.Event, interval: float = DEFAULT_TIMER_INTERVAL
    ) -> None:
        """Check deadlines and retry stalled steps (:meth:`retry_stalled`) every
        ``interval`` seconds, and purge old results every
        :data:`PURGE_INTERVAL_SECONDS`, until ``stop_event`` is set."""
        last_purge = -math.inf
        while not stop_event.wait(interval):
            try:
                self.retry_stalled()
                self.check_deadlines()
                if time.monotonic() - last_purge >= PURGE_INTERVAL_SECONDS:
                    last_purge = time.monotonic()
                    self.purge_results()
            except Exception:
                logger.exception("deadline check or result purge failed; retrying")

    def recover(self) -> list[str]:
        """After a (re)start: finish every NOISING query, take out the uploads the old
        process was receiving for COLLECTING queries (their owners resend), finalise
        whatever pages of AGGREGATING queries are ready, then handle due ones.

        Returns
        -------
        The ids of the queries that were finished, failed or scheduled.
        """
        handled = []
        for record in self.store.queries(QueryState.NOISING):
            logger.warning(
                "query %s was interrupted while adding noise; finishing", record.query_id
            )
            handled.append(record.query_id)
            self._schedule(record.query_id)
        for record in self.store.queries(QueryState.COLLECTING, QueryState.AGGREGATING):
            if self._fail_if_quorum_unreachable(record.query_id):
                handled.append(record.query_id)
                continue
            try:
                context = self._context(record.query_id)
            except FedpcaError as exc:
                # Not a start refused for good, naming no query (found by review): a
                # query this version cannot plan (a stored query a protocol change
                # made invalid) fails, under the refund rule of every failure.
                self._fail(
                    record.query_id,
                    f"this proxy's version cannot plan the query after a restart: {exc}",
                )
                handled.append(record.query_id)
                continue
            removed = self.store.discard_partial_uploads(
                record.query_id,
                total_ciphertexts=total_ciphertexts(context),
                algebra=self._algebra(record.query_id),
            )
            if removed:
                logger.warning(
                    "query %s: %d chunks of uploads interrupted by the restart taken out",
                    record.query_id,
                    removed,
                )
            # Noise drawn before the restart is gone: pages not yet final get a fresh draw.
            self._prepare_noise(
                record.query_id, context, bounded=record.state is QueryState.COLLECTING
            )
            if record.state is QueryState.AGGREGATING:
                self.advance(record.query_id)
        return handled + self.check_deadlines()
