"""The ``--ca``, ``--cert`` and ``--key`` options of every ``fedpca … init`` command.

Each node folder takes its TLS files either from a ``fedpca certs init`` directory
(``--certs``, whose help names the role) or as three files given one by one; the three
are the same for the proxy, an owner and an analyst, so they are declared once here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

__all__ = ["tls_file_options"]

_Command = TypeVar("_Command", bound=Callable[..., object])

_FILES = (
    ("--ca", "The deployment's CA certificate (instead of --certs)."),
    ("--cert", "This node's certificate (instead of --certs)."),
    ("--key", "This node's private key (instead of --certs; copied with mode 0600)."),
)


def tls_file_options(command: _Command) -> _Command:
    """Add ``--ca``, ``--cert`` and ``--key`` (existing files) to a click command."""
    for name, help_text in reversed(_FILES):
        option = click.option(
            name, type=click.Path(dir_okay=False, exists=True, path_type=Path), help=help_text
        )
        command = option(command)
    return command
