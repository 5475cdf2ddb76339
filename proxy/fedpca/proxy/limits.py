"""Per-peer resource bounds of the proxy (no gRPC here; the servicer applies them).

One owner certificate used to freeze the proxy: 61 open task streams or 62 uploads that
sent a header and stalled each held one of 64 server threads. The asynchronous server
holds no thread per stream, and these bounds keep any one peer from taking more than
its share of what remains:

* one task stream per owner: a newer stream replaces the older one, which ends; and at
  most ``max_task_stream_opens_per_minute`` openings of one owner's stream in any
  minute (an opening writes to the database and a log line; a review measured one owner
  reopening in a loop, about 250 times a second, keeping a proxy core busy), and as
  many Hello calls (each writes too: 707 a second in a review of stop 42);
* at most ``max_uploads_per_owner`` uploads in flight per owner, each ended after
  ``upload_idle_seconds`` without a message or ``upload_total_seconds`` in all, and
  at most ``max_upload_starts_per_minute`` uploads begun by one owner in any minute
  (each begun and broken off is written, folded in and taken out again: 355 a second
  from one owner in the same review);
* at most ``max_watches_per_analyst`` status watches per analyst, and
  ``max_listings_per_analyst_per_minute`` listings of its queries, one at a time;
* at most ``max_calls_per_peer`` calls of any kind in flight per peer, and as many
  whose one request is still arriving, each for at most ``request_read_seconds``;
* at most ``max_open_queries_per_analyst`` queries of one analyst not yet done or failed,
  and ``max_queries_per_analyst_per_day`` submitted in any 24 hours (each query costs
  the proxy its noise draw, about 10 µs a value, and a database row, even when it is
  cancelled and refunded, so a small budget must not buy an unbounded amount of them),
  no new one once its queries of the last 24 hours take ``max_query_mib_per_analyst_per_day``
  in the database (a query can be 2 MiB stored: a histogram's public bin edges), and at
  most ``max_submissions_per_analyst`` submissions of one analyst checked at once;
* at most ``max_pending_work`` blocking jobs (database, folding) waiting for the
  proxy's ``worker_threads``, and at most ``max_worker_jobs_per_peer`` of one peer's
  jobs on them at once (its others wait their turn): one peer's ``max_calls_per_peer``
  calls could otherwise hold every worker thread, and every other peer's database
  work waited behind them (a red team's suspicion at stop 45, confirmed by a test).

A call beyond a bound is answered RESOURCE_EXHAUSTED at once; nothing waits for a slot.
Refusals are logged, at most ``logged_refusals_per_minute`` lines per method; the rest
are counted in one line, so a flood of bad calls cannot fill the disk through the log.
A refusal a peer repeats at every reconnection (another wire protocol version) gets one
line per peer and method every :data:`REPEATED_REFUSAL_SECONDS`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from fedpca.errors import ConfigError, OverloadError
from fedpca.owner_terms import OwnerTerms

__all__ = [
    "REPEATED_REFUSAL_SECONDS",
    "PeerLimits",
    "PeerRate",
    "PeerSlots",
    "RefusalLog",
    "TaskStreams",
]

REPEATED_REFUSAL_SECONDS = 600.0
"""Window of the refusals a peer repeats at every reconnection: one line per peer and
method in it, then one line counting the rest. An owner node of another wire protocol
reconnects at most 30 s apart: logged every time, its refusal would write some 3,000
lines a day, and a few such owners would fill the per-method allowance, hiding other
peers' refusals."""


@dataclass(frozen=True)
class PeerLimits:
    """``[limits]`` of the proxy configuration."""

    max_uploads_per_owner: int = 2
    upload_idle_seconds: float = 60.0
    upload_total_seconds: float = 3600.0
    max_watches_per_analyst: int = 8
    max_open_queries_per_analyst: int = 4
    max_queries_per_analyst_per_day: int = 500
    max_query_mib_per_analyst_per_day: float = 64.0
    """MiB of the database an analyst's queries of the last 24 hours may take (the query
    and its plan as stored) before its next submission is refused. A review filled
    1.1 GiB a day with cancelled, refunded histogram queries of 2.2 MiB each."""
    max_submissions_per_analyst: int = 2
    """Submissions of one analyst being checked at once (each composes its ledger, which
    takes seconds under the PLD accountant, on one of the shared worker threads)."""
    max_calls_per_peer: int = 16
    """Calls of one peer in flight at once, of any kind; each may hold a message of up to
    2 MiB (:data:`fedpca.transport.channels.PROXY_MAX_RECEIVE_BYTES`) while it lasts."""
    max_pending_work: int = 4096
    worker_threads: int = 16
    max_worker_jobs_per_peer: int = 4
    """Jobs of one peer on the ``worker_threads`` at once (never more than half of them,
    and at least 1); its further jobs wait, off the threads, for one of these to end."""
    max_concurrent_rpcs: int = 20_000
    """gRPC's own bound on calls in flight (task streams of every owner included)."""
    request_read_seconds: float = 30.0
    """How long a call may take to send its one request (single-request methods); at
    most ``max_calls_per_peer`` calls of a peer may be sending theirs at once."""
    logged_refusals_per_minute: int = 60
    """Refusal log lines per method and minute; the others are counted in one line."""
    max_task_stream_opens_per_minute: int = 20
    """Openings of one owner's task stream in any 60 seconds, and as many of its Hello
    calls; the others are refused (RESOURCE_EXHAUSTED) before any database work. An
    owner node reconnects after 0.5-1 s at first and backs off exponentially when
    refused."""
    max_upload_starts_per_minute: int = 60
    """Uploads one owner begins (a header sent) in any 60 seconds, resumed ones included;
    the others are refused (RESOURCE_EXHAUSTED) before any database work."""
    max_listings_per_analyst_per_minute: int = 60
    """``ListQueries`` listings of one analyst in any 60 seconds, one at a time (a lookup
    of one query is not counted): a listing of 1,000 queries reads each one's status
    (0.1 s of the proxy's CPU; a review of stop 42 kept a core busy from 16 threads)."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, float):
                if not (math.isfinite(value) and value > 0):
                    raise ConfigError(f"limits.{spec.name} must be finite and > 0, got {value!r}")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"limits.{spec.name} must be an integer >= 1, got {value!r}")

    def check_room_for(self, owners: int) -> None:
        """Refuse a ``max_concurrent_rpcs`` too small for ``owners`` allowed owners: each
        keeps a task stream open and may upload ``max_uploads_per_owner`` shares at once,
        and one analyst may make ``max_calls_per_peer`` calls; below that, gRPC itself
        refuses owners' calls once the allowed owners are connected (found by review:
        a value of 1 was accepted).

        Raises
        ------
        ConfigError
        """
        needed = owners * (1 + self.max_uploads_per_owner) + self.max_calls_per_peer
        if self.max_concurrent_rpcs < needed:
            raise ConfigError(
                f"limits.max_concurrent_rpcs = {self.max_concurrent_rpcs} leaves no room for "
                f"the {owners} allowed owners: each keeps a task stream open and may upload "
                f"{self.max_uploads_per_owner} shares at once, and an analyst may make "
                f"{self.max_calls_per_peer} calls; at least {needed} are needed"
            )

    @classmethod
    def from_mapping(cls, table: dict[str, Any]) -> PeerLimits:
        known = {spec.name: spec for spec in fields(cls)}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"unknown keys in [limits]: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"limits.{name} must be a number, got {value!r}")
            values[name] = float(value) if known[name].type in ("float", float) else value
        return cls(**values)


class PeerSlots:
    """Counting slots per (kind, peer); thread-safe, never blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: Counter[tuple[str, str]] = Counter()

    def acquire(self, kind: str, peer: str, limit: int) -> None:
        """Take one slot or raise :class:`OverloadError`."""
        with self._lock:
            if self._used[(kind, peer)] >= limit:
                raise OverloadError(
                    f"{peer} already has {limit} {kind} in flight, the most this proxy allows"
                )
            self._used[(kind, peer)] += 1

    def release(self, kind: str, peer: str) -> None:
        with self._lock:
            self._used[(kind, peer)] -= 1
            if self._used[(kind, peer)] <= 0:
                del self._used[(kind, peer)]


class PeerRate:
    """At most ``per_minute`` events of each peer in any 60 seconds.

    Parameters
    ----------
    per_minute : events admitted per peer in any 60 seconds.
    doing : what the event is, for the refusal ("opened its task stream").
    clock : monotonic seconds (tests pass their own).
    """

    WINDOW_SECONDS = 60.0

    def __init__(
        self, per_minute: int, doing: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_minute = per_minute
        self._doing = doing
        self._clock = clock
        self._lock = threading.Lock()
        # Per peer, the times of its admitted events in the last window (at most
        # per_minute each; the peers are the allow-listed ones).
        self._times: dict[str, deque[float]] = {}

    def admit(self, peer: str) -> None:
        """Count one event of ``peer``, or raise :class:`OverloadError`."""
        now = self._clock()
        with self._lock:
            recent = self._times.setdefault(peer, deque())
            while recent and now - recent[0] >= self.WINDOW_SECONDS:
                recent.popleft()
            if len(recent) >= self.per_minute:
                raise OverloadError(
                    f"{peer} {self._doing} {len(recent)} times in the last "
                    f"{self.WINDOW_SECONDS:g} s, the most this proxy allows; retry later"
                )
            recent.append(now)


class TaskStreams:
    """The one task stream of each owner: a newer stream supersedes the older.

    :meth:`admit` counts an owner's openings and refuses those beyond
    ``opens_per_minute`` in any 60 seconds; :meth:`open` returns a generation number
    and tells the stream it replaces (its ``superseded`` callback), which ends. Only
    that stream is woken: waking every owner's stream (as a change of any query does)
    on every opening made one owner's reopening loop cost the proxy a database read
    per connected owner.

    Parameters
    ----------
    opens_per_minute : openings admitted per owner in any 60 seconds.
    clock : monotonic seconds (tests pass their own).
    """

    def __init__(
        self, opens_per_minute: int = 20, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._openings = PeerRate(opens_per_minute, "opened its task stream", clock)
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[int, Callable[[], None], OwnerTerms | None]] = {}
        self._next = 0

    def admit(self, owner_id: str) -> None:
        """Count one opening of ``owner_id``'s stream, or raise :class:`OverloadError`."""
        self._openings.admit(owner_id)

    def open(
        self, owner_id: str, superseded: Callable[[], None], terms: OwnerTerms | None = None
    ) -> int:
        """Make a new stream the owner's current one; ``superseded`` is called if a
        newer one replaces it; ``terms`` are the terms the owner stated on it. Returns
        the new stream's generation."""
        with self._lock:
            self._next += 1
            previous = self._latest.get(owner_id)
            self._latest[owner_id] = (self._next, superseded, terms)
            generation = self._next
        if previous is not None:
            previous[1]()
        return generation

    def close(self, owner_id: str, generation: int) -> None:
        with self._lock:
            latest = self._latest.get(owner_id)
            if latest is not None and latest[0] == generation:
                del self._latest[owner_id]

    def connected(self) -> int:
        """Owners with an open task stream."""
        with self._lock:
            return len(self._latest)

    def connected_owners(self) -> frozenset[str]:
        """The owners with an open task stream."""
        with self._lock:
            return frozenset(self._latest)

    def stated_terms(self) -> dict[str, OwnerTerms]:
        """The terms each connected owner stated on its open stream (owners that stated
        none are left out)."""
        with self._lock:
            return self._stated_terms()

    def connected_and_terms(self) -> tuple[frozenset[str], dict[str, OwnerTerms]]:
        """The owners with an open stream and the terms they stated, read at one moment
        (read apart, an owner connecting in between was in the terms but not counted)."""
        with self._lock:
            return frozenset(self._latest), self._stated_terms()

    def _stated_terms(self) -> dict[str, OwnerTerms]:
        return {owner: terms for owner, (_, _, terms) in self._latest.items() if terms is not None}


class RefusalLog:
    """Which refusals get a log line: at most ``lines_per_window`` per method in each
    window of ``window_seconds`` (a minute); the others are counted and reported in one
    line when the next refusal comes after the window.

    A refusal line quotes up to 2,000 characters of what the peer sent; unlimited, a
    flood of malformed calls wrote about 0.37 MB/s to the proxy's log (review of stop
    25). With the defaults a flood now costs a few lines a second.
    """

    def __init__(
        self,
        lines_per_window: int,
        window_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        per: str = "method",
    ) -> None:
        self.lines_per_window = lines_per_window
        self.window_seconds = window_seconds
        self.per = per
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._window_started_at = datetime.now(UTC)
        self._counts: Counter[str] = Counter()

    def admit(self, method: str) -> tuple[bool, list[str]]:
        """Whether this refusal of ``method`` gets its own line, and summary lines of
        refusals not logged in a window that has ended (to be logged first).

        ``method`` is what the lines are counted per: a method's name, or (``per``
        saying so) a method and the peer, ``"Hello by owner/hospital-a"``."""
        with self._lock:
            summaries: list[str] = []
            if self._clock() - self._window_start >= self.window_seconds:
                summaries = self._summaries()
                self._counts.clear()
                self._window_start = self._clock()
                self._window_started_at = datetime.now(UTC)
            self._counts[method] += 1
            return self._counts[method] <= self.lines_per_window, summaries

    def _summaries(self) -> list[str]:
        since = self._window_started_at.isoformat(timespec="seconds")
        lines = "1 line" if self.lines_per_window == 1 else f"{self.lines_per_window} lines"
        return [
            f"{count - self.lines_per_window} more refusals of {method} since {since} "
            f"were not logged (at most {lines} per {self.per} every "
            f"{self.window_seconds:g} s)"
            for method, count in sorted(self._counts.items())
            if count > self.lines_per_window
        ]
