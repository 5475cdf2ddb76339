"""Running one query against the proxy, shared by every estimator: the quorum it
states, submitting it signed, following its progress (a tqdm display or a decline log),
cancelling it on Ctrl-C while it collects, fetching and decrypting its result pages, and
warning when fewer owners contributed than the proxy accepts."""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpca.analyst.decode import DecodedRelease, decrypt_stream
from fedpca.analyst.interrupts import interrupted_by
from fedpca.analyst.owner_wait import check_owner_terms, wait_for_quorum
from fedpca.analyst.rpc_errors import ProxyUnavailableError
from fedpca.codec.paillier import CryptoPool
from fedpca.errors import (
    ConfigError,
    FedpcaError,
    NotFoundError,
    QueryStateError,
    UnusableReleaseError,
)
from fedpca.messages import DeploymentInfo, QueryState
from fedpca.protocol import ReleasePlan
from fedpca.query import QuerySpec, stamped
from fedpca.transport.certs import TlsFiles, TlsMaterial

__all__ = [
    "DeclineLog",
    "EstimatorRun",
    "MissingOwnersWarning",
    "ProgressDisplay",
    "missing_owners_message",
    "new_query_id",
    "refuse_in_bootstrapping_child",
    "resolve_quorum",
    "run_estimator_query",
    "run_query",
    "tls_material",
    "warn_if_owners_missing",
]

logger = logging.getLogger("fedpca.analyst.estimators")

StatusCallback = Callable[[Any], None]


class MissingOwnersWarning(UserWarning):
    """A result covers fewer owners than the proxy accepts (an explicit quorum below
    the number of registered owners let collection close early)."""


def missing_owners_message(query_id: str, contributed: int, registered: int, quorum: int) -> str:
    """The warning for a result that covers ``contributed`` of ``registered`` owners."""
    return (
        f"query {query_id}: only {contributed} of {registered} registered owners contributed "
        f"(quorum {quorum}); the result covers their records only. The others declined (see "
        "the declines reported) or had not uploaded when the quorum closed collection; a "
        "query with the quorum unset waits for every registered owner, and fails if one "
        "declines."
    )


def refuse_in_bootstrapping_child() -> None:
    # A worker process that is still importing its parent's main script (spawn or
    # forkserver start, a script without `if __name__ == "__main__":`) must not submit
    # a query: it would be a second, unintended release charged to the analyst.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ConfigError(
            "fit() was called while a worker process was importing the main script; a "
            'script that starts processes needs `if __name__ == "__main__":` around its '
            "top-level code. Refusing to submit a second query from a worker."
        )


def resolve_quorum(quorum: int | None, deployment: DeploymentInfo | None) -> int:
    """The quorum a query states: ``quorum``, or (None) every owner the proxy accepts.

    Raises
    ------
    ConfigError
        ``quorum=None`` without a deployment to count the owners of, a deployment
        that accepts no owners, or a quorum above the owners it accepts (the proxy
        refuses it too; here before the warnings about owners not connected).
    """
    if quorum is not None:
        if deployment is not None and int(quorum) > deployment.owners_registered:
            raise ConfigError(
                f"quorum {int(quorum)} is more than the {deployment.owners_registered} "
                f"owners proxy {deployment.proxy_id!r} accepts"
            )
        return int(quorum)
    if deployment is None:
        raise ConfigError(
            "quorum=None waits for every owner the proxy accepts: fit() asks the "
            "proxy for their number; give quorum=N to build a query without it"
        )
    if deployment.owners_registered < 1:
        raise ConfigError(f"proxy {deployment.proxy_id!r} accepts no owners")
    return deployment.owners_registered


def warn_if_owners_missing(
    release: DecodedRelease, owners_registered: int | None, stacklevel: int = 3
) -> None:
    """:class:`MissingOwnersWarning` when fewer owners contributed than are registered."""
    if owners_registered is not None and release.n_owners < owners_registered:
        query = release.query
        message = missing_owners_message(
            query.query_id, release.n_owners, owners_registered, query.quorum
        )
        warnings.warn(message, MissingOwnersWarning, stacklevel=stacklevel + 1)


MAX_DECLINES_SHOWN = 4096
"""The most owners whose declines one query shows: a deployment has fewer owners, and a
proxy sending new owner ids in every status held each in memory and logged each (found
by review: 24.8 MiB and 137 MiB of log in 5 s)."""


class NewDeclines:
    """The declines of a query's statuses not seen before, each owner's once, at most
    :data:`MAX_DECLINES_SHOWN` owners (then one warning)."""

    def __init__(self) -> None:
        self._declined: set[str] = set()
        self._overflowed = False

    def __call__(self, status: Any) -> list[Any]:
        new = []
        for decline in status.declines:
            if decline.owner_id in self._declined:
                continue
            if len(self._declined) >= MAX_DECLINES_SHOWN:
                if not self._overflowed:
                    self._overflowed = True
                    logger.warning(
                        "query %s: the proxy reports declines of more than %d owners; "
                        "no more are shown",
                        status.query_id,
                        MAX_DECLINES_SHOWN,
                    )
                break
            self._declined.add(decline.owner_id)
            new.append(decline)
        return new


class DeclineLog:
    """Logs each owner's decline once (the status callback when there is no display)."""

    def __init__(self) -> None:
        self._new = NewDeclines()

    def status(self, status: Any) -> None:
        for decline in self._new(status):
            logger.warning("query %s: owner declined: %s", status.query_id, decline.line())


@contextmanager
def charged_release(query_id: str) -> Iterator[None]:
    """Post-processing of a release already paid for: an error it raises names the
    query and how to get the release again, at no new charge (before, a bad parameter
    found there left only its own message, after the budget was spent: review)."""
    try:
        yield
    except FedpcaError as exc:
        # No post-processing gives what was asked: "fetch it again" would fail the same
        # way (review); the release may still give something else.
        fetch = f"`fedpca analyst fetch {query_id} --out result.json`"
        if isinstance(exc, UnusableReleaseError):
            note = (
                f"{exc} (query {query_id} is charged; no post-processing of its result gives "
                "what was asked, so fetching it as asked would fail the same way: check the "
                "query's parameters and ask a new query"
            )
            if exc.still_gives is not None:
                option, what = exc.still_gives
                note += (
                    f"; {fetch.replace(' --out', f' {option} --out')} with your --config "
                    f"gives {what} from the same release at no new charge"
                )
            note += ")"
        else:
            note = (
                f"{exc} (query {query_id} is charged and its result kept at the proxy: {fetch} "
                "with your --config fetches it again at no new charge, with other "
                "post-processing options if need be (`fetch --help`); in Python, "
                "AnalystClient.fetch, decrypt_result and the estimator's "
                "from_result(release, ...) rebuild it with other parameters)"
            )
        try:
            again = type(exc)(note)
        except TypeError:  # an error whose constructor takes more than a message
            again = None
        if again is None:
            raise
        raise again from exc


def new_query_id() -> str:
    """A fresh, unguessable query id."""
    return f"q-{uuid.uuid4().hex}"


def run_query(
    spec: QuerySpec,
    client: Any,
    private_key: Any,
    signing_key: Any,
    *,
    on_status: StatusCallback | None = None,
    on_submitted: StatusCallback | None = None,
    decrypt_progress: Callable[[int], None] | None = None,
    on_fetched: Callable[[int], None] | None = None,
    pool: CryptoPool | None = None,
    wait_timeout: float | None = None,
) -> tuple[DecodedRelease, dict[str, float]]:
    """Submit ``spec``, follow it, and decrypt its result page by page as it is released.

    Parameters
    ----------
    spec : the query (its key must be ``private_key``'s).
    client : an :class:`~fedpca.analyst.client.AnalystClient` (or anything with
        ``submit``, ``wait_for_contributors`` and ``fetch_stream``).
    private_key : the analyst's phe private key.
    signing_key : the analyst's Ed25519 query-signing key (owners answer only signed
        queries).
    on_status : called with every status update until the contributors are fixed.
    on_submitted : called with the status returned by the submission.
    decrypt_progress : called with the number of ciphertexts decrypted so far.
    on_fetched : called with the number of ciphertexts to decrypt, once the result's
        header arrived.
    pool : crypto pool for decryption (default: a temporary one on all cores,
        closed before returning). Its workers are started before the submission, so
        a pool that cannot start fails the call before anything is charged.
    wait_timeout : give up waiting after this many seconds (None = never).

    Returns
    -------
    (DecodedRelease, timings) with timings in seconds for "start workers" (none
    when the pool was already running), "submit", "wait" (until the
    contributors are fixed and the result's header arrived), "decrypt" (from then on
    until the last page is decrypted; it overlaps the owners' encryption and the
    proxy's folding of later pages), "tail" (from the last page's arrival until
    it is decrypted) and "decrypt_cpu" (CPU seconds the decryption workers spent, as
    they measured it: the decryption's share of the crypto floor).
    """
    if spec.analyst_public_key_n != private_key.public_key.n:
        raise ConfigError("the query is not addressed to this private key")
    # Stamped here, not only by the client, so that the result is checked against the
    # query as signed. A caller that may run the same query again (after a proxy
    # restart) passes it stamped, as build_query makes it: a second stamp would make it
    # another query, which the proxy refuses under the same id.
    spec = stamped(spec)
    # The analyst's own plan of the release, derived before anything is charged: a
    # query whose result it could not check fails here.
    ReleasePlan.for_query(spec, private_key.public_key.n.bit_length())
    owned = pool is None
    active = CryptoPool() if pool is None else pool
    try:
        timings: dict[str, float] = {}
        # The decryption workers start before anything is charged: a pool that cannot
        # start fails the call while the budget is still untouched.
        start = time.perf_counter()
        active.start()
        timings["start workers"] = time.perf_counter() - start
        with _cancelled_on_interrupt(client, spec.query_id):
            start = time.perf_counter()
            submitted = client.submit(spec, signing_key)
            timings["submit"] = time.perf_counter() - start
            logger.info("submitted query %s (state %s)", spec.query_id, submitted.state.value)
            if on_submitted is not None:
                on_submitted(submitted)
            start = time.perf_counter()
            deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
            try:
                client.wait_for_contributors(
                    spec.query_id, on_status=on_status, timeout=wait_timeout
                )
            except ProxyUnavailableError as exc:
                # The query is the proxy's now and goes on without this process.
                raise ProxyUnavailableError(
                    f"{exc} (query {spec.query_id} was submitted and goes on at the proxy: "
                    f"follow it with `fedpca analyst status {spec.query_id}` and fetch its "
                    f"result with `fedpca analyst fetch {spec.query_id}`)"
                ) from exc
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            stream = client.fetch_stream(spec.query_id, timeout=remaining)
            timings["wait"] = time.perf_counter() - start
            total = sum(block.n_ciphertexts for block in stream.header.blocks)
            if on_fetched is not None:
                on_fetched(total)
            arrived = [0.0]

            def batches() -> Iterator[list[int]]:
                for chunk in stream.chunks:
                    arrived[0] = time.perf_counter()
                    yield chunk.ciphertexts

            cpu_before = _decryption_cpu(active)
            start = time.perf_counter()
            release = decrypt_stream(
                stream.header,
                batches(),
                private_key,
                expected_query=spec,
                pool=active,
                progress=decrypt_progress,
            )
            finished = time.perf_counter()
            timings["decrypt"] = finished - start
            timings["tail"] = finished - arrived[0] if arrived[0] else 0.0
            timings["decrypt_cpu"] = _decryption_cpu(active) - cpu_before
        except KeyboardInterrupt as exc:
            # Past the wait the query can no longer be cancelled from here: its pages are
            # being released and it is charged. Say so, and how to get the result back.
            logger.warning(
                "%s after the contributors were fixed: query %s is not cancelled "
                "and its charge stands; its result stays stored at the proxy (30 days by "
                "default): follow it with `fedpca analyst status %s` and fetch it with "
                "`fedpca analyst fetch %s --out result.json`",
                interrupted_by(exc),
                spec.query_id,
                spec.query_id,
                spec.query_id,
            )
            raise
        except FedpcaError as exc:
            if _failed(client, spec.query_id):
                raise  # no result is stored to fetch again (an operator's walkthrough)
            # The release happened and is paid for; it stays stored at the proxy.
            raise type(exc)(
                f"{exc} (the result of query {spec.query_id} stays stored at the proxy, 30 days "
                f"by default: fetch it again with `fedpca analyst fetch {spec.query_id}`)"
            ) from exc
    finally:
        if owned:
            active.close()
    return release, timings


@contextmanager
def _cancelled_on_interrupt(client: Any, query_id: str) -> Iterator[None]:
    """Submit and follow the query in the block; on Ctrl-C (or SIGTERM in the command
    line, :mod:`fedpca.analyst.interrupts`) cancel it at the proxy, then re-raise.

    A cancelled query fails at once; its charge is refunded if no owner had begun an
    upload (the proxy's refund rule), and owners receive a cancellation. An interrupt
    during the submission cancels too: the proxy may have accepted the query already.
    """
    try:
        yield
    except KeyboardInterrupt as interrupt:
        how = interrupted_by(interrupt)
        try:
            receipt = client.cancel(query_id)
        except NotFoundError:
            logger.warning(
                "%s: query %s is not at the proxy, so nothing is charged for it; should "
                "its submission still arrive, `fedpca analyst list` shows it and "
                "`fedpca analyst cancel %s` stops it",
                how,
                query_id,
                query_id,
            )
        except QueryStateError as exc:
            logger.warning("%s; query %s could not be cancelled: %s", how, query_id, exc)
        except FedpcaError as exc:
            logger.warning(
                "%s; cancelling query %s failed (%s): it may still be collecting; "
                "`fedpca analyst cancel %s` stops it",
                how,
                query_id,
                exc,
                query_id,
            )
        else:
            logger.warning(
                "%s: query %s cancelled; %s",
                how,
                query_id,
                "its charge was refunded"
                if receipt.refunded
                else "an upload had begun, so its charge stands",
            )
        raise


def _decryption_cpu(pool: CryptoPool) -> float:
    """CPU seconds the pool's workers have spent decrypting so far."""
    return sum(cpu for name, (_, cpu) in pool.work_done().items() if "decrypt" in name)


class ProgressDisplay:
    """tqdm bars for the owners' uploads and for decryption (``verbose=True``)."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._owners: Any = None
        self._decrypt: Any = None
        self._new_declines = NewDeclines()
        self._quorum = 0
        self._last_shown = ""

    def status(self, status: Any) -> None:
        self._quorum = status.quorum
        for decline in self._new_declines(status):
            self._tqdm.write(f"owner declined: {decline.line()}", file=sys.stderr)
        if self._owners is None:
            # Owners arrive minutes apart: a rate would mislead, elapsed time does not.
            self._owners = self._tqdm(
                total=max(status.quorum, 1),
                desc="owners",
                bar_format="{desc} {n}/{total} |{bar}| [{elapsed}]",
                # No bars where nobody watches them redraw (a pipe, a log file): there
                # they came out as fragments joined by carriage returns.
                disable=None,
            )
        bar = self._owners
        bar.total = max(status.quorum, status.owners_contributed, 1)
        if status.owners_registered:
            bar.total = max(bar.total, status.owners_registered)
        bar.n = status.owners_contributed
        declined = f", {status.owners_declined} declined" if status.owners_declined else ""
        uploading = f", {status.owners_uploading} uploading" if status.owners_uploading else ""
        line = f"{status.state.value}{uploading}{declined}: owners (quorum {status.quorum})"
        bar.set_description_str(line, refresh=False)
        bar.refresh()
        plain = (
            f"{status.state.value}: {status.owners_contributed} owner(s) contributed"
            f"{uploading}{declined}; quorum {status.quorum}"
        )
        if bar.disable and plain != self._last_shown:
            # No bar where stderr is a pipe or a log file: a line per change instead
            # (found by review: a query that waited minutes showed nothing there).
            self._last_shown = plain
            print(plain, file=sys.stderr, flush=True)
        if status.terminal:
            bar.close()

    def fetched(self, total: int) -> None:
        if self._owners is not None:
            # The contributors are fixed and go on uploading while pages are decrypted:
            # the bar's last count (uploads complete, often 0) read as owners missing.
            self._owners.leave = False
            self._owners.close()
            if self._quorum:
                self._tqdm.write(
                    f"contributors fixed: {self._quorum} owners; decrypting pages as they arrive",
                    file=sys.stderr,
                )
        self._decrypt = self._tqdm(total=total, desc="decrypt", unit="ct", disable=None)

    def decrypted(self, done: int) -> None:
        if self._decrypt is not None:
            bar = self._decrypt
            if bar.disable and bar.total and done * 4 // bar.total > bar.n * 4 // bar.total:
                print(f"decrypted {done}/{bar.total} ciphertexts", file=sys.stderr, flush=True)
            bar.n = done
            bar.refresh()
            if done >= bar.total:
                bar.close()


def tls_material(
    ca: str | Path | None, cert: str | Path | None, key: str | Path | None
) -> TlsMaterial | None:
    """An estimator's ``ca``/``cert``/``key`` files, loaded; None when none is given.

    Raises
    ------
    ConfigError
        Only some of the three are given (or the files are unusable).
    """
    if ca is None and cert is None and key is None:
        return None
    if ca is None or cert is None or key is None:
        raise ConfigError("ca, cert and key must be given together")
    return TlsMaterial.load(TlsFiles(Path(ca), Path(cert), Path(key)))


OWNER_WAIT_SHOWN_SECONDS = 0.5
"""A wait for owners to connect at least this long is its own timing, "owners
connect" (shorter: no wait, only the one question to the proxy)."""


@dataclass(frozen=True)
class EstimatorRun:
    """What :func:`run_estimator_query` hands back to an estimator's ``fit``."""

    release: DecodedRelease
    timings: dict[str, float]
    owners_registered: int
    prepare_seconds: float
    """From the call until the query was built (connection, the deployment's facts),
    without the wait for owners to connect (``timings["owners connect"]``)."""


def run_estimator_query(
    estimator: Any,
    private_key: Any,
    signing_key: Any,
    build: Callable[[DeploymentInfo], QuerySpec],
) -> EstimatorRun:
    """Connect with an estimator's settings, build its query and run it (:func:`run_query`).

    ``estimator`` supplies ``proxy``, ``ca``/``cert``/``key``, ``insecure``,
    ``server_name_override``, ``n_jobs``, ``verbose`` and ``on_status`` (the
    parameters every estimator shares); ``build`` makes the query from the
    deployment's public facts. Declines go to the progress display with ``verbose``,
    else to the log; ``on_status`` sees every status as well.
    """
    from fedpca.analyst.client import AnalystClient  # grpc: imported when first used

    started = time.perf_counter()
    tls = tls_material(estimator.ca, estimator.cert, estimator.key)
    display = ProgressDisplay() if estimator.verbose else None
    declines = DeclineLog()

    def on_status(status: Any) -> None:
        if estimator.on_status is not None:
            estimator.on_status(status)
        # Each decline is one line: on the progress display, else in the log.
        if display is not None:
            display.status(status)
        else:
            declines.status(status)

    with (
        AnalystClient(
            estimator.proxy,
            tls,
            insecure=estimator.insecure,
            server_name_override=estimator.server_name_override,
        ) as client,
        CryptoPool(estimator.n_jobs) as pool,
    ):
        deployment = client.describe(with_owner_terms=True)
        spec = build(deployment)
        waiting = time.perf_counter()
        stated = deployment
        deployment = wait_for_quorum(client, deployment, spec, bool(estimator.wait_for_owners))
        waited = time.perf_counter() - waiting
        if waited < OWNER_WAIT_SHOWN_SECONDS:
            waited = 0.0  # no wait, one question to the proxy: part of "prepare"
        if deployment is not stated:  # owners connected meanwhile: their terms too
            stated = client.describe(with_owner_terms=True)
        check_owner_terms(stated, spec, bool(estimator.wait_for_owners))
        if not spec.private:
            logger.warning("epsilon = inf: the release is NOT PRIVATE (no noise at all)")
        prepared = time.perf_counter() - started - waited
        release, timings = run_query(
            spec,
            client,
            private_key,
            signing_key,
            on_status=on_status,
            on_submitted=on_status,
            on_fetched=None if display is None else display.fetched,
            decrypt_progress=None if display is None else display.decrypted,
            pool=pool,
        )
    if waited:  # said apart: it was counted as "prepare"
        timings = {"owners connect": waited, **timings}
    return EstimatorRun(release, timings, deployment.owners_registered, prepared)


def _failed(client: Any, query_id: str) -> bool:
    """Whether the proxy says the query failed (False if it cannot be asked)."""
    try:
        return bool(client.status(query_id).state is QueryState.FAILED)
    except FedpcaError:
        return False
