from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QueryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUERY_KIND_UNSPECIFIED: _ClassVar[QueryKind]
    QUERY_KIND_PCA: _ClassVar[QueryKind]
    QUERY_KIND_DCA: _ClassVar[QueryKind]
    QUERY_KIND_AGGREGATE: _ClassVar[QueryKind]

class AggregateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGGREGATE_KIND_UNSPECIFIED: _ClassVar[AggregateKind]
    AGGREGATE_KIND_STATS: _ClassVar[AggregateKind]
    AGGREGATE_KIND_HISTOGRAM: _ClassVar[AggregateKind]
    AGGREGATE_KIND_LINREG: _ClassVar[AggregateKind]

class Moments(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOMENTS_UNSPECIFIED: _ClassVar[Moments]
    MOMENTS_MEAN: _ClassVar[Moments]
    MOMENTS_VARIANCE: _ClassVar[Moments]
    MOMENTS_COVARIANCE: _ClassVar[Moments]

class ProtocolMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_MODE_UNSPECIFIED: _ClassVar[ProtocolMode]
    PROTOCOL_MODE_STATS: _ClassVar[ProtocolMode]
    PROTOCOL_MODE_MASKED: _ClassVar[ProtocolMode]

class Calibration(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CALIBRATION_UNSPECIFIED: _ClassVar[Calibration]
    CALIBRATION_ANALYTIC: _ClassVar[Calibration]
    CALIBRATION_CLASSIC: _ClassVar[Calibration]
    CALIBRATION_ZCDP: _ClassVar[Calibration]

class Neighbouring(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEIGHBOURING_UNSPECIFIED: _ClassVar[Neighbouring]
    NEIGHBOURING_ADD_REMOVE: _ClassVar[Neighbouring]
    NEIGHBOURING_REPLACE_ONE: _ClassVar[Neighbouring]
QUERY_KIND_UNSPECIFIED: QueryKind
QUERY_KIND_PCA: QueryKind
QUERY_KIND_DCA: QueryKind
QUERY_KIND_AGGREGATE: QueryKind
AGGREGATE_KIND_UNSPECIFIED: AggregateKind
AGGREGATE_KIND_STATS: AggregateKind
AGGREGATE_KIND_HISTOGRAM: AggregateKind
AGGREGATE_KIND_LINREG: AggregateKind
MOMENTS_UNSPECIFIED: Moments
MOMENTS_MEAN: Moments
MOMENTS_VARIANCE: Moments
MOMENTS_COVARIANCE: Moments
PROTOCOL_MODE_UNSPECIFIED: ProtocolMode
PROTOCOL_MODE_STATS: ProtocolMode
PROTOCOL_MODE_MASKED: ProtocolMode
CALIBRATION_UNSPECIFIED: Calibration
CALIBRATION_ANALYTIC: Calibration
CALIBRATION_CLASSIC: Calibration
CALIBRATION_ZCDP: Calibration
NEIGHBOURING_UNSPECIFIED: Neighbouring
NEIGHBOURING_ADD_REMOVE: Neighbouring
NEIGHBOURING_REPLACE_ONE: Neighbouring

class QuerySpec(_message.Message):
    __slots__ = ("query_id", "kind", "n_features", "feature_lower", "feature_upper", "clip_norm", "epsilon", "delta", "calibration", "noise_weights", "neighbouring", "bounded_owner_tables", "mode", "n_components", "label_column", "class_labels", "feature_columns", "quorum", "deadline_seconds", "issued_at", "max_records_per_owner", "max_owners", "frac_bits", "analyst_public_key_n", "analyst_key_fingerprint", "aggregates")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    N_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LOWER_FIELD_NUMBER: _ClassVar[int]
    FEATURE_UPPER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    NOISE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_OWNER_TABLES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    N_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    LABEL_COLUMN_FIELD_NUMBER: _ClassVar[int]
    CLASS_LABELS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_PER_OWNER_FIELD_NUMBER: _ClassVar[int]
    MAX_OWNERS_FIELD_NUMBER: _ClassVar[int]
    FRAC_BITS_FIELD_NUMBER: _ClassVar[int]
    ANALYST_PUBLIC_KEY_N_FIELD_NUMBER: _ClassVar[int]
    ANALYST_KEY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AGGREGATES_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    kind: QueryKind
    n_features: int
    feature_lower: _containers.RepeatedScalarFieldContainer[float]
    feature_upper: _containers.RepeatedScalarFieldContainer[float]
    clip_norm: float
    epsilon: float
    delta: float
    calibration: Calibration
    noise_weights: _containers.RepeatedScalarFieldContainer[float]
    neighbouring: Neighbouring
    bounded_owner_tables: bool
    mode: ProtocolMode
    n_components: int
    label_column: int
    class_labels: _containers.RepeatedScalarFieldContainer[float]
    feature_columns: _containers.RepeatedScalarFieldContainer[int]
    quorum: int
    deadline_seconds: float
    issued_at: float
    max_records_per_owner: int
    max_owners: int
    frac_bits: int
    analyst_public_key_n: bytes
    analyst_key_fingerprint: str
    aggregates: _containers.RepeatedCompositeFieldContainer[Aggregate]
    def __init__(self, query_id: _Optional[str] = ..., kind: _Optional[_Union[QueryKind, str]] = ..., n_features: _Optional[int] = ..., feature_lower: _Optional[_Iterable[float]] = ..., feature_upper: _Optional[_Iterable[float]] = ..., clip_norm: _Optional[float] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., calibration: _Optional[_Union[Calibration, str]] = ..., noise_weights: _Optional[_Iterable[float]] = ..., neighbouring: _Optional[_Union[Neighbouring, str]] = ..., bounded_owner_tables: _Optional[bool] = ..., mode: _Optional[_Union[ProtocolMode, str]] = ..., n_components: _Optional[int] = ..., label_column: _Optional[int] = ..., class_labels: _Optional[_Iterable[float]] = ..., feature_columns: _Optional[_Iterable[int]] = ..., quorum: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., issued_at: _Optional[float] = ..., max_records_per_owner: _Optional[int] = ..., max_owners: _Optional[int] = ..., frac_bits: _Optional[int] = ..., analyst_public_key_n: _Optional[bytes] = ..., analyst_key_fingerprint: _Optional[str] = ..., aggregates: _Optional[_Iterable[_Union[Aggregate, _Mapping]]] = ...) -> None: ...

class BinEdges(_message.Message):
    __slots__ = ("edges",)
    EDGES_FIELD_NUMBER: _ClassVar[int]
    edges: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, edges: _Optional[_Iterable[float]] = ...) -> None: ...

class Aggregate(_message.Message):
    __slots__ = ("kind", "columns", "lower", "upper", "moments", "bin_edges", "group_column", "categories", "target_column", "target_lower", "target_upper")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_FIELD_NUMBER: _ClassVar[int]
    BIN_EDGES_FIELD_NUMBER: _ClassVar[int]
    GROUP_COLUMN_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    TARGET_COLUMN_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOWER_FIELD_NUMBER: _ClassVar[int]
    TARGET_UPPER_FIELD_NUMBER: _ClassVar[int]
    kind: AggregateKind
    columns: _containers.RepeatedScalarFieldContainer[int]
    lower: _containers.RepeatedScalarFieldContainer[float]
    upper: _containers.RepeatedScalarFieldContainer[float]
    moments: Moments
    bin_edges: _containers.RepeatedCompositeFieldContainer[BinEdges]
    group_column: int
    categories: _containers.RepeatedScalarFieldContainer[float]
    target_column: int
    target_lower: float
    target_upper: float
    def __init__(self, kind: _Optional[_Union[AggregateKind, str]] = ..., columns: _Optional[_Iterable[int]] = ..., lower: _Optional[_Iterable[float]] = ..., upper: _Optional[_Iterable[float]] = ..., moments: _Optional[_Union[Moments, str]] = ..., bin_edges: _Optional[_Iterable[_Union[BinEdges, _Mapping]]] = ..., group_column: _Optional[int] = ..., categories: _Optional[_Iterable[float]] = ..., target_column: _Optional[int] = ..., target_lower: _Optional[float] = ..., target_upper: _Optional[float] = ...) -> None: ...

class OwnerTerms(_message.Message):
    __slots__ = ("n_columns", "label_column", "neighbouring", "allowed_kinds", "columns_limited", "allowed_columns", "allow_masked_mode", "allow_not_private", "max_delta_per_query", "max_epsilon_per_query", "budget_delta", "accountant", "min_quorum", "max_tasks_per_day", "max_records")
    N_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LABEL_COLUMN_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_KINDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_LIMITED_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_MASKED_MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NOT_PRIVATE_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_PER_QUERY_FIELD_NUMBER: _ClassVar[int]
    MAX_EPSILON_PER_QUERY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DELTA_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    MIN_QUORUM_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_PER_DAY_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    n_columns: int
    label_column: int
    neighbouring: Neighbouring
    allowed_kinds: _containers.RepeatedScalarFieldContainer[str]
    columns_limited: bool
    allowed_columns: _containers.RepeatedScalarFieldContainer[int]
    allow_masked_mode: bool
    allow_not_private: bool
    max_delta_per_query: float
    max_epsilon_per_query: float
    budget_delta: float
    accountant: str
    min_quorum: int
    max_tasks_per_day: int
    max_records: int
    def __init__(self, n_columns: _Optional[int] = ..., label_column: _Optional[int] = ..., neighbouring: _Optional[_Union[Neighbouring, str]] = ..., allowed_kinds: _Optional[_Iterable[str]] = ..., columns_limited: _Optional[bool] = ..., allowed_columns: _Optional[_Iterable[int]] = ..., allow_masked_mode: _Optional[bool] = ..., allow_not_private: _Optional[bool] = ..., max_delta_per_query: _Optional[float] = ..., max_epsilon_per_query: _Optional[float] = ..., budget_delta: _Optional[float] = ..., accountant: _Optional[str] = ..., min_quorum: _Optional[int] = ..., max_tasks_per_day: _Optional[int] = ..., max_records: _Optional[int] = ...) -> None: ...
