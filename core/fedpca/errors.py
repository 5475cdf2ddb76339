"""One error hierarchy for fedpca.

Every error raised on purpose by fedpca derives from :class:`FedpcaError` and also
from the builtin exception whose meaning it shares, so callers that only know the
builtin still catch it.  Only gRPC servicers translate these into status codes.
"""

from __future__ import annotations


class FedpcaError(Exception):
    """Base class of every error fedpca raises on purpose."""


class ConfigError(FedpcaError, ValueError):
    """A configuration file, flag or query parameter is invalid."""


class DataError(FedpcaError, ValueError):
    """An owner's input table is malformed (names file, row and column when known)."""


class UnusableReleaseError(DataError):
    """A release, already charged, from which no post-processing gives what was asked
    (e.g. DCA with fewer than two classes present): fetching it again cannot help, a
    new query with other parameters may.

    ``still_gives``: the option of ``fedpca analyst fetch`` that gets something else
    from the same release, and what (a DCA release's PCA), if any.
    """

    def __init__(self, message: str, *, still_gives: tuple[str, str] | None = None) -> None:
        super().__init__(message)
        self.still_gives = still_gives


class EncodingOverflowError(FedpcaError, OverflowError):
    """A value could exceed the declared bounds of a packed slot.

    Raised *before* anything is encrypted; fedpca never lets a slot wrap.
    """


class LayoutError(FedpcaError, ValueError):
    """A packed-ciphertext layout does not match what the query declared."""


class CiphertextError(FedpcaError, ValueError):
    """A ciphertext is out of range, not coprime to n, or has the wrong length."""


class KeyFileError(FedpcaError, ValueError):
    """A Paillier key file is malformed or does not match its fingerprint."""


class UntrustedKeyError(FedpcaError, PermissionError):
    """An owner was asked to encrypt under an analyst key its policy does not pin."""


class CalibrationError(FedpcaError, ValueError):
    """DP parameters are outside the range a mechanism is valid for."""


class CompositionError(CalibrationError):
    """A ledger's releases compose to less noise than the accountant can account for;
    the message counts the ledger's releases (an owner keeps it in its own log)."""


class BudgetExceededError(FedpcaError, PermissionError):
    """A release would push cumulative (epsilon, delta) past the configured budget."""


class ShareExceededError(BudgetExceededError):
    """A release would take its analyst past its share of an owner's budget. The message
    reads only that analyst's own releases (fedpca.dp.shares)."""


class OverloadError(FedpcaError, RuntimeError):
    """A peer asked the proxy for more than one of its per-peer bounds allows (calls,
    uploads or queries in flight, queries a day): nothing was done; retry later."""


class OwnersNotConnectedError(OverloadError, ConfigError):
    """Fewer owners than a query's quorum are connected to the proxy: nothing was
    submitted; retry later (or ask a smaller quorum)."""


class PolicyError(FedpcaError, PermissionError):
    """A task violates an owner's local policy (other than the budget)."""


class OwnersWouldDeclineError(PolicyError):
    """The terms the connected owners stated leave fewer owners than a query's quorum
    that would accept it: nothing was submitted."""


class ProtocolError(FedpcaError, ValueError):
    """A peer sent a message that breaks the protocol (order, size, hash, replay)."""


class ProtocolVersionError(ProtocolError):
    """A peer speaks another wire protocol version than this node
    (:data:`fedpca.version.PROTOCOL_VERSION`); the message names the peer and both
    versions.

    Attributes
    ----------
    peer : the peer, as the message names it.
    theirs : the version it states (its own text, cut, if not a number).
    ours : this node's version.
    """

    def __init__(self, peer: str, theirs: object, ours: int, here: str) -> None:
        self.peer = peer
        self.theirs = theirs
        self.ours = ours
        super().__init__(
            f"{peer} speaks wire protocol {theirs}, {here} {ours}: every node needs a build "
            "of the same wire protocol (`fedpca --version` prints a build's)"
        )


class QueryStateError(FedpcaError, RuntimeError):
    """An operation does not fit the current state of a query (e.g. late upload)."""


class DeclinedForBudgetError(QueryStateError):
    """A query failed, and every owner that declined it did so for its privacy budget
    (the analyst's CLI exits as for a refusal of its own budget)."""


BUDGET_REFUSALS = (BudgetExceededError, DeclinedForBudgetError)
"""What the analyst's CLI reports as a refusal by a privacy budget (its exit status 3)."""


class NotFoundError(FedpcaError, LookupError):
    """An unknown query, owner or analyst was referenced."""


class AuthenticationError(FedpcaError, PermissionError):
    """A peer is unknown or its certificate does not grant the role it acts in."""
