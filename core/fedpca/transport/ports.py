"""Why a listening address cannot be bound, in one line an operator can act on.

gRPC reports a port it cannot bind as "Failed to bind to address ..." without the
reason, after printing a C-core log line of its own; Python's ``bind`` has the reason
(``errno``) but not the setting the address came from. :func:`check_bindable` tries the
address with a socket of its own before a server binds it, so a port in use is reported
as such, naming the setting to change, before gRPC tries; :func:`bind_error` words the
refusal for a bind that failed.
"""

from __future__ import annotations

import errno
import socket

from fedpca.errors import ConfigError

__all__ = ["bind_error", "check_bindable"]


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _failed_bind(address: str) -> tuple[OSError | None, bool]:
    """Why binding ``address`` fails now (a port in use first), or None; and whether
    it fails for every address the host resolves to.

    Binds (without listening) a socket to each of them and closes it at once. Port 0
    (any free port) and a host that does not resolve give (None, False): the server
    reports those.
    """
    split = _split(address)
    if split is None or split[1] == 0:
        return None, False
    host, port = split
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError):
        return None, False
    failures: list[OSError] = []
    bound = 0
    for family, kind, protocol, _, where in found:
        try:
            probe = socket.socket(family, kind, protocol)
        except OSError:
            continue  # an address family this machine lacks (e.g. no IPv6)
        with probe:
            # As servers do, so that connections of an earlier run in TIME_WAIT do not
            # count as "in use"; a socket listening on the port still does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                failures.append(exc)
            else:
                bound += 1
    failures.sort(key=lambda exc: exc.errno != errno.EADDRINUSE)
    return (failures[0] if failures else None), bool(failures) and not bound


def bind_error(address: str, setting: str, cause: OSError | None = None) -> ConfigError:
    """The error for ``address`` (``host:port``) that could not be bound.

    Parameters
    ----------
    address : the address as configured.
    setting : what the operator changes to pick another address, e.g.
        ``"proxy.listen (or --listen)"``.
    cause : the failed bind's OSError; without one, a bind is tried here for the reason.
    """
    if cause is None:
        cause, _ = _failed_bind(address)
    split = _split(address)
    port = split[1] if split is not None else "?"
    code = None if cause is None else cause.errno
    if code == errno.EADDRINUSE:
        why = f"port {port} is already in use"
    elif code == errno.EADDRNOTAVAIL:
        why = "the host is not an address of this machine"
    elif code == errno.EACCES:
        why = f"permission denied (port {port} needs privileges)"
    elif cause is not None:
        why = f"it cannot be bound ({cause.strerror or cause})"
    else:
        why = "it cannot be bound (the port in use, or the host not an address of this machine?)"
    # One line: the operator reads it as the command's only error.
    return ConfigError(f"cannot listen on {address}: {' '.join(why.split())}; change {setting}")


def check_bindable(address: str, setting: str) -> None:
    """Raise :func:`bind_error`'s ConfigError if ``address`` cannot be bound now.

    Refused: a port in use or one that needs privileges on any address the host
    resolves to, or any reason when none of them can be bound. A host name that
    resolves to an address of a family this machine does not serve (``localhost``
    without IPv6) is left to the server, which binds the others. A port taken between
    this check and the server's bind still fails there.
    """
    failure, everywhere = _failed_bind(address)
    if failure is not None and (everywhere or failure.errno in (errno.EADDRINUSE, errno.EACCES)):
        raise bind_error(address, setting, failure)
