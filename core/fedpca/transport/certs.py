"""Certificates for fedpca's mutual TLS: a private CA, node certificates, identities.

Every node (owner, proxy, analyst) holds a certificate issued by one fedpca CA.
The certificate is the node's identity: its role and node id are encoded as a
SAN URI ``fedpca://<role>/<node-id>`` (authoritative) and repeated in the subject
(CN = node id, OU = role) for humans reading ``openssl x509 -text``. Message
fields that repeat a node id are informational only.

Key type: EC P-256 (ECDSA with SHA-256) for the CA and all nodes: ~128-bit security
like RSA-3072, supported by every TLS 1.2/1.3 stack (gRPC's BoringSSL included), and
generated in milliseconds, which keeps test fixtures fast.

Extended key usage follows the direction of connections: owners and analysts
only dial out (clientAuth), the proxy only serves (serverAuth) and carries the
DNS/IP names it is reached at, so no owner or analyst certificate can pass
hostname verification as the proxy.

Private keys are written unencrypted (PKCS#8 PEM) with mode 0600, created that
way so they are never readable by others, not even briefly; protect them like
any service key and pass them to fedpca by path.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpca.errors import AuthenticationError, ConfigError, KeyFileError
from fedpca.files import undone_on_failure, write_atomically

logger = logging.getLogger(__name__)

URI_SCHEME = "fedpca"
DEFAULT_PROXY_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1")
DEFAULT_CA_VALID_DAYS = 3650
DEFAULT_NODE_VALID_DAYS = 825
# Backdate notBefore so a node whose clock runs slightly behind the CA's still
# accepts a freshly issued certificate.
_CLOCK_SKEW = dt.timedelta(minutes=5)
# Node ids appear in URIs, file names and log lines; a conservative alphabet
# means none of those needs escaping.
_NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

PrivateKey = ec.EllipticCurvePrivateKey


class Role(StrEnum):
    """The role a certificate grants."""

    OWNER = "owner"
    PROXY = "proxy"
    ANALYST = "analyst"


@dataclass(frozen=True)
class NodeIdentity:
    """Who a peer is, as certified by the fedpca CA."""

    role: Role
    node_id: str

    def __post_init__(self) -> None:
        validate_node_id(self.node_id)

    @property
    def uri(self) -> str:
        """The SAN URI encoding this identity: ``fedpca://<role>/<node-id>``."""
        return f"{URI_SCHEME}://{self.role}/{self.node_id}"

    def __str__(self) -> str:
        return f"{self.role}/{self.node_id}"


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` if it is a valid node id, else raise ConfigError."""
    if not _NODE_ID_RE.fullmatch(node_id):
        raise ConfigError(
            f"node id {node_id!r} must be 1-63 characters of letters, digits, '.', '_', '-',"
            " starting with a letter or digit"
        )
    return node_id


@dataclass(frozen=True)
class CertificateAuthority:
    """The fedpca CA: its private key and self-signed certificate."""

    key: PrivateKey
    certificate: x509.Certificate


@dataclass(frozen=True)
class NodeCertificate:
    """A node's private key and CA-issued certificate."""

    identity: NodeIdentity
    key: PrivateKey
    certificate: x509.Certificate


def generate_private_key() -> PrivateKey:
    """A fresh EC P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def _validity(valid_days: int) -> tuple[dt.datetime, dt.datetime]:
    if valid_days < 1:
        raise ConfigError(f"valid_days must be >= 1, got {valid_days}")
    now = dt.datetime.now(dt.UTC)
    return now - _CLOCK_SKEW, now + dt.timedelta(days=valid_days)


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """Signatures only (TLS 1.3 with EC keys), plus certificates and CRLs for the CA."""
    flags = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment"), False)
    flags |= dict.fromkeys(("key_agreement", "encipher_only", "decipher_only"), False)
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        **flags,
    )


def create_ca(
    common_name: str = "fedpca CA", valid_days: int = DEFAULT_CA_VALID_DAYS
) -> CertificateAuthority:
    """Create a self-signed CA that may sign node certificates but no further CAs."""
    key = generate_private_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpca"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    not_before, not_after = _validity(valid_days)
    public_key = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(key, certificate)


def _san_entries(identity: NodeIdentity, hosts: Sequence[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() for c in host) or "/" in host:
                raise ConfigError(f"invalid proxy host name {host!r}") from None
            entries.append(x509.DNSName(host))
    return entries


def issue_node_certificate(
    ca: CertificateAuthority,
    identity: NodeIdentity,
    hosts: Sequence[str] | None = None,
    valid_days: int = DEFAULT_NODE_VALID_DAYS,
) -> NodeCertificate:
    """A fresh key for one node and its certificate (see :func:`certify_public_key`)."""
    key = generate_private_key()
    return NodeCertificate(
        identity, key, certify_public_key(ca, identity, key.public_key(), hosts, valid_days)
    )


def certify_public_key(
    ca: CertificateAuthority,
    identity: NodeIdentity,
    public_key: ec.EllipticCurvePublicKey,
    hosts: Sequence[str] | None = None,
    valid_days: int = DEFAULT_NODE_VALID_DAYS,
) -> x509.Certificate:
    """The CA's certificate binding ``public_key`` to ``identity``.

    ``hosts``: proxy only, the DNS names / IP addresses clients dial (default
    :data:`DEFAULT_PROXY_HOSTS`); none for owners and analysts.

    Raises
    ------
    ConfigError
        Hosts given for a non-proxy role, an invalid host, or bad validity.
    """
    if identity.role is Role.PROXY:
        hosts = DEFAULT_PROXY_HOSTS if hosts is None else tuple(hosts)
        if not hosts:
            raise ConfigError("a proxy certificate needs at least one DNS name or IP address")
        usage = ExtendedKeyUsageOID.SERVER_AUTH
    else:
        if hosts:
            raise ConfigError(f"only the proxy certificate carries host names, not {identity}")
        hosts = ()
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    not_before, not_after = _validity(valid_days)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpca"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id),
        ]
    )
    ca_key_id = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(_san_entries(identity, hosts)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id.value),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )


# --------------------------------------------------------------- identities


def load_certificate(data: bytes | str) -> x509.Certificate:
    """Parse a certificate given as PEM or DER.

    Raises
    ------
    AuthenticationError
        If the data is not a certificate (it usually comes from a peer).
    """
    raw = data.encode("ascii") if isinstance(data, str) else bytes(data)
    try:
        if raw.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(raw)
        return x509.load_der_x509_certificate(raw)
    except ValueError as exc:
        raise AuthenticationError(f"peer certificate cannot be parsed: {exc}") from exc


def identity_from_certificate(certificate: x509.Certificate | bytes | str) -> NodeIdentity:
    """Read the (role, node id) a certificate grants from its ``fedpca://`` SAN URI.

    Only meaningful for a certificate whose chain has been verified against the
    fedpca CA (gRPC does that before a servicer runs when client auth is required).

    Raises
    ------
    AuthenticationError
        No SAN, no or several ``fedpca://`` URIs, or a malformed role / node id.
    """
    cert = (
        certificate if isinstance(certificate, x509.Certificate) else load_certificate(certificate)
    )
    subject = cert.subject.rfc4514_string()
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise AuthenticationError(
            f"certificate {subject!r} has no subjectAltName, so no fedpca identity"
        ) from None
    uris = [
        uri
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.lower().startswith(f"{URI_SCHEME}://")
    ]
    if len(uris) != 1:
        raise AuthenticationError(
            f"certificate {subject!r} must carry exactly one {URI_SCHEME}:// URI, found {len(uris)}"
        )
    try:
        parts = urlsplit(uris[0])
        if parts.query or parts.fragment or parts.port is not None or parts.username:
            raise ValueError("no port, user, query or fragment allowed")
        if not parts.path.startswith("/"):
            raise ValueError("missing node id")
        return NodeIdentity(Role(parts.hostname or ""), parts.path[1:])
    except ValueError as exc:
        raise AuthenticationError(
            f"identity URI {uris[0]!r} in {subject!r} is not fedpca://<role>/<node-id>: {exc}"
        ) from exc


def identity_from_context(context: Any) -> NodeIdentity:
    """The verified identity of the peer of a gRPC call.

    Parameters
    ----------
    context : grpc.ServicerContext
        The servicer context of the current call.

    Raises
    ------
    AuthenticationError
        If the peer presented no certificate (insecure port) or an unusable one.
    """
    # The server requires and verifies client certificates, so a call that
    # reaches a servicer over TLS always has a CA-verified peer certificate here.
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert") or []
    if not pems:
        raise AuthenticationError(
            "peer presented no client certificate (insecure connection?); identity unknown"
        )
    return _peer_facts(pems[0])[0]


# A peer presents the same certificate on every call; parsing it (and its extensions)
# was about a fifth of the proxy's busy samples for calls it refuses at once. Certificates are
# immutable and their identity a function of their bytes, so what the proxy reads from one
# (identity, serial) is kept per PEM, not the parsed certificate: about 5.9 KiB less per
# connected owner (failures are not cached: they raise).
@functools.lru_cache(maxsize=4096)
def _peer_facts(pem: bytes) -> tuple[NodeIdentity, int]:
    certificate = load_certificate(pem)
    return identity_from_certificate(certificate), certificate.serial_number


def require_role(
    context: Any, *roles: Role, revoked_serials: frozenset[int] = frozenset()
) -> NodeIdentity:
    """The peer's identity, if its certificate grants one of ``roles`` and is not revoked.

    Raises
    ------
    AuthenticationError
        No usable certificate, a revoked one, or a role not in ``roles``.
    """
    if revoked_serials and (pems := context.auth_context().get("x509_pem_cert")):
        peer, serial = _peer_facts(pems[0])  # named in the proxy's log (found by review)
        if serial in revoked_serials:
            raise AuthenticationError(f"the certificate of {peer} (serial {serial:x}) is revoked")
    identity = identity_from_context(context)
    if identity.role not in roles:
        allowed = ", ".join(str(role) for role in roles)
        raise AuthenticationError(f"{identity} may not call this method (requires {allowed})")
    return identity


# ------------------------------------------------------------------- files


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically; the file never exists with looser permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda handle: handle.write(data), mode)


def write_private_key(path: Path, key: PrivateKey) -> None:
    """Write an unencrypted PKCS#8 PEM private key with mode 0600."""
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_atomic(path, data, 0o600)


def write_certificate(path: Path, certificate: x509.Certificate) -> None:
    """Write a PEM certificate (public, mode 0644)."""
    _write_atomic(path, certificate.public_bytes(serialization.Encoding.PEM), 0o644)


def read_private_key(path: Path) -> PrivateKey:
    """Read an EC private key written by :func:`write_private_key`.

    Raises
    ------
    KeyFileError
        Unreadable, not a PEM private key, or not an EC key.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"cannot read private key {path}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KeyFileError(f"{path} is not an EC private key")
    return key


def read_certificate(path: Path) -> x509.Certificate:
    """Read a PEM or DER certificate file (ConfigError if unreadable)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read certificate {path}: {exc}") from exc
    try:
        return load_certificate(data)
    except AuthenticationError:
        # The parser's own message (an ASN.1 tag dump) tells a user nothing.
        raise ConfigError(
            f"{path} is not a certificate (neither PEM nor DER X.509; fedpca writes them "
            "as cert.pem)"
        ) from None


@dataclass(frozen=True)
class TlsFiles:
    """Paths of one node's TLS material."""

    ca_certificate: Path
    certificate: Path
    private_key: Path


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of one node's TLS material, checked for consistency.

    Build it with :meth:`load`; :mod:`fedpca.transport.channels` turns it into
    gRPC credentials.
    """

    root_certificates: bytes
    certificate_chain: bytes
    private_key: bytes
    identity: NodeIdentity

    def __repr__(self) -> str:
        # Never print key material, even in a traceback.
        return f"TlsMaterial(identity={self.identity})"

    def expiry_problem(self, now: dt.datetime | None = None) -> str | None:
        """What of this material is not valid at ``now`` (default: now), or None: asked
        by a node that cannot connect (review: one whose certificate expired while it
        ran retried for ever, its log saying TLS was fine as far as checked)."""
        now = dt.datetime.now(dt.UTC) if now is None else now
        pems = {"this node's": self.certificate_chain, "the CA": self.root_certificates}
        for what, pem in pems.items():
            if problem := _outside_validity(load_certificate(pem), now):
                return f"{what} certificate {problem}, and restart with it"
        return None

    @classmethod
    def load(cls, files: TlsFiles) -> TlsMaterial:
        """Read and cross-check a node's CA certificate, certificate and key.

        Raises
        ------
        ConfigError
            If the certificate was not issued by the CA, does not match the key,
            carries no fedpca identity, or it or the CA's is not valid now (expired,
            or not yet valid by this machine's clock).
        KeyFileError
            If the key file is unreadable.
        """
        ca = read_certificate(files.ca_certificate)
        cert = read_certificate(files.certificate)
        now = dt.datetime.now(dt.UTC)
        for path, certificate in ((files.ca_certificate, ca), (files.certificate, cert)):
            # A node started with it retried for ever behind a message about the
            # network or the CA (found by review).
            if problem := _outside_validity(certificate, now):
                raise ConfigError(f"certificate {path} {problem}")
        key = read_private_key(files.private_key)
        exposure = private_key_exposure(files.private_key)
        if exposure is not None:
            logger.warning("%s", exposure)
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise ConfigError(
                f"certificate {files.certificate} was not issued by CA {files.ca_certificate}"
            ) from exc
        if cert.public_key() != key.public_key():
            raise ConfigError(
                f"private key {files.private_key} does not match certificate {files.certificate}"
            )
        try:
            identity = identity_from_certificate(cert)
        except AuthenticationError as exc:
            raise ConfigError(f"{files.certificate}: {exc}") from exc
        return cls(
            root_certificates=ca.public_bytes(serialization.Encoding.PEM),
            certificate_chain=cert.public_bytes(serialization.Encoding.PEM),
            private_key=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            identity=identity,
        )


def _outside_validity(certificate: x509.Certificate, now: dt.datetime) -> str | None:
    """Why ``certificate`` is not valid at ``now`` (every peer refuses it then), or None."""
    if now > certificate.not_valid_after_utc:
        return (
            f"expired on {certificate.not_valid_after_utc:%Y-%m-%d}: issue a new one "
            '(`fedpca certs issue … --force`, docs/operations.md "Revoking a certificate")'
        )
    if now + _CLOCK_SKEW < certificate.not_valid_before_utc:
        starts = certificate.not_valid_before_utc
        return f"is valid only from {starts:%Y-%m-%d %H:%M} UTC: check this machine's clock"
    return None


def private_key_exposure(path: Path) -> str | None:
    """What is wrong with a private key file every user of the host may read, or None.

    Group-readable is left alone: Kubernetes mounts Secrets 0440 for the pod's group.
    """
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # reading it failed or will fail with its own message
    if not mode & stat.S_IROTH:
        return None
    return (
        f"{path} is readable by every user of this host (mode {stat.S_IMODE(mode):04o}): "
        f"chmod 600 {path}"
    )


# -------------------------------------------------------------- directory


@dataclass(frozen=True)
class CertificateDirectory:
    """Layout of a directory created by ``fedpca certs init``::

    <root>/ca/ca.pem             CA certificate (give to every node)
    <root>/ca/ca-key.pem         CA private key (0600; keep offline)
    <root>/<role>/<id>/cert.pem  node certificate
    <root>/<role>/<id>/key.pem   node private key (0600)
    """

    root: Path

    @property
    def ca_certificate(self) -> Path:
        return self.root / "ca" / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca-key.pem"

    def node_files(self, identity: NodeIdentity) -> TlsFiles:
        """Where the TLS files of ``identity`` live."""
        node_dir = self.root / identity.role.value / identity.node_id
        return TlsFiles(self.ca_certificate, node_dir / "cert.pem", node_dir / "key.pem")

    def load_ca(self) -> CertificateAuthority:
        """Read the CA key and certificate back."""
        ca = CertificateAuthority(
            read_private_key(self.ca_key), read_certificate(self.ca_certificate)
        )
        if ca.certificate.public_key() != ca.key.public_key():
            raise ConfigError(f"{self.ca_key} does not match {self.ca_certificate}")
        return ca

    def write_node(self, node: NodeCertificate) -> TlsFiles:
        """Write a node's certificate and key; return their paths."""
        files = self.node_files(node.identity)
        write_certificate(files.certificate, node.certificate)
        write_private_key(files.private_key, node.key)
        return files


def init_certificates(
    out: Path,
    owner_ids: Sequence[str],
    analyst_ids: Sequence[str],
    proxy_id: str = "proxy",
    proxy_hosts: Sequence[str] = DEFAULT_PROXY_HOSTS,
    valid_days: int = DEFAULT_NODE_VALID_DAYS,
    force: bool = False,
) -> dict[NodeIdentity, TlsFiles]:
    """Create a CA and certificates for the proxy, owners and analysts under ``out``.

    Returns
    -------
    dict
        Identity -> TLS file paths, proxy first, then owners, then analysts.

    Raises
    ------
    ConfigError
        A CA already exists under ``out`` (and not ``force``), or ids repeat / are invalid.
        Whatever fails once writing began (a proxy host name that is refused, say) undoes
        what this call wrote and puts back the files it replaced.
    """
    layout = CertificateDirectory(Path(out))
    if layout.ca_key.exists() and not force:
        raise ConfigError(
            f"{layout.ca_key} already exists; refusing to replace the CA (use --force)"
        )
    identities = [NodeIdentity(Role.PROXY, proxy_id)]
    identities += [NodeIdentity(Role.OWNER, node_id) for node_id in owner_ids]
    identities += [NodeIdentity(Role.ANALYST, node_id) for node_id in analyst_ids]
    seen: set[NodeIdentity] = set()
    for identity in identities:
        if identity in seen:
            raise ConfigError(f"node {identity} listed twice")
        seen.add(identity)
    replaced = [layout.ca_key, layout.ca_certificate]
    for identity in identities:
        files = layout.node_files(identity)
        replaced += [files.certificate, files.private_key]
    with undone_on_failure([layout.root], replaced):
        ca = create_ca()
        write_private_key(layout.ca_key, ca.key)
        write_certificate(layout.ca_certificate, ca.certificate)
        os.chmod(layout.ca_key.parent, 0o700)
        written: dict[NodeIdentity, TlsFiles] = {}
        for identity in identities:
            hosts = proxy_hosts if identity.role is Role.PROXY else None
            node = issue_node_certificate(ca, identity, hosts=hosts, valid_days=valid_days)
            written[identity] = layout.write_node(node)
            logger.info("issued certificate for %s", identity)
    return written
