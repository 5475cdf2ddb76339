"""What the roles say to one another, as plain domain objects.

Every message of the protocol has one home here: the owner's session (hello,
tasks, declines), uploads and their receipts, query status, results and budgets,
the ciphertext payloads they carry and the chunking of those payloads.
:mod:`fedpca.transport.serde` only translates these objects to and from the
generated ``fedpca.v1`` messages, so domain code (the proxy's coordinator, the
analyst's decoder) depends on this package and never on the wire layer.

- :mod:`~fedpca.messages.ciphertexts`: blocks, payloads, fixed-width ciphertext bytes;
- :mod:`~fedpca.messages.chunks`: cutting a payload into chunks and checking them;
- :mod:`~fedpca.messages.tasks`: hello, proxy info, task stream events, declines;
- :mod:`~fedpca.messages.uploads`: upload ids, headers, receipts;
- :mod:`~fedpca.messages.queries`: query state and status, results, budgets;
- :mod:`~fedpca.messages.deployment`: the deployment's public facts, query listings,
  cancellations.
"""

from __future__ import annotations

from fedpca.messages.chunks import (
    CHAIN_GENESIS,
    CHUNK_FRAMING_BYTES,
    DEFAULT_CHUNK_MESSAGE_BYTES,
    SHA256_BYTES,
    UPLOAD_CHUNK_BYTES,
    ChunkAssembler,
    ChunkChain,
    ChunkLike,
    DecodedChunk,
    EncodedChunk,
    chain_link,
    check_sha256,
    chunk_count,
    chunk_stream,
    ciphertexts_per_chunk,
    collect_payload,
    split_into_chunks,
)
from fedpca.messages.ciphertexts import (
    MAX_BLOCK_NAME_LENGTH,
    MAX_LAYOUT_BLOCKS,
    CiphertextBlock,
    CiphertextPayload,
    blocks_of,
    check_layout,
    ciphertext_width,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
)
from fedpca.messages.deployment import CANCELLED_REASON, CancelReceipt, DeploymentInfo, QuerySummary
from fedpca.messages.queries import (
    REFUSAL_METADATA,
    BudgetStatus,
    Charge,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    OwnerDecline,
    QueryResult,
    QueryState,
    QueryStatus,
    Refusal,
    ResultHeader,
    SignedQuery,
)
from fedpca.messages.tasks import (
    DECLINES_CLOSED,
    MAX_DECLINE_DETAIL,
    PROTOCOL_VERSION,
    DeclineReason,
    Heartbeat,
    ObfuscationVariant,
    OwnerHello,
    ProxyInfo,
    Task,
    TaskCancellation,
    TaskDecline,
    TaskEvent,
)
from fedpca.messages.uploads import (
    SHARE_RELEASED_METADATA,
    UPLOAD_ACCEPTED_METADATA,
    UPLOAD_ID_PATTERN,
    UploadHeader,
    UploadReceipt,
    UploadStatus,
    new_upload_id,
)

__all__ = [
    "CANCELLED_REASON",
    "CHAIN_GENESIS",
    "CHUNK_FRAMING_BYTES",
    "DECLINES_CLOSED",
    "DEFAULT_CHUNK_MESSAGE_BYTES",
    "MAX_BLOCK_NAME_LENGTH",
    "MAX_DECLINE_DETAIL",
    "MAX_LAYOUT_BLOCKS",
    "PROTOCOL_VERSION",
    "REFUSAL_METADATA",
    "SHA256_BYTES",
    "SHARE_RELEASED_METADATA",
    "UPLOAD_ACCEPTED_METADATA",
    "UPLOAD_CHUNK_BYTES",
    "UPLOAD_ID_PATTERN",
    "BudgetStatus",
    "CancelReceipt",
    "Charge",
    "ChunkAssembler",
    "ChunkChain",
    "ChunkLike",
    "CiphertextBlock",
    "CiphertextPayload",
    "DeclineReason",
    "DecodedChunk",
    "DeploymentInfo",
    "EncodedChunk",
    "Heartbeat",
    "NoiseDescription",
    "NoiseMechanism",
    "NoiseSection",
    "ObfuscationVariant",
    "OwnerDecline",
    "OwnerHello",
    "ProxyInfo",
    "QueryResult",
    "QueryState",
    "QueryStatus",
    "QuerySummary",
    "Refusal",
    "ResultHeader",
    "SignedQuery",
    "Task",
    "TaskCancellation",
    "TaskDecline",
    "TaskEvent",
    "UploadHeader",
    "UploadReceipt",
    "UploadStatus",
    "blocks_of",
    "chain_link",
    "check_layout",
    "check_sha256",
    "chunk_count",
    "chunk_stream",
    "ciphertext_width",
    "ciphertexts_from_bytes",
    "ciphertexts_per_chunk",
    "ciphertexts_to_bytes",
    "collect_payload",
    "new_upload_id",
    "split_into_chunks",
]
