"""One owner's upload at the proxy: the checks on its header, then its stream of chunks.

Everything that can be checked before a single chunk is read is checked on the
header (:func:`check_upload_header`). The chunks are then folded into the
encrypted aggregate as they arrive (:class:`UploadStream`); completing the upload
records it and a stream that fails is taken out again, both atomically in the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from fedpca.codec import (
    SerialisedCiphertextGroup,
    check_owner_count,
    ciphertexts_to_bytes,
    validate_ciphertexts,
)
from fedpca.errors import CiphertextError, FedpcaError, LayoutError, ProtocolError, QueryStateError
from fedpca.messages import CiphertextBlock, QueryState, UploadHeader
from fedpca.proxy.queries import QueryContext, wire_blocks
from fedpca.proxy.store import ProxyStore, UploadCompletion
from fedpca.query import ProtocolMode

__all__ = ["UploadStream", "check_upload_header"]

logger = logging.getLogger(__name__)


def check_upload_header(
    context: QueryContext,
    store: ProxyStore,
    owner_id: str,
    header: UploadHeader,
    clock: Callable[[], float],
) -> bool:
    """Everything that can be checked before a single chunk is read.

    Returns True when the header is a retry of an upload already accepted.

    A retry of an upload this owner already had accepted passes the state and
    deadline checks (the store then answers "duplicate"), even after the query
    has moved on; it must still match the plan like any other upload.

    Raises
    ------
    NotFoundError
        Unknown query.
    QueryStateError
        The query no longer collects uploads (late upload).
    CiphertextError
        The header names another analyst key.
    LayoutError
        The blocks differ from the plan's owner blocks.
    ProtocolError
        The public record count is missing (masked mode), present (stats mode)
        or above the query's max_records_per_owner.
    """
    spec = context.spec
    # Key, layout and count are checked before the retry shortcut: a genuine retry
    # resends the very same header, and one with the same upload id and content
    # hash but e.g. another layout or a stats-mode record count was answered
    # "duplicate" without ever being validated.
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
    if _is_retry(store, owner_id, header):
        return True
    record = store.query(header.query_id)
    if record.state is not QueryState.COLLECTING:
        raise QueryStateError(
            f"query {header.query_id!r} is {record.state.value}: uploads are no longer accepted"
        )
    if clock() >= record.deadline_at:
        raise QueryStateError(f"query {header.query_id!r}: the upload deadline has passed")
    return False


def _is_retry(store: ProxyStore, owner_id: str, header: UploadHeader) -> bool:
    digest = header.content_sha256.hex()
    return any(
        u.owner_id == owner_id and u.upload_id == header.upload_id and u.content_sha256 == digest
        for u in store.uploads(header.query_id)
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

    Made by :meth:`fedpca.proxy.coordinator.Coordinator.begin_upload`, which passes
    ``on_change`` (a query changed: wake its watchers) and ``on_accepted`` (count the
    upload, close the query at its quorum). Call :meth:`add` for each chunk in
    wire order, then :meth:`complete` once the whole stream (and its content hash)
    has been verified; on any failure call :meth:`abandon`, which takes the
    chunks folded so far out of the aggregate again. A retry of an upload the
    proxy already accepted (``duplicate``) folds nothing and completes as
    "duplicate".
    """

    def __init__(
        self,
        store: ProxyStore,
        owner_id: str,
        header: UploadHeader,
        context: QueryContext,
        stream: int,
        *,
        duplicate: bool,
        on_change: Callable[[], None],
        on_accepted: Callable[[str, UploadCompletion, float], None],
    ) -> None:
        self.store = store
        self.owner_id = owner_id
        self.header = header
        self.context = context
        self.stream = stream
        self.duplicate = duplicate
        self.algebra = SerialisedCiphertextGroup(context.public_key.n)
        self.total = sum(block.layout.n_ciphertexts for block in context.plan.owner_blocks)
        self.fold_seconds = 0.0
        self._announced = False
        self._on_change = on_change
        self._on_accepted = on_accepted

    def add(self, position: int, ciphertexts: Sequence[int]) -> None:
        """Check one chunk's ciphertexts (wire positions from ``position``) and fold them.

        Raises
        ------
        CiphertextError
            A ciphertext outside Z*_{n^2}.
        QueryStateError, ProtocolError
            From :meth:`ProxyStore.fold_chunk` (query closed, a different upload
            already accepted from this owner, superseded by a newer stream).
        """
        if self.duplicate:
            return
        started = time.perf_counter()
        public_key = self.context.public_key
        validate_ciphertexts(ciphertexts, public_key)
        folded = self.store.fold_chunk(
            self.header.query_id,
            self.owner_id,
            self.header.upload_id,
            self.stream,
            position,
            ciphertexts_to_bytes(ciphertexts, public_key),
            self.total,
            self.algebra,
        )
        self.duplicate = not folded
        self.fold_seconds += time.perf_counter() - started
        if folded and not self._announced:
            self._announced = True  # watchers see this owner as uploading
            self._on_change()

    def complete(self) -> UploadCompletion:
        """Accept the upload, exactly once; closes the query when it makes the quorum.

        Raises
        ------
        EncodingOverflowError
            More owners than the query's max_owners.
        ProtocolError
            A second, different upload from this owner, a replay of ciphertexts
            accepted for another query, or chunks that do not cover the layout.
        QueryStateError
            The query stopped collecting meanwhile.
        """
        header = self.header
        bounds = self.context.plan.bounds

        def owner_count_fits(n_contributed: int) -> None:
            check_owner_count(bounds, n_contributed + 1)

        receipt = self.store.complete_upload(
            header.query_id,
            self.owner_id,
            header.upload_id,
            self.stream,
            header.content_sha256.hex(),
            self.total,
            self.algebra,
            public_count=header.public_record_count,
            before_accept=owner_count_fits,
        )
        if receipt.duplicate:
            logger.info("query %s: duplicate upload from %s", header.query_id, self.owner_id)
            return receipt
        self._on_accepted(header.query_id, receipt, self.fold_seconds)
        return receipt

    def abandon(self) -> None:
        """Take this stream's folded chunks out of the aggregate (after a failure)."""
        if self.duplicate:
            return
        try:
            removed = self.store.discard_stream(
                self.header.query_id, self.owner_id, self.stream, self.algebra
            )
        except FedpcaError as exc:
            logger.warning(
                "%s: could not take the unfinished upload out: %s", self.header.label, exc
            )
            return
        if removed:
            self._on_change()
            logger.info(
                "%s: unfinished upload of %s taken out of the aggregate (%d chunks)",
                self.header.label,
                self.owner_id,
                removed,
            )
