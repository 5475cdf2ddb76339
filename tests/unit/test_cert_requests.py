"""Certificate requests: a node's key stays on its host, the CA decides what is certified."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpca.app.certs_cli import certs_group
from fedpca.app.cli import main
from fedpca.errors import ConfigError
from fedpca.transport import certs
from fedpca.transport.cert_requests import (
    certify_request,
    create_request,
    public_key_fingerprint,
    read_request,
    requested_identity,
    write_request,
)
from fedpca.transport.certs import NodeIdentity, Role

OWNER = NodeIdentity(Role.OWNER, "hospital-7")


@pytest.fixture(scope="module")
def ca() -> certs.CertificateAuthority:
    return certs.create_ca()


def _subject(role: str | None, node_id: str) -> x509.Name:
    names = [x509.NameAttribute(NameOID.COMMON_NAME, node_id)]
    if role is not None:
        names.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    return x509.Name(names)


def _saved(tmp_path: Path, request: x509.CertificateSigningRequest) -> Path:
    path = tmp_path / "request.pem"
    write_request(path, request)
    return path


def test_the_certificate_binds_the_requests_key_to_the_identity(
    ca: certs.CertificateAuthority, tmp_path: Path
) -> None:
    key = certs.generate_private_key()
    request = read_request(_saved(tmp_path, create_request(OWNER, key)))
    assert requested_identity(request) == OWNER
    certificate = certify_request(ca, request, OWNER, valid_days=30)
    certificate.verify_directly_issued_by(ca.certificate)
    assert certificate.public_key() == key.public_key()
    assert certs.identity_from_certificate(certificate) == OWNER
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
    assert 30 <= lifetime.days <= 31
    # The node's three files load as any node's do (key and certificate match).
    files = certs.TlsFiles(tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem")
    certs.write_certificate(files.ca_certificate, ca.certificate)
    certs.write_certificate(files.certificate, certificate)
    certs.write_private_key(files.private_key, key)
    assert certs.TlsMaterial.load(files).identity == OWNER


def test_what_a_request_asks_for_beyond_its_key_is_not_certified(
    ca: certs.CertificateAuthority,
) -> None:
    # A hostile requester asks to be a CA, the proxy, and a web server.
    key = certs.generate_private_key()
    greedy = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_subject("owner", "hospital-7"))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.UniformResourceIdentifier("fedpca://proxy/proxy"),
                    x509.DNSName("proxy.example.org"),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    certificate = certify_request(ca, greedy, OWNER)
    constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca is False
    assert not certificate.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "fedpca://owner/hospital-7"
    ]
    assert names.get_values_for_type(x509.DNSName) == []
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]


@pytest.mark.parametrize(
    ("signed_as", "why"),
    [
        (NodeIdentity(Role.OWNER, "hospital-8"), "is for owner/hospital-7, not owner/hospital-8"),
        (NodeIdentity(Role.ANALYST, "hospital-7"), "not analyst/hospital-7"),
        (NodeIdentity(Role.PROXY, "hospital-7"), "not proxy/hospital-7"),
    ],
)
def test_a_request_is_certified_only_as_what_it_names(
    ca: certs.CertificateAuthority, signed_as: NodeIdentity, why: str
) -> None:
    request = create_request(OWNER, certs.generate_private_key())
    with pytest.raises(ConfigError, match=why):
        certify_request(ca, request, signed_as)


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        (_subject(None, "hospital-7"), "names no single role"),
        (_subject("admin", "hospital-7"), "names role 'admin'"),
        (_subject("owner", "bad id!"), "node id 'bad id!'"),
    ],
)
def test_a_request_must_name_a_role_and_a_valid_id(
    ca: certs.CertificateAuthority, subject: x509.Name, why: str
) -> None:
    key = certs.generate_private_key()
    request = (
        x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    )
    with pytest.raises(ConfigError, match=why):
        certify_request(ca, request, OWNER)


def test_altered_foreign_and_garbage_requests_are_refused(tmp_path: Path) -> None:
    good = create_request(OWNER, certs.generate_private_key())
    der = bytearray(good.public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0x01  # inside the signature
    altered = tmp_path / "altered.der"
    altered.write_bytes(bytes(der))
    with pytest.raises(ConfigError, match="signature does not match its key"):
        read_request(altered)
    # The DER form of a good request is read as its PEM form is.
    plain = tmp_path / "good.der"
    plain.write_bytes(good.public_bytes(serialization.Encoding.DER))
    assert read_request(plain).public_key() == good.public_key()

    def request_with(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> Path:
        request = x509.CertificateSigningRequestBuilder().subject_name(
            _subject("owner", "hospital-7")
        )
        path = tmp_path / "other-key.pem"
        write_request(path, request.sign(key, hashes.SHA256()))
        return path

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(ConfigError, match="EC P-256 keys only"):
        read_request(request_with(rsa_key))
    with pytest.raises(ConfigError, match="EC P-256 keys only"):
        read_request(request_with(ec.generate_private_key(ec.SECP384R1())))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE REQUEST-----\nnot base64\n")
    with pytest.raises(ConfigError, match="is not a certificate request"):
        read_request(garbage)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"0" * (64 * 1024 + 1))
    with pytest.raises(ConfigError, match="larger than any certificate request"):
        read_request(huge)
    with pytest.raises(ConfigError, match="cannot read certificate request"):
        read_request(tmp_path / "missing.pem")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cli_request_then_sign(tmp_path: Path) -> None:
    runner = CliRunner()
    ca_dir, node_dir = tmp_path / "certs", tmp_path / "node"
    assert runner.invoke(certs_group, ["init", "--out", str(ca_dir)]).exit_code == 0
    asked = runner.invoke(
        certs_group, ["request", "--role", "owner", "--id", "hospital-7", "--out", str(node_dir)]
    )
    assert asked.exit_code == 0, asked.output
    key_path = node_dir / "owner-hospital-7-key.pem"
    request_path = node_dir / "owner-hospital-7-request.pem"
    assert _mode(key_path) == 0o600 and _mode(node_dir) == 0o700
    key = certs.read_private_key(key_path)
    fingerprint = public_key_fingerprint(key.public_key())
    assert f"public key {fingerprint}" in asked.output
    # Again without --force: nothing is replaced (a certificate for the key may exist).
    again = runner.invoke(
        certs_group, ["request", "--role", "owner", "--id", "hospital-7", "--out", str(node_dir)]
    )
    assert again.exit_code == 1 and "pass --force" in again.output
    assert certs.read_private_key(key_path).public_key() == key.public_key()

    sign = ["sign", "--certs", str(ca_dir), "--request", str(request_path), "--role", "owner"]
    wrong = runner.invoke(certs_group, [*sign, "--id", "hospital-8"])
    assert wrong.exit_code == 1
    assert "the request is for owner/hospital-7, not owner/hospital-8" in wrong.output
    assert not (ca_dir / "owner" / "hospital-8").exists()
    signed = runner.invoke(certs_group, [*sign, "--id", "hospital-7"])
    assert signed.exit_code == 0, signed.output
    # The CA's operator sees the fingerprint the node's operator read out.
    assert f"certified owner/hospital-7, public key {fingerprint}" in signed.output
    sent = node_dir / "owner-hospital-7-cert.pem"
    recorded = ca_dir / "owner" / "hospital-7" / "cert.pem"
    assert sent.read_bytes() == recorded.read_bytes()
    certificate = certs.read_certificate(sent)
    assert signed.output.splitlines()[-1] == f"serial {certificate.serial_number:x}"
    assert not (ca_dir / "owner" / "hospital-7" / "key.pem").exists()
    files = certs.TlsFiles(ca_dir / "ca" / "ca.pem", sent, key_path)
    assert certs.TlsMaterial.load(files).identity == OWNER
    # Signing again replaces nothing unless forced.
    twice = runner.invoke(certs_group, [*sign, "--id", "hospital-7"])
    assert twice.exit_code == 1 and "pass --force" in twice.output
    assert recorded.read_bytes() == sent.read_bytes()


def test_cli_sign_over_an_issued_certificate_drops_the_key_it_no_longer_matches(
    tmp_path: Path,
) -> None:
    runner = CliRunner()
    ca_dir = tmp_path / "certs"
    init = runner.invoke(certs_group, ["init", "--out", str(ca_dir), "--owner-ids", "hospital-7"])
    assert init.exit_code == 0, init.output
    issued = certs.CertificateDirectory(ca_dir).node_files(OWNER)
    assert issued.private_key.exists()
    key = certs.generate_private_key()
    write_request(tmp_path / "r.pem", create_request(OWNER, key))
    sign = ["sign", "--certs", str(ca_dir), "--request", str(tmp_path / "r.pem")]
    sign += ["--role", "owner", "--id", "hospital-7", "--out", str(tmp_path / "c.pem")]
    refused = runner.invoke(certs_group, sign)
    assert refused.exit_code == 1 and "pass --force" in refused.output
    assert issued.private_key.exists()
    forced = runner.invoke(certs_group, [*sign, "--force"])
    assert forced.exit_code == 0, forced.output
    assert not issued.private_key.exists()
    assert certs.read_certificate(issued.certificate).public_key() == key.public_key()


def test_cli_a_signed_proxy_names_the_hosts_given_to_sign(tmp_path: Path) -> None:
    runner = CliRunner()
    ca_dir = tmp_path / "certs"
    assert runner.invoke(certs_group, ["init", "--out", str(ca_dir)]).exit_code == 0
    key = certs.generate_private_key()
    proxy = NodeIdentity(Role.PROXY, "proxy-2")
    write_request(tmp_path / "r.pem", create_request(proxy, key))
    sign = ["sign", "--certs", str(ca_dir), "--request", str(tmp_path / "r.pem")]
    sign += ["--role", "proxy", "--id", "proxy-2", "--proxy-host", "proxy.example.org"]
    result = runner.invoke(certs_group, [*sign, "--proxy-host", "10.0.0.5"])
    assert result.exit_code == 0, result.output
    certificate = certs.read_certificate(tmp_path / "proxy-proxy-2-cert.pem")
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["proxy.example.org"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]


def test_proxy_init_accepts_an_owner_certified_from_its_request(tmp_path: Path) -> None:
    runner = CliRunner()
    ca_dir = tmp_path / "certs"
    assert runner.invoke(main, ["certs", "init", "--out", str(ca_dir)]).exit_code == 0
    write_request(tmp_path / "r.pem", create_request(OWNER, certs.generate_private_key()))
    sign = ["certs", "sign", "--certs", str(ca_dir), "--request", str(tmp_path / "r.pem")]
    assert runner.invoke(main, [*sign, "--role", "owner", "--id", "hospital-7"]).exit_code == 0
    proxy = ["proxy", "init", "--out", str(tmp_path / "proxy"), "--certs", str(ca_dir)]
    result = runner.invoke(main, [*proxy, "--owners", "owner-1,hospital-7"])
    assert result.exit_code == 0, result.output
    assert "hospital-7" in (tmp_path / "proxy" / "proxy.toml").read_text()
