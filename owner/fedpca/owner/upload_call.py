"""The gRPC side of one upload call: waiting for its end, and what the proxy said about
its header and, on a refusal, about the share (used by :mod:`fedpca.owner.task_processing`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from fedpca.messages import SHARE_RELEASED_METADATA, UPLOAD_ACCEPTED_METADATA
from fedpca.owner.retry import status_code

__all__ = ["HeaderAcknowledgement", "query_closed", "result_when_done", "share_unreleased"]


def result_when_done(call: Any) -> Any:
    """``call.result()``, waited for on an event instead of in gRPC's blocking wait,
    which wakes the thread ten times a second for the whole upload (on a machine of
    ten owners, ~0.1 CPU-s a round in wake-ups)."""
    done = threading.Event()
    call.add_done_callback(lambda _call: done.set())
    done.wait()
    return call.result()


class HeaderAcknowledgement:
    """The proxy's word on an upload's header: the call's initial metadata carries
    ``UPLOAD_ACCEPTED_METADATA: yes`` once the proxy recorded the upload as begun
    (protocol version 3); a call that ends without it was refused at the header."""

    def __init__(self, on_accepted: Callable[[], bool] | None = None) -> None:
        self._call: Any = None
        self._started = threading.Event()
        self._on_accepted = on_accepted
        self.failure: BaseException | None = None
        """What ``on_accepted`` raised (the ledger could not record the acceptance: no
        chunk was handed out, and gRPC ends the call with UNKNOWN)."""

    def watch(self, call: Any) -> None:
        """The upload call whose initial metadata to wait for."""
        self._call = call
        self._started.set()

    def wait(self) -> bool:
        """Block until the proxy answered the header (or the call ended); True if it
        accepted it and ``on_accepted`` (run before any chunk is handed out) agreed."""
        self._started.wait()
        metadata = dict(self._call.initial_metadata() or ())
        accepted = metadata.get(UPLOAD_ACCEPTED_METADATA) == "yes"
        if accepted and self._on_accepted is not None:
            # False: the chunks may not leave (the reservation is gone).
            try:
                accepted = self._on_accepted()
            except BaseException as exc:
                self.failure = exc
                raise
        return accepted


def _share_released(err: grpc.RpcError) -> str | None:
    """The value of the refusal's ``SHARE_RELEASED_METADATA`` (None: absent)."""
    if status_code(err) is not grpc.StatusCode.FAILED_PRECONDITION:
        return None
    trailing: Callable[[], Any] | None = getattr(err, "trailing_metadata", None)
    metadata = dict(trailing() or ()) if trailing is not None else {}
    value = metadata.get(SHARE_RELEASED_METADATA)
    return value if isinstance(value, str) else None


def query_closed(err: grpc.RpcError) -> bool:
    """The proxy refused the upload because its query no longer takes it (it ended,
    failed or closed to new owners): nothing of this owner is at fault. Told by the
    status and the metadata key the proxy sets on that refusal only, not by its text."""
    return _share_released(err) is not None


def share_unreleased(err: grpc.RpcError) -> bool:
    """The proxy's refusal says no result of the query can hold anything of this share."""
    return _share_released(err) == "no"
