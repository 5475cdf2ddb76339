"""What the analyst's client makes of a call the proxy failed: one
:class:`~fedpca.errors.FedpcaError` subclass per gRPC status (and, for
RESOURCE_EXHAUSTED, per the proxy's refusal metadata), with the proxy's text made safe
to print."""

from __future__ import annotations

import grpc

from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    ConfigError,
    FedpcaError,
    NotFoundError,
    OverloadError,
    QueryStateError,
)
from fedpca.formatting import printable
from fedpca.messages import REFUSAL_METADATA, Refusal

__all__ = ["ProxyError", "ProxyUnavailableError", "error_from_rpc"]


class ProxyError(FedpcaError, RuntimeError):
    """The proxy failed a call for a reason the protocol does not name."""


class ProxyUnavailableError(FedpcaError, ConnectionError):
    """The proxy could not be reached (or did not answer in time)."""


_STATUS_ERRORS: dict[grpc.StatusCode, type[FedpcaError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: BudgetExceededError,
    grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: QueryStateError,
    grpc.StatusCode.ALREADY_EXISTS: QueryStateError,
    grpc.StatusCode.ABORTED: QueryStateError,
    grpc.StatusCode.UNAVAILABLE: ProxyUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ProxyUnavailableError,
}


def _refusal(error: grpc.RpcError) -> Refusal | None:
    """What the proxy said a RESOURCE_EXHAUSTED was (None: it did not say)."""
    trailing = error.trailing_metadata() if isinstance(error, grpc.Call) else None
    for key, value in trailing or ():
        if key == REFUSAL_METADATA:
            try:
                return Refusal(value)
            except ValueError:
                return None
    return None


def error_from_rpc(error: grpc.RpcError, action: str) -> FedpcaError:
    """Translate a failed call into the matching FedpcaError.

    Parameters
    ----------
    error : the ``grpc.RpcError`` (also a ``grpc.Call``).
    action : what was attempted, e.g. "submit query 'q1'", for the message.
    """
    code = error.code() if isinstance(error, grpc.Call) else None
    # The proxy's text, shown in terminals: its control characters escaped.
    details = printable((error.details() if isinstance(error, grpc.Call) else None) or str(error))
    cls = _STATUS_ERRORS.get(code, ProxyError) if code is not None else ProxyError
    if cls is BudgetExceededError and _refusal(error) is not Refusal.BUDGET:
        cls = OverloadError
    name = code.name if code is not None else "UNKNOWN"
    if cls is BudgetExceededError:
        # The proxy's message says whether the budget is exhausted or the query asked
        # for more than is left (and how much is); "exhausted" here said so of both.
        message = f"{action}: refused: {details}"
    elif cls is OverloadError:
        message = (
            f"{action}: refused for now, the proxy is at a limit (nothing was charged): {details}"
        )
    elif cls is ConfigError:
        message = f"{action}: refused by the proxy: {details}"
    elif cls is ProxyUnavailableError:
        message = f"{action}: proxy unavailable ({name}): {details}"
    else:
        message = f"{action}: {details} ({name})"
    return cls(message)
