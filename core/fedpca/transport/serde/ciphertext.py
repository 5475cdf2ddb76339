"""ciphertext.proto: block layouts and chunks of a ciphertext stream.

What the blocks and chunks mean, and how a stream is checked, is in
:mod:`fedpca.messages.chunks`; here they only become messages and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from itertools import islice

from fedpca.errors import LayoutError, ProtocolError
from fedpca.messages import (
    DEFAULT_CHUNK_MESSAGE_BYTES,
    MAX_LAYOUT_BLOCKS,
    CiphertextBlock,
    CiphertextPayload,
    EncodedChunk,
    check_layout,
    split_into_chunks,
)
from fedpca.transport.serde._common import (
    set_scalars,
)
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb


def blocks_to_proto(blocks: Sequence[CiphertextBlock]) -> list[ciphertext_pb.CiphertextBlock]:
    """Encode a layout (the single domain → wire mapping of a block)."""
    check_layout(blocks)
    messages = []
    for block in blocks:
        message = ciphertext_pb.CiphertextBlock()
        set_scalars(
            message,
            f"block {block.name!r}",
            name=block.name,
            key_bits=block.key_bits,
            slot_bits=block.slot_bits,
            slots_per_ciphertext=block.slots_per_ciphertext,
            value_count=block.value_count,
            n_ciphertexts=block.n_ciphertexts,
        )
        messages.append(message)
    return messages


def blocks_from_proto(
    messages: Iterable[ciphertext_pb.CiphertextBlock],
) -> tuple[CiphertextBlock, ...]:
    """Decode and check a layout (the single wire → domain mapping of a block).

    Raises
    ------
    ProtocolError
        If any block or the layout as a whole is invalid.
    """
    # Counted before a block is built from a peer's header, and without a Python object
    # per block: list() of a header's 4 million empty blocks held the event loop for
    # seconds (review).
    count = len(messages) if isinstance(messages, Sized) else None
    if count is None:
        messages = list(islice(messages, MAX_LAYOUT_BLOCKS + 1))
        count = len(messages)
    if count > MAX_LAYOUT_BLOCKS:
        raise ProtocolError(
            f"invalid ciphertext layout: {count} blocks, more than any plan has "
            f"({MAX_LAYOUT_BLOCKS})"
        )
    try:
        blocks = tuple(
            CiphertextBlock(
                name=message.name,
                key_bits=message.key_bits,
                slot_bits=message.slot_bits,
                slots_per_ciphertext=message.slots_per_ciphertext,
                value_count=message.value_count,
                n_ciphertexts=message.n_ciphertexts,
            )
            for message in messages
        )
        check_layout(blocks)
    except LayoutError as exc:
        raise ProtocolError(f"invalid ciphertext layout: {exc}") from exc
    return blocks


def blocks_with_label(
    messages: Iterable[ciphertext_pb.CiphertextBlock], label: str
) -> tuple[CiphertextBlock, ...]:
    try:
        return blocks_from_proto(messages)
    except ProtocolError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc


def chunk_to_proto(chunk: EncodedChunk) -> ciphertext_pb.CiphertextChunk:
    """One chained chunk as its message."""
    return ciphertext_pb.CiphertextChunk(
        index=chunk.index, ciphertexts=chunk.ciphertexts, sha256=chunk.sha256
    )


def encode_chunks(
    payload: CiphertextPayload, max_message_bytes: int = DEFAULT_CHUNK_MESSAGE_BYTES
) -> list[ciphertext_pb.CiphertextChunk]:
    """Chunk messages of a whole payload (:func:`fedpca.messages.split_into_chunks`):
    in order, indices 0, 1, ..., each carrying its link of the stream's hash chain."""
    return [chunk_to_proto(chunk) for chunk in split_into_chunks(payload, max_message_bytes)]
