"""owner_service.proto: hello, task stream, uploads and declines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fedpca.codec.ciphertext import ciphertext_byte_length
from fedpca.errors import ConfigError, ProtocolError
from fedpca.formatting import printable
from fedpca.messages import (
    CHUNK_FRAMING_BYTES,
    MAX_DECLINE_DETAIL,
    UPLOAD_CHUNK_BYTES,
    UPLOAD_ID_PATTERN,
    CiphertextBlock,
    CiphertextPayload,
    EncodedChunk,
    Heartbeat,
    OwnerHello,
    ProxyInfo,
    Task,
    TaskCancellation,
    TaskDecline,
    TaskEvent,
    UploadHeader,
    UploadReceipt,
    collect_payload,
)
from fedpca.owner_terms import OwnerTerms
from fedpca.transport.serde._common import (
    DECLINE_FROM_PROTO,
    DECLINE_TO_PROTO,
    OBFUSCATION_TO_PROTO,
    UPLOAD_STATUS_FROM_PROTO,
    UPLOAD_STATUS_TO_PROTO,
    bounded_text,
    capabilities_from_proto,
    enum_from_proto,
    require_task_key,
    require_text,
    set_scalars,
    short_repr,
    shown_text,
    timestamp_from_proto,
    timestamp_to_proto,
)
from fedpca.transport.serde.ciphertext import (
    blocks_to_proto,
    blocks_with_label,
    chunk_to_proto,
    encode_chunks,
)
from fedpca.transport.serde.query import (
    MAX_KEY_MODULUS_BITS,
    owner_terms_from_proto,
    owner_terms_to_proto,
    query_spec_from_proto,
    query_spec_to_proto,
)
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb
from fedpca.v1 import owner_service_pb2 as owner_pb


def upload_header_message(
    query_id: str,
    analyst_key_fingerprint: str,
    upload_id: str,
    blocks: Sequence[CiphertextBlock],
    total_chunks: int,
    public_record_count: int | None = None,
) -> owner_pb.UploadMessage:
    """The first message of an Upload stream (its chunks follow as they are encrypted).

    ``public_record_count`` is the owner's clear-text record count, sent in masked
    mode only.
    """
    if not UPLOAD_ID_PATTERN.fullmatch(upload_id):
        raise ConfigError(
            f"upload_id {short_repr(upload_id)} must match {UPLOAD_ID_PATTERN.pattern}"
        )
    header = owner_pb.UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=analyst_key_fingerprint,
        upload_id=upload_id,
        blocks=blocks_to_proto(blocks),
        total_chunks=total_chunks,
    )
    if public_record_count is not None:
        set_scalars(header, "UploadHeader", public_record_count=public_record_count)
    return owner_pb.UploadMessage(header=header)


def upload_chunk_message(chunk: EncodedChunk) -> owner_pb.UploadMessage:
    """One chained chunk of an Upload stream."""
    return owner_pb.UploadMessage(chunk=chunk_to_proto(chunk))


def encode_upload(
    query_id: str,
    analyst_key_fingerprint: str,
    upload_id: str,
    payload: CiphertextPayload,
    max_message_bytes: int = UPLOAD_CHUNK_BYTES,
    public_record_count: int | None = None,
) -> list[owner_pb.UploadMessage]:
    """A whole Upload client stream for a payload encrypted in advance: header, chunks.

    Chunks are cut as owners cut them (:data:`fedpca.messages.UPLOAD_CHUNK_BYTES`), well
    under what the proxy reads in one message.

    Owners stream instead (:meth:`fedpca.owner.node.OwnerNode`); this serves tools
    and tests that hold a complete payload.
    """
    chunks = encode_chunks(payload, max_message_bytes)
    header = upload_header_message(
        query_id,
        analyst_key_fingerprint,
        upload_id,
        payload.blocks,
        len(chunks),
        public_record_count,
    )
    return [header] + [owner_pb.UploadMessage(chunk=chunk) for chunk in chunks]


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
    query_id = require_task_key(header.query_id, "UploadHeader.query_id")
    if not UPLOAD_ID_PATTERN.fullmatch(header.upload_id):
        raise ProtocolError(
            f"UploadHeader.upload_id {short_repr(header.upload_id)} must match "
            f"{UPLOAD_ID_PATTERN.pattern}"
        )
    label = f"upload {header.upload_id!r} for query {query_id!r}"
    if header.content_sha256:
        raise ProtocolError(
            f"{label}: content_sha256 must be empty since protocol version 2 (each chunk "
            "carries its link of a hash chain); update the owner's fedpca"
        )
    decoded = UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=require_text(
            header.analyst_key_fingerprint, f"{label}: analyst_key_fingerprint"
        ),
        upload_id=header.upload_id,
        blocks=blocks_with_label(header.blocks, label),
        total_chunks=header.total_chunks,
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
    set_scalars(
        message,
        "UploadReceipt",
        query_id=receipt.query_id,
        upload_id=receipt.upload_id,
        status=UPLOAD_STATUS_TO_PROTO[receipt.status],
        chunks_received=receipt.chunks_received,
        ciphertexts_received=receipt.ciphertexts_received,
    )
    return message


def upload_receipt_from_proto(message: owner_pb.UploadReceipt) -> UploadReceipt:
    return UploadReceipt(
        query_id=message.query_id,
        upload_id=message.upload_id,
        status=enum_from_proto(message.status, UPLOAD_STATUS_FROM_PROTO, "UploadReceipt.status"),
        chunks_received=message.chunks_received,
        ciphertexts_received=message.ciphertexts_received,
    )


def owner_hello_to_proto(hello: OwnerHello) -> owner_pb.OwnerHello:
    return owner_pb.OwnerHello(
        node_id=hello.node_id,
        software_version=hello.software_version,
        obfuscation_variants=[OBFUSCATION_TO_PROTO[v] for v in hello.obfuscation_variants],
    )


def owner_hello_from_proto(message: owner_pb.OwnerHello) -> OwnerHello:
    return OwnerHello(
        node_id=bounded_text(message.node_id, "OwnerHello.node_id"),
        software_version=shown_text(message.software_version, "OwnerHello.software_version"),
        obfuscation_variants=capabilities_from_proto(
            message.obfuscation_variants, "OwnerHello.obfuscation_variants"
        ),
    )


def proxy_info_to_proto(info: ProxyInfo) -> owner_pb.ProxyInfo:
    message = owner_pb.ProxyInfo(server_time=timestamp_to_proto(info.server_time, "server_time"))
    set_scalars(
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


SMALLEST_PROXY_MESSAGE_BYTES = CHUNK_FRAMING_BYTES + ciphertext_byte_length(MAX_KEY_MODULUS_BITS)
"""The smallest message limit a proxy may state (0: not stated): one chunk of one
ciphertext under the largest analyst key. Below it no upload can be cut, which an owner
found only after it had reserved its budget and computed its share; the refunded task was
then computed again on every re-delivery (red team, stop 43)."""


def proxy_info_from_proto(message: owner_pb.ProxyInfo) -> ProxyInfo:
    if not message.HasField("server_time"):
        raise ProtocolError("ProxyInfo.server_time is missing")
    if 0 < message.max_message_bytes < SMALLEST_PROXY_MESSAGE_BYTES:
        raise ProtocolError(
            f"the proxy states a message limit of {message.max_message_bytes} bytes, below "
            f"the {SMALLEST_PROXY_MESSAGE_BYTES} bytes of one chunk of one ciphertext"
        )
    # Bounded like every peer's text: an owner logs these (a proxy's 5 MB ids grew an
    # owner's log by 10 MB/s, review).
    return ProxyInfo(
        proxy_id=shown_text(message.proxy_id, "ProxyInfo.proxy_id"),
        software_version=shown_text(message.software_version, "ProxyInfo.software_version"),
        protocol_version=message.protocol_version,
        authenticated_node_id=bounded_text(
            message.authenticated_node_id, "ProxyInfo.authenticated_node_id"
        ),
        heartbeat_interval_seconds=message.heartbeat_interval_seconds,
        max_message_bytes=message.max_message_bytes,
        server_time=timestamp_from_proto(message.server_time, "ProxyInfo.server_time"),
    )


MAX_IN_FLIGHT_TASKS = 64
"""Most in-flight task keys an owner reports when it opens its task stream (an honest
owner has one upload in flight at a time, and a few after a long outage)."""


def task_stream_request_to_proto(
    node_id: str, in_flight_tasks: Sequence[str] = (), terms: OwnerTerms | None = None
) -> owner_pb.TaskStreamRequest:
    """Open the task stream; the node id is informational (the certificate decides).

    ``in_flight_tasks``: keys of the tasks whose upload began and has not finished
    (the first :data:`MAX_IN_FLIGHT_TASKS` are sent). ``terms``: the owner's terms.
    """
    message = owner_pb.TaskStreamRequest(
        node_id=node_id, in_flight_tasks=list(in_flight_tasks)[:MAX_IN_FLIGHT_TASKS]
    )
    if terms is not None:
        message.terms.CopyFrom(owner_terms_to_proto(terms))
    return message


def stated_terms_from_proto(message: owner_pb.TaskStreamRequest) -> OwnerTerms | None:
    """The terms the owner states on its task stream (None from an older owner).

    Raises
    ------
    ProtocolError
        Terms out of range (:func:`owner_terms_from_proto`).
    """
    if not message.HasField("terms"):
        return None
    return owner_terms_from_proto(message.terms, "TaskStreamRequest.terms")


def task_stream_request_from_proto(
    message: owner_pb.TaskStreamRequest,
) -> tuple[str, tuple[str, ...]]:
    """The node id the owner claims (informational only) and its in-flight task keys.

    Raises
    ------
    ProtocolError
        More than :data:`MAX_IN_FLIGHT_TASKS` keys, or a malformed key.
    """
    keys = tuple(message.in_flight_tasks)
    if len(keys) > MAX_IN_FLIGHT_TASKS:
        raise ProtocolError(
            f"TaskStreamRequest: {len(keys)} in-flight tasks, at most {MAX_IN_FLIGHT_TASKS}"
        )
    for key in keys:
        require_task_key(key, "TaskStreamRequest.in_flight_tasks")
    return bounded_text(message.node_id, "TaskStreamRequest.node_id"), keys


def task_event_to_proto(event: TaskEvent) -> owner_pb.TaskEvent:
    """Wrap a heartbeat, task or cancellation in a TaskEvent."""
    if isinstance(event, Heartbeat):
        return owner_pb.TaskEvent(
            heartbeat=owner_pb.Heartbeat(sent_at=timestamp_to_proto(event.sent_at, "sent_at"))
        )
    if isinstance(event, Task):
        return owner_pb.TaskEvent(
            task=owner_pb.Task(
                query=query_spec_to_proto(event.query),
                upload_deadline=timestamp_to_proto(event.upload_deadline, "upload_deadline"),
                accepted_obfuscation_variants=[
                    OBFUSCATION_TO_PROTO[v] for v in event.accepted_obfuscation_variants
                ],
                query_signature=event.query_signature,
                query_signer=event.query_signer,
                task_id=event.task_id,
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
            sent_at=timestamp_from_proto(message.heartbeat.sent_at, "Heartbeat.sent_at")
        )
    if kind == "task":
        task = message.task
        if not task.HasField("query"):
            raise ProtocolError("Task.query is missing")
        if not task.HasField("upload_deadline"):
            raise ProtocolError(
                f"Task for query {short_repr(task.query.query_id)}: upload_deadline missing"
            )
        return Task(
            query=query_spec_from_proto(task.query),
            upload_deadline=timestamp_from_proto(task.upload_deadline, "Task.upload_deadline"),
            accepted_obfuscation_variants=capabilities_from_proto(
                task.accepted_obfuscation_variants, "Task.accepted_obfuscation_variants"
            ),
            query_signature=task.query_signature,
            query_signer=task.query_signer,
            # The proxy's id for the task: the owner's ledger key and log label.
            task_id=require_task_key(task.task_id, "Task.task_id") if task.task_id else "",
        )
    if kind == "cancellation":
        return TaskCancellation(
            query_id=require_task_key(message.cancellation.query_id, "TaskCancellation.query_id"),
            # One line, its control characters escaped: the owner logs it and keeps it.
            reason=printable(" ".join(message.cancellation.reason.split())[:MAX_DECLINE_DETAIL]),
        )
    raise ProtocolError("TaskEvent carries no event (unknown to this version or empty)")


def task_decline_to_proto(decline: TaskDecline) -> owner_pb.TaskDecline:
    return owner_pb.TaskDecline(
        query_id=decline.query_id,
        reason=DECLINE_TO_PROTO[decline.reason],
        detail=decline.detail,
    )


def task_decline_from_proto(message: owner_pb.TaskDecline) -> TaskDecline:
    return TaskDecline(
        query_id=require_task_key(message.query_id, "TaskDecline.query_id"),
        reason=enum_from_proto(message.reason, DECLINE_FROM_PROTO, "TaskDecline.reason"),
        detail=message.detail,
    )


def decline_receipt_to_proto(query_id: str) -> owner_pb.DeclineReceipt:
    return owner_pb.DeclineReceipt(query_id=query_id)


def decline_receipt_from_proto(message: owner_pb.DeclineReceipt) -> str:
    """Return the acknowledged query id."""
    return message.query_id
