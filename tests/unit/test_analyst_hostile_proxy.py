"""What a malicious or broken proxy can make the analyst's client do through query
statuses (found by a review of the analyst's side, stop 35): statuses of another query
taken for the one asked about, a watch loop that spun when every status stream ended at
once, declines of ever new owners held and logged without end, and terminal control
characters passed through to the analyst's screen and logs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from fedpca.analyst.client import AnalystClient
from fedpca.analyst.querying import MAX_DECLINES_SHOWN, DeclineLog
from fedpca.analyst.rpc_errors import ProxyUnavailableError, error_from_rpc
from fedpca.errors import ProtocolError
from fedpca.messages import (
    BudgetStatus,
    CancelReceipt,
    OwnerDecline,
    QueryState,
    QueryStatus,
    TaskCancellation,
)
from fedpca.transport import serde
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from helpers import fake_analyst_service

ESCAPES = "\x1b]0;owned\x07\x1b[2J"
"""An OSC window title and a CSI screen clear: what a hostile peer's text carried."""


class _StatusProxy(analyst_grpc.AnalystServiceServicer):
    """Answers status calls about any query with ``answer_for``'s COLLECTING status;
    its status streams end at once, with no status (``empty``) or after one."""

    def __init__(self) -> None:
        self.answer_for: str | None = None
        self.empty = True
        self.watches = 0
        self.fetches = 0

    def _status(self, query_id: str) -> Any:
        status = QueryStatus(self.answer_for or query_id, QueryState.COLLECTING, 0, 1)
        return serde.query_status_to_proto(status)

    def GetQueryStatus(self, request: Any, context: Any) -> Any:
        return self._status(serde.query_ref_from_proto(request))

    def WatchQueryStatus(self, request: Any, context: Any) -> Iterator[Any]:
        self.watches += 1
        if not self.empty:
            yield self._status(serde.query_ref_from_proto(request))

    def FetchResult(self, request: Any, context: Any) -> Iterator[Any]:
        self.fetches += 1
        while context.is_active():  # never a message: the caller's time runs out
            time.sleep(0.01)
        yield from ()


@pytest.fixture
def status_proxy() -> Iterator[tuple[_StatusProxy, str]]:
    fake = _StatusProxy()
    with fake_analyst_service(fake) as address:
        yield fake, address


def test_status_streams_that_end_at_once_are_reopened_after_a_pause_then_given_up(
    status_proxy: tuple[_StatusProxy, str],
) -> None:
    """Before, every stream that ended without a terminal status was re-opened at once:
    2,534 calls in 2 s, for ever (estimators wait without a timeout)."""
    fake, address = status_proxy
    with (
        AnalystClient(address, None, insecure=True, retry_delays=(0.05,) * 3) as client,
        pytest.raises(ProxyUnavailableError, match="keeps ending the status stream"),
    ):
        for _ in client.watch("q1", timeout=10.0):
            pass
    assert fake.watches == 4  # the first, then one after each of the three pauses


def test_a_fetch_gives_up_at_the_callers_timeout(
    status_proxy: tuple[_StatusProxy, str],
) -> None:
    """The retry of a timed-out call, right for a call with its own timeout, was also
    made where the timeout is the caller's whole wait: a fetch with timeout 1 s went on
    re-opening and pausing through every retry delay (review of the change)."""
    fake, address = status_proxy
    started = time.monotonic()
    with (
        AnalystClient(address, None, insecure=True, retry_delays=(0.5, 1.0, 2.0)) as client,
        pytest.raises(ProxyUnavailableError, match="DEADLINE_EXCEEDED"),
    ):
        client.fetch_stream("q1", timeout=0.5)
    assert time.monotonic() - started < 1.5 and fake.fetches == 1


def test_status_streams_that_end_after_one_status_are_reopened_at_a_pace(
    status_proxy: tuple[_StatusProxy, str],
) -> None:
    """A stream that sends a status before it ends is re-opened after the first pause
    each time, as long as the caller waits (the query may still finish)."""
    fake, address = status_proxy
    fake.empty = False
    started = time.monotonic()
    with (
        AnalystClient(address, None, insecure=True, retry_delays=(0.1,) * 3) as client,
        pytest.raises(ProxyUnavailableError, match=r"DEADLINE_EXCEEDED|timed out"),
    ):
        for _ in client.watch("q1", timeout=1.0):
            pass
    pauses = (time.monotonic() - started) / 0.1
    assert 2 <= fake.watches <= pauses + 1  # one per 0.1 s pause (was: thousands in 1 s)


def test_a_status_of_another_query_is_refused(status_proxy: tuple[_StatusProxy, str]) -> None:
    fake, address = status_proxy
    fake.answer_for, fake.empty = "q-someone-else", False
    with AnalystClient(address, None, insecure=True, retry_delays=()) as client:
        with pytest.raises(ProtocolError, match="status of 'q-someone-else'"):
            client.status("q-mine")
        with pytest.raises(ProtocolError, match="status of 'q-someone-else'"):
            next(iter(client.watch("q-mine")))
        with pytest.raises(ProtocolError, match="status of 'q-someone-else'"):
            client.wait_for_contributors("q-mine")


def test_declines_of_ever_new_owners_are_shown_up_to_a_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = DeclineLog()
    caplog.set_level(logging.WARNING, logger="fedpca.analyst")
    for batch in range(3):
        declines = tuple(
            OwnerDecline(f"owner-{batch}-{i}", "policy_refusal", "no") for i in range(4096)
        )
        log.status(QueryStatus("q1", QueryState.COLLECTING, 0, 1, declines=declines))
    lines = [r.getMessage() for r in caplog.records]
    assert sum("owner declined" in line for line in lines) == MAX_DECLINES_SHOWN
    assert sum("no more are shown" in line for line in lines) == 1  # was: 12,288 lines


def test_a_peers_control_characters_reach_no_screen_or_log() -> None:
    status = QueryStatus(
        "q1",
        QueryState.FAILED,
        0,
        1,
        failure_reason=f"owner-x said {ESCAPES}",
        declines=(OwnerDecline(f"owner{ESCAPES}", "policy_refusal", f"detail {ESCAPES}"),),
    )
    decoded = serde.query_status_from_proto(serde.query_status_to_proto(status))
    shown = [decoded.failure_reason or "", decoded.declines[0].line()]
    assert all("\x1b" not in text and "\x07" not in text for text in shown)
    assert "\\x1b]0;owned\\x07" in shown[0]  # escaped, still readable

    class _Refused(grpc.RpcError, grpc.Call):  # type: ignore[misc]
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return f"query failed: {ESCAPES}"

        def trailing_metadata(self) -> Any:
            return ()

    message = str(error_from_rpc(_Refused(), "fetch result of query 'q1'"))
    assert "\x1b" not in message and "\\x1b[2J" in message


def test_the_proxy_and_owners_escape_a_peers_text_before_logging_it() -> None:
    from fedpca.owner.retry import status_details
    from fedpca.proxy.owner_tasks import _one_line

    assert "\x1b" not in _one_line(f"declined {ESCAPES}")

    class _Error(grpc.RpcError):
        def details(self) -> str:
            return f"refused {ESCAPES}"

    assert status_details(_Error()) == "refused \\x1b]0;owned\\x07\\x1b[2J"


def test_other_peer_texts_are_escaped_too() -> None:
    """Found by review of the escaping: a withdrawal's reason (the owner logs and keeps
    it), the analyst id a budget reports and the query ids a listing shows still
    carried a peer's control characters."""
    cancellation = serde.task_event_from_proto(
        serde.task_event_to_proto(TaskCancellation("alice/q1", f"withdrawn {ESCAPES}"))
    )
    assert isinstance(cancellation, TaskCancellation)
    assert "\x1b" not in cancellation.reason and "\\x07" in cancellation.reason
    budget = serde.budget_status_from_proto(
        serde.budget_status_to_proto(BudgetStatus(f"alice{ESCAPES}", 1e-5, 0.0, 1.0, 1.0, 0))
    )
    assert budget.analyst_id.isprintable()


def test_a_cancel_receipt_of_another_query_is_refused() -> None:
    class _Receipts(_StatusProxy):
        def CancelQuery(self, request: Any, context: Any) -> Any:
            status = QueryStatus("q-other", QueryState.FAILED, 0, 1)
            return serde.cancel_receipt_to_proto(CancelReceipt(status, refunded=True))

    with (
        fake_analyst_service(_Receipts(), max_workers=2) as address,
        AnalystClient(address, None, insecure=True) as client,
        pytest.raises(ProtocolError, match="status of 'q-other'"),
    ):
        client.cancel("q-mine")


def test_a_pause_between_status_streams_ends_with_the_callers_timeout(
    status_proxy: tuple[_StatusProxy, str],
) -> None:
    """Found by review: the pause slept its whole back-off past the caller's timeout
    (3 s for a timeout of 0.5 s here; up to 30 s with the default delays)."""
    _, address = status_proxy
    started = time.monotonic()
    with (
        AnalystClient(address, None, insecure=True, retry_delays=(3.0,) * 3) as client,
        pytest.raises(ProxyUnavailableError),
    ):
        for _ in client.watch("q1", timeout=0.5):
            pass
    assert time.monotonic() - started < 2.5
