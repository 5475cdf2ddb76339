"""Ciphertext streams cut into chunks, and the checks that put them back together.

A ciphertext stream is a header declaring named blocks followed by ordered chunks.
Each chunk carries fixed-width unsigned big-endian ciphertexts
(``2 * ceil(key_bits / 8)`` bytes each, because a Paillier ciphertext lives in
Z_{n^2}) and its own SHA-256; the header carries the chunk count and a SHA-256
over all ciphertext bytes in order. Blocks follow one another in declaration order
and chunk boundaries ignore block boundaries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fedpca.errors import ConfigError, LayoutError, ProtocolError
from fedpca.messages.ciphertexts import (
    CiphertextBlock,
    CiphertextPayload,
    check_layout,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
)

__all__ = [
    "CHUNK_FRAMING_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "SHA256_BYTES",
    "UPLOAD_CHUNK_BYTES",
    "ChunkAssembler",
    "ChunkLike",
    "DecodedChunk",
    "EncodedChunk",
    "check_sha256",
    "ciphertexts_per_chunk",
    "collect_payload",
    "split_into_chunks",
]

DEFAULT_MAX_MESSAGE_BYTES = 3 * 1024 * 1024
"""Default upper bound for one serialised chunk message.

Well below the 8 MiB channel limit (:mod:`fedpca.transport.channels`) and gRPC's
4 MiB default, so a peer running with default limits still accepts our chunks.
"""

SHA256_BYTES = 32

CHUNK_FRAMING_BYTES = 64
"""Worst-case framing around a chunk's ciphertext bytes inside an UploadMessage /
ResultMessage: oneof tag + length (<= 6), index tag + varint (<= 6), sha256 tag +
length + 32 bytes (34), payload tag + length varint (<= 6). 64 leaves margin."""

UPLOAD_CHUNK_BYTES = 256 * 1024 + CHUNK_FRAMING_BYTES
"""Message size owners cut uploads into: 512 ciphertexts of a 2048-bit key (256 KiB)
plus the chunk framing, i.e. exactly one aggregate page of the proxy, so a chunk
folds into one page. The proxy folds chunk by chunk, so what it holds per upload in
flight is about one chunk; smaller chunks keep that small, at the price of one SQLite
transaction each."""


def check_sha256(value: bytes, what: str) -> bytes:
    """``value`` as bytes if it has the length of a SHA-256 digest (ProtocolError if not)."""
    if len(value) != SHA256_BYTES:
        raise ProtocolError(f"{what} must be {SHA256_BYTES} bytes (SHA-256), got {len(value)}")
    return bytes(value)


def ciphertexts_per_chunk(width: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> int:
    """How many ciphertexts of ``width`` bytes fit in one chunk message."""
    per_chunk = (max_message_bytes - CHUNK_FRAMING_BYTES) // width
    if per_chunk < 1:
        raise ConfigError(
            f"max_message_bytes={max_message_bytes} cannot hold one {width}-byte ciphertext"
            f" plus {CHUNK_FRAMING_BYTES} bytes of framing"
        )
    return per_chunk


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk of a stream about to be sent.

    Attributes
    ----------
    index : position of the chunk in the stream, from 0.
    ciphertexts : the chunk's ciphertexts, fixed width, big-endian, in wire order.
    sha256 : SHA-256 of ``ciphertexts``.
    """

    index: int
    ciphertexts: bytes
    sha256: bytes


def split_into_chunks(
    payload: CiphertextPayload, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[list[EncodedChunk], bytes]:
    """Cut a payload into chunks whose messages each serialise under ``max_message_bytes``.

    Returns
    -------
    chunks : list of EncodedChunk
        In order, indices 0, 1, ...; each with its own SHA-256.
    content_sha256 : bytes
        SHA-256 over all ciphertext bytes in order (for the stream header).
    """
    width = payload.ciphertext_bytes
    per_chunk = ciphertexts_per_chunk(width, max_message_bytes)
    content = hashlib.sha256()
    chunks: list[EncodedChunk] = []
    pending: list[int] = []

    def flush() -> None:
        data = ciphertexts_to_bytes(pending, width)
        content.update(data)
        chunks.append(EncodedChunk(len(chunks), data, hashlib.sha256(data).digest()))
        pending.clear()

    for ciphertext in payload.in_wire_order():
        pending.append(ciphertext)
        if len(pending) == per_chunk:
            flush()
    if pending:
        flush()
    return chunks, content.digest()


class ChunkLike(Protocol):
    """What :class:`ChunkAssembler` reads of a received chunk.

    The wire message ``fedpca.v1.CiphertextChunk`` has these fields, so a received
    chunk is checked as it arrives, without a copy into another type.
    """

    @property
    def index(self) -> int: ...

    @property
    def ciphertexts(self) -> bytes: ...

    @property
    def sha256(self) -> bytes: ...


@dataclass(frozen=True)
class DecodedChunk:
    """Ciphertexts of one accepted chunk.

    Attributes
    ----------
    index : chunk index.
    offset : wire-order position of the first ciphertext in this chunk.
    ciphertexts : the decoded ciphertexts.
    """

    index: int
    offset: int
    ciphertexts: list[int]


class ChunkAssembler:
    """Validates one ordered stream of ciphertext chunks.

    Used by both the proxy (uploads) and the analyst (results). It does not keep
    the ciphertexts: :meth:`add` hands each chunk's ciphertexts back so a caller
    can fold them as they arrive; until :meth:`finish` has checked the count and
    the content hash, the caller must be able to take them out again (the proxy
    stages each folded chunk for that, see :mod:`fedpca.proxy.store`).

    Parameters
    ----------
    blocks : the layout declared by the stream header.
    total_chunks : number of chunks declared by the header.
    content_sha256 : SHA-256 over all ciphertext bytes declared by the header.
    label : prefix for error messages (e.g. ``"upload 'u1' for query 'q1'"``).
    """

    def __init__(
        self,
        blocks: Sequence[CiphertextBlock],
        total_chunks: int,
        content_sha256: bytes,
        label: str = "ciphertext stream",
    ) -> None:
        self._label = label
        try:
            self._width = check_layout(blocks)
        except LayoutError as exc:
            raise ProtocolError(f"{label}: invalid ciphertext layout: {exc}") from exc
        self._expected_ciphertexts = sum(block.n_ciphertexts for block in blocks)
        # Empty chunks are refused, so more chunks than ciphertexts cannot be honest.
        if not 1 <= total_chunks <= self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: total_chunks={total_chunks} must be in"
                f" [1, {self._expected_ciphertexts}] (the declared ciphertext count)"
            )
        self._total_chunks = total_chunks
        self._content_sha256 = check_sha256(content_sha256, f"{label}: content_sha256")
        self._hasher = hashlib.sha256()
        self._chunks_received = 0
        self._ciphertexts_received = 0
        self._bytes_received = 0
        self._finished = False

    @property
    def chunks_received(self) -> int:
        return self._chunks_received

    @property
    def ciphertexts_received(self) -> int:
        return self._ciphertexts_received

    @property
    def bytes_received(self) -> int:
        return self._bytes_received

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    @property
    def expected_ciphertexts(self) -> int:
        return self._expected_ciphertexts

    def add(self, chunk: ChunkLike) -> DecodedChunk:
        """Check the next chunk and return its ciphertexts.

        Raises
        ------
        ProtocolError
            Out-of-order or surplus index, empty chunk, length not a multiple of
            the ciphertext width, per-chunk hash mismatch, or more ciphertexts
            than the layout declares.
        """
        label = self._label
        if self._finished:
            raise ProtocolError(f"{label}: chunk {chunk.index} arrived after the stream ended")
        expected_index = self._chunks_received
        if chunk.index != expected_index:
            raise ProtocolError(
                f"{label}: chunk index {chunk.index} arrived, expected {expected_index}"
                " (chunks must arrive in order starting at 0)"
            )
        if expected_index >= self._total_chunks:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} exceeds the declared total_chunks"
                f"={self._total_chunks}"
            )
        data = chunk.ciphertexts
        if not data:
            raise ProtocolError(f"{label}: chunk {chunk.index} is empty")
        if len(data) % self._width:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} has {len(data)} bytes, not a multiple of the"
                f" ciphertext width {self._width}"
            )
        declared = check_sha256(chunk.sha256, f"{label}: chunk {chunk.index} sha256")
        actual = hashlib.sha256(data).digest()
        if declared != actual:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} SHA-256 mismatch"
                f" (declared {declared.hex()[:16]}…, computed {actual.hex()[:16]}…)"
            )
        count = len(data) // self._width
        if self._ciphertexts_received + count > self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} brings the ciphertext count to"
                f" {self._ciphertexts_received + count}, layout declares"
                f" {self._expected_ciphertexts}"
            )
        self._hasher.update(data)
        decoded = DecodedChunk(
            index=chunk.index,
            offset=self._ciphertexts_received,
            ciphertexts=ciphertexts_from_bytes(data, self._width),
        )
        self._chunks_received += 1
        self._ciphertexts_received += count
        self._bytes_received += len(data)
        return decoded

    def finish(self) -> None:
        """Check that the stream is complete and its content hash matches.

        Raises
        ------
        ProtocolError
            Missing chunks, too few ciphertexts, or content hash mismatch.
        """
        label = self._label
        if self._chunks_received != self._total_chunks:
            raise ProtocolError(
                f"{label}: stream ended after {self._chunks_received} of"
                f" {self._total_chunks} declared chunks"
            )
        if self._ciphertexts_received != self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: received {self._ciphertexts_received} ciphertexts, layout declares"
                f" {self._expected_ciphertexts}"
            )
        actual = self._hasher.digest()
        if actual != self._content_sha256:
            raise ProtocolError(
                f"{label}: content SHA-256 mismatch (declared"
                f" {self._content_sha256.hex()[:16]}…, computed {actual.hex()[:16]}…)"
            )
        self._finished = True


def collect_payload(
    blocks: Sequence[CiphertextBlock], assembler: ChunkAssembler, chunks: Iterable[ChunkLike]
) -> CiphertextPayload:
    """Check a whole stream of chunks with ``assembler`` and keep its ciphertexts."""
    flat: list[int] = []
    for chunk in chunks:
        flat.extend(assembler.add(chunk).ciphertexts)
    assembler.finish()
    return CiphertextPayload.from_wire_order(blocks, flat)
