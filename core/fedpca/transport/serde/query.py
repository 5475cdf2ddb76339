"""``fedpca.v1.QuerySpec`` (query.proto) <-> :class:`fedpca.query.QuerySpec`."""

from __future__ import annotations

from typing import Any

from fedpca.errors import ConfigError, ProtocolError
from fedpca.query import MAX_AGGREGATES, Aggregate, QuerySpec
from fedpca.transport.serde._common import (
    AGGREGATE_KIND_FROM_PROTO,
    AGGREGATE_KIND_TO_PROTO,
    CALIBRATION_FROM_PROTO,
    CALIBRATION_TO_PROTO,
    KIND_FROM_PROTO,
    KIND_TO_PROTO,
    MODE_FROM_PROTO,
    MODE_TO_PROTO,
    MOMENTS_FROM_PROTO,
    MOMENTS_TO_PROTO,
    NEIGHBOURING_FROM_PROTO,
    NEIGHBOURING_TO_PROTO,
    bounded_text,
    enum_from_proto,
    extend_repeated,
    set_scalars,
    short_repr,
)
from fedpca.v1 import query_pb2 as query_pb

MAX_QUERY_BYTES = 1 << 20
"""The largest encoded QuerySpec accepted from a peer: 65,536 features' bounds, or
about 131,000 histogram bin edges. Far above what PCA at M = 5,000 needs (80 KB)."""


def _key_modulus_to_bytes(n: int) -> bytes:
    if n <= 0:
        raise ConfigError(f"analyst_public_key_n must be positive, got {n}")
    return n.to_bytes((n.bit_length() + 7) // 8, "big")


MAX_KEY_MODULUS_BITS = 8_192
"""The longest analyst Paillier modulus accepted from a peer (4 times the 2,048-bit
default; 2,467 decimal digits). Unbounded, a modulus of more than about 14,280 bits in a
task made the query's digest fail (Python's limit of 4,300 digits on int-to-text
conversion): the owner's session ended with a traceback on each such event, at a
proxy's will (found by review)."""


def _key_modulus_from_bytes(data: bytes, what: str) -> int:
    if not data:
        raise ProtocolError(f"{what}.analyst_public_key_n is empty")

    # One canonical encoding per key: fingerprints and equality checks on the
    # raw bytes must not depend on how a peer padded the modulus.
    if data[0] == 0:
        raise ProtocolError(
            f"{what}.analyst_public_key_n has a leading zero byte (not minimal big-endian)"
        )
    n = int.from_bytes(data, "big")
    if n.bit_length() > MAX_KEY_MODULUS_BITS:
        raise ProtocolError(
            f"{what}.analyst_public_key_n has {n.bit_length():,} bits; at most "
            f"{MAX_KEY_MODULUS_BITS:,} are accepted"
        )
    return n


#: Names of the QuerySpec fields on the wire; equal to the dataclass field names.
QUERY_SPEC_WIRE_FIELDS: frozenset[str] = frozenset(query_pb.QuerySpec.DESCRIPTOR.fields_by_name)


def query_spec_to_proto(spec: QuerySpec) -> query_pb.QuerySpec:
    """Encode a :class:`~fedpca.query.QuerySpec`; every field is written explicitly.

    Raises
    ------
    ConfigError
        If a value does not fit its wire type (e.g. a negative label column).
    """
    what = f"QuerySpec {spec.query_id!r}"
    message = query_pb.QuerySpec()
    set_scalars(
        message,
        what,
        query_id=spec.query_id,
        kind=KIND_TO_PROTO[spec.kind],
        n_features=spec.n_features,
        clip_norm=spec.clip_norm,
        epsilon=spec.epsilon,
        delta=spec.delta,
        calibration=CALIBRATION_TO_PROTO[spec.calibration],
        neighbouring=NEIGHBOURING_TO_PROTO[spec.neighbouring],
        bounded_owner_tables=spec.bounded_owner_tables,
        mode=MODE_TO_PROTO[spec.mode],
        n_components=spec.n_components,
        quorum=spec.quorum,
        deadline_seconds=spec.deadline_seconds,
        max_records_per_owner=spec.max_records_per_owner,
        max_owners=spec.max_owners,
        frac_bits=spec.frac_bits,
        analyst_public_key_n=_key_modulus_to_bytes(spec.analyst_public_key_n),
        analyst_key_fingerprint=spec.analyst_key_fingerprint,
    )
    if spec.label_column is not None:
        set_scalars(message, what, label_column=spec.label_column)
    if spec.issued_at is not None:
        set_scalars(message, what, issued_at=spec.issued_at)
    extend_repeated(message, what, "feature_lower", spec.feature_lower)
    extend_repeated(message, what, "feature_upper", spec.feature_upper)
    extend_repeated(message, what, "class_labels", spec.class_labels)
    extend_repeated(message, what, "feature_columns", spec.feature_columns)
    extend_repeated(message, what, "noise_weights", spec.noise_weights)
    for index, part in enumerate(spec.aggregates):
        _aggregate_to_proto(part, message.aggregates.add(), f"{what}.aggregates[{index}]")
    return message


def _aggregate_to_proto(part: Aggregate, message: query_pb.Aggregate, what: str) -> None:
    set_scalars(message, what, kind=AGGREGATE_KIND_TO_PROTO[part.kind])
    extend_repeated(message, what, "columns", part.columns)
    extend_repeated(message, what, "lower", part.lower)
    extend_repeated(message, what, "upper", part.upper)
    if part.moments is not None:
        set_scalars(message, what, moments=MOMENTS_TO_PROTO[part.moments])
    for edges in part.bin_edges:
        extend_repeated(message.bin_edges.add(), what, "edges", edges)
    for name in ("group_column", "target_column", "target_lower", "target_upper"):
        value = getattr(part, name)
        if value is not None:
            set_scalars(message, what, **{name: value})
    extend_repeated(message, what, "categories", part.categories)


def _aggregate_from_proto(message: query_pb.Aggregate, what: str) -> Aggregate:
    kwargs: dict[str, Any] = {
        "kind": enum_from_proto(message.kind, AGGREGATE_KIND_FROM_PROTO, f"{what}.kind"),
        "columns": tuple(message.columns),
        "lower": tuple(message.lower),
        "upper": tuple(message.upper),
        "bin_edges": tuple(tuple(e.edges) for e in message.bin_edges),
        "categories": tuple(message.categories),
    }
    if message.moments != query_pb.MOMENTS_UNSPECIFIED:
        kwargs["moments"] = enum_from_proto(message.moments, MOMENTS_FROM_PROTO, f"{what}.moments")
    for name in ("group_column", "target_column", "target_lower", "target_upper"):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    try:
        return Aggregate(**kwargs)
    except ConfigError as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from exc


def query_spec_from_proto(message: query_pb.QuerySpec) -> QuerySpec:
    """Decode and validate a QuerySpec sent by a peer.

    Absent ``optional`` fields, UNSPECIFIED calibration and UNSPECIFIED mode take
    the :class:`~fedpca.query.QuerySpec` defaults; the kind has no default.

    Raises
    ------
    ProtocolError
        If the message is malformed or the spec it describes is invalid (the
        message of the underlying ConfigError is kept).
    """
    what = f"QuerySpec {short_repr(message.query_id)}"
    # Bounded before anything is built from it: a peer's spec is decoded on its way in
    # (the proxy's event loop, an owner's task stream), stored and read back.
    size = message.ByteSize()
    if size > MAX_QUERY_BYTES:
        raise ProtocolError(
            f"{what} is {size} bytes, more than {MAX_QUERY_BYTES} (at most "
            f"{MAX_QUERY_BYTES // 16:,} features or about {MAX_QUERY_BYTES // 8:,} histogram "
            "bin edges)"
        )
    if len(message.aggregates) > MAX_AGGREGATES:
        raise ProtocolError(f"{what}: at most {MAX_AGGREGATES} aggregates per query")
    kwargs: dict[str, Any] = {
        "query_id": message.query_id,
        "kind": enum_from_proto(message.kind, KIND_FROM_PROTO, f"{what}.kind"),
        "n_features": message.n_features,
        "feature_lower": tuple(message.feature_lower),
        "feature_upper": tuple(message.feature_upper),
        "epsilon": message.epsilon,
        "delta": message.delta,
        "n_components": message.n_components,
        "class_labels": tuple(message.class_labels),
        "feature_columns": tuple(message.feature_columns),
        "noise_weights": tuple(message.noise_weights),
        "bounded_owner_tables": message.bounded_owner_tables,
        "analyst_public_key_n": _key_modulus_from_bytes(message.analyst_public_key_n, what),
        "analyst_key_fingerprint": bounded_text(
            message.analyst_key_fingerprint, f"{what}.analyst_key_fingerprint"
        ),
        "aggregates": tuple(
            _aggregate_from_proto(part, f"{what}.aggregates[{index}]")
            for index, part in enumerate(message.aggregates)
        ),
    }
    if message.calibration != query_pb.CALIBRATION_UNSPECIFIED:
        kwargs["calibration"] = enum_from_proto(
            message.calibration, CALIBRATION_FROM_PROTO, f"{what}.calibration"
        )
    if message.neighbouring != query_pb.NEIGHBOURING_UNSPECIFIED:
        kwargs["neighbouring"] = enum_from_proto(
            message.neighbouring, NEIGHBOURING_FROM_PROTO, f"{what}.neighbouring"
        )
    if message.mode != query_pb.PROTOCOL_MODE_UNSPECIFIED:
        kwargs["mode"] = enum_from_proto(message.mode, MODE_FROM_PROTO, f"{what}.mode")
    for name in (
        "clip_norm",
        "label_column",
        "quorum",
        "deadline_seconds",
        "max_records_per_owner",
        "max_owners",
        "frac_bits",
        "issued_at",
    ):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    try:
        return QuerySpec(**kwargs)
    except ConfigError as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from exc
