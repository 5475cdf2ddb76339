"""How an owner node retries its calls to the proxy: which gRPC statuses mean "try again
later", and the jittered exponential backoff between attempts."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fedpca.errors import (
    ConfigError,
)
from fedpca.formatting import printable

__all__ = ["RETRYABLE_CODES", "RetryPolicy", "status_code", "status_details", "status_name"]


RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # The proxy never refuses with CANCELLED (it answers a request stream that broke
        # off with it), and a node that cancels its own call is stopping, so its retry
        # loop ends anyway. In a 50-owner round on 2 cores one upload ended CANCELLED
        # before its header was accepted (cause not established); taken as final, the
        # owner gave the task up and the query waited for it until its deadline.
        grpc.StatusCode.CANCELLED,
    }
)
"""Statuses that say "try again later"; every other failure of an upload is final."""


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff and timeouts of the node's calls to the proxy.

    Attributes
    ----------
    upload_attempts : attempts per upload (the first one included).
    backoff_initial, backoff_max : seconds; attempt ``a`` waits a uniform draw
        from ``[d/2, d]`` with ``d = min(backoff_max, backoff_initial 2^a)``
        (jitter keeps owners that lost the proxy together from retrying in lockstep).
    reconnect_initial, reconnect_max : the same for re-opening the task stream.
    refused_reconnect_max : the cap instead while the proxy refuses this owner (revoked,
        not on its allow-list, another protocol): a fix takes an operator, and a node
        retrying every 30 s for days filled both sides' logs (an operator's walkthrough).
    call_timeout : seconds for Hello and DeclineTask.
    upload_timeout : seconds for one Upload call.
    decline_attempts : attempts to deliver a decline.
    """

    upload_attempts: int = 6
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    reconnect_initial: float = 1.0
    reconnect_max: float = 30.0
    refused_reconnect_max: float = 300.0
    call_timeout: float = 30.0
    upload_timeout: float = 600.0
    decline_attempts: int = 3

    def __post_init__(self) -> None:
        if self.upload_attempts < 1 or self.decline_attempts < 1:
            raise ConfigError("retry attempts must be >= 1")
        for name in (
            "backoff_initial",
            "backoff_max",
            "reconnect_initial",
            "reconnect_max",
            "refused_reconnect_max",
            "call_timeout",
            "upload_timeout",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be finite and > 0, got {value!r}")

    @staticmethod
    def delay(attempt: int, initial: float, cap: float) -> float:
        """Jittered exponential backoff before retry number ``attempt`` (0-based)."""
        ceiling = min(cap, initial * 2.0 ** min(attempt, 30))
        return random.uniform(ceiling / 2, ceiling)


def status_code(err: grpc.RpcError) -> grpc.StatusCode:
    # Errors raised by calls are also grpc.Call objects; a bare RpcError has no code.
    code: Callable[[], grpc.StatusCode] | None = getattr(err, "code", None)
    return code() if code is not None else grpc.StatusCode.UNKNOWN


def status_name(err: grpc.RpcError) -> str:
    return status_code(err).name


MAX_STATUS_DETAILS = 300
"""Characters of a peer's status details kept in a log line or a ledger row: the proxy
chooses the text, and it was logged and stored whole (found by review)."""


def status_details(err: grpc.RpcError) -> str:
    """The status's details (a peer's text), cut to :data:`MAX_STATUS_DETAILS`, its
    control characters escaped."""
    details: Callable[[], str | None] | None = getattr(err, "details", None)
    text = printable((details() if details is not None else None) or str(err))
    if len(text) > MAX_STATUS_DETAILS:
        return text[:MAX_STATUS_DETAILS] + f"... ({len(text)} characters)"
    return text
