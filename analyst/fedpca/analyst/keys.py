"""The analyst's keys: one directory, three files.

``DIR/analyst.key.json`` holds the Paillier private key (mode 0600, never leaves the
analyst's machine); ``DIR/analyst.pub.json`` is the public key the analyst hands
to the owners so that they can pin its fingerprint.  Both are written with the
codec's key-file helpers, so the format is the one every role reads.
``DIR/analyst.signing.pem`` is the Ed25519 key the analyst signs every query with
(:mod:`fedpca.signing`); owners pin its public half, ``ed25519:<hex>``, next to the
Paillier fingerprint and answer only queries it signed.

Only 2048- and 3072-bit moduli are generated (112- and 128-bit security, NIST SP
800-57); shorter TEST-ONLY keys need ``allow_insecure_test_key=True`` from Python
and are never reachable from the command line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpca.codec.keys import (
    DEFAULT_KEY_BITS,
    generate_keypair,
    key_fingerprint,
    load_private_key,
    load_public_key,
    save_private_key,
    save_public_key,
)
from fedpca.errors import ConfigError, KeyFileError
from fedpca.signing import (
    Ed25519PrivateKey,
    generate_signing_key,
    load_signing_key,
    save_signing_key,
    signer_id,
)

__all__ = [
    "DEFAULT_KEY_BITS",
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_FILE",
    "SIGNING_KEY_FILE",
    "SUPPORTED_KEY_BITS",
    "AnalystKeyFiles",
    "create_analyst_keys",
    "load_analyst_private_key",
    "load_analyst_public_key",
    "load_analyst_signing_key",
    "refuse_to_overwrite",
]

logger = logging.getLogger(__name__)

PRIVATE_KEY_FILE = "analyst.key.json"
PUBLIC_KEY_FILE = "analyst.pub.json"
SIGNING_KEY_FILE = "analyst.signing.pem"
SUPPORTED_KEY_BITS: tuple[int, ...] = (2048, 3072)
"""Moduli the analyst may generate; the default is the codec's ``DEFAULT_KEY_BITS`` (3072)."""


@dataclass(frozen=True)
class AnalystKeyFiles:
    """Paths of an analyst key directory and the fingerprint of its key.

    Attributes
    ----------
    directory : the key directory.
    fingerprint : ``sha256:…`` of the public key (what owners pin), or "" if unknown.
    """

    directory: Path
    fingerprint: str = ""
    signer: str = ""
    """``ed25519:<hex>`` of the query-signing key (what owners pin), or "" if unknown."""

    @property
    def private_key(self) -> Path:
        return self.directory / PRIVATE_KEY_FILE

    @property
    def public_key(self) -> Path:
        return self.directory / PUBLIC_KEY_FILE

    @property
    def signing_key(self) -> Path:
        return self.directory / SIGNING_KEY_FILE


def refuse_to_overwrite(directory: str | os.PathLike[str], *, force: bool) -> AnalystKeyFiles:
    """The key files of ``directory``, after checking none exists unless ``force``
    (callers check before a minute of key generation, not after it).

    Raises
    ------
    ConfigError
        A key file exists and ``force`` is False.
    """
    files = AnalystKeyFiles(Path(directory))
    existing = [p for p in (files.private_key, files.public_key, files.signing_key) if p.exists()]
    if existing and not force:
        raise ConfigError(
            f"{existing[0]} already exists; refusing to overwrite an analyst key "
            "(results under it would become unreadable). Use --force to replace it."
        )
    return files


def create_analyst_keys(
    directory: str | os.PathLike[str],
    key_bits: int = DEFAULT_KEY_BITS,
    *,
    force: bool = False,
    allow_insecure_test_key: bool = False,
) -> AnalystKeyFiles:
    """Generate a keypair and write it to ``directory``.

    Parameters
    ----------
    directory : created (mode 0700) if missing.
    key_bits : 2048 or 3072 (any size with ``allow_insecure_test_key``, tests only).
    force : replace an existing key.  Without it an existing key file is an error,
        because overwriting it makes every result encrypted under the old key
        unreadable and every owner's pin stale.
    allow_insecure_test_key : permit short TEST-ONLY keys.

    Returns
    -------
    AnalystKeyFiles with the new key's fingerprint.

    Raises
    ------
    ConfigError
        Unsupported key size, or a key exists and ``force`` is False.
    """
    if key_bits not in SUPPORTED_KEY_BITS and not allow_insecure_test_key:
        raise ConfigError(
            f"analyst keys must have {' or '.join(map(str, SUPPORTED_KEY_BITS))} bits, "
            f"got {key_bits}"
        )
    files = refuse_to_overwrite(directory, force=force)
    files.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_key, private_key = generate_keypair(
        key_bits, allow_insecure_test_key=allow_insecure_test_key
    )
    # Private first: a crash in between leaves a usable private key (the public
    # half can be re-derived), never a public key without its private half.
    save_private_key(files.private_key, private_key)
    save_public_key(files.public_key, public_key)
    signing_key = generate_signing_key()
    files.signing_key.unlink(missing_ok=True)  # only reached with force
    save_signing_key(signing_key, files.signing_key)
    fingerprint = key_fingerprint(public_key)
    logger.info("wrote %d-bit analyst key %s to %s", key_bits, fingerprint, files.directory)
    return AnalystKeyFiles(files.directory, fingerprint, signer_id(signing_key))


def _key_path(location: str | os.PathLike[str], file_name: str) -> Path:
    path = Path(location)
    return path / file_name if path.is_dir() else path


def load_analyst_private_key(
    location: str | os.PathLike[str], *, allow_insecure_test_key: bool = False
) -> Any:
    """Read the private key from a key directory or a key file.

    Returns
    -------
    phe.paillier.PaillierPrivateKey

    Raises
    ------
    KeyFileError
        Missing or malformed file, or a key shorter than 2048 bits without
        ``allow_insecure_test_key``.
    """
    path = _key_path(location, PRIVATE_KEY_FILE)
    if not path.is_file():
        raise KeyFileError(
            f"no analyst private key at {path}; create one with `fedpca analyst keygen --out DIR`"
        )
    return load_private_key(path, allow_insecure_test_key=allow_insecure_test_key)


def load_analyst_public_key(
    location: str | os.PathLike[str], *, allow_insecure_test_key: bool = False
) -> Any:
    """Read the public key from a key directory or a key file (phe PaillierPublicKey)."""
    path = _key_path(location, PUBLIC_KEY_FILE)
    if not path.is_file():
        raise KeyFileError(f"no analyst public key at {path}")
    return load_public_key(path, allow_insecure_test_key=allow_insecure_test_key)


def load_analyst_signing_key(location: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The query-signing key of a key directory, or the one next to a Paillier key file.

    Raises
    ------
    KeyFileError
        Missing or malformed file.
    """
    path = Path(location)
    if path.is_dir():
        path = path / SIGNING_KEY_FILE
    elif path.suffix != ".pem":
        path = path.with_name(SIGNING_KEY_FILE)
    return load_signing_key(path)
