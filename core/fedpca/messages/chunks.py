"""Ciphertext streams cut into chunks, chained by hashes, and the checks that read them.

A ciphertext stream is a header declaring named blocks and a chunk count, followed
by ordered chunks. Each chunk carries fixed-width unsigned big-endian ciphertexts
(``2 * ceil(key_bits / 8)`` bytes each, because a Paillier ciphertext lives in
Z_{n^2}) and a *link* of a hash chain::

    link_{-1} = SHA-256("fedpca ciphertext chunk chain v1")
    link_i    = SHA-256(link_{i-1} || uint32_be(i) || ciphertexts_i)

so every chunk is checked the moment it arrives, and its link commits to every byte
and chunk boundary before it: a sender can stream chunks while it is still
encrypting the later ones (no hash over the whole content is needed up front), and
a receiver can act on a chunk (fold it, decrypt it) before the stream ends. The
last link commits to the whole stream. Blocks follow one another in declaration
order and chunk boundaries ignore block boundaries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
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
    "CHAIN_GENESIS",
    "CHUNK_FRAMING_BYTES",
    "DEFAULT_CHUNK_MESSAGE_BYTES",
    "SHA256_BYTES",
    "UPLOAD_CHUNK_BYTES",
    "ChunkAssembler",
    "ChunkChain",
    "ChunkLike",
    "DecodedChunk",
    "EncodedChunk",
    "chain_link",
    "check_sha256",
    "chunk_count",
    "chunk_stream",
    "ciphertexts_per_chunk",
    "collect_payload",
    "split_into_chunks",
]

DEFAULT_CHUNK_MESSAGE_BYTES = 3 * 1024 * 1024
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
folds into one page and completes it. Small chunks also start the pipeline early:
the first one leaves the owner after 512 encryptions."""

CHAIN_GENESIS = hashlib.sha256(b"fedpca ciphertext chunk chain v1").digest()
"""The link before chunk 0."""


def chain_link(previous: bytes, index: int, data: bytes) -> bytes:
    """``SHA-256(previous || uint32_be(index) || data)``: the link of chunk ``index``."""
    hasher = hashlib.sha256(previous)
    hasher.update(index.to_bytes(4, "big"))
    hasher.update(data)
    return hasher.digest()


def check_sha256(value: bytes, what: str) -> bytes:
    """``value`` as bytes if it has the length of a SHA-256 digest (ProtocolError if not)."""
    if len(value) != SHA256_BYTES:
        raise ProtocolError(f"{what} must be {SHA256_BYTES} bytes (SHA-256), got {len(value)}")
    return bytes(value)


def ciphertexts_per_chunk(width: int, max_message_bytes: int = DEFAULT_CHUNK_MESSAGE_BYTES) -> int:
    """How many ciphertexts of ``width`` bytes fit in one chunk message."""
    per_chunk = (max_message_bytes - CHUNK_FRAMING_BYTES) // width
    if per_chunk < 1:
        raise ConfigError(
            f"max_message_bytes={max_message_bytes} cannot hold one {width}-byte ciphertext"
            f" plus {CHUNK_FRAMING_BYTES} bytes of framing"
        )
    return per_chunk


def chunk_count(total_ciphertexts: int, per_chunk: int) -> int:
    """Chunks of at most ``per_chunk`` ciphertexts that carry ``total_ciphertexts``."""
    return -(-total_ciphertexts // per_chunk)


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk of a stream about to be sent.

    Attributes
    ----------
    index : position of the chunk in the stream, from 0.
    ciphertexts : the chunk's ciphertexts, fixed width, big-endian, in wire order.
    sha256 : its link in the stream's hash chain (:func:`chain_link`).
    """

    index: int
    ciphertexts: bytes
    sha256: bytes


class ChunkChain:
    """The sending side of a hash chain: chunk after chunk, each with its link."""

    def __init__(self) -> None:
        self._link = CHAIN_GENESIS
        self._index = 0

    def next(self, data: bytes) -> EncodedChunk:
        """The next chunk carrying ``data`` (fixed-width ciphertext bytes)."""
        self._link = chain_link(self._link, self._index, data)
        chunk = EncodedChunk(self._index, data, self._link)
        self._index += 1
        return chunk


def chunk_stream(batches: Iterable[Sequence[int]], width: int, per_chunk: int) -> Iterator[bytes]:
    """Regroup ciphertexts arriving in batches of any size into chunks of ``per_chunk``.

    Yields each chunk's bytes as soon as it is full (the last one may be shorter),
    so a sender streams while the later batches are still being computed.
    """
    pending: list[int] = []
    for batch in batches:
        pending.extend(batch)
        while len(pending) >= per_chunk:
            yield ciphertexts_to_bytes(pending[:per_chunk], width)
            del pending[:per_chunk]
    if pending:
        yield ciphertexts_to_bytes(pending, width)


def split_into_chunks(
    payload: CiphertextPayload, max_message_bytes: int = DEFAULT_CHUNK_MESSAGE_BYTES
) -> list[EncodedChunk]:
    """Cut a whole payload into chained chunks whose messages each fit ``max_message_bytes``."""
    width = payload.ciphertext_bytes
    chain = ChunkChain()
    per_chunk = ciphertexts_per_chunk(width, max_message_bytes)
    return [
        chain.next(data) for data in chunk_stream([list(payload.in_wire_order())], width, per_chunk)
    ]


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
    data : the same ciphertexts as the fixed-width bytes they arrived in.
    link : the chunk's verified link in the stream's hash chain.
    """

    index: int
    offset: int
    ciphertexts: list[int]
    data: bytes = b""
    link: bytes = b""


class ChunkAssembler:
    """Validates one ordered stream of chained ciphertext chunks as they arrive.

    Used by both the proxy (uploads) and the analyst (results). It does not keep
    the ciphertexts: :meth:`add` checks each chunk's link and hands its ciphertexts
    back, so a caller can fold or decrypt them at once; :meth:`finish` checks that
    the stream was complete.

    Parameters
    ----------
    blocks : the layout declared by the stream header.
    total_chunks : number of chunks declared by the header.
    label : prefix for error messages (e.g. ``"upload 'u1' for query 'q1'"``).
    """

    def __init__(
        self,
        blocks: Sequence[CiphertextBlock],
        total_chunks: int,
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
        self._link = CHAIN_GENESIS
        self._content = hashlib.sha256()
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

    @property
    def width(self) -> int:
        """Bytes per ciphertext."""
        return self._width

    @property
    def content_sha256(self) -> bytes:
        """SHA-256 over all ciphertext bytes in order, independent of chunk boundaries
        (the proxy's key for refusing ciphertexts replayed into another query).

        Raises
        ------
        ProtocolError
            Before :meth:`finish` succeeded.
        """
        if not self._finished:
            raise ProtocolError(f"{self._label}: the stream is not complete yet")
        return self._content.digest()

    def add(self, chunk: ChunkLike) -> DecodedChunk:
        """Check the next chunk (index, size, link) and return its ciphertexts.

        Raises
        ------
        ProtocolError
            Out-of-order or surplus index, empty chunk, length not a multiple of
            the ciphertext width, a link that does not continue the chain, or more
            ciphertexts than the layout declares.
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
        data = bytes(chunk.ciphertexts)
        if not data:
            raise ProtocolError(f"{label}: chunk {chunk.index} is empty")
        if len(data) % self._width:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} has {len(data)} bytes, not a multiple of the"
                f" ciphertext width {self._width}"
            )
        declared = check_sha256(chunk.sha256, f"{label}: chunk {chunk.index} sha256")
        actual = chain_link(self._link, chunk.index, data)
        if declared != actual:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} does not continue the hash chain"
                f" (declared link {declared.hex()[:16]}…, computed {actual.hex()[:16]}…)"
            )
        count = len(data) // self._width
        if self._ciphertexts_received + count > self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} brings the ciphertext count to"
                f" {self._ciphertexts_received + count}, layout declares"
                f" {self._expected_ciphertexts}"
            )
        self._link = actual
        self._content.update(data)
        decoded = DecodedChunk(
            index=chunk.index,
            offset=self._ciphertexts_received,
            ciphertexts=ciphertexts_from_bytes(data, self._width),
            data=data,
            link=actual,
        )
        self._chunks_received += 1
        self._ciphertexts_received += count
        self._bytes_received += len(data)
        return decoded

    def finish(self) -> None:
        """Check that the stream is complete.

        Raises
        ------
        ProtocolError
            Missing chunks or too few ciphertexts.
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
