"""The one place that converts between ``fedpca.v1`` messages and domain objects.

gRPC servicers and clients only call the ``*_to_proto`` / ``*_from_proto``
functions and the stream encoders and readers exported here; nothing else in
fedpca touches generated message classes field by field. The domain objects
themselves, and the chunking of ciphertext streams, live in
:mod:`fedpca.messages`. One module per proto file: :mod:`.query`,
:mod:`.ciphertext`, :mod:`.owner_service`, :mod:`.analyst_service`.

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

from fedpca.transport.serde.analyst_service import (
    MAX_LISTED_QUERIES,
    budget_request_from_proto,
    budget_request_to_proto,
    budget_status_from_proto,
    budget_status_to_proto,
    cancel_receipt_from_proto,
    cancel_receipt_to_proto,
    decode_result,
    deployment_info_from_proto,
    deployment_info_to_proto,
    encode_result,
    list_queries_request_from_proto,
    list_queries_request_to_proto,
    listed_query_from_proto,
    noise_description_from_proto,
    noise_description_to_proto,
    query_list_from_proto,
    query_list_to_proto,
    query_ref_from_proto,
    query_ref_to_proto,
    query_status_from_proto,
    query_status_to_proto,
    read_result_stream,
    result_chunk_message,
    result_header_from_message,
    result_header_message,
    submit_query_request_from_proto,
    submit_query_request_to_proto,
)
from fedpca.transport.serde.ciphertext import (
    blocks_from_proto,
    blocks_to_proto,
    chunk_to_proto,
    encode_chunks,
)
from fedpca.transport.serde.owner_service import (
    MAX_IN_FLIGHT_TASKS,
    decline_receipt_from_proto,
    decline_receipt_to_proto,
    encode_upload,
    owner_hello_from_proto,
    owner_hello_to_proto,
    proxy_info_from_proto,
    proxy_info_to_proto,
    read_upload,
    stated_terms_from_proto,
    task_decline_from_proto,
    task_decline_to_proto,
    task_event_from_proto,
    task_event_to_proto,
    task_stream_request_from_proto,
    task_stream_request_to_proto,
    upload_chunk_from_message,
    upload_chunk_message,
    upload_header_from_message,
    upload_header_message,
    upload_receipt_from_proto,
    upload_receipt_to_proto,
)
from fedpca.transport.serde.query import (
    QUERY_SPEC_WIRE_FIELDS,
    owner_terms_from_proto,
    owner_terms_to_proto,
    query_spec_from_proto,
    query_spec_to_proto,
)

__all__ = [
    "MAX_IN_FLIGHT_TASKS",
    "MAX_LISTED_QUERIES",
    "QUERY_SPEC_WIRE_FIELDS",
    "blocks_from_proto",
    "blocks_to_proto",
    "budget_request_from_proto",
    "budget_request_to_proto",
    "budget_status_from_proto",
    "budget_status_to_proto",
    "cancel_receipt_from_proto",
    "cancel_receipt_to_proto",
    "chunk_to_proto",
    "decline_receipt_from_proto",
    "decline_receipt_to_proto",
    "decode_result",
    "deployment_info_from_proto",
    "deployment_info_to_proto",
    "encode_chunks",
    "encode_result",
    "encode_upload",
    "list_queries_request_from_proto",
    "list_queries_request_to_proto",
    "listed_query_from_proto",
    "noise_description_from_proto",
    "noise_description_to_proto",
    "owner_hello_from_proto",
    "owner_hello_to_proto",
    "owner_terms_from_proto",
    "owner_terms_to_proto",
    "proxy_info_from_proto",
    "proxy_info_to_proto",
    "query_list_from_proto",
    "query_list_to_proto",
    "query_ref_from_proto",
    "query_ref_to_proto",
    "query_spec_from_proto",
    "query_spec_to_proto",
    "query_status_from_proto",
    "query_status_to_proto",
    "read_result_stream",
    "read_upload",
    "result_chunk_message",
    "result_header_from_message",
    "result_header_message",
    "stated_terms_from_proto",
    "submit_query_request_from_proto",
    "submit_query_request_to_proto",
    "task_decline_from_proto",
    "task_decline_to_proto",
    "task_event_from_proto",
    "task_event_to_proto",
    "task_stream_request_from_proto",
    "task_stream_request_to_proto",
    "upload_chunk_from_message",
    "upload_chunk_message",
    "upload_header_from_message",
    "upload_header_message",
    "upload_receipt_from_proto",
    "upload_receipt_to_proto",
]
