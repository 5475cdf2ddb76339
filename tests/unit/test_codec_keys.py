"""Key helpers: generation guard, fingerprints, JSON key files (TEST-ONLY 512-bit keys)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from fedpca.codec import (
    generate_keypair,
    key_fingerprint,
    load_private_key,
    load_public_key,
    save_private_key,
    save_public_key,
)
from fedpca.errors import KeyFileError

Keypair = tuple[Any, Any]


def test_short_keys_need_the_explicit_test_flag() -> None:
    with pytest.raises(ValueError, match="allow_insecure_test_key"):
        generate_keypair(1024)
    public_key, private_key = generate_keypair(256, allow_insecure_test_key=True)
    assert public_key.n.bit_length() == 256
    assert private_key.p * private_key.q == public_key.n


def test_fingerprint_is_sha256_of_big_endian_n(test_only_keypair_512: Keypair) -> None:
    public_key, _ = test_only_keypair_512
    expected = hashlib.sha256(public_key.n.to_bytes(64, "big")).hexdigest()
    assert key_fingerprint(public_key) == f"sha256:{expected}"


def test_key_files_round_trip(tmp_path: Path, test_only_keypair_512: Keypair) -> None:
    public_key, private_key = test_only_keypair_512
    public_path = tmp_path / "analyst.pub.json"
    private_path = tmp_path / "analyst.key.json"
    save_public_key(public_path, public_key)
    save_private_key(private_path, private_key)
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert load_public_key(public_path, allow_insecure_test_key=True) == public_key
    loaded = load_private_key(private_path, allow_insecure_test_key=True)
    assert loaded == private_key
    assert loaded.public_key == public_key
    assert json.loads(public_path.read_text())["fingerprint"] == key_fingerprint(public_key)
    assert "p" not in json.loads(public_path.read_text())
    # The atomic writes leave no temporary files behind.
    assert set(tmp_path.iterdir()) == {public_path, private_path}


def test_overwriting_a_private_key_resets_permissions(
    tmp_path: Path, test_only_keypair_512: Keypair
) -> None:
    _, private_key = test_only_keypair_512
    path = tmp_path / "key.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    save_private_key(path, private_key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_short_keys_in_files_need_the_test_flag(
    tmp_path: Path, test_only_keypair_512: Keypair
) -> None:
    public_key, private_key = test_only_keypair_512
    save_public_key(tmp_path / "pub.json", public_key)
    save_private_key(tmp_path / "key.json", private_key)
    with pytest.raises(KeyFileError, match=r"pub\.json.*insecure"):
        load_public_key(tmp_path / "pub.json")
    with pytest.raises(KeyFileError, match=r"key\.json.*insecure"):
        load_private_key(tmp_path / "key.json")


def _private_document(private_key: Any) -> dict[str, Any]:
    n = private_key.public_key.n
    return {
        "format": "fedpca-paillier-private-key",
        "version": 1,
        "key_bits": n.bit_length(),
        "n": format(n, "x"),
        "fingerprint": key_fingerprint(private_key.public_key),
        "p": format(private_key.p, "x"),
        "q": format(private_key.q, "x"),
    }


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: [1, 2], "JSON object"),
        (lambda d: {**d, "format": "fedpca-paillier-public-key"}, "format"),
        (lambda d: {**d, "version": 2}, "version"),
        (lambda d: {k: v for k, v in d.items() if k != "n"}, "'n'"),
        (lambda d: {**d, "p": "xyz"}, "not hexadecimal"),
        (lambda d: {**d, "q": 12}, "hex string"),
        (lambda d: {**d, "q": format(int(d["q"], 16) + 2, "x")}, r"p \* q does not equal n"),
        (lambda d: {**d, "key_bits": 2048}, "key_bits"),
        (lambda d: {**d, "fingerprint": "sha256:00"}, "fingerprint"),
    ],
)
def test_malformed_private_key_files_name_the_file(
    tmp_path: Path, test_only_keypair_512: Keypair, mutation: Any, message: str
) -> None:
    _, private_key = test_only_keypair_512
    document = mutation(_private_document(private_key))
    path = tmp_path / "broken.key.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match=message) as info:
        load_private_key(path, allow_insecure_test_key=True)
    assert str(path) in str(info.value)


def test_equal_primes_are_refused(tmp_path: Path) -> None:
    p = 2**127 - 1  # a Mersenne prime; n = p^2 is no Paillier modulus
    n = p * p
    from phe.paillier import PaillierPublicKey

    document = {
        "format": "fedpca-paillier-private-key",
        "version": 1,
        "key_bits": n.bit_length(),
        "n": format(n, "x"),
        "fingerprint": key_fingerprint(PaillierPublicKey(n)),
        "p": format(p, "x"),
        "q": format(p, "x"),
    }
    path = tmp_path / "square.json"
    path.write_text(json.dumps(document))
    with pytest.raises(KeyFileError, match="must differ"):
        load_private_key(path, allow_insecure_test_key=True)


def test_public_key_file_must_not_be_a_private_one(
    tmp_path: Path, test_only_keypair_512: Keypair
) -> None:
    _, private_key = test_only_keypair_512
    save_private_key(tmp_path / "key.json", private_key)
    with pytest.raises(KeyFileError, match="format"):
        load_public_key(tmp_path / "key.json", allow_insecure_test_key=True)


def test_readable_private_key_file_is_warned_about(
    tmp_path: Path, test_only_keypair_512: Keypair, caplog: pytest.LogCaptureFixture
) -> None:
    _, private_key = test_only_keypair_512
    path = tmp_path / "key.json"
    save_private_key(path, private_key)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="fedpca.codec.keys"):
        load_private_key(path, allow_insecure_test_key=True)
    assert "group or others" in caplog.text
    # A public key file given as the private key (readable by all, as it may be) is
    # refused as such, without the warning about an exposed private key (review).
    caplog.clear()
    public = tmp_path / "key.pub.json"
    save_public_key(public, private_key.public_key)
    os.chmod(public, 0o644)
    with (
        caplog.at_level(logging.WARNING, logger="fedpca.codec.keys"),
        pytest.raises(KeyFileError, match="format"),
    ):
        load_private_key(public, allow_insecure_test_key=True)
    assert "group or others" not in caplog.text


def test_missing_key_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_public_key(tmp_path / "absent.json")
