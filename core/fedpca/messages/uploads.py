"""An owner's upload: its id, its validated header and the proxy's receipt."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

from fedpca.messages.chunks import ChunkAssembler
from fedpca.messages.ciphertexts import CiphertextBlock

__all__ = [
    "SHARE_RELEASED_METADATA",
    "UPLOAD_ACCEPTED_METADATA",
    "UPLOAD_ID_PATTERN",
    "UploadHeader",
    "UploadReceipt",
    "UploadStatus",
    "new_upload_id",
]

UPLOAD_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""What an upload id must fully match. Upload ids end up in the proxy's durable
store (keys, log lines); a conservative alphabet means no store has to escape them."""


UPLOAD_ACCEPTED_METADATA = "fedpca-upload-accepted"
"""Initial metadata key the proxy sends, with the value ``yes``, on an upload whose
header it accepted: the owner joined the query's contributors (or resumes), and the
proxy recorded that an upload began, so the analyst's charge is never refunded. The
owner sends its first chunk only after it (protocol version 3)."""


SHARE_RELEASED_METADATA = "fedpca-share-released"
"""Trailing metadata key of an upload refused (FAILED_PRECONDITION) because its query
ended or no longer takes this owner, and of no other refusal: its presence tells the
owner that nothing of its own is at fault (another owner declined, the analyst
cancelled, the deadline passed, the quorum was reached without it). The value is ``no``
when no result of the query can contain anything of this owner's share (the owner is
not one of the query's contributors, or the query failed before any page of its result
was released), else ``yes``. Proxies before ``yes`` existed sent the key only with
``no``. The owner refunds on its own knowledge, not on this word
(:mod:`fedpca.owner.task_endings`)."""


def new_upload_id() -> str:
    """A fresh random upload id (reuse it when retrying the same upload)."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class UploadHeader:
    """Validated first message of an upload.

    Attributes
    ----------
    query_id : the query answered.
    analyst_key_fingerprint : key the ciphertexts are encrypted under.
    upload_id : owner-chosen nonce; retries of the same upload reuse it.
    blocks : the layout.
    total_chunks : chunks that follow (each carries its link of the stream's hash
        chain, :mod:`fedpca.messages.chunks`, so nothing about the content is
        declared up front and the owner streams while it encrypts).
    public_record_count : masked mode only: the owner's record count, in the
        clear; None (absent on the wire) in stats mode.
    """

    query_id: str
    analyst_key_fingerprint: str
    upload_id: str
    blocks: tuple[CiphertextBlock, ...]
    total_chunks: int
    public_record_count: int | None = None

    @property
    def label(self) -> str:
        """Prefix for error and log messages about this upload."""
        return f"upload {self.upload_id!r} for query {self.query_id!r}"

    def assembler(self) -> ChunkAssembler:
        """A :class:`ChunkAssembler` checking the chunks this header announces."""
        return ChunkAssembler(self.blocks, self.total_chunks, self.label)


class UploadStatus(StrEnum):
    """Outcome of an upload at the proxy."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    """Same upload id accepted before; nothing was counted twice."""


@dataclass(frozen=True)
class UploadReceipt:
    """The proxy's answer to an upload."""

    query_id: str
    upload_id: str
    status: UploadStatus
    chunks_received: int
    ciphertexts_received: int
