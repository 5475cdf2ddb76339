"""``fedpca.v1.QuerySpec`` (query.proto) <-> :class:`fedpca.query.QuerySpec`."""

from __future__ import annotations

from typing import Any

from fedpca.errors import ConfigError, ProtocolError
from fedpca.owner_terms import MAX_STATED_COUNT, OwnerTerms
from fedpca.query import (
    MAX_AGGREGATES,
    RELEASE_KINDS,
    Accountant,
    Aggregate,
    QuerySpec,
    release_kind,
)
from fedpca.table_schema import TableSchema
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


MAX_STATED_COLUMNS = 1 << 16
"""The widest owner file whose terms are taken: 65,536 columns (the query's own bound,
:data:`MAX_QUERY_BYTES`, allows no more features)."""

MAX_STATED_ALLOWED_COLUMNS = 8_192
"""Most allowed columns an owner's terms may list (the GISETTE width of the protocol's
evaluation is 5,000): a proxy keeps each connected owner's terms in memory."""


def owner_terms_to_proto(terms: OwnerTerms) -> query_pb.OwnerTerms:
    """An owner's terms for its task stream (absent fields: no label column, no
    enforced capacity)."""
    what = "OwnerTerms"
    message = query_pb.OwnerTerms(neighbouring=NEIGHBOURING_TO_PROTO[terms.neighbouring])
    set_scalars(
        message,
        what,
        n_columns=terms.schema.n_columns,
        columns_limited=terms.allowed_columns is not None,
        allow_masked_mode=terms.allow_masked_mode,
        allow_not_private=terms.allow_not_private,
        max_delta_per_query=terms.max_delta_per_query,
        max_epsilon_per_query=terms.max_epsilon_per_query,
        budget_delta=terms.budget_delta,
        accountant=terms.accountant,
        min_quorum=terms.min_quorum,
        max_tasks_per_day=terms.max_tasks_per_day,
    )
    if terms.schema.label_column is not None:
        set_scalars(message, what, label_column=terms.schema.label_column)
    if terms.max_records is not None:
        set_scalars(message, what, max_records=terms.max_records)
    extend_repeated(message, what, "allowed_kinds", (kind.value for kind in terms.allowed_kinds))
    extend_repeated(message, what, "allowed_columns", terms.allowed_columns or ())
    return message


def owner_terms_from_proto(message: query_pb.OwnerTerms, what: str) -> OwnerTerms:
    """The terms an owner stated, checked for range (they are shown to analysts and
    judge their queries).

    Raises
    ------
    ProtocolError
        A field out of range: no columns or more than :data:`MAX_STATED_COLUMNS`, a
        label or allowed column outside the file, more than
        :data:`MAX_STATED_ALLOWED_COLUMNS` allowed columns, an unknown release kind or
        accountant (a newer owner's: its terms are then as good as not stated), a delta
        outside [0, 1), a negative or NaN epsilon, a quorum of 0.
    """
    n_columns = message.n_columns
    if not 1 <= n_columns <= MAX_STATED_COLUMNS:
        raise ProtocolError(f"{what}.n_columns = {n_columns}: not in 1..{MAX_STATED_COLUMNS}")
    label = message.label_column if message.HasField("label_column") else None
    if label is not None and label >= n_columns:
        raise ProtocolError(f"{what}.label_column = {label}: the file has {n_columns} columns")
    allowed: tuple[int, ...] | None = None
    if message.columns_limited:
        if len(message.allowed_columns) > MAX_STATED_ALLOWED_COLUMNS:
            raise ProtocolError(
                f"{what}.allowed_columns: more than {MAX_STATED_ALLOWED_COLUMNS} columns"
            )
        allowed = tuple(message.allowed_columns)
        outside = [c for c in allowed if c >= n_columns]
        if outside:
            raise ProtocolError(
                f"{what}.allowed_columns names column {outside[0]}; the file has "
                f"{n_columns} columns"
            )
    elif message.allowed_columns:
        raise ProtocolError(f"{what}.allowed_columns given without columns_limited")
    if len(message.allowed_kinds) > len(RELEASE_KINDS):
        raise ProtocolError(f"{what}.allowed_kinds: more than {len(RELEASE_KINDS)} kinds")
    kinds = []
    for name in message.allowed_kinds:
        try:
            kinds.append(release_kind(name))
        except ConfigError:
            # Quoted short: the proxy logs this, and a peer chooses the name's length.
            raise ProtocolError(
                f"{what}.allowed_kinds: unknown release kind {short_repr(name)}"
            ) from None
    try:
        accountant = Accountant(message.accountant)
    except ValueError:
        raise ProtocolError(
            f"{what}.accountant: unknown accountant {short_repr(message.accountant)}"
        ) from None
    for name, value in (
        ("max_delta_per_query", message.max_delta_per_query),
        ("budget_delta", message.budget_delta),
    ):
        if not 0.0 <= value < 1.0:
            raise ProtocolError(f"{what}.{name} = {value!r}: not in [0, 1)")
    if not message.max_epsilon_per_query >= 0.0:  # NaN fails too
        raise ProtocolError(
            f"{what}.max_epsilon_per_query = {message.max_epsilon_per_query!r}: not >= 0"
        )
    if message.min_quorum < 1:
        raise ProtocolError(f"{what}.min_quorum = {message.min_quorum}: not >= 1")
    if message.min_quorum > MAX_STATED_COUNT:
        raise ProtocolError(f"{what}.min_quorum = {message.min_quorum}: too large")
    if message.max_tasks_per_day > MAX_STATED_COUNT:
        raise ProtocolError(f"{what}.max_tasks_per_day = {message.max_tasks_per_day}: too large")
    return OwnerTerms(
        schema=TableSchema(n_columns, label),
        neighbouring=enum_from_proto(
            message.neighbouring, NEIGHBOURING_FROM_PROTO, f"{what}.neighbouring"
        ),
        allowed_kinds=tuple(kinds),
        allowed_columns=allowed,
        allow_masked_mode=message.allow_masked_mode,
        allow_not_private=message.allow_not_private,
        max_delta_per_query=message.max_delta_per_query,
        max_epsilon_per_query=message.max_epsilon_per_query,
        budget_delta=message.budget_delta,
        accountant=accountant,
        min_quorum=message.min_quorum,
        max_tasks_per_day=message.max_tasks_per_day,
        max_records=message.max_records if message.HasField("max_records") else None,
    )
