"""What every translation in :mod:`fedpca.transport.serde` shares.

The domain <-> wire tables of every enum, and helpers for scalar fields and
timestamps that turn protobuf's errors into fedpca's: a value we cannot encode is
a ConfigError, a value a peer sent that we cannot decode is a ProtocolError.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from fedpca.admission import AdmissionLimit
from fedpca.errors import ConfigError, ProtocolError
from fedpca.formatting import printable
from fedpca.messages import (
    DeclineReason,
    NoiseMechanism,
    ObfuscationVariant,
    QueryState,
    UploadStatus,
)
from fedpca.query import (
    QUERY_ID_PATTERN,
    AggregateKind,
    Calibration,
    Moments,
    Neighbouring,
    ProtocolMode,
    QueryKind,
)
from fedpca.transport.certs import validate_node_id
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import query_pb2 as query_pb

logger = logging.getLogger(__name__)


_E = TypeVar("_E")
_W = TypeVar("_W", bound=int)

KIND_TO_PROTO: dict[QueryKind, query_pb.QueryKind] = {
    QueryKind.PCA: query_pb.QUERY_KIND_PCA,
    QueryKind.DCA: query_pb.QUERY_KIND_DCA,
    QueryKind.AGGREGATE: query_pb.QUERY_KIND_AGGREGATE,
}
AGGREGATE_KIND_TO_PROTO: dict[AggregateKind, query_pb.AggregateKind] = {
    AggregateKind.STATS: query_pb.AGGREGATE_KIND_STATS,
    AggregateKind.HISTOGRAM: query_pb.AGGREGATE_KIND_HISTOGRAM,
    AggregateKind.LINREG: query_pb.AGGREGATE_KIND_LINREG,
}
MOMENTS_TO_PROTO: dict[Moments, query_pb.Moments] = {
    Moments.MEAN: query_pb.MOMENTS_MEAN,
    Moments.VARIANCE: query_pb.MOMENTS_VARIANCE,
    Moments.COVARIANCE: query_pb.MOMENTS_COVARIANCE,
}
MODE_TO_PROTO: dict[ProtocolMode, query_pb.ProtocolMode] = {
    ProtocolMode.STATS: query_pb.PROTOCOL_MODE_STATS,
    ProtocolMode.MASKED: query_pb.PROTOCOL_MODE_MASKED,
}
CALIBRATION_TO_PROTO: dict[Calibration, query_pb.Calibration] = {
    Calibration.ZCDP: query_pb.CALIBRATION_ZCDP,
    Calibration.ANALYTIC: query_pb.CALIBRATION_ANALYTIC,
    Calibration.CLASSIC: query_pb.CALIBRATION_CLASSIC,
}
NEIGHBOURING_TO_PROTO: dict[Neighbouring, query_pb.Neighbouring] = {
    Neighbouring.ADD_REMOVE: query_pb.NEIGHBOURING_ADD_REMOVE,
    Neighbouring.REPLACE_ONE: query_pb.NEIGHBOURING_REPLACE_ONE,
}
OBFUSCATION_TO_PROTO: dict[ObfuscationVariant, owner_pb.ObfuscationVariant] = {
    ObfuscationVariant.FULL: owner_pb.OBFUSCATION_VARIANT_FULL,
    ObfuscationVariant.DJN: owner_pb.OBFUSCATION_VARIANT_DJN_SHORT_EXPONENT,
}
DECLINE_TO_PROTO: dict[DeclineReason, owner_pb.DeclineReason] = {
    DeclineReason.POLICY_REFUSAL: owner_pb.DECLINE_REASON_POLICY_REFUSAL,
    DeclineReason.KEY_NOT_PINNED: owner_pb.DECLINE_REASON_KEY_NOT_PINNED,
    DeclineReason.BUDGET_EXHAUSTED: owner_pb.DECLINE_REASON_BUDGET_EXHAUSTED,
    DeclineReason.UNSIGNED_QUERY: owner_pb.DECLINE_REASON_UNSIGNED_QUERY,
}
UPLOAD_STATUS_TO_PROTO: dict[UploadStatus, owner_pb.UploadReceipt.Status] = {
    UploadStatus.ACCEPTED: owner_pb.UploadReceipt.STATUS_ACCEPTED,
    UploadStatus.DUPLICATE: owner_pb.UploadReceipt.STATUS_DUPLICATE,
}
# The wire also numbers PENDING (1); no proxy ever reports it, so it decodes like any
# value unknown to this version.
STATE_TO_PROTO: dict[QueryState, analyst_pb.QueryState] = {
    QueryState.COLLECTING: analyst_pb.QUERY_STATE_COLLECTING,
    QueryState.AGGREGATING: analyst_pb.QUERY_STATE_AGGREGATING,
    QueryState.NOISING: analyst_pb.QUERY_STATE_NOISING,
    QueryState.DONE: analyst_pb.QUERY_STATE_DONE,
    QueryState.FAILED: analyst_pb.QUERY_STATE_FAILED,
}
MECHANISM_TO_PROTO: dict[NoiseMechanism, analyst_pb.NoiseMechanism] = {
    NoiseMechanism.GAUSSIAN: analyst_pb.NOISE_MECHANISM_GAUSSIAN,
    NoiseMechanism.NONE: analyst_pb.NOISE_MECHANISM_NONE,
}
ADMISSION_LIMIT_TO_PROTO: dict[AdmissionLimit, analyst_pb.AdmissionLimit] = {
    AdmissionLimit.BUDGET: analyst_pb.ADMISSION_LIMIT_BUDGET,
    AdmissionLimit.PER_QUERY_CAP: analyst_pb.ADMISSION_LIMIT_PER_QUERY_CAP,
    AdmissionLimit.NOISE_FLOOR: analyst_pb.ADMISSION_LIMIT_NOISE_FLOOR,
    AdmissionLimit.EXHAUSTED: analyst_pb.ADMISSION_LIMIT_EXHAUSTED,
    AdmissionLimit.UNLIMITED: analyst_pb.ADMISSION_LIMIT_UNLIMITED,
}


def _invert(mapping: Mapping[_E, _W]) -> dict[_W, _E]:
    return {wire: domain for domain, wire in mapping.items()}


KIND_FROM_PROTO = _invert(KIND_TO_PROTO)
AGGREGATE_KIND_FROM_PROTO = _invert(AGGREGATE_KIND_TO_PROTO)
MOMENTS_FROM_PROTO = _invert(MOMENTS_TO_PROTO)
MODE_FROM_PROTO = _invert(MODE_TO_PROTO)
CALIBRATION_FROM_PROTO = _invert(CALIBRATION_TO_PROTO)
NEIGHBOURING_FROM_PROTO = _invert(NEIGHBOURING_TO_PROTO)
OBFUSCATION_FROM_PROTO = _invert(OBFUSCATION_TO_PROTO)
DECLINE_FROM_PROTO = _invert(DECLINE_TO_PROTO)
UPLOAD_STATUS_FROM_PROTO = _invert(UPLOAD_STATUS_TO_PROTO)
STATE_FROM_PROTO = _invert(STATE_TO_PROTO)
MECHANISM_FROM_PROTO = _invert(MECHANISM_TO_PROTO)
ADMISSION_LIMIT_FROM_PROTO = _invert(ADMISSION_LIMIT_TO_PROTO)


def enum_from_proto(value: _W, mapping: Mapping[_W, _E], what: str) -> _E:
    """Decode a single-valued enum strictly: UNSPECIFIED or unknown is an error."""
    try:
        return mapping[value]
    except KeyError:
        raise ProtocolError(
            f"{what}: enum value {value} is unspecified or unknown to this version"
        ) from None


MAX_CAPABILITIES = 16
"""More obfuscation variants than any version of fedpca offers."""


def capabilities_from_proto(
    values: Iterable[owner_pb.ObfuscationVariant], what: str
) -> tuple[ObfuscationVariant, ...]:
    """Decode a capability list leniently: a newer peer may offer variants we lack.

    At most :data:`MAX_CAPABILITIES` entries (a peer's 8 million took the proxy's event
    loop for most of a second per call, review).
    """
    listed = list(itertools.islice(values, MAX_CAPABILITIES + 1))
    if len(listed) > MAX_CAPABILITIES:
        raise ProtocolError(f"{what}: more than {MAX_CAPABILITIES} obfuscation variants")
    known = []
    for value in listed:
        variant = OBFUSCATION_FROM_PROTO.get(value)
        if variant is None:
            logger.debug("%s: ignoring unknown obfuscation variant %d", what, value)
        else:
            known.append(variant)
    return tuple(known)


def set_scalars(message: Any, what: str, **values: Any) -> None:
    """Assign scalar fields, turning protobuf's range/type errors into ConfigError."""
    for name, value in values.items():
        try:
            setattr(message, name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}.{name}={value!r} cannot be encoded: {exc}") from exc


def extend_repeated(message: Any, what: str, name: str, values: Iterable[Any]) -> None:
    try:
        getattr(message, name).extend(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}.{name} cannot be encoded: {exc}") from exc


def timestamp_to_proto(moment: datetime, what: str) -> timestamp_pb2.Timestamp:
    # A naive datetime would be read as UTC by protobuf and silently shift by
    # the local offset; deadlines must not depend on the sender's time zone.
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ConfigError(f"{what} must be a timezone-aware datetime, got naive {moment!r}")
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def timestamp_from_proto(stamp: timestamp_pb2.Timestamp, what: str) -> datetime:
    # A peer may send any int64 seconds / int32 nanos; protobuf's ToDatetime raises a
    # bare ValueError outside 0001-01-01..9999-12-31 or for nanos outside [0, 1e9).
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError) as exc:
        raise ProtocolError(f"{what} is not a valid timestamp: {exc}") from None


MAX_PEER_TEXT = 256
"""The longest identifier, fingerprint or version a peer may send (each is far shorter):
longer text is refused at decoding, before it is stored, logged or quoted."""


def require_text(value: str, what: str, *, max_length: int = MAX_PEER_TEXT) -> str:
    """A non-empty text field of a peer's message, at most ``max_length`` characters."""
    if not value:
        raise ProtocolError(f"{what} is empty")
    return bounded_text(value, what, max_length=max_length)


def bounded_text(value: str, what: str, *, max_length: int = MAX_PEER_TEXT) -> str:
    """A text field of a peer's message (may be empty), at most ``max_length`` characters."""
    if len(value) > max_length:
        raise ProtocolError(
            f"{what} {short_repr(value)} is {len(value)} characters long, more than {max_length}"
        )
    return value


def shown_text(value: str, what: str, *, max_length: int = MAX_PEER_TEXT) -> str:
    """:func:`bounded_text` for a field only shown to people (a reason, a version), its
    control characters escaped (:func:`fedpca.formatting.printable`): a peer's ESC or BEL
    reached terminals and logs (found by review). Never for a field that is compared or
    signed: that must stay exactly what was sent."""
    return printable(bounded_text(value, what, max_length=max_length))


def short_repr(text: str, limit: int = 40) -> str:
    """``repr`` of a peer's text cut to ``limit`` characters: error messages and log
    lines quote what a peer sent without growing with it."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def require_query_id(value: str, what: str) -> str:
    """A query id as an analyst refers to its query (the rule of upload ids).

    Raises
    ------
    ProtocolError
        Empty, longer than 128 characters, or outside ``[A-Za-z0-9._-]``.
    """
    if not QUERY_ID_PATTERN.fullmatch(require_text(value, what)):
        raise ProtocolError(
            f"{what} {short_repr(value)} must be 1 to 128 letters, digits, '.', '_' or '-'"
        )
    return value


def require_task_key(value: str, what: str) -> str:
    """A task's key as an owner sends it back: ``<analyst id>/<query id>`` (the proxy's
    task id), or a bare query id.

    Raises
    ------
    ProtocolError
        Either part breaks its rule (node ids, :func:`require_query_id`).
    """
    analyst, separator, query_id = require_text(value, what).rpartition("/")
    valid = QUERY_ID_PATTERN.fullmatch(query_id) is not None
    if valid and separator:
        try:
            validate_node_id(analyst)
        except ConfigError:
            valid = False
    if not valid:
        raise ProtocolError(
            f"{what} {short_repr(value)} must be '<analyst id>/<query id>' (a query id is 1 "
            "to 128 letters, digits, '.', '_' or '-')"
        )
    return value
