"""Why a connection to the proxy fails: unreachable, or a TLS problem retrying won't fix.

gRPC reports every failure to connect as UNAVAILABLE, and with several addresses for
one name (``localhost`` is 127.0.0.1 and ::1) only the last address's error: a proxy
certificate that does not name the host dialled surfaced as "[::1] connection refused"
after half a minute of retries. :func:`diagnose_connection` looks for itself: it
resolves the name, opens a TCP connection to each address and runs a TLS handshake that
verifies the proxy's certificate against the fedpca CA and the name dialled, with
Python's :mod:`ssl`. A verification failure is permanent and is reported at once with
the names the certificate does carry; a refused or silent port is not (the proxy may be
restarting), and the caller goes on retrying.

The handshake presents no client certificate: the client checks the server's
certificate before the server asks for the client's, which is all this needs.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Any

from cryptography import x509

__all__ = ["ConnectionDiagnosis", "diagnose_connection", "split_target"]


@dataclass(frozen=True)
class ConnectionDiagnosis:
    """What :func:`diagnose_connection` found.

    Attributes
    ----------
    reachable : some address of the target accepted a TCP connection.
    problem : a failure that retrying will not fix (a certificate that does not name
        the host, or one the fedpca CA did not sign), in one sentence; None otherwise.
    addresses : one line per address tried ("127.0.0.1: connection refused").
    """

    reachable: bool
    problem: str | None
    addresses: tuple[str, ...]

    def summary(self) -> str:
        return "; ".join(self.addresses) if self.addresses else "no address"


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) as (host, port).

    Raises
    ------
    ValueError
        Not ``host:port`` with a numeric port.
    """
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {target!r}")
    return host.strip("[]"), int(port)


def _names(der: bytes | None) -> list[str]:
    if not der:
        return []
    certificate = x509.load_der_x509_certificate(der)
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return [
        str(name.value)
        for name in san.value
        if not isinstance(name, x509.UniformResourceIdentifier)
    ]


def _handshake(
    address: tuple[Any, ...], family: int, context: ssl.SSLContext, name: str, timeout: float
) -> bytes | None:
    with socket.socket(family, socket.SOCK_STREAM) as raw:
        raw.settimeout(timeout)
        raw.connect(address)
        with context.wrap_socket(raw, server_hostname=name) as tls:
            return tls.getpeercert(binary_form=True)


def diagnose_connection(
    target: str,
    root_certificates: bytes | None,
    server_name: str | None = None,
    timeout: float = 3.0,
    *,
    can_override_name: bool = False,
) -> ConnectionDiagnosis:
    """Try every address of ``target`` and, with ``root_certificates``, verify the
    proxy's certificate against them and against ``server_name`` (default: the host).

    Parameters
    ----------
    target : ``host:port`` as dialled.
    root_certificates : the fedpca CA (PEM); None for an insecure channel (TCP only).
    server_name : the name the certificate must carry (``--server-name``).
    timeout : seconds per connection attempt.
    can_override_name : whether the caller may verify against another name than the
        host it dials (the analyst's ``--server-name``); an owner may not.
    """
    try:
        host, port = split_target(target)
    except ValueError as exc:
        return ConnectionDiagnosis(False, str(exc), ())
    name = server_name or host
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return ConnectionDiagnosis(False, None, (f"{host}: cannot resolve ({exc.strerror})",))
    verifying = strict = None
    if root_certificates is not None:
        verifying = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        verifying.load_verify_locations(cadata=root_certificates.decode("ascii"))
        # The same without the name check, to read the names the certificate carries.
        strict = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        strict.check_hostname = False
        strict.load_verify_locations(cadata=root_certificates.decode("ascii"))
    lines: list[str] = []
    reachable = False
    problem: str | None = None
    seen: set[tuple[int, str]] = set()
    for family, _, _, _, address in infos:
        sockaddr: tuple[Any, ...] = tuple(address)
        key = (family, str(sockaddr[0]))
        if key in seen:
            continue
        seen.add(key)
        shown = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else str(sockaddr[0])
        try:
            if verifying is None:
                with socket.socket(family, socket.SOCK_STREAM) as raw:
                    raw.settimeout(timeout)
                    raw.connect(sockaddr)
            else:
                _handshake(sockaddr, family, verifying, name, timeout)
        except ssl.SSLCertVerificationError as exc:
            reachable = True
            reason = exc.verify_message or str(exc)
            if "hostname" in reason.lower() or "ip address mismatch" in reason.lower():
                assert strict is not None
                try:
                    names = _names(_handshake(sockaddr, family, strict, name, timeout))
                except OSError:
                    names = []
                override = (
                    " (or verify against one with --server-name)" if can_override_name else ""
                )
                problem = (
                    f"the proxy's certificate is not valid for {name!r} (it names "
                    f"{', '.join(names) or 'no host'}): dial the proxy by one of those "
                    f"names{override}, or reissue the proxy certificate with "
                    f"--proxy-host {name}"
                )
            elif "expired" in reason.lower() or "not yet valid" in reason.lower():
                # Not a wrong CA (the hint below sent an analyst to check tls.ca: review).
                problem = (
                    f"the proxy's certificate is outside its validity period ({reason}): "
                    "its operator must issue it a new one (fedpca certs issue), or the "
                    "clocks of this machine and the proxy's disagree"
                )
            else:
                problem = (
                    f"the proxy's certificate does not verify against your CA ({reason}): "
                    "is tls.ca the CA of this deployment?"
                )
            lines.append(f"{shown}: TLS verification failed: {reason}")
        except ssl.SSLError as exc:
            # Verified the server, then the handshake failed later (e.g. the server
            # wanted a client certificate this check does not present): reachable.
            reachable = True
            lines.append(f"{shown}: TLS ok as far as checked ({exc.reason or exc})")
        except ConnectionRefusedError:
            lines.append(f"{shown}: connection refused")
        except TimeoutError:
            lines.append(f"{shown}: no answer within {timeout:g} s")
        except OSError as exc:
            lines.append(f"{shown}: {exc.strerror or exc}")
        else:
            reachable = True
            lines.append(f"{shown}: reachable" + (", certificate valid" if verifying else ""))
    return ConnectionDiagnosis(reachable, problem, tuple(lines))
