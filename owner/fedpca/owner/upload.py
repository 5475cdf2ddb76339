"""One upload's messages, sent while the share is still being encrypted (no gRPC here).

The owner does not wait for its whole share to be encrypted before it starts sending:
a producer thread takes the ciphertexts in wire order as the crypto pool returns them,
cuts them into chunks chained by hashes (:mod:`fedpca.messages.chunks`) and appends
each chunk message to a list the moment it is complete. An upload attempt reads that
list from the start, waiting for the next message while it is being encrypted, so the
first chunk leaves after about 512 encryptions and the last one right after the last
encryption.

Every attempt (a retry after a broken stream, a re-delivered task) replays the very
same messages under the same upload id, so the proxy recognises the chunks it already
folded and resumes after them; nothing is encrypted twice within one process.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fedpca.messages import ChunkChain, chunk_stream
from fedpca.owner.share_snapshots import KeptShare

__all__ = ["OutgoingUpload"]

logger = logging.getLogger(__name__)


_ATTACH_WAIT = 5.0
"""Seconds a stopped upload's messages wait for their call (:meth:`OutgoingUpload.attach`)
before they end; the caller attaches it right after creating it."""


class OutgoingUpload:
    """The messages of one upload: a header, then chunks produced while encrypting.

    Parameters
    ----------
    upload_id : the upload's id (the header carries it too).
    header : the first message (``UploadMessage`` with the header).
    batches : ciphertexts in wire order, batch by batch as they are encrypted.
    width : bytes per ciphertext.
    per_chunk : ciphertexts per chunk message (the last one may hold fewer).
    chunk_message : turns an :class:`~fedpca.messages.EncodedChunk` into its message.
    on_done : called once from the producer thread when every chunk is ready.
    """

    def __init__(
        self,
        upload_id: str,
        header: Any,
        batches: Iterable[Sequence[int]],
        width: int,
        per_chunk: int,
        chunk_message: Callable[[Any], Any],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.upload_id = upload_id
        self.chunk_handed_out = False
        """True once any chunk message was handed to gRPC (it may have left the node)."""
        self.share: KeptShare | None = None
        """The encoded share, until it is kept on disk (:mod:`fedpca.owner.share_snapshots`)."""
        self._messages: list[Any] = [header]
        self._batches = batches
        self._width = width
        self._per_chunk = per_chunk
        self._chunk_message = chunk_message
        self._on_done = on_done
        self._changed = threading.Condition()
        self._complete = False
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._call: Any = None  # the upload call sending these messages (attach)
        self._thread = threading.Thread(
            target=self._produce, name="owner-upload-producer", daemon=True
        )

    def start(self) -> OutgoingUpload:
        """Start encrypting and chunking in the background; returns ``self``."""
        self._thread.start()
        return self

    def _produce(self) -> None:
        chain = ChunkChain()
        try:
            for data in chunk_stream(self._batches, self._width, self._per_chunk):
                if self._stopped.is_set():
                    return
                message = self._chunk_message(chain.next(data))
                with self._changed:
                    self._messages.append(message)
                    self._changed.notify_all()
            if self._on_done is not None:
                self._on_done()
        except BaseException as exc:  # handed to whoever reads the messages
            with self._changed:
                self._error = exc
            logger.error("encrypting the upload failed: %s", type(exc).__name__)
        finally:
            close = getattr(self._batches, "close", None)
            if close is not None and self._stopped.is_set():
                close()  # cancels the pool tasks still queued
            with self._changed:
                self._complete = True
                self._changed.notify_all()

    @property
    def error(self) -> BaseException | None:
        """What stopped the encryption, if anything did."""
        with self._changed:
            return self._error

    @property
    def complete(self) -> bool:
        """True once every chunk message exists (or producing them failed)."""
        with self._changed:
            return self._complete

    def messages(self, header_accepted: Callable[[], bool] | None = None) -> Iterator[Any]:
        """All messages from the header on, waiting for each chunk while it is encrypted.

        ``header_accepted`` is asked once, after the header and before the first chunk
        is handed out: it waits for the proxy's word and says whether the header was
        accepted. When it says no, the messages end there (the proxy refused; no chunk
        left this node).

        Raises
        ------
        BaseException
            Whatever stopped the encryption (the upload call is then cancelled).
        """
        index = 0

        def more(seen: int) -> bool:
            return seen < len(self._messages) or self._complete or self._stopped.is_set()

        while True:
            with self._changed:
                self._changed.wait_for(functools.partial(more, index))
                if self._stopped.is_set():
                    # Ending the messages here would close the stream cleanly, which the
                    # proxy refuses as an upload short of its chunks and this node then
                    # recorded as rejected: a stop during encryption wrecked the query
                    # (found by an operator's review). The call is cancelled instead
                    # (stop, attach), and the upload resumes when the node starts again.
                    self._changed.wait_for(lambda: self._call is not None, _ATTACH_WAIT)
                    return
                if index < len(self._messages):
                    message = self._messages[index]
                elif self._error is not None:
                    raise self._error
                else:
                    return
            if index == 1 and header_accepted is not None and not header_accepted():
                return
            if index > 0:
                self.chunk_handed_out = True  # before gRPC may send it
            yield message
            index += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the producer to finish; True if it did within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def attach(self, call: Any) -> None:
        """The upload call sending :meth:`messages`: :meth:`stop` cancels it (at once,
        if it came first)."""
        with self._changed:
            self._call = call
            stopped = self._stopped.is_set()
            self._changed.notify_all()
        if stopped:
            call.cancel()

    def stop(self) -> None:
        """Stop producing (the node is stopping or the task was cancelled), and cancel
        the upload call, if any, before its messages end: the proxy sees a cancelled
        upload, which it keeps for a resumption, not a short one, which it refuses."""
        with self._changed:
            call = self._call
        if call is not None:
            call.cancel()
        self._stopped.set()
        with self._changed:
            self._changed.notify_all()
