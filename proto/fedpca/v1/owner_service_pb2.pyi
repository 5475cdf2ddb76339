import datetime

from fedpca.v1 import ciphertext_pb2 as _ciphertext_pb2
from fedpca.v1 import query_pb2 as _query_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ObfuscationVariant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBFUSCATION_VARIANT_UNSPECIFIED: _ClassVar[ObfuscationVariant]
    OBFUSCATION_VARIANT_FULL: _ClassVar[ObfuscationVariant]
    OBFUSCATION_VARIANT_DJN_SHORT_EXPONENT: _ClassVar[ObfuscationVariant]

class DeclineReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECLINE_REASON_UNSPECIFIED: _ClassVar[DeclineReason]
    DECLINE_REASON_POLICY_REFUSAL: _ClassVar[DeclineReason]
    DECLINE_REASON_KEY_NOT_PINNED: _ClassVar[DeclineReason]
    DECLINE_REASON_BUDGET_EXHAUSTED: _ClassVar[DeclineReason]
    DECLINE_REASON_UNSIGNED_QUERY: _ClassVar[DeclineReason]
OBFUSCATION_VARIANT_UNSPECIFIED: ObfuscationVariant
OBFUSCATION_VARIANT_FULL: ObfuscationVariant
OBFUSCATION_VARIANT_DJN_SHORT_EXPONENT: ObfuscationVariant
DECLINE_REASON_UNSPECIFIED: DeclineReason
DECLINE_REASON_POLICY_REFUSAL: DeclineReason
DECLINE_REASON_KEY_NOT_PINNED: DeclineReason
DECLINE_REASON_BUDGET_EXHAUSTED: DeclineReason
DECLINE_REASON_UNSIGNED_QUERY: DeclineReason

class OwnerHello(_message.Message):
    __slots__ = ("node_id", "software_version", "obfuscation_variants")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    OBFUSCATION_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    software_version: str
    obfuscation_variants: _containers.RepeatedScalarFieldContainer[ObfuscationVariant]
    def __init__(self, node_id: _Optional[str] = ..., software_version: _Optional[str] = ..., obfuscation_variants: _Optional[_Iterable[_Union[ObfuscationVariant, str]]] = ...) -> None: ...

class ProxyInfo(_message.Message):
    __slots__ = ("proxy_id", "software_version", "protocol_version", "authenticated_node_id", "heartbeat_interval_seconds", "max_message_bytes", "server_time")
    PROXY_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    proxy_id: str
    software_version: str
    protocol_version: int
    authenticated_node_id: str
    heartbeat_interval_seconds: float
    max_message_bytes: int
    server_time: _timestamp_pb2.Timestamp
    def __init__(self, proxy_id: _Optional[str] = ..., software_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., authenticated_node_id: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TaskStreamRequest(_message.Message):
    __slots__ = ("node_id", "in_flight_tasks", "terms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TASKS_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    in_flight_tasks: _containers.RepeatedScalarFieldContainer[str]
    terms: _query_pb2.OwnerTerms
    def __init__(self, node_id: _Optional[str] = ..., in_flight_tasks: _Optional[_Iterable[str]] = ..., terms: _Optional[_Union[_query_pb2.OwnerTerms, _Mapping]] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("heartbeat", "task", "cancellation")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CANCELLATION_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    task: Task
    cancellation: TaskCancellation
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., cancellation: _Optional[_Union[TaskCancellation, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: _timestamp_pb2.Timestamp
    def __init__(self, sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("query", "upload_deadline", "accepted_obfuscation_variants", "query_signature", "query_signer", "task_id")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_OBFUSCATION_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNER_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    query: _query_pb2.QuerySpec
    upload_deadline: _timestamp_pb2.Timestamp
    accepted_obfuscation_variants: _containers.RepeatedScalarFieldContainer[ObfuscationVariant]
    query_signature: bytes
    query_signer: str
    task_id: str
    def __init__(self, query: _Optional[_Union[_query_pb2.QuerySpec, _Mapping]] = ..., upload_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., accepted_obfuscation_variants: _Optional[_Iterable[_Union[ObfuscationVariant, str]]] = ..., query_signature: _Optional[bytes] = ..., query_signer: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class TaskCancellation(_message.Message):
    __slots__ = ("query_id", "reason")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    reason: str
    def __init__(self, query_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("query_id", "analyst_key_fingerprint", "upload_id", "blocks", "total_chunks", "content_sha256", "public_record_count")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    ANALYST_KEY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    analyst_key_fingerprint: str
    upload_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[_ciphertext_pb2.CiphertextBlock]
    total_chunks: int
    content_sha256: bytes
    public_record_count: int
    def __init__(self, query_id: _Optional[str] = ..., analyst_key_fingerprint: _Optional[str] = ..., upload_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[_ciphertext_pb2.CiphertextBlock, _Mapping]]] = ..., total_chunks: _Optional[int] = ..., content_sha256: _Optional[bytes] = ..., public_record_count: _Optional[int] = ...) -> None: ...

class UploadMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: _ciphertext_pb2.CiphertextChunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[_ciphertext_pb2.CiphertextChunk, _Mapping]] = ...) -> None: ...

class UploadReceipt(_message.Message):
    __slots__ = ("query_id", "upload_id", "status", "chunks_received", "ciphertexts_received")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[UploadReceipt.Status]
        STATUS_ACCEPTED: _ClassVar[UploadReceipt.Status]
        STATUS_DUPLICATE: _ClassVar[UploadReceipt.Status]
    STATUS_UNSPECIFIED: UploadReceipt.Status
    STATUS_ACCEPTED: UploadReceipt.Status
    STATUS_DUPLICATE: UploadReceipt.Status
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    upload_id: str
    status: UploadReceipt.Status
    chunks_received: int
    ciphertexts_received: int
    def __init__(self, query_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., status: _Optional[_Union[UploadReceipt.Status, str]] = ..., chunks_received: _Optional[int] = ..., ciphertexts_received: _Optional[int] = ...) -> None: ...

class TaskDecline(_message.Message):
    __slots__ = ("query_id", "reason", "detail")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    reason: DeclineReason
    detail: str
    def __init__(self, query_id: _Optional[str] = ..., reason: _Optional[_Union[DeclineReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class DeclineReceipt(_message.Message):
    __slots__ = ("query_id",)
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    def __init__(self, query_id: _Optional[str] = ...) -> None: ...
