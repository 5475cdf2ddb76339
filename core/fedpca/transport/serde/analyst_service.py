"""analyst_service.proto: submission, query status, results and budgets."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from fedpca.admission import NextQuery
from fedpca.errors import ConfigError, LayoutError, ProtocolError
from fedpca.messages import (
    DEFAULT_CHUNK_MESSAGE_BYTES,
    BudgetStatus,
    CancelReceipt,
    Charge,
    ChunkAssembler,
    CiphertextPayload,
    DecodedChunk,
    DeploymentInfo,
    EncodedChunk,
    NoiseDescription,
    NoiseSection,
    OwnerDecline,
    QueryResult,
    QueryStatus,
    QuerySummary,
    ResultHeader,
    SignedQuery,
)
from fedpca.owner_terms import OwnerTerms
from fedpca.transport.serde._common import (
    ADMISSION_LIMIT_FROM_PROTO,
    ADMISSION_LIMIT_TO_PROTO,
    AGGREGATE_KIND_FROM_PROTO,
    AGGREGATE_KIND_TO_PROTO,
    CALIBRATION_FROM_PROTO,
    CALIBRATION_TO_PROTO,
    KIND_FROM_PROTO,
    KIND_TO_PROTO,
    MECHANISM_FROM_PROTO,
    MECHANISM_TO_PROTO,
    MODE_FROM_PROTO,
    MODE_TO_PROTO,
    NEIGHBOURING_FROM_PROTO,
    NEIGHBOURING_TO_PROTO,
    STATE_FROM_PROTO,
    STATE_TO_PROTO,
    bounded_text,
    enum_from_proto,
    require_query_id,
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
    owner_terms_from_proto,
    owner_terms_to_proto,
    query_spec_from_proto,
    query_spec_to_proto,
)
from fedpca.v1 import analyst_service_pb2 as analyst_pb

logger = logging.getLogger(__name__)

MAX_SIGNATURE_BYTES = 256


def submit_query_request_to_proto(query: SignedQuery) -> analyst_pb.SubmitQueryRequest:
    return analyst_pb.SubmitQueryRequest(
        query=query_spec_to_proto(query.spec),
        query_signature=query.signature,
        query_signer=query.signer,
    )


def submit_query_request_from_proto(message: analyst_pb.SubmitQueryRequest) -> SignedQuery:
    if not message.HasField("query"):
        raise ProtocolError("SubmitQueryRequest.query is missing")
    if len(message.query_signature) > MAX_SIGNATURE_BYTES or len(message.query_signer) > 100:
        raise ProtocolError("SubmitQueryRequest: the query signature or signer is too long")
    return SignedQuery(
        query_spec_from_proto(message.query), message.query_signature, message.query_signer
    )


def query_ref_to_proto(query_id: str) -> analyst_pb.QueryRef:
    return analyst_pb.QueryRef(query_id=query_id)


def query_ref_from_proto(message: analyst_pb.QueryRef) -> str:
    """Return the referenced query id (ProtocolError unless it is a valid query id)."""
    return require_query_id(message.query_id, "QueryRef.query_id")


CHARGE_TO_PROTO: dict[Charge, analyst_pb.QueryCharge] = {
    Charge.UNKNOWN: analyst_pb.QUERY_CHARGE_UNSPECIFIED,
    Charge.RESERVED: analyst_pb.QUERY_CHARGE_RESERVED,
    Charge.CHARGED: analyst_pb.QUERY_CHARGE_CHARGED,
    Charge.REFUNDED: analyst_pb.QUERY_CHARGE_REFUNDED,
}
CHARGE_FROM_PROTO = {wire: domain for domain, wire in CHARGE_TO_PROTO.items()}


def query_status_to_proto(status: QueryStatus) -> analyst_pb.QueryStatus:
    message = analyst_pb.QueryStatus()
    set_scalars(
        message,
        f"QueryStatus {status.query_id!r}",
        query_id=status.query_id,
        state=STATE_TO_PROTO[status.state],
        owners_contributed=status.owners_contributed,
        quorum=status.quorum,
        owners_declined=status.owners_declined,
        owners_uploading=status.owners_uploading,
        owners_registered=status.owners_registered,
        pages_final=status.pages_final,
        pages_total=status.pages_total,
        charge=CHARGE_TO_PROTO[status.charge],
    )
    message.declines.extend(
        analyst_pb.OwnerDecline(owner_id=d.owner_id, reason=d.reason, detail=d.detail)
        for d in status.declines
    )
    if status.deadline is not None:
        message.deadline.CopyFrom(timestamp_to_proto(status.deadline, "QueryStatus.deadline"))
    if status.failure_reason is not None:
        message.failure_reason = status.failure_reason
    if status.result_deleted_at is not None:
        message.result_deleted_at.CopyFrom(
            timestamp_to_proto(status.result_deleted_at, "QueryStatus.result_deleted_at")
        )
    return message


MAX_STATUS_DECLINES = 4096
"""More declining owners than a deployment has: the most a status may list."""

MAX_STATUS_TEXT = 4000
"""The longest decline detail or failure reason a status may carry (the proxy cuts its
own far shorter): a proxy's longer text is refused, not logged (review)."""

MAX_NOISE_SECTIONS = 1024
"""More noise sections than any plan has (64 aggregates of a few sections each)."""


def query_status_from_proto(message: analyst_pb.QueryStatus) -> QueryStatus:
    what = f"QueryStatus {short_repr(message.query_id)}"
    if len(message.declines) > MAX_STATUS_DECLINES:
        raise ProtocolError(f"{what}: more than {MAX_STATUS_DECLINES} declines")
    return QueryStatus(
        query_id=require_text(message.query_id, "QueryStatus.query_id"),
        state=enum_from_proto(message.state, STATE_FROM_PROTO, f"{what}.state"),
        owners_contributed=message.owners_contributed,
        quorum=message.quorum,
        owners_declined=message.owners_declined,
        deadline=(
            timestamp_from_proto(message.deadline, f"{what}.deadline")
            if message.HasField("deadline")
            else None
        ),
        failure_reason=(
            shown_text(message.failure_reason, f"{what}.failure_reason", max_length=MAX_STATUS_TEXT)
            if message.HasField("failure_reason")
            else None
        ),
        owners_uploading=message.owners_uploading,
        declines=tuple(
            OwnerDecline(
                owner_id=shown_text(d.owner_id, f"{what}.declines.owner_id"),
                reason=shown_text(d.reason, f"{what}.declines.reason"),
                detail=shown_text(d.detail, f"{what}.declines.detail", max_length=MAX_STATUS_TEXT),
            )
            for d in message.declines
        ),
        owners_registered=message.owners_registered,
        pages_final=message.pages_final,
        pages_total=message.pages_total,
        # Lenient, unlike the state: a value a later proxy adds is only not shown.
        charge=CHARGE_FROM_PROTO.get(message.charge, Charge.UNKNOWN),
        result_deleted_at=(
            timestamp_from_proto(message.result_deleted_at, f"{what}.result_deleted_at")
            if message.HasField("result_deleted_at")
            else None
        ),
    )


def noise_description_to_proto(noise: NoiseDescription) -> analyst_pb.NoiseDescription:
    return analyst_pb.NoiseDescription(
        mechanism=MECHANISM_TO_PROTO[noise.mechanism],
        calibration=CALIBRATION_TO_PROTO[noise.calibration],
        epsilon=noise.epsilon,
        delta=noise.delta,
        sections=[analyst_pb.NoiseSection(name=s.name, sigma=s.sigma) for s in noise.sections],
    )


def noise_description_from_proto(message: analyst_pb.NoiseDescription) -> NoiseDescription:
    if len(message.sections) > MAX_NOISE_SECTIONS:
        raise ProtocolError(f"NoiseDescription: more than {MAX_NOISE_SECTIONS} sections")
    return NoiseDescription(
        mechanism=enum_from_proto(
            message.mechanism, MECHANISM_FROM_PROTO, "NoiseDescription.mechanism"
        ),
        calibration=enum_from_proto(
            message.calibration, CALIBRATION_FROM_PROTO, "NoiseDescription.calibration"
        ),
        epsilon=message.epsilon,
        delta=message.delta,
        sections=tuple(
            NoiseSection(name=bounded_text(s.name, "NoiseSection.name"), sigma=s.sigma)
            for s in message.sections
        ),
    )


def result_header_message(header: ResultHeader) -> analyst_pb.ResultMessage:
    """The first message of a FetchResult stream."""
    message = analyst_pb.ResultHeader(
        query=query_spec_to_proto(header.query),
        n_owners=header.n_owners,
        blocks=blocks_to_proto(header.blocks),
        noise=noise_description_to_proto(header.noise),
        total_chunks=header.total_chunks,
        query_signature=header.query_signature,
        query_signer=header.query_signer,
    )
    if header.masked_mean_block is not None:
        message.masked_mean_block = header.masked_mean_block
    if header.public_record_count is not None:
        set_scalars(message, "ResultHeader", public_record_count=header.public_record_count)
    return analyst_pb.ResultMessage(header=message)


def result_chunk_message(chunk: EncodedChunk) -> analyst_pb.ResultMessage:
    """One chained chunk (a result page) of a FetchResult stream."""
    return analyst_pb.ResultMessage(chunk=chunk_to_proto(chunk))


def encode_result(
    result: QueryResult,
    max_message_bytes: int = DEFAULT_CHUNK_MESSAGE_BYTES,
    *,
    query_signature: bytes = b"",
    query_signer: str = "",
) -> list[analyst_pb.ResultMessage]:
    """A whole FetchResult stream of a complete result: header first (with the
    analyst's signature over the query, as submitted), then chunks."""
    chunks = encode_chunks(result.payload, max_message_bytes)
    header = ResultHeader(
        query=result.query,
        n_owners=result.n_owners,
        noise=result.noise,
        blocks=result.blocks,
        total_chunks=len(chunks),
        masked_mean_block=result.masked_mean_block,
        public_record_count=result.public_record_count,
        query_signature=query_signature,
        query_signer=query_signer,
    )
    return [result_header_message(header)] + [
        analyst_pb.ResultMessage(chunk=chunk) for chunk in chunks
    ]


def result_header_from_message(message: analyst_pb.ResultMessage) -> ResultHeader:
    """Decode the first message of a FetchResult stream.

    Raises
    ------
    ProtocolError
        If the message is not a header or any header field is invalid.
    """
    if message.WhichOneof("payload") != "header":
        raise ProtocolError("a result stream must start with a ResultHeader")
    header = message.header
    for name in ("query", "noise"):
        if not header.HasField(name):
            raise ProtocolError(f"ResultHeader.{name} is missing")
    query = query_spec_from_proto(header.query)
    label = f"result of query {query.query_id!r}"
    if header.content_sha256:
        raise ProtocolError(
            f"{label}: content_sha256 must be empty since protocol version 2 (each page "
            "carries its link of a hash chain); the proxy runs another fedpca version"
        )
    blocks = blocks_with_label(header.blocks, label)
    try:
        decoded = ResultHeader(
            query=query,
            n_owners=header.n_owners,
            noise=noise_description_from_proto(header.noise),
            blocks=blocks,
            total_chunks=header.total_chunks,
            masked_mean_block=(
                header.masked_mean_block if header.HasField("masked_mean_block") else None
            ),
            public_record_count=(
                header.public_record_count if header.HasField("public_record_count") else None
            ),
            query_signature=header.query_signature,
            query_signer=header.query_signer,
        )
    except LayoutError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc
    ChunkAssembler(blocks, decoded.total_chunks, label)  # the chunk count fits the layout
    return decoded


def read_result_stream(
    messages: Iterable[analyst_pb.ResultMessage],
) -> tuple[ResultHeader, Iterator[DecodedChunk]]:
    """The header of a FetchResult stream and an iterator over its checked chunks.

    Each chunk is checked (index, size, hash-chain link) as it arrives, so a caller
    decrypts pages while later ones are still being finalised at the proxy; the
    iterator raises ProtocolError if the stream ends early.
    """
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None:
        raise ProtocolError("a result stream must start with a ResultHeader")
    header = result_header_from_message(first)
    label = f"result of query {header.query.query_id!r}"
    assembler = ChunkAssembler(header.blocks, header.total_chunks, label)

    def chunks() -> Iterator[DecodedChunk]:
        for message in iterator:
            kind = message.WhichOneof("payload")
            if kind != "chunk":
                raise ProtocolError(f"{label}: expected a ciphertext chunk, got {kind}")
            yield assembler.add(message.chunk)
        assembler.finish()

    return header, chunks()


def decode_result(messages: Iterable[analyst_pb.ResultMessage]) -> QueryResult:
    """Read and fully validate a whole FetchResult stream.

    Raises
    ------
    ProtocolError
        On any framing, layout, hash or count problem, or an invalid header.
    """
    header, chunks = read_result_stream(messages)
    flat: list[int] = []
    for chunk in chunks:
        flat.extend(chunk.ciphertexts)
    try:
        return QueryResult(
            query=header.query,
            n_owners=header.n_owners,
            noise=header.noise,
            payload=CiphertextPayload.from_wire_order(header.blocks, flat),
            masked_mean_block=header.masked_mean_block,
            public_record_count=header.public_record_count,
        )
    except LayoutError as exc:
        raise ProtocolError(f"result of query {header.query.query_id!r}: {exc}") from exc


def budget_request_to_proto(
    delta: float | None = None, query_delta: float | None = None
) -> analyst_pb.BudgetRequest:
    message = analyst_pb.BudgetRequest()
    if delta is not None:
        message.delta = delta
    if query_delta is not None:
        message.query_delta = query_delta
    return message


def budget_request_from_proto(
    message: analyst_pb.BudgetRequest,
) -> tuple[float | None, float | None]:
    """Return the requested delta and query delta (None: the proxy's defaults)."""
    deltas: list[float | None] = []
    for name in ("delta", "query_delta"):
        if not message.HasField(name):
            deltas.append(None)
            continue
        value = getattr(message, name)
        if not 0 < value < 1:
            raise ProtocolError(f"BudgetRequest.{name} must be in (0, 1), got {value}")
        deltas.append(value)
    return deltas[0], deltas[1]


def budget_status_to_proto(status: BudgetStatus) -> analyst_pb.BudgetStatus:
    message = analyst_pb.BudgetStatus()
    set_scalars(
        message,
        "BudgetStatus",
        analyst_id=status.analyst_id,
        delta=status.delta,
        epsilon_spent=status.epsilon_spent,
        epsilon_remaining=status.epsilon_remaining,
        epsilon_limit=status.epsilon_limit,
        n_releases=status.n_releases,
    )
    if status.limit_delta is not None:
        set_scalars(message, "BudgetStatus", limit_delta=status.limit_delta)
    if status.next_query is not None:
        message.next_query.limit = ADMISSION_LIMIT_TO_PROTO[status.next_query.limit]
        set_scalars(
            message.next_query,
            "NextQuery",
            epsilon=status.next_query.epsilon,
            delta=status.next_query.delta,
        )
    return message


def budget_status_from_proto(message: analyst_pb.BudgetStatus) -> BudgetStatus:
    next_query = None
    if message.HasField("next_query"):
        wire = message.next_query
        limit = enum_from_proto(wire.limit, ADMISSION_LIMIT_FROM_PROTO, "NextQuery.limit")
        try:
            next_query = NextQuery(wire.epsilon, wire.delta, limit)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
    return BudgetStatus(
        analyst_id=shown_text(message.analyst_id, "BudgetStatus.analyst_id"),
        delta=message.delta,
        epsilon_spent=message.epsilon_spent,
        epsilon_remaining=message.epsilon_remaining,
        epsilon_limit=message.epsilon_limit,
        n_releases=message.n_releases,
        # 0 is proto3's "not set" (an older proxy): no budget has delta 0.
        limit_delta=message.limit_delta if message.limit_delta > 0 else None,
        next_query=next_query,
    )


# ------------------------------------------------- deployment, listing, cancel
MAX_LISTED_QUERIES = 1000
"""Most queries one ListQueries call returns."""


def deployment_info_to_proto(info: DeploymentInfo) -> analyst_pb.DeploymentInfo:
    message = analyst_pb.DeploymentInfo(neighbouring=NEIGHBOURING_TO_PROTO[info.neighbouring])
    set_scalars(
        message,
        "DeploymentInfo",
        proxy_id=info.proxy_id,
        software_version=info.software_version,
        protocol_version=info.protocol_version,
        owners_registered=info.owners_registered,
        owners_connected=info.owners_connected,
        max_delta_per_query=info.max_delta_per_query,
        accountant=info.accountant,
        analyst_id=info.analyst_id,
        budget_epsilon=info.budget_epsilon,
        budget_delta=info.budget_delta,
    )
    message.server_time.CopyFrom(timestamp_to_proto(info.server_time, "DeploymentInfo.server_time"))
    message.owners_absent.extend(info.owners_absent)
    for owner_id, terms in info.owner_terms:
        message.owner_terms.add(owner_id=owner_id).terms.CopyFrom(owner_terms_to_proto(terms))
    return message


def _stated_terms(message: analyst_pb.DeploymentInfo) -> tuple[tuple[str, OwnerTerms], ...]:
    """The owners' terms a proxy passed on; one this version cannot read is left out (a
    newer owner may answer a release kind it does not know), logged, as if not stated.

    Raises
    ------
    ProtocolError
        Terms of more owners than are connected (each costs the analyst's tools a
        judgement of its query: a proxy could otherwise keep them busy at will).
    """
    if len(message.owner_terms) > message.owners_connected:
        raise ProtocolError(
            f"DeploymentInfo: terms of {len(message.owner_terms)} owners, but "
            f"{message.owners_connected} connected"
        )
    stated = []
    for entry in message.owner_terms:
        try:
            owner_id = bounded_text(entry.owner_id, "StatedOwnerTerms.owner_id")
            stated.append((owner_id, owner_terms_from_proto(entry.terms, "StatedOwnerTerms")))
        except ProtocolError as exc:
            logger.info("the terms of an owner are left out: %s", exc)
    return tuple(stated)


def deployment_info_from_proto(message: analyst_pb.DeploymentInfo) -> DeploymentInfo:
    return DeploymentInfo(
        proxy_id=message.proxy_id,
        software_version=message.software_version,
        protocol_version=message.protocol_version,
        owners_registered=message.owners_registered,
        owners_connected=message.owners_connected,
        neighbouring=enum_from_proto(
            message.neighbouring, NEIGHBOURING_FROM_PROTO, "DeploymentInfo.neighbouring"
        ),
        max_delta_per_query=message.max_delta_per_query,
        accountant=message.accountant,
        analyst_id=message.analyst_id,
        budget_epsilon=message.budget_epsilon,
        budget_delta=message.budget_delta,
        server_time=timestamp_from_proto(message.server_time, "DeploymentInfo.server_time"),
        owners_absent=tuple(message.owners_absent),
        owner_terms=_stated_terms(message),
    )


def list_queries_request_to_proto(
    limit: int = 0, query_id: str | None = None
) -> analyst_pb.ListQueriesRequest:
    message = analyst_pb.ListQueriesRequest()
    set_scalars(message, "ListQueriesRequest", limit=limit, query_id=query_id or "")
    return message


def list_queries_request_from_proto(message: analyst_pb.ListQueriesRequest) -> int | None:
    """The requested number of queries (None: the proxy's default), capped."""
    if message.limit == 0:
        return None
    return min(message.limit, MAX_LISTED_QUERIES)


def listed_query_from_proto(message: analyst_pb.ListQueriesRequest) -> str | None:
    """The one query asked for (ProtocolError unless a valid query id); None: every one."""
    if not message.query_id:
        return None
    return require_query_id(message.query_id, "ListQueriesRequest.query_id")


def query_list_to_proto(queries: Iterable[QuerySummary]) -> analyst_pb.QueryList:
    message = analyst_pb.QueryList()
    for summary in queries:
        item = message.queries.add(
            status=query_status_to_proto(summary.status),
            kind=KIND_TO_PROTO[summary.kind],
            mode=MODE_TO_PROTO[summary.mode],
            aggregates=[AGGREGATE_KIND_TO_PROTO[kind] for kind in summary.aggregates],
        )
        set_scalars(item, "QuerySummary", epsilon=summary.epsilon, delta=summary.delta)
        item.created_at.CopyFrom(timestamp_to_proto(summary.created_at, "QuerySummary.created_at"))
    return message


def query_list_from_proto(message: analyst_pb.QueryList) -> list[QuerySummary]:
    return [
        QuerySummary(
            status=query_status_from_proto(item.status),
            kind=enum_from_proto(item.kind, KIND_FROM_PROTO, "QuerySummary.kind"),
            mode=enum_from_proto(item.mode, MODE_FROM_PROTO, "QuerySummary.mode"),
            epsilon=item.epsilon,
            delta=item.delta,
            created_at=timestamp_from_proto(item.created_at, "QuerySummary.created_at"),
            aggregates=tuple(
                enum_from_proto(kind, AGGREGATE_KIND_FROM_PROTO, "QuerySummary.aggregates")
                for kind in item.aggregates
            ),
        )
        for item in message.queries
    ]


def cancel_receipt_to_proto(receipt: CancelReceipt) -> analyst_pb.CancelReceipt:
    return analyst_pb.CancelReceipt(
        status=query_status_to_proto(receipt.status), refunded=receipt.refunded
    )


def cancel_receipt_from_proto(message: analyst_pb.CancelReceipt) -> CancelReceipt:
    if not message.HasField("status"):
        raise ProtocolError("CancelReceipt.status is missing")
    return CancelReceipt(query_status_from_proto(message.status), message.refunded)
