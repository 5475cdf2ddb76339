"""Certificate signing requests: a node's private key never leaves its host.

The node's operator runs ``fedpca certs request`` (a new key, kept there, and a CSR
naming the node), sends the CSR to the CA's operator, who runs ``fedpca certs sign``
and sends back the certificate. The CA decides what a certificate says: the role, the
id and a proxy's host names come from the CA operator's command line. A CSR only
contributes its public key; its subject must name the same role and id (so a request
sent under one name is not certified under another typed by mistake), and any
extension it asks for (a CA flag, host names, key usages) is ignored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import NameOID

from fedpca.errors import ConfigError
from fedpca.files import write_atomically
from fedpca.transport.certs import (
    DEFAULT_NODE_VALID_DAYS,
    CertificateAuthority,
    NodeIdentity,
    PrivateKey,
    Role,
    certify_public_key,
)

_MAX_REQUEST_BYTES = 64 * 1024


def create_request(identity: NodeIdentity, key: PrivateKey) -> x509.CertificateSigningRequest:
    """A CSR naming ``identity`` (O=fedpca, OU=role, CN=id), signed by ``key``."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpca"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id),
        ]
    )
    return x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())


def write_request(path: Path, request: x509.CertificateSigningRequest) -> None:
    """Write a PEM CSR (public, mode 0644)."""
    data = request.public_bytes(serialization.Encoding.PEM)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda handle: handle.write(data), 0o644)


def read_request(path: Path) -> x509.CertificateSigningRequest:
    """Read a PEM or DER CSR whose signature is its own key's.

    Raises
    ------
    ConfigError
        Unreadable, too large, not a CSR, a signature that does not verify (altered
        on its way), or a key other than EC P-256 (what ``certs request`` makes).
    """
    try:
        with Path(path).open("rb") as handle:
            data = handle.read(_MAX_REQUEST_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read certificate request {path}: {exc}") from exc
    if len(data) > _MAX_REQUEST_BYTES:
        raise ConfigError(f"{path} is larger than any certificate request (64 KiB)")
    request = None
    for load in (x509.load_pem_x509_csr, x509.load_der_x509_csr):
        try:
            request = load(data)
            break
        except ValueError:
            continue
    if request is None:
        raise ConfigError(
            f"{path} is not a certificate request (neither PEM nor DER; "
            "`fedpca certs request` writes one as <role>-<id>.csr.pem)"
        )
    try:
        signed = request.is_signature_valid
    except UnsupportedAlgorithm as exc:
        raise ConfigError(f"{path}: its signature cannot be checked ({exc})") from None
    if not signed:
        raise ConfigError(
            f"{path}: its signature does not match its key (altered after it was made?)"
        )
    key = request.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ConfigError(
            f"{path}: fedpca certifies EC P-256 keys only (`fedpca certs request` makes one)"
        )
    return request


def requested_identity(request: x509.CertificateSigningRequest) -> NodeIdentity:
    """The role and id a CSR's subject names (ConfigError if it names none)."""

    def attribute(oid: x509.ObjectIdentifier, what: str) -> str:
        values = request.subject.get_attributes_for_oid(oid)
        if len(values) != 1:
            raise ConfigError(f"the request names no single {what} ({request.subject})")
        return str(values[0].value)

    role = attribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "role (OU)")
    if role not in {r.value for r in Role}:
        raise ConfigError(f"the request names role {role!r}, not owner, proxy or analyst")
    return NodeIdentity(Role(role), attribute(NameOID.COMMON_NAME, "node id (CN)"))


def public_key_fingerprint(key: CertificatePublicKeyTypes) -> str:
    """``sha256:<hex>`` of the key's SubjectPublicKeyInfo: what the node's operator and
    the CA's compare out of band before a CSR is signed."""
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


def certify_request(
    ca: CertificateAuthority,
    request: x509.CertificateSigningRequest,
    identity: NodeIdentity,
    hosts: Sequence[str] | None = None,
    valid_days: int = DEFAULT_NODE_VALID_DAYS,
) -> x509.Certificate:
    """The certificate for ``request``'s key as ``identity`` (the CA operator's words).

    Raises
    ------
    ConfigError
        The request names another role or id, or ``hosts`` / ``valid_days`` are
        invalid (see :func:`fedpca.transport.certs.certify_public_key`).
    """
    named = requested_identity(request)
    if named != identity:
        raise ConfigError(
            f"the request is for {named}, not {identity}: sign it as what it names, or ask "
            "for a new request"
        )
    key = request.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):  # read_request admits no other
        raise ConfigError(f"the request's key is not an EC key ({type(key).__name__})")
    return certify_public_key(ca, identity, key, hosts, valid_days)
