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

class QueryState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUERY_STATE_UNSPECIFIED: _ClassVar[QueryState]
    QUERY_STATE_PENDING: _ClassVar[QueryState]
    QUERY_STATE_COLLECTING: _ClassVar[QueryState]
    QUERY_STATE_AGGREGATING: _ClassVar[QueryState]
    QUERY_STATE_NOISING: _ClassVar[QueryState]
    QUERY_STATE_DONE: _ClassVar[QueryState]
    QUERY_STATE_FAILED: _ClassVar[QueryState]

class QueryCharge(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUERY_CHARGE_UNSPECIFIED: _ClassVar[QueryCharge]
    QUERY_CHARGE_RESERVED: _ClassVar[QueryCharge]
    QUERY_CHARGE_CHARGED: _ClassVar[QueryCharge]
    QUERY_CHARGE_REFUNDED: _ClassVar[QueryCharge]

class NoiseMechanism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOISE_MECHANISM_UNSPECIFIED: _ClassVar[NoiseMechanism]
    NOISE_MECHANISM_GAUSSIAN: _ClassVar[NoiseMechanism]
    NOISE_MECHANISM_NONE: _ClassVar[NoiseMechanism]

class AdmissionLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMISSION_LIMIT_UNSPECIFIED: _ClassVar[AdmissionLimit]
    ADMISSION_LIMIT_BUDGET: _ClassVar[AdmissionLimit]
    ADMISSION_LIMIT_PER_QUERY_CAP: _ClassVar[AdmissionLimit]
    ADMISSION_LIMIT_NOISE_FLOOR: _ClassVar[AdmissionLimit]
    ADMISSION_LIMIT_EXHAUSTED: _ClassVar[AdmissionLimit]
    ADMISSION_LIMIT_UNLIMITED: _ClassVar[AdmissionLimit]
QUERY_STATE_UNSPECIFIED: QueryState
QUERY_STATE_PENDING: QueryState
QUERY_STATE_COLLECTING: QueryState
QUERY_STATE_AGGREGATING: QueryState
QUERY_STATE_NOISING: QueryState
QUERY_STATE_DONE: QueryState
QUERY_STATE_FAILED: QueryState
QUERY_CHARGE_UNSPECIFIED: QueryCharge
QUERY_CHARGE_RESERVED: QueryCharge
QUERY_CHARGE_CHARGED: QueryCharge
QUERY_CHARGE_REFUNDED: QueryCharge
NOISE_MECHANISM_UNSPECIFIED: NoiseMechanism
NOISE_MECHANISM_GAUSSIAN: NoiseMechanism
NOISE_MECHANISM_NONE: NoiseMechanism
ADMISSION_LIMIT_UNSPECIFIED: AdmissionLimit
ADMISSION_LIMIT_BUDGET: AdmissionLimit
ADMISSION_LIMIT_PER_QUERY_CAP: AdmissionLimit
ADMISSION_LIMIT_NOISE_FLOOR: AdmissionLimit
ADMISSION_LIMIT_EXHAUSTED: AdmissionLimit
ADMISSION_LIMIT_UNLIMITED: AdmissionLimit

class SubmitQueryRequest(_message.Message):
    __slots__ = ("query", "query_signature", "query_signer")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNER_FIELD_NUMBER: _ClassVar[int]
    query: _query_pb2.QuerySpec
    query_signature: bytes
    query_signer: str
    def __init__(self, query: _Optional[_Union[_query_pb2.QuerySpec, _Mapping]] = ..., query_signature: _Optional[bytes] = ..., query_signer: _Optional[str] = ...) -> None: ...

class QueryRef(_message.Message):
    __slots__ = ("query_id",)
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    def __init__(self, query_id: _Optional[str] = ...) -> None: ...

class QueryStatus(_message.Message):
    __slots__ = ("query_id", "state", "owners_contributed", "quorum", "owners_declined", "deadline", "failure_reason", "owners_uploading", "declines", "owners_registered", "pages_final", "pages_total", "charge", "result_deleted_at")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNERS_CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    OWNERS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    OWNERS_UPLOADING_FIELD_NUMBER: _ClassVar[int]
    DECLINES_FIELD_NUMBER: _ClassVar[int]
    OWNERS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FINAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHARGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_DELETED_AT_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    state: QueryState
    owners_contributed: int
    quorum: int
    owners_declined: int
    deadline: _timestamp_pb2.Timestamp
    failure_reason: str
    owners_uploading: int
    declines: _containers.RepeatedCompositeFieldContainer[OwnerDecline]
    owners_registered: int
    pages_final: int
    pages_total: int
    charge: QueryCharge
    result_deleted_at: _timestamp_pb2.Timestamp
    def __init__(self, query_id: _Optional[str] = ..., state: _Optional[_Union[QueryState, str]] = ..., owners_contributed: _Optional[int] = ..., quorum: _Optional[int] = ..., owners_declined: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failure_reason: _Optional[str] = ..., owners_uploading: _Optional[int] = ..., declines: _Optional[_Iterable[_Union[OwnerDecline, _Mapping]]] = ..., owners_registered: _Optional[int] = ..., pages_final: _Optional[int] = ..., pages_total: _Optional[int] = ..., charge: _Optional[_Union[QueryCharge, str]] = ..., result_deleted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class OwnerDecline(_message.Message):
    __slots__ = ("owner_id", "reason", "detail")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    reason: str
    detail: str
    def __init__(self, owner_id: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class NoiseSection(_message.Message):
    __slots__ = ("name", "sigma")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIGMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    sigma: float
    def __init__(self, name: _Optional[str] = ..., sigma: _Optional[float] = ...) -> None: ...

class NoiseDescription(_message.Message):
    __slots__ = ("mechanism", "calibration", "epsilon", "delta", "sections")
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    mechanism: NoiseMechanism
    calibration: _query_pb2.Calibration
    epsilon: float
    delta: float
    sections: _containers.RepeatedCompositeFieldContainer[NoiseSection]
    def __init__(self, mechanism: _Optional[_Union[NoiseMechanism, str]] = ..., calibration: _Optional[_Union[_query_pb2.Calibration, str]] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., sections: _Optional[_Iterable[_Union[NoiseSection, _Mapping]]] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("query", "n_owners", "blocks", "noise", "masked_mean_block", "total_chunks", "content_sha256", "public_record_count", "query_signature", "query_signer")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    N_OWNERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    MASKED_MEAN_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    QUERY_SIGNER_FIELD_NUMBER: _ClassVar[int]
    query: _query_pb2.QuerySpec
    n_owners: int
    blocks: _containers.RepeatedCompositeFieldContainer[_ciphertext_pb2.CiphertextBlock]
    noise: NoiseDescription
    masked_mean_block: str
    total_chunks: int
    content_sha256: bytes
    public_record_count: int
    query_signature: bytes
    query_signer: str
    def __init__(self, query: _Optional[_Union[_query_pb2.QuerySpec, _Mapping]] = ..., n_owners: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[_ciphertext_pb2.CiphertextBlock, _Mapping]]] = ..., noise: _Optional[_Union[NoiseDescription, _Mapping]] = ..., masked_mean_block: _Optional[str] = ..., total_chunks: _Optional[int] = ..., content_sha256: _Optional[bytes] = ..., public_record_count: _Optional[int] = ..., query_signature: _Optional[bytes] = ..., query_signer: _Optional[str] = ...) -> None: ...

class ResultMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ResultHeader
    chunk: _ciphertext_pb2.CiphertextChunk
    def __init__(self, header: _Optional[_Union[ResultHeader, _Mapping]] = ..., chunk: _Optional[_Union[_ciphertext_pb2.CiphertextChunk, _Mapping]] = ...) -> None: ...

class BudgetRequest(_message.Message):
    __slots__ = ("delta", "query_delta")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    QUERY_DELTA_FIELD_NUMBER: _ClassVar[int]
    delta: float
    query_delta: float
    def __init__(self, delta: _Optional[float] = ..., query_delta: _Optional[float] = ...) -> None: ...

class NextQuery(_message.Message):
    __slots__ = ("epsilon", "delta", "limit")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    limit: AdmissionLimit
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., limit: _Optional[_Union[AdmissionLimit, str]] = ...) -> None: ...

class BudgetStatus(_message.Message):
    __slots__ = ("analyst_id", "delta", "epsilon_spent", "epsilon_remaining", "epsilon_limit", "n_releases", "limit_delta", "next_query")
    ANALYST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_REMAINING_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LIMIT_FIELD_NUMBER: _ClassVar[int]
    N_RELEASES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_DELTA_FIELD_NUMBER: _ClassVar[int]
    NEXT_QUERY_FIELD_NUMBER: _ClassVar[int]
    analyst_id: str
    delta: float
    epsilon_spent: float
    epsilon_remaining: float
    epsilon_limit: float
    n_releases: int
    limit_delta: float
    next_query: NextQuery
    def __init__(self, analyst_id: _Optional[str] = ..., delta: _Optional[float] = ..., epsilon_spent: _Optional[float] = ..., epsilon_remaining: _Optional[float] = ..., epsilon_limit: _Optional[float] = ..., n_releases: _Optional[int] = ..., limit_delta: _Optional[float] = ..., next_query: _Optional[_Union[NextQuery, _Mapping]] = ...) -> None: ...

class DescribeDeploymentRequest(_message.Message):
    __slots__ = ("with_owner_terms",)
    WITH_OWNER_TERMS_FIELD_NUMBER: _ClassVar[int]
    with_owner_terms: bool
    def __init__(self, with_owner_terms: _Optional[bool] = ...) -> None: ...

class StatedOwnerTerms(_message.Message):
    __slots__ = ("owner_id", "terms")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    terms: _query_pb2.OwnerTerms
    def __init__(self, owner_id: _Optional[str] = ..., terms: _Optional[_Union[_query_pb2.OwnerTerms, _Mapping]] = ...) -> None: ...

class DeploymentInfo(_message.Message):
    __slots__ = ("proxy_id", "software_version", "protocol_version", "owners_registered", "owners_connected", "neighbouring", "max_delta_per_query", "accountant", "analyst_id", "budget_epsilon", "budget_delta", "server_time", "owners_absent", "owner_terms")
    PROXY_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNERS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    OWNERS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_PER_QUERY_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    ANALYST_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DELTA_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    OWNERS_ABSENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_TERMS_FIELD_NUMBER: _ClassVar[int]
    proxy_id: str
    software_version: str
    protocol_version: int
    owners_registered: int
    owners_connected: int
    neighbouring: _query_pb2.Neighbouring
    max_delta_per_query: float
    accountant: str
    analyst_id: str
    budget_epsilon: float
    budget_delta: float
    server_time: _timestamp_pb2.Timestamp
    owners_absent: _containers.RepeatedScalarFieldContainer[str]
    owner_terms: _containers.RepeatedCompositeFieldContainer[StatedOwnerTerms]
    def __init__(self, proxy_id: _Optional[str] = ..., software_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., owners_registered: _Optional[int] = ..., owners_connected: _Optional[int] = ..., neighbouring: _Optional[_Union[_query_pb2.Neighbouring, str]] = ..., max_delta_per_query: _Optional[float] = ..., accountant: _Optional[str] = ..., analyst_id: _Optional[str] = ..., budget_epsilon: _Optional[float] = ..., budget_delta: _Optional[float] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., owners_absent: _Optional[_Iterable[str]] = ..., owner_terms: _Optional[_Iterable[_Union[StatedOwnerTerms, _Mapping]]] = ...) -> None: ...

class ListQueriesRequest(_message.Message):
    __slots__ = ("limit", "query_id")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    limit: int
    query_id: str
    def __init__(self, limit: _Optional[int] = ..., query_id: _Optional[str] = ...) -> None: ...

class QuerySummary(_message.Message):
    __slots__ = ("status", "kind", "mode", "epsilon", "delta", "created_at", "aggregates")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    AGGREGATES_FIELD_NUMBER: _ClassVar[int]
    status: QueryStatus
    kind: _query_pb2.QueryKind
    mode: _query_pb2.ProtocolMode
    epsilon: float
    delta: float
    created_at: _timestamp_pb2.Timestamp
    aggregates: _containers.RepeatedScalarFieldContainer[_query_pb2.AggregateKind]
    def __init__(self, status: _Optional[_Union[QueryStatus, _Mapping]] = ..., kind: _Optional[_Union[_query_pb2.QueryKind, str]] = ..., mode: _Optional[_Union[_query_pb2.ProtocolMode, str]] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., aggregates: _Optional[_Iterable[_Union[_query_pb2.AggregateKind, str]]] = ...) -> None: ...

class QueryList(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[QuerySummary]
    def __init__(self, queries: _Optional[_Iterable[_Union[QuerySummary, _Mapping]]] = ...) -> None: ...

class CancelReceipt(_message.Message):
    __slots__ = ("status", "refunded")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REFUNDED_FIELD_NUMBER: _ClassVar[int]
    status: QueryStatus
    refunded: bool
    def __init__(self, status: _Optional[_Union[QueryStatus, _Mapping]] = ..., refunded: _Optional[bool] = ...) -> None: ...
