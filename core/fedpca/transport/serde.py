"""The one place that converts between ``fedpca.v1`` messages and domain objects.

gRPC servicers and clients only call the ``*_to_proto`` / ``*_from_proto``
functions and the stream encoders and readers defined here; nothing else in
fedpca touches generated message classes field by field. The domain objects
themselves, and the chunking of ciphertext streams, live in
:mod:`fedpca.messages`.

Direction and errors
--------------------
``*_to_proto`` encodes a local, already valid domain object; a value that cannot
be represented on the wire raises :class:`~fedpca.errors.ConfigError` (or
:class:`~fedpca.errors.CiphertextError` for a ciphertext out of range).
``*_from_proto`` decodes what a peer sent; anything malformed raises
:class:`~fedpca.errors.ProtocolError` whose message names the field, chunk or
block at fault, so the servicer can return it verbatim as INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from fedpca.errors import ConfigError, LayoutError, ProtocolError
from fedpca.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    UPLOAD_ID_PATTERN,
    BudgetStatus,
    ChunkAssembler,
    CiphertextBlock,
    CiphertextPayload,
    DeclineReason,
    Heartbeat,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    ObfuscationVariant,
    OwnerHello,
    ProxyInfo,
    QueryResult,
    QueryState,
    QueryStatus,
    Task,
    TaskCancellation,
    TaskDecline,
    TaskEvent,
    UploadHeader,
    UploadReceipt,
    UploadStatus,
    check_layout,
    check_sha256,
    collect_payload,
    split_into_chunks,
)
from fedpca.query import Calibration, ProtocolMode, QueryKind, QuerySpec
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import query_pb2 as query_pb

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- enums

_E = TypeVar("_E")
_W = TypeVar("_W", bound=int)

_KIND_TO_PROTO: dict[QueryKind, query_pb.QueryKind] = {
    QueryKind.PCA: query_pb.QUERY_KIND_PCA,
    QueryKind.DCA: query_pb.QUERY_KIND_DCA,
}
_MODE_TO_PROTO: dict[ProtocolMode, query_pb.ProtocolMode] = {
    ProtocolMode.STATS: query_pb.PROTOCOL_MODE_STATS,
    ProtocolMode.MASKED: query_pb.PROTOCOL_MODE_MASKED,
}
_CALIBRATION_TO_PROTO: dict[Calibration, query_pb.Calibration] = {
    Calibration.ANALYTIC: query_pb.CALIBRATION_ANALYTIC,
    Calibration.CLASSIC: query_pb.CALIBRATION_CLASSIC,
}


_OBFUSCATION_TO_PROTO: dict[ObfuscationVariant, owner_pb.ObfuscationVariant] = {
    ObfuscationVariant.FULL: owner_pb.OBFUSCATION_VARIANT_FULL,
    ObfuscationVariant.DJN: owner_pb.OBFUSCATION_VARIANT_DJN_SHORT_EXPONENT,
}
_DECLINE_TO_PROTO: dict[DeclineReason, owner_pb.DeclineReason] = {
    DeclineReason.POLICY_REFUSAL: owner_pb.DECLINE_REASON_POLICY_REFUSAL,
    DeclineReason.KEY_NOT_PINNED: owner_pb.DECLINE_REASON_KEY_NOT_PINNED,
    DeclineReason.BUDGET_EXHAUSTED: owner_pb.DECLINE_REASON_BUDGET_EXHAUSTED,
}
_UPLOAD_STATUS_TO_PROTO: dict[UploadStatus, owner_pb.UploadReceipt.Status] = {
    UploadStatus.ACCEPTED: owner_pb.UploadReceipt.STATUS_ACCEPTED,
    UploadStatus.DUPLICATE: owner_pb.UploadReceipt.STATUS_DUPLICATE,
}
# The wire also numbers PENDING (1) and AGGREGATING (3); no proxy ever reports them,
# so they decode like any value unknown to this version.
_STATE_TO_PROTO: dict[QueryState, analyst_pb.QueryState] = {
    QueryState.COLLECTING: analyst_pb.QUERY_STATE_COLLECTING,
    QueryState.NOISING: analyst_pb.QUERY_STATE_NOISING,
    QueryState.DONE: analyst_pb.QUERY_STATE_DONE,
    QueryState.FAILED: analyst_pb.QUERY_STATE_FAILED,
}
_MECHANISM_TO_PROTO: dict[NoiseMechanism, analyst_pb.NoiseMechanism] = {
    NoiseMechanism.GAUSSIAN: analyst_pb.NOISE_MECHANISM_GAUSSIAN,
    NoiseMechanism.NONE: analyst_pb.NOISE_MECHANISM_NONE,
}


def _invert(mapping: Mapping[_E, _W]) -> dict[_W, _E]:
    return {wire: domain for domain, wire in mapping.items()}


_KIND_FROM_PROTO = _invert(_KIND_TO_PROTO)
_MODE_FROM_PROTO = _invert(_MODE_TO_PROTO)
_CALIBRATION_FROM_PROTO = _invert(_CALIBRATION_TO_PROTO)
_OBFUSCATION_FROM_PROTO = _invert(_OBFUSCATION_TO_PROTO)
_DECLINE_FROM_PROTO = _invert(_DECLINE_TO_PROTO)
_UPLOAD_STATUS_FROM_PROTO = _invert(_UPLOAD_STATUS_TO_PROTO)
_STATE_FROM_PROTO = _invert(_STATE_TO_PROTO)
_MECHANISM_FROM_PROTO = _invert(_MECHANISM_TO_PROTO)


def _enum_from_proto(value: _W, mapping: Mapping[_W, _E], what: str) -> _E:
    """Decode a single-valued enum strictly: UNSPECIFIED or unknown is an error."""
    try:
        return mapping[value]
    except KeyError:
        raise ProtocolError(
            f"{what}: enum value {value} is unspecified or unknown to this version"
        ) from None


def _capabilities_from_proto(
    values: Iterable[owner_pb.ObfuscationVariant], what: str
) -> tuple[ObfuscationVariant, ...]:
    """Decode a capability list leniently: a newer peer may offer variants we lack."""
    known = []
    for value in values:
        variant = _OBFUSCATION_FROM_PROTO.get(value)
        if variant is None:
            logger.debug("%s: ignoring unknown obfuscation variant %d", what, value)
        else:
            known.append(variant)
    return tuple(known)


# ---------------------------------------------------------------- small helpers


def _set_scalars(message: Any, what: str, **values: Any) -> None:
    """Assign scalar fields, turning protobuf's range/type errors into ConfigError."""
    for name, value in values.items():
        try:
            setattr(message, name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}.{name}={value!r} cannot be encoded: {exc}") from exc


def _extend(message: Any, what: str, name: str, values: Iterable[Any]) -> None:
    try:
        getattr(message, name).extend(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}.{name} cannot be encoded: {exc}") from exc


def _timestamp_to_proto(moment: datetime, what: str) -> timestamp_pb2.Timestamp:
    # A naive datetime would be read as UTC by protobuf and silently shift by
    # the local offset; deadlines must not depend on the sender's time zone.
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ConfigError(f"{what} must be a timezone-aware datetime, got naive {moment!r}")
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _timestamp_from_proto(stamp: timestamp_pb2.Timestamp, what: str) -> datetime:
    # A peer may send any int64 seconds / int32 nanos; protobuf's ToDatetime raises a
    # bare ValueError outside 0001-01-01..9999-12-31 or for nanos outside [0, 1e9).
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError) as exc:
        raise ProtocolError(f"{what} is not a valid timestamp: {exc}") from None


def _key_modulus_to_bytes(n: int) -> bytes:
    if n <= 0:
        raise ConfigError(f"analyst_public_key_n must be positive, got {n}")
    return n.to_bytes((n.bit_length() + 7) // 8, "big")


def _key_modulus_from_bytes(data: bytes, what: str) -> int:
    if not data:
        raise ProtocolError(f"{what}.analyst_public_key_n is empty")
    # One canonical encoding per key: fingerprints and equality checks on the
    # raw bytes must not depend on how a peer padded the modulus.
    if data[0] == 0:
        raise ProtocolError(
            f"{what}.analyst_public_key_n has a leading zero byte (not minimal big-endian)"
        )
    return int.from_bytes(data, "big")


def _require_text(value: str, what: str) -> str:
    if not value:
        raise ProtocolError(f"{what} is empty")
    return value


# -------------------------------------------------------------------- QuerySpec

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
    _set_scalars(
        message,
        what,
        query_id=spec.query_id,
        kind=_KIND_TO_PROTO[spec.kind],
        n_features=spec.n_features,
        clip_norm=spec.clip_norm,
        epsilon=spec.epsilon,
        delta=spec.delta,
        calibration=_CALIBRATION_TO_PROTO[spec.calibration],
        mode=_MODE_TO_PROTO[spec.mode],
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
        _set_scalars(message, what, label_column=spec.label_column)
    _extend(message, what, "feature_lower", spec.feature_lower)
    _extend(message, what, "feature_upper", spec.feature_upper)
    _extend(message, what, "class_labels", spec.class_labels)
    _extend(message, what, "noise_weights", spec.noise_weights)
    return message


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
    what = f"QuerySpec {message.query_id!r}"
    kwargs: dict[str, Any] = {
        "query_id": message.query_id,
        "kind": _enum_from_proto(message.kind, _KIND_FROM_PROTO, f"{what}.kind"),
        "n_features": message.n_features,
        "feature_lower": tuple(message.feature_lower),
        "feature_upper": tuple(message.feature_upper),
        "epsilon": message.epsilon,
        "delta": message.delta,
        "n_components": message.n_components,
        "class_labels": tuple(message.class_labels),
        "noise_weights": tuple(message.noise_weights),
        "analyst_public_key_n": _key_modulus_from_bytes(message.analyst_public_key_n, what),
        "analyst_key_fingerprint": message.analyst_key_fingerprint,
    }
    if message.calibration != query_pb.CALIBRATION_UNSPECIFIED:
        kwargs["calibration"] = _enum_from_proto(
            message.calibration, _CALIBRATION_FROM_PROTO, f"{what}.calibration"
        )
    if message.mode != query_pb.PROTOCOL_MODE_UNSPECIFIED:
        kwargs["mode"] = _enum_from_proto(message.mode, _MODE_FROM_PROTO, f"{what}.mode")
    for name in (
        "clip_norm",
        "label_column",
        "quorum",
        "deadline_seconds",
        "max_records_per_owner",
        "max_owners",
        "frac_bits",
    ):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    try:
        return QuerySpec(**kwargs)
    except ConfigError as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from exc


# ------------------------------------------------------------ ciphertext layout


def blocks_to_proto(blocks: Sequence[CiphertextBlock]) -> list[ciphertext_pb.CiphertextBlock]:
    """Encode a layout (the single domain → wire mapping of a block)."""
    check_layout(blocks)
    messages = []
    for block in blocks:
        message = ciphertext_pb.CiphertextBlock()
        _set_scalars(
            message,
            f"block {block.name!r}",
            name=block.name,
            key_bits=block.key_bits,
            slot_bits=block.slot_bits,
            slots_per_ciphertext=block.slots_per_ciphertext,
            value_count=block.value_count,
            n_ciphertexts=block.n_ciphertexts,
        )
        messages.append(message)
    return messages


def blocks_from_proto(
    messages: Iterable[ciphertext_pb.CiphertextBlock],
) -> tuple[CiphertextBlock, ...]:
    """Decode and check a layout (the single wire → domain mapping of a block).

    Raises
    ------
    ProtocolError
        If any block or the layout as a whole is invalid.
    """
    try:
        blocks = tuple(
            CiphertextBlock(
                name=message.name,
                key_bits=message.key_bits,
                slot_bits=message.slot_bits,
                slots_per_ciphertext=message.slots_per_ciphertext,
                value_count=message.value_count,
                n_ciphertexts=message.n_ciphertexts,
            )
            for message in messages
        )
        check_layout(blocks)
    except LayoutError as exc:
        raise ProtocolError(f"invalid ciphertext layout: {exc}") from exc
    return blocks


# ------------------------------------------------------------------- chunks


def encode_chunks(
    payload: CiphertextPayload, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[list[ciphertext_pb.CiphertextChunk], bytes]:
    """Chunk messages of a payload (:func:`fedpca.messages.split_into_chunks`).

    Returns
    -------
    chunks : list of CiphertextChunk
        In order, indices 0, 1, ...; each with its own SHA-256.
    content_sha256 : bytes
        SHA-256 over all ciphertext bytes in order (for the stream header).
    """
    chunks, content_sha256 = split_into_chunks(payload, max_message_bytes)
    messages = [
        ciphertext_pb.CiphertextChunk(
            index=chunk.index, ciphertexts=chunk.ciphertexts, sha256=chunk.sha256
        )
        for chunk in chunks
    ]
    return messages, content_sha256


# ----------------------------------------------------------------------- upload


def encode_upload(
    query_id: str,
    analyst_key_fingerprint: str,
    upload_id: str,
    payload: CiphertextPayload,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    public_record_count: int | None = None,
) -> list[owner_pb.UploadMessage]:
    """Build the full Upload client stream: header first, then chunks.

    Returns a list rather than a generator so that a retry can resend the very
    same messages (same upload id, same hashes). ``public_record_count`` is the
    owner's clear-text record count, sent in masked mode only.
    """
    if not UPLOAD_ID_PATTERN.fullmatch(upload_id):
        raise ConfigError(f"upload_id {upload_id!r} must match {UPLOAD_ID_PATTERN.pattern}")
    chunks, content_sha256 = encode_chunks(payload, max_message_bytes)
    header = owner_pb.UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=analyst_key_fingerprint,
        upload_id=upload_id,
        blocks=blocks_to_proto(payload.blocks),
        total_chunks=len(chunks),
        content_sha256=content_sha256,
    )
    if public_record_count is not None:
        _set_scalars(header, "UploadHeader", public_record_count=public_record_count)
    return [owner_pb.UploadMessage(header=header)] + [
        owner_pb.UploadMessage(chunk=chunk) for chunk in chunks
    ]


def upload_header_from_message(message: owner_pb.UploadMessage) -> UploadHeader:
    """Decode the first message of an upload stream.

    Raises
    ------
    ProtocolError
        If the message is not a header or any header field is invalid.
    """
    if message.WhichOneof("payload") != "header":
        raise ProtocolError("an upload must start with an UploadHeader")
    header = message.header
    query_id = _require_text(header.query_id, "UploadHeader.query_id")
    if not UPLOAD_ID_PATTERN.fullmatch(header.upload_id):
        raise ProtocolError(
            f"UploadHeader.upload_id {header.upload_id!r} must match {UPLOAD_ID_PATTERN.pattern}"
        )
    label = f"upload {header.upload_id!r} for query {query_id!r}"
    decoded = UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=_require_text(
            header.analyst_key_fingerprint, f"{label}: analyst_key_fingerprint"
        ),
        upload_id=header.upload_id,
        blocks=_blocks_with_label(header.blocks, label),
        total_chunks=header.total_chunks,
        content_sha256=check_sha256(header.content_sha256, f"{label}: content_sha256"),
        public_record_count=(
            header.public_record_count if header.HasField("public_record_count") else None
        ),
    )
    # Check chunk count against the layout now, before any chunk is read.
    decoded.assembler()
    return decoded


def upload_chunk_from_message(message: owner_pb.UploadMessage) -> ciphertext_pb.CiphertextChunk:
    """Extract the chunk of a non-first upload message (ProtocolError otherwise)."""
    kind = message.WhichOneof("payload")
    if kind != "chunk":
        raise ProtocolError(f"expected a ciphertext chunk after the upload header, got {kind}")
    return message.chunk


def read_upload(
    messages: Iterable[owner_pb.UploadMessage],
) -> tuple[UploadHeader, CiphertextPayload]:
    """Read and fully validate a complete upload stream."""
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None:
        raise ProtocolError("upload stream is empty (expected an UploadHeader)")
    header = upload_header_from_message(first)
    payload = collect_payload(
        header.blocks, header.assembler(), (upload_chunk_from_message(m) for m in iterator)
    )
    return header, payload


def upload_receipt_to_proto(receipt: UploadReceipt) -> owner_pb.UploadReceipt:
    message = owner_pb.UploadReceipt()
    _set_scalars(
        message,
        "UploadReceipt",
        query_id=receipt.query_id,
        upload_id=receipt.upload_id,
        status=_UPLOAD_STATUS_TO_PROTO[receipt.status],
        chunks_received=receipt.chunks_received,
        ciphertexts_received=receipt.ciphertexts_received,
    )
    return message


def upload_receipt_from_proto(message: owner_pb.UploadReceipt) -> UploadReceipt:
    return UploadReceipt(
        query_id=message.query_id,
        upload_id=message.upload_id,
        status=_enum_from_proto(message.status, _UPLOAD_STATUS_FROM_PROTO, "UploadReceipt.status"),
        chunks_received=message.chunks_received,
        ciphertexts_received=message.ciphertexts_received,
    )


def _blocks_with_label(
    messages: Iterable[ciphertext_pb.CiphertextBlock], label: str
) -> tuple[CiphertextBlock, ...]:
    try:
        return blocks_from_proto(messages)
    except ProtocolError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc


# ---------------------------------------------------------------- owner session


def owner_hello_to_proto(hello: OwnerHello) -> owner_pb.OwnerHello:
    return owner_pb.OwnerHello(
        node_id=hello.node_id,
        software_version=hello.software_version,
        obfuscation_variants=[_OBFUSCATION_TO_PROTO[v] for v in hello.obfuscation_variants],
    )


def owner_hello_from_proto(message: owner_pb.OwnerHello) -> OwnerHello:
    return OwnerHello(
        node_id=message.node_id,
        software_version=message.software_version,
        obfuscation_variants=_capabilities_from_proto(
            message.obfuscation_variants, "OwnerHello.obfuscation_variants"
        ),
    )


def proxy_info_to_proto(info: ProxyInfo) -> owner_pb.ProxyInfo:
    message = owner_pb.ProxyInfo(server_time=_timestamp_to_proto(info.server_time, "server_time"))
    _set_scalars(
        message,
        "ProxyInfo",
        proxy_id=info.proxy_id,
        software_version=info.software_version,
        protocol_version=info.protocol_version,
        authenticated_node_id=info.authenticated_node_id,
        heartbeat_interval_seconds=info.heartbeat_interval_seconds,
        max_message_bytes=info.max_message_bytes,
    )
    return message


def proxy_info_from_proto(message: owner_pb.ProxyInfo) -> ProxyInfo:
    if not message.HasField("server_time"):
        raise ProtocolError("ProxyInfo.server_time is missing")
    return ProxyInfo(
        proxy_id=message.proxy_id,
        software_version=message.software_version,
        protocol_version=message.protocol_version,
        authenticated_node_id=message.authenticated_node_id,
        heartbeat_interval_seconds=message.heartbeat_interval_seconds,
        max_message_bytes=message.max_message_bytes,
        server_time=_timestamp_from_proto(message.server_time, "ProxyInfo.server_time"),
    )


def task_stream_request_to_proto(node_id: str) -> owner_pb.TaskStreamRequest:
    """Open the task stream; the node id is informational (the certificate decides)."""
    return owner_pb.TaskStreamRequest(node_id=node_id)


def task_stream_request_from_proto(message: owner_pb.TaskStreamRequest) -> str:
    """Return the node id the owner claims (informational only)."""
    return message.node_id


def task_event_to_proto(event: TaskEvent) -> owner_pb.TaskEvent:
    """Wrap a heartbeat, task or cancellation in a TaskEvent."""
    if isinstance(event, Heartbeat):
        return owner_pb.TaskEvent(
            heartbeat=owner_pb.Heartbeat(sent_at=_timestamp_to_proto(event.sent_at, "sent_at"))
        )
    if isinstance(event, Task):
        return owner_pb.TaskEvent(
            task=owner_pb.Task(
                query=query_spec_to_proto(event.query),
                upload_deadline=_timestamp_to_proto(event.upload_deadline, "upload_deadline"),
                accepted_obfuscation_variants=[
                    _OBFUSCATION_TO_PROTO[v] for v in event.accepted_obfuscation_variants
                ],
            )
        )
    return owner_pb.TaskEvent(
        cancellation=owner_pb.TaskCancellation(query_id=event.query_id, reason=event.reason)
    )


def task_event_from_proto(message: owner_pb.TaskEvent) -> TaskEvent:
    """Unwrap a TaskEvent (ProtocolError if empty or a task lacks its query/deadline)."""
    kind = message.WhichOneof("event")
    if kind == "heartbeat":
        if not message.heartbeat.HasField("sent_at"):
            raise ProtocolError("Heartbeat.sent_at is missing")
        return Heartbeat(
            sent_at=_timestamp_from_proto(message.heartbeat.sent_at, "Heartbeat.sent_at")
        )
    if kind == "task":
        task = message.task
        if not task.HasField("query"):
            raise ProtocolError("Task.query is missing")
        if not task.HasField("upload_deadline"):
            raise ProtocolError(f"Task for query {task.query.query_id!r}: upload_deadline missing")
        return Task(
            query=query_spec_from_proto(task.query),
            upload_deadline=_timestamp_from_proto(task.upload_deadline, "Task.upload_deadline"),
            accepted_obfuscation_variants=_capabilities_from_proto(
                task.accepted_obfuscation_variants, "Task.accepted_obfuscation_variants"
            ),
        )
    if kind == "cancellation":
        return TaskCancellation(
            query_id=_require_text(message.cancellation.query_id, "TaskCancellation.query_id"),
            reason=message.cancellation.reason,
        )
    raise ProtocolError("TaskEvent carries no event (unknown to this version or empty)")


def task_decline_to_proto(decline: TaskDecline) -> owner_pb.TaskDecline:
    return owner_pb.TaskDecline(
        query_id=decline.query_id,
        reason=_DECLINE_TO_PROTO[decline.reason],
        detail=decline.detail,
    )


def task_decline_from_proto(message: owner_pb.TaskDecline) -> TaskDecline:
    return TaskDecline(
        query_id=_require_text(message.query_id, "TaskDecline.query_id"),
        reason=_enum_from_proto(message.reason, _DECLINE_FROM_PROTO, "TaskDecline.reason"),
        detail=message.detail,
    )


def decline_receipt_to_proto(query_id: str) -> owner_pb.DeclineReceipt:
    return owner_pb.DeclineReceipt(query_id=query_id)


def decline_receipt_from_proto(message: owner_pb.DeclineReceipt) -> str:
    """Return the acknowledged query id."""
    return message.query_id


# ---------------------------------------------------------------- analyst side


def submit_query_request_to_proto(spec: QuerySpec) -> analyst_pb.SubmitQueryRequest:
    return analyst_pb.SubmitQueryRequest(query=query_spec_to_proto(spec))


def submit_query_request_from_proto(message: analyst_pb.SubmitQueryRequest) -> QuerySpec:
    if not message.HasField("query"):
        raise ProtocolError("SubmitQueryRequest.query is missing")
    return query_spec_from_proto(message.query)


def query_ref_to_proto(query_id: str) -> analyst_pb.QueryRef:
    return analyst_pb.QueryRef(query_id=query_id)


def query_ref_from_proto(message: analyst_pb.QueryRef) -> str:
    """Return the referenced query id (ProtocolError if empty)."""
    return _require_text(message.query_id, "QueryRef.query_id")


def query_status_to_proto(status: QueryStatus) -> analyst_pb.QueryStatus:
    message = analyst_pb.QueryStatus()
    _set_scalars(
        message,
        f"QueryStatus {status.query_id!r}",
        query_id=status.query_id,
        state=_STATE_TO_PROTO[status.state],
        owners_contributed=status.owners_contributed,
        quorum=status.quorum,
        owners_declined=status.owners_declined,
        owners_uploading=status.owners_uploading,
    )
    if status.deadline is not None:
        message.deadline.CopyFrom(_timestamp_to_proto(status.deadline, "QueryStatus.deadline"))
    if status.failure_reason is not None:
        message.failure_reason = status.failure_reason
    return message


def query_status_from_proto(message: analyst_pb.QueryStatus) -> QueryStatus:
    what = f"QueryStatus {message.query_id!r}"
    return QueryStatus(
        query_id=_require_text(message.query_id, "QueryStatus.query_id"),
        state=_enum_from_proto(message.state, _STATE_FROM_PROTO, f"{what}.state"),
        owners_contributed=message.owners_contributed,
        quorum=message.quorum,
        owners_declined=message.owners_declined,
        deadline=(
            _timestamp_from_proto(message.deadline, f"{what}.deadline")
            if message.HasField("deadline")
            else None
        ),
        failure_reason=message.failure_reason if message.HasField("failure_reason") else None,
        owners_uploading=message.owners_uploading,
    )


def noise_description_to_proto(noise: NoiseDescription) -> analyst_pb.NoiseDescription:
    return analyst_pb.NoiseDescription(
        mechanism=_MECHANISM_TO_PROTO[noise.mechanism],
        calibration=_CALIBRATION_TO_PROTO[noise.calibration],
        epsilon=noise.epsilon,
        delta=noise.delta,
        sections=[analyst_pb.NoiseSection(name=s.name, sigma=s.sigma) for s in noise.sections],
    )


def noise_description_from_proto(message: analyst_pb.NoiseDescription) -> NoiseDescription:
    return NoiseDescription(
        mechanism=_enum_from_proto(
            message.mechanism, _MECHANISM_FROM_PROTO, "NoiseDescription.mechanism"
        ),
        calibration=_enum_from_proto(
            message.calibration, _CALIBRATION_FROM_PROTO, "NoiseDescription.calibration"
        ),
        epsilon=message.epsilon,
        delta=message.delta,
        sections=tuple(NoiseSection(name=s.name, sigma=s.sigma) for s in message.sections),
    )


def encode_result(
    result: QueryResult, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[analyst_pb.ResultMessage]:
    """Build the full FetchResult server stream: header first, then chunks."""
    chunks, content_sha256 = encode_chunks(result.payload, max_message_bytes)
    header = analyst_pb.ResultHeader(
        query=query_spec_to_proto(result.query),
        n_owners=result.n_owners,
        blocks=blocks_to_proto(result.payload.blocks),
        noise=noise_description_to_proto(result.noise),
        total_chunks=len(chunks),
        content_sha256=content_sha256,
    )
    if result.masked_mean_block is not None:
        header.masked_mean_block = result.masked_mean_block
    if result.public_record_count is not None:
        _set_scalars(header, "ResultHeader", public_record_count=result.public_record_count)
    return [analyst_pb.ResultMessage(header=header)] + [
        analyst_pb.ResultMessage(chunk=chunk) for chunk in chunks
    ]


def decode_result(messages: Iterable[analyst_pb.ResultMessage]) -> QueryResult:
    """Read and fully validate a FetchResult stream.

    Raises
    ------
    ProtocolError
        On any framing, layout, hash or count problem, or an invalid header.
    """
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None or first.WhichOneof("payload") != "header":
        raise ProtocolError("a result stream must start with a ResultHeader")
    header = first.header
    for name in ("query", "noise"):
        if not header.HasField(name):
            raise ProtocolError(f"ResultHeader.{name} is missing")
    query = query_spec_from_proto(header.query)
    label = f"result of query {query.query_id!r}"
    blocks = _blocks_with_label(header.blocks, label)
    assembler = ChunkAssembler(blocks, header.total_chunks, header.content_sha256, label)

    def chunks() -> Iterator[ciphertext_pb.CiphertextChunk]:
        for message in iterator:
            kind = message.WhichOneof("payload")
            if kind != "chunk":
                raise ProtocolError(f"{label}: expected a ciphertext chunk, got {kind}")
            yield message.chunk

    payload = collect_payload(blocks, assembler, chunks())
    try:
        return QueryResult(
            query=query,
            n_owners=header.n_owners,
            noise=noise_description_from_proto(header.noise),
            payload=payload,
            masked_mean_block=(
                header.masked_mean_block if header.HasField("masked_mean_block") else None
            ),
            public_record_count=(
                header.public_record_count if header.HasField("public_record_count") else None
            ),
        )
    except LayoutError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc


def budget_request_to_proto(delta: float | None = None) -> analyst_pb.BudgetRequest:
    message = analyst_pb.BudgetRequest()
    if delta is not None:
        message.delta = delta
    return message


def budget_request_from_proto(message: analyst_pb.BudgetRequest) -> float | None:
    """Return the requested delta, or None for the proxy's configured delta."""
    if not message.HasField("delta"):
        return None
    if not 0 < message.delta < 1:
        raise ProtocolError(f"BudgetRequest.delta must be in (0, 1), got {message.delta}")
    return message.delta


def budget_status_to_proto(status: BudgetStatus) -> analyst_pb.BudgetStatus:
    message = analyst_pb.BudgetStatus()
    _set_scalars(
        message,
        "BudgetStatus",
        analyst_id=status.analyst_id,
        delta=status.delta,
        epsilon_spent=status.epsilon_spent,
        epsilon_remaining=status.epsilon_remaining,
        epsilon_limit=status.epsilon_limit,
        n_releases=status.n_releases,
    )
    return message


def budget_status_from_proto(message: analyst_pb.BudgetStatus) -> BudgetStatus:
    return BudgetStatus(
        analyst_id=message.analyst_id,
        delta=message.delta,
        epsilon_spent=message.epsilon_spent,
        epsilon_remaining=message.epsilon_remaining,
        epsilon_limit=message.epsilon_limit,
        n_releases=message.n_releases,
    )
