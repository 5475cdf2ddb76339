"""One owner's upload at the proxy: the checks on its header, then its stream of chunks.

Everything that can be checked before a single chunk is read is checked on the
header (:func:`check_upload_header`); the store then lets the owner join the query's
contributors, or resume its upload (:meth:`fedpca.proxy.store.ProxyStore.join`). Each
chunk is folded into the encrypted aggregate as soon as it arrives
(:class:`UploadStream`), durably, and result pages it completes become final at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from fedpca.codec import SerialisedCiphertextGroup, validate_ciphertexts
from fedpca.errors import CiphertextError, FedpcaError, LayoutError, ProtocolError
from fedpca.messages import CiphertextBlock, DecodedChunk, UploadHeader
from fedpca.proxy.queries import QueryContext, wire_blocks
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_records import Joined, UploadCompletion
from fedpca.query import ProtocolMode

__all__ = ["UploadStream", "check_upload_header"]

logger = logging.getLogger(__name__)


def check_upload_header(context: QueryContext, header: UploadHeader) -> None:
    """Everything about an upload that can be checked before a single chunk is read.

    Raises
    ------
    CiphertextError
        The header names another analyst key.
    LayoutError
        The blocks differ from the plan's owner blocks.
    ProtocolError
        The public record count is missing (masked mode), present (stats mode)
        or above the query's max_records_per_owner.
    """
    spec = context.spec
    if header.analyst_key_fingerprint != spec.analyst_key_fingerprint:
        raise CiphertextError(
            f"{header.label}: encrypted under key {header.analyst_key_fingerprint}, the "
            f"query uses {spec.analyst_key_fingerprint}"
        )
    expected = wire_blocks(context.plan)
    if tuple(header.blocks) != expected:
        raise LayoutError(f"{header.label}: {_layout_difference(header.blocks, expected)}")
    count = header.public_record_count
    if spec.mode is ProtocolMode.MASKED:
        if count is None:
            raise ProtocolError(
                f"{header.label}: masked mode needs the owner's public_record_count"
            )
        if count > spec.max_records_per_owner:
            raise ProtocolError(
                f"{header.label}: public_record_count {count} exceeds the query's "
                f"max_records_per_owner={spec.max_records_per_owner}"
            )
    elif count is not None:
        raise ProtocolError(
            f"{header.label}: public_record_count must be absent in stats mode (the "
            "count is a noised statistic)"
        )


def _layout_difference(got: Sequence[CiphertextBlock], expected: Sequence[CiphertextBlock]) -> str:
    if [b.name for b in got] != [b.name for b in expected]:
        return (
            f"blocks {[b.name for b in got]} declared, the query's plan has "
            f"{[b.name for b in expected]}"
        )
    for mine, theirs in zip(got, expected, strict=True):
        if mine != theirs:
            return f"block {mine.name!r} is {mine}, the query's plan requires {theirs}"
    return "layout differs from the plan"


class UploadStream:
    """One owner's upload in progress: its chunks are folded as they arrive.

    Made by :meth:`fedpca.proxy.coordinator.Coordinator.begin_upload` once the owner
    joined (or rejoined) the query's contributors. Call :meth:`add` for each checked
    chunk in wire order, then :meth:`complete` once the stream has ended; on any
    failure call :meth:`abandon`. Chunks below the owner's mark (already folded by an
    earlier stream of this upload) are skipped; a retry of an upload the proxy already
    accepted folds nothing and completes as "duplicate".

    Parameters
    ----------
    on_folded : called with the query key and the CPU seconds this thread spent checking
        and folding, after each folded chunk (pages may be final).
    on_ended : called once the stream ended, completed or not (the coordinator
        counts the owner's live streams).
    streams_open : how many streams of this upload (its id) to this query are open,
        this one included.
    """

    def __init__(
        self,
        store: ProxyStore,
        owner_id: str,
        header: UploadHeader,
        context: QueryContext,
        joined: Joined,
        *,
        on_folded: Callable[[str, float], None],
        on_completed: Callable[[str], None],
        on_ended: Callable[[], None],
        streams_open: Callable[[], int],
        turn: AbstractContextManager[Any],
    ) -> None:
        self.store = store
        self.owner_id = owner_id
        self.header = header
        self.context = context
        self.duplicate = joined.duplicate
        self.covered = joined.covered
        self.algebra = SerialisedCiphertextGroup(context.public_key.n)
        self.total = sum(block.layout.n_ciphertexts for block in context.plan.owner_blocks)
        self._on_folded = on_folded
        self._on_completed = on_completed
        self._on_ended = on_ended
        self._streams_open = streams_open
        self._turn = turn
        self._ended = False

    def add(self, chunk: DecodedChunk) -> None:
        """Check one chunk's ciphertexts and fold them (durably) unless already folded.

        Raises
        ------
        CiphertextError
            A ciphertext outside Z*_{n^2}.
        QueryClosedError, ProtocolError
            From :meth:`ProxyStore.fold_chunk`.
        """
        count = len(chunk.ciphertexts)
        if self.duplicate or chunk.offset + count <= self.covered:
            return
        # CPU time of this thread only: waiting for the group commit's fsync is not work.
        started = time.thread_time()
        validate_ciphertexts(chunk.ciphertexts, self.context.public_key)
        folded = self.store.fold_chunk(
            self.header.query_id,
            self.owner_id,
            self.header.upload_id,
            chunk.offset,
            chunk.data,
            self.total,
            self.algebra,
        )
        self.covered = folded.covered
        if folded.folded:
            self._on_folded(self.header.query_id, time.thread_time() - started)

    def complete(self, content_sha256: bytes) -> UploadCompletion:
        """Accept the upload, exactly once (``content_sha256``: over all its ciphertexts).

        Raises
        ------
        ProtocolError
            A second, different upload from this owner, a replay of ciphertexts
            accepted for another query, or chunks that do not cover the layout.
        QueryClosedError
            The query failed.
        """
        header = self.header
        try:
            receipt = self.store.complete_upload(
                header.query_id,
                self.owner_id,
                header.upload_id,
                content_sha256.hex(),
                self.total,
                public_count=header.public_record_count,
                resent=self.duplicate,
            )
        finally:
            self._end()
        if receipt.duplicate:
            logger.info("query %s: duplicate upload from %s", header.query_id, self.owner_id)
        else:
            self._on_completed(header.query_id)
        return receipt

    def abandon(self) -> None:
        """The stream broke: while the contributors are not fixed, and unless another
        stream of this upload is still open, take its chunks out and free its place;
        afterwards keep them so that the upload resumes."""
        try:
            # The upload's turn: a new stream of it joins before or after, never between
            # this check and the take-out.
            with self._turn:
                if self.duplicate or self._streams_open() > 1:
                    return
                try:
                    removed = self.store.abandon(
                        self.header.query_id,
                        self.owner_id,
                        self.header.upload_id,
                        total_ciphertexts=self.total,
                        algebra=self.algebra,
                    )
                except FedpcaError as exc:
                    logger.warning(
                        "%s: could not take the unfinished upload out: %s",
                        self.header.label,
                        exc,
                    )
                    return
            if removed:
                self._on_folded(self.header.query_id, 0.0)
        finally:
            self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._on_ended()
