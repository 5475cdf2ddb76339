"""Worker processes that never run the caller's ``__main__`` module.

With the "spawn" and "forkserver" start methods, :mod:`multiprocessing` tells each
new process (and the fork server when it starts) to import the parent's main
module: ``python analysis.py`` re-runs ``analysis.py`` as ``__mp_main__`` in every
worker. A script without an ``if __name__ == "__main__":`` guard then runs again in
the workers, and a script that fits an estimator submits its query (and spends
privacy budget) again from each of them.

The crypto workers only ever run functions of :mod:`fedpca.codec._worker`, so they
never need the caller's main module. :func:`worker_context` returns a start-method
context whose processes are launched while ``sys.modules["__main__"]`` is, for the
moment of the launch only, an empty stand-in module without ``__file__`` or
``__spec__``: :func:`multiprocessing.spawn.get_preparation_data` then names no main
module to import, exactly as for an interactive session. The swap is held under a
lock and lasts as long as the parent takes to hand the new process its start-up
data; other threads that look up ``__main__`` by name during that moment would see
the stand-in, which is why it is kept that short.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import context as mp_context
from typing import Any

__all__ = ["worker_context"]

_SWAP_LOCK = threading.Lock()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    with _SWAP_LOCK:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                del sys.modules["__main__"]
            else:
                sys.modules["__main__"] = main


class _ForkServerProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        with _main_module_hidden():
            return mp_context.ForkServerProcess._Popen(process_obj)


class _SpawnProcess(mp_context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        with _main_module_hidden():
            return mp_context.SpawnProcess._Popen(process_obj)


class _ForkServerContext(mp_context.ForkServerContext):
    Process = _ForkServerProcess


class _SpawnContext(mp_context.SpawnContext):
    Process = _SpawnProcess


def worker_context(start_method: str) -> mp_context.BaseContext:
    """A ``multiprocessing`` context for ``start_method`` ("forkserver" or "spawn")
    whose processes do not import the caller's main module."""
    if start_method == "forkserver":
        return _ForkServerContext()
    if start_method == "spawn":
        return _SpawnContext()
    raise ValueError(f"no worker context for start method {start_method!r}")
