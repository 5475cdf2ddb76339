"""Paillier key helpers: generation, fingerprints and JSON key files.

Key files are small JSON documents with the integers as lowercase hex strings
(portable to languages without arbitrary-precision JSON numbers)::

    {"format": "fedpca-paillier-public-key", "version": 1, "key_bits": 2048,
     "n": "c0ffee...", "fingerprint": "sha256:..."}

A private key file additionally holds ``p`` and ``q`` and is written with mode 0600.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import gmpy2
from phe import paillier

from ..errors import KeyFileError
from ..files import write_atomically

logger = logging.getLogger(__name__)

MIN_KEY_BITS = 2048
"""Smallest modulus accepted without ``allow_insecure_test_key`` (112-bit security)."""

DEFAULT_KEY_BITS = 3072
"""Default modulus size: 128-bit security, NIST's recommendation for use beyond 2030."""

_PUBLIC_FORMAT = "fedpca-paillier-public-key"
_PRIVATE_FORMAT = "fedpca-paillier-private-key"
_VERSION = 1


def _check_key_bits(key_bits: int, allow_insecure_test_key: bool) -> None:
    if key_bits < MIN_KEY_BITS and not allow_insecure_test_key:
        raise ValueError(
            f"{key_bits}-bit Paillier keys are insecure (minimum {MIN_KEY_BITS}); pass "
            "allow_insecure_test_key=True only in tests"
        )


def generate_keypair(
    key_bits: int = DEFAULT_KEY_BITS, *, allow_insecure_test_key: bool = False
) -> tuple[paillier.PaillierPublicKey, paillier.PaillierPrivateKey]:
    """Generate a Paillier keypair whose modulus has exactly ``key_bits`` bits.

    Parameters
    ----------
    key_bits : int
        Modulus length; at least ``MIN_KEY_BITS`` unless ``allow_insecure_test_key``.
    allow_insecure_test_key : bool
        Permit short keys, for tests only.

    Returns
    -------
    (phe.paillier.PaillierPublicKey, phe.paillier.PaillierPrivateKey)
    """
    _check_key_bits(key_bits, allow_insecure_test_key)
    public_key, private_key = paillier.generate_paillier_keypair(n_length=key_bits)
    if public_key.n.bit_length() != key_bits:  # phe guarantees it; the packing proof needs it
        raise RuntimeError(f"generated modulus has {public_key.n.bit_length()} bits")
    return public_key, private_key


def key_fingerprint(public_key: paillier.PaillierPublicKey) -> str:
    """``"sha256:" + hex(SHA-256 of n as ceil(bits/8) big-endian bytes)``."""
    n: int = public_key.n
    digest = hashlib.sha256(n.to_bytes((n.bit_length() + 7) // 8, "big")).hexdigest()
    return f"sha256:{digest}"


def _public_document(public_key: paillier.PaillierPublicKey) -> dict[str, Any]:
    return {
        "format": _PUBLIC_FORMAT,
        "version": _VERSION,
        "key_bits": public_key.n.bit_length(),
        "n": format(public_key.n, "x"),
        "fingerprint": key_fingerprint(public_key),
    }


def _write_atomically(path: Path, text: str, mode: int) -> None:
    """Write ``text`` via :func:`fedpca.files.write_atomically`: the private key never
    exists on disk with wider permissions, and a crash never leaves a half-written
    key file behind."""
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")), mode)


def save_public_key(path: str | os.PathLike[str], public_key: paillier.PaillierPublicKey) -> None:
    """Write a public key file (mode 0644)."""
    text = json.dumps(_public_document(public_key), indent=2) + "\n"
    _write_atomically(Path(path), text, 0o644)


def save_private_key(
    path: str | os.PathLike[str], private_key: paillier.PaillierPrivateKey
) -> None:
    """Write a private key file readable only by its owner (mode 0600)."""
    document = _public_document(private_key.public_key)
    document["format"] = _PRIVATE_FORMAT
    document["p"] = format(private_key.p, "x")
    document["q"] = format(private_key.q, "x")
    _write_atomically(Path(path), json.dumps(document, indent=2) + "\n", 0o600)


def _read_document(path: Path, expected_format: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")  # OSError (missing, unreadable) propagates
    except UnicodeDecodeError as error:
        raise KeyFileError(f"{path}: not a UTF-8 text file ({error.reason})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise KeyFileError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None
    except (ValueError, RecursionError) as error:
        # json raises these for an integer literal of more than 4300 digits and for
        # arrays/objects nested deeper than the interpreter's recursion limit.
        raise KeyFileError(f"{path}: not a usable JSON document ({error})") from None
    if not isinstance(document, dict):
        raise KeyFileError(f"{path}: expected a JSON object")
    if document.get("format") != expected_format:
        raise KeyFileError(
            f"{path}: format is {document.get('format')!r}, expected {expected_format!r}"
        )
    if document.get("version") != _VERSION:
        raise KeyFileError(f"{path}: unsupported version {document.get('version')!r}")
    return document


def _hex_field(path: Path, document: dict[str, Any], name: str) -> int:
    value = document.get(name)
    if not isinstance(value, str) or not value:
        raise KeyFileError(f"{path}: field {name!r} must be a non-empty hex string")
    try:
        number = int(value, 16)
    except ValueError:
        raise KeyFileError(f"{path}: field {name!r} is not hexadecimal") from None
    if number <= 1:
        raise KeyFileError(f"{path}: field {name!r} must be > 1")
    return number


def _public_key_from(
    path: Path, document: dict[str, Any], allow_insecure_test_key: bool
) -> paillier.PaillierPublicKey:
    n = _hex_field(path, document, "n")
    if n % 2 == 0:
        raise KeyFileError(f"{path}: n must be odd")
    if document.get("key_bits") != n.bit_length():
        raise KeyFileError(
            f"{path}: key_bits {document.get('key_bits')!r} does not match n "
            f"({n.bit_length()} bits)"
        )
    try:
        _check_key_bits(n.bit_length(), allow_insecure_test_key)
    except ValueError as error:
        raise KeyFileError(f"{path}: {error}") from None
    public_key = paillier.PaillierPublicKey(n)
    fingerprint = document.get("fingerprint")
    if fingerprint != key_fingerprint(public_key):
        raise KeyFileError(f"{path}: fingerprint {fingerprint!r} does not match n")
    return public_key


def load_public_key(
    path: str | os.PathLike[str], *, allow_insecure_test_key: bool = False
) -> paillier.PaillierPublicKey:
    """Read a public key file.

    Raises
    ------
    KeyFileError
        If the file is malformed, its fingerprint does not match n, or the key is
        shorter than ``MIN_KEY_BITS`` without ``allow_insecure_test_key``.
    """
    file = Path(path)
    return _public_key_from(file, _read_document(file, _PUBLIC_FORMAT), allow_insecure_test_key)


def load_private_key(
    path: str | os.PathLike[str], *, allow_insecure_test_key: bool = False
) -> paillier.PaillierPrivateKey:
    """Read a private key file (its ``public_key`` attribute is the public key).

    Raises
    ------
    KeyFileError
        If the file is malformed, p·q != n, p == q, p or q is not prime, or the checks of
        :func:`load_public_key` fail.
    """
    file = Path(path)
    document = _read_document(file, _PRIVATE_FORMAT)
    # Once it is known to be a private key (a public key file given instead was first
    # warned about as an exposed private key: review).
    if os.name == "posix" and file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("private key file %s is accessible by group or others", file)
    public_key = _public_key_from(file, document, allow_insecure_test_key)
    p = _hex_field(file, document, "p")
    q = _hex_field(file, document, "q")
    if p * q != public_key.n:
        raise KeyFileError(f"{file}: p * q does not equal n")
    if p == q:
        raise KeyFileError(f"{file}: p and q must differ")
    # With composite factors phe either fails deep inside (no modular inverse) or
    # builds a key whose CRT decryption is silently wrong.
    for name, factor in (("p", p), ("q", q)):
        if not gmpy2.is_prime(factor):
            raise KeyFileError(f"{file}: {name} is not a prime")
    return paillier.PaillierPrivateKey(public_key, p, q)
