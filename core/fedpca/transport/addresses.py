"""``host:port`` addresses, as every role's flags and configuration files take them.

One rule for the address an owner or analyst dials (``owner.proxy``, the analyst's
``proxy``) and the address a node listens on (``proxy.listen``, ``monitoring.listen``):
a host name or IPv4 address, or an IPv6 address in brackets as gRPC takes it
(``[::1]:50051``), then a port. An address is checked where it is given (``init``,
the loaders, the flags), so ``--proxy localhost`` is refused when it is typed rather
than when the first call fails to connect.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

import click

from fedpca.errors import ConfigError

__all__ = ["address_problem", "check_address", "click_address"]

# A host name or an IPv4 address (IDN names are given in their ASCII form).
_HOST = re.compile(r"[A-Za-z0-9._-]+")
_EXAMPLE = "e.g. proxy.example.org:50051, or [::1]:50051 for an IPv6 address"


def address_problem(value: str, *, listening: bool = False) -> str | None:
    """What is wrong with ``value`` as ``host:port``, or None if nothing is.

    ``listening``: an address to bind, where port 0 means any free port.
    """
    lowest = 0 if listening else 1
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket:
            return f"{value!r} opens a bracket it does not close ({_EXAMPLE})"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} in brackets is not an IPv6 address ({_EXAMPLE})"
        if not rest.startswith(":"):
            return f"{value!r} has no port ({_EXAMPLE})"
        port = rest[1:]
    else:
        host, colon, port = value.rpartition(":")
        if not colon:
            return f"{value!r} has no port (e.g. {value or 'localhost'}:50051)"
        if ":" in host:
            return f"{value!r}: an IPv6 address goes in brackets, e.g. [::1]:50051"
        if not host:
            return f"{value!r} has no host ({_EXAMPLE})"
        if _HOST.fullmatch(host) is None:
            return f"{host!r} is not a host name or IP address ({_EXAMPLE})"
    # ASCII digits only: str.isdigit() also accepts other scripts' digits, and int()
    # refuses strings of more than 4300 digits.
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} of {value!r} is not a number ({_EXAMPLE})"
    if len(port) > 5 or not lowest <= int(port) <= 65535:
        any_port = "; 0 = any free port" if listening else ""
        return f"port {port} of {value!r} is out of range ({lowest} to 65535{any_port})"
    return None


def check_address(value: str, setting: str, *, listening: bool = False) -> str:
    """Return ``value`` if it is ``host:port`` (:func:`address_problem`).

    Raises
    ------
    ConfigError
        Naming ``setting`` (a key such as ``owner.proxy``, or a flag) and the problem.
    """
    problem = address_problem(value, listening=listening)
    if problem is not None:
        raise ConfigError(f"{setting} must be 'host:port': {problem}")
    return value


def click_address(
    *, listening: bool = False
) -> Callable[[click.Context, click.Parameter, str | None], str | None]:
    """A click callback refusing an option value that is not ``host:port``, so that a
    command refuses it before it writes or sends anything."""

    def callback(_: click.Context, __: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            problem = address_problem(value, listening=listening)
            if problem is not None:
                raise click.BadParameter(f"must be 'host:port': {problem}")
        return value

    return callback
