"""Query signatures: the analyst signs every query, owners answer only signed ones.

Without them a malicious proxy could invent tasks (any spec under a pinned analyst key)
and collect owners' shares for queries the analyst never asked for. The analyst holds an
Ed25519 signing key next to its Paillier key (``fedpca analyst keygen`` creates both) and
signs the digest of every query it submits (:func:`fedpca.query.spec_digest`, which
covers every public parameter, the Paillier key and the query id included). Owners pin
the signing key's public half (``policy.accepted_query_signers``, written
``ed25519:<64 hex digits>``) next to the Paillier fingerprint, and verify the signature
the proxy forwards with each task.

Ed25519 from ``cryptography``: deterministic signatures, 32-byte public keys, no
parameters to get wrong.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from fedpca.errors import ConfigError, KeyFileError, PolicyError, UntrustedKeyError
from fedpca.query import QuerySpec, spec_digest

__all__ = [
    "CLOCK_ALLOWANCE_SECONDS",
    "SIGNER_PREFIX",
    "Ed25519PrivateKey",
    "generate_signing_key",
    "load_signing_key",
    "parse_signer",
    "save_signing_key",
    "sign_query",
    "signed_deadline",
    "signer_id",
    "verify_query",
]

SIGNER_PREFIX = "ed25519:"
_SIGNER_RE = re.compile(r"ed25519:[0-9a-f]{64}")
_CONTEXT = b"fedpca query signature v1\n"
"""Domain separation: a query signature can never be mistaken for another message's."""


def generate_signing_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 signing key (from the operating system's CSPRNG)."""
    return Ed25519PrivateKey.generate()


def signer_id(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """``ed25519:<64 hex digits>``: the public key as owners pin it."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SIGNER_PREFIX + raw.hex()


def parse_signer(text: str) -> Ed25519PublicKey:
    """The public key of an ``ed25519:<hex>`` signer id.

    Raises
    ------
    ConfigError
        If ``text`` is not a signer id.
    """
    if not _SIGNER_RE.fullmatch(text):
        raise ConfigError(
            f"{text!r} is not a query-signing key (expected 'ed25519:' and 64 lowercase hex "
            "digits, as printed by `fedpca analyst keygen`)"
        )
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text[len(SIGNER_PREFIX) :]))


def _message(spec: QuerySpec) -> bytes:
    return _CONTEXT + spec_digest(spec).encode("ascii")


def sign_query(spec: QuerySpec, key: Ed25519PrivateKey) -> bytes:
    """The signature of ``spec`` (64 bytes)."""
    return key.sign(_message(spec))


def verify_query(spec: QuerySpec, signature: bytes, signer: str) -> None:
    """Check that ``signer`` signed exactly ``spec``.

    Raises
    ------
    UntrustedKeyError
        If the signature is missing or does not verify.
    ConfigError
        If ``signer`` is not a signer id.
    """
    if not signature:
        raise UntrustedKeyError(f"query {spec.query_id!r} is not signed by its analyst")
    try:
        parse_signer(signer).verify(signature, _message(spec))
    except InvalidSignature:
        raise UntrustedKeyError(
            f"query {spec.query_id!r}: the signature does not verify under {signer}"
        ) from None


CLOCK_ALLOWANCE_SECONDS = 300.0
"""How far an analyst's clock may be from an owner's (or the proxy's) when the signing
time of a query is checked (NTP keeps clocks within a second; five minutes forgives a
machine without it)."""


def signed_deadline(spec: QuerySpec, now: float) -> float:
    """The last time (UNIX seconds) a signed query may be answered: ``issued_at +
    deadline_seconds`` plus :data:`CLOCK_ALLOWANCE_SECONDS`. Owners answer only until
    then (a proxy could otherwise keep signed queries and deliver them later); the
    proxy refuses at submission a query already past it.

    Raises
    ------
    PolicyError
        The query carries no signing time, or was signed in the future of ``now`` by
        more than the allowance.
    """
    if spec.issued_at is None:
        raise PolicyError(
            f"query {spec.query_id!r} carries no signing time (an analyst build before wire "
            "protocol 5): owners answer only queries signed with one"
        )
    if spec.issued_at > now + CLOCK_ALLOWANCE_SECONDS:
        raise PolicyError(
            f"query {spec.query_id!r} was signed at {_utc(spec.issued_at)}, in the future "
            f"of this node's clock ({_utc(now)}): check the analyst's clock"
        )
    return spec.issued_at + spec.deadline_seconds + CLOCK_ALLOWANCE_SECONDS


def _utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def save_signing_key(key: Ed25519PrivateKey, path: str | os.PathLike[str]) -> Path:
    """Write the private key as PKCS#8 PEM, created with mode 0600."""
    target = Path(path)
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    return target


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read a signing key written by :func:`save_signing_key`.

    Raises
    ------
    KeyFileError
        If the file is missing or not an Ed25519 private key.
    """
    source = Path(path)
    try:
        key = serialization.load_pem_private_key(source.read_bytes(), password=None)
    except FileNotFoundError:
        raise KeyFileError(
            f"{source}: no query-signing key (create one with `fedpca analyst keygen`)"
        ) from None
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{source}: not a readable query-signing key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{source}: not an Ed25519 private key")
    return key
