"""SIGTERM handled like Ctrl-C by the ``fedpca analyst`` commands.

``timeout``, a CI job's cancellation and ``kill`` send SIGTERM, whose default action
ends the process at once: a query the command was waiting for stayed open at the proxy
(and charged if it then failed at its deadline after an owner had begun an upload), and
the decryption pool was never shut down (Python's resource tracker reported its
semaphores as leaked). While a command runs, SIGTERM raises :class:`Terminated` in the
main thread instead: a :class:`KeyboardInterrupt`, so every path that handles Ctrl-C
(cancelling the query while it collects, shutting the pool down, saying how to fetch a
result already being released) handles it alike.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "TERMINATED_EXIT_CODE",
    "Terminated",
    "interrupted_by",
    "sigterm_interrupts",
]

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
"""What a command ended by SIGTERM exits with, as a shell reports a process killed by
it (143)."""

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""What a command interrupted by Ctrl-C exits with, as a shell reports SIGINT (130)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a command ran (raised where Ctrl-C's KeyboardInterrupt would
    be)."""


def interrupted_by(exc: BaseException) -> str:
    """How a log line names the interruption ``exc``: SIGTERM or Ctrl-C."""
    return "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Raise :class:`Terminated` on SIGTERM until the block ends, then restore the
    previous handler. Only the main thread may set handlers: elsewhere (a command run
    from a thread) SIGTERM keeps its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
