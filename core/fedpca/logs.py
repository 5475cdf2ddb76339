"""Log output of the ``fedpca`` processes: plain text lines, or one JSON object per line.

Handlers are configured here and only from entry points (the ``fedpca`` command and its
``serve`` subcommands); library code only gets loggers. The format is chosen once per
process with ``fedpca --log-format json`` or the environment variable
``FEDPCA_LOG_FORMAT=json`` (handy in containers) and kept when a subcommand raises the
level (``serve`` logs INFO by default).

JSON lines come from python-json-logger: ``time`` (ISO 8601, UTC, milliseconds), ``level``,
``logger``, ``message``, plus ``process`` and ``thread`` names and, for a logged
exception, ``exc_info``. A log aggregator can then filter on the fields instead of
parsing text.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from enum import StrEnum
from typing import Any

__all__ = [
    "LOG_FORMAT_ENV",
    "TEXT_FORMAT",
    "LogFormat",
    "SparseLog",
    "configure_logging",
    "one_line_warnings",
]

LOG_FORMAT_ENV = "FEDPCA_LOG_FORMAT"
"""Environment variable choosing the log format when no flag does ("text" or "json")."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


_HANDLER_NAME = "fedpca"
_chosen: LogFormat | None = None


def _formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format is LogFormat.TEXT:
        return logging.Formatter(TEXT_FORMAT)
    from pythonjsonlogger.json import JsonFormatter

    formatter = JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(processName)s %(threadName)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )
    # ISO 8601 in UTC with milliseconds, as the text lines have them (a datefmt gave
    # whole seconds in local time: an operator's walkthrough, stop 42).
    formatter.converter = time.gmtime
    formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
    formatter.default_msec_format = "%s.%03dZ"
    return formatter


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (test runners and
    daemonising wrappers replace it after start-up)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.set_name(_HANDLER_NAME)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    return f"warning: {message} ({category.__name__})\n"


def one_line_warnings() -> None:
    """Print Python warnings as one line each, ``warning: MESSAGE (Category)``: for a
    command's user, not the file, line and source of the library that warned (an
    analyst's walkthrough found DCA's and a weak class's warnings so, after the
    charge). Entry points only, like the handlers."""
    warnings.formatwarning = _one_line_warning


def configure_logging(level: int, log_format: LogFormat | str | None = None) -> None:
    """Send log records at ``level`` or more to stderr, as text or JSON lines.

    Parameters
    ----------
    level : the root logger's level. Once a level is set, later calls only lower it
        (more output): ``fedpca -vv proxy serve`` stays at DEBUG although ``serve``
        asks for INFO.
    log_format : "text" or "json"; None keeps the format chosen earlier in this
        process, else ``$FEDPCA_LOG_FORMAT``, else text.

    Raises
    ------
    ValueError
        An unknown format (from the argument or the environment).
    """
    global _chosen, _level_set
    if log_format is not None:
        _chosen = LogFormat(log_format)
    elif _chosen is None:
        _chosen = LogFormat(os.environ.get(LOG_FORMAT_ENV, LogFormat.TEXT.value).lower())
    root = logging.getLogger()
    handler = next((h for h in root.handlers if h.get_name() == _HANDLER_NAME), None)
    if handler is None:
        handler = _StderrHandler()
        root.addHandler(handler)
    handler.setFormatter(_formatter(_chosen))
    root.setLevel(min(root.level, level) if _level_set else level)
    _level_set = True


_level_set = False


class SparseLog:
    """Counts one kind of event a peer can cause at will and says which to log: the
    1st, 2nd, 4th, 8th, ... A flood of them must not fill the disk with the log (a proxy
    sending cancellations or replayed tasks by the thousand wrote 0.3-0.45 MB/s of an
    owner's log: found by review)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Count one event; True if it is one to log."""
        with self._lock:
            self.count += 1
            return self.count & (self.count - 1) == 0
