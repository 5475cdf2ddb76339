"""CA and node certificates, identity extraction, TLS material and the certs CLI."""

from __future__ import annotations

import ipaddress
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpca.app.certs_cli import certs_group
from fedpca.errors import AuthenticationError, ConfigError, KeyFileError
from fedpca.transport import certs
from fedpca.transport.certs import NodeIdentity, Role
from helpers import resign_certificate

OWNER = NodeIdentity(Role.OWNER, "hospital-a")
ANALYST = NodeIdentity(Role.ANALYST, "analyst-1")
PROXY = NodeIdentity(Role.PROXY, "proxy")


@pytest.fixture(scope="module")
def ca() -> certs.CertificateAuthority:
    return certs.create_ca()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _san(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_ca_is_a_ca_that_cannot_sign_subcas(ca: certs.CertificateAuthority) -> None:
    constraints = ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert ca.certificate.signature_hash_algorithm is not None
    assert ca.certificate.signature_hash_algorithm.name == "sha256"
    assert ca.key.curve.name == "secp256r1"


@pytest.mark.parametrize("identity", [OWNER, ANALYST, PROXY])
def test_identity_is_encoded_and_read_back(
    ca: certs.CertificateAuthority, identity: NodeIdentity
) -> None:
    node = certs.issue_node_certificate(ca, identity)
    cert = node.certificate
    cert.verify_directly_issued_by(ca.certificate)
    assert f"fedpca://{identity.role}/{identity.node_id}" in _san(cert).get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity.node_id
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == (
        identity.role.value
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    der = cert.public_bytes(serialization.Encoding.DER)
    for form in (cert, pem, der, pem.decode()):
        assert certs.identity_from_certificate(form) == identity


def test_extended_key_usage_follows_connection_direction(ca: certs.CertificateAuthority) -> None:
    def usage(identity: NodeIdentity) -> list[x509.ObjectIdentifier]:
        cert = certs.issue_node_certificate(ca, identity).certificate
        return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert usage(PROXY) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert usage(OWNER) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert usage(ANALYST) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_proxy_hosts(ca: certs.CertificateAuthority) -> None:
    default = _san(certs.issue_node_certificate(ca, PROXY).certificate)
    assert default.get_values_for_type(x509.DNSName) == ["localhost"]
    assert default.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    custom = _san(
        certs.issue_node_certificate(
            ca, PROXY, hosts=["proxy.example.org", "10.0.0.7", "::1"]
        ).certificate
    )
    assert custom.get_values_for_type(x509.DNSName) == ["proxy.example.org"]
    assert [str(a) for a in custom.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "::1"]
    # Owners and analysts never serve, so they must not be able to pass as a host.
    assert not _san(certs.issue_node_certificate(ca, OWNER).certificate).get_values_for_type(
        x509.DNSName
    )
    with pytest.raises(ConfigError, match="only the proxy"):
        certs.issue_node_certificate(ca, OWNER, hosts=["localhost"])
    with pytest.raises(ConfigError, match="at least one"):
        certs.issue_node_certificate(ca, PROXY, hosts=[])
    with pytest.raises(ConfigError, match="invalid proxy host"):
        certs.issue_node_certificate(ca, PROXY, hosts=["bad host"])


@pytest.mark.parametrize("node_id", ["", "-x", "a/b", "a b", "x" * 64, "ü"])
def test_invalid_node_ids(node_id: str) -> None:
    with pytest.raises(ConfigError, match="node id"):
        NodeIdentity(Role.OWNER, node_id)


def _custom_cert(ca: certs.CertificateAuthority, san: list[x509.GeneralName] | None) -> bytes:
    key = certs.generate_private_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(ca.certificate.not_valid_before_utc)
        .not_valid_after(ca.certificate.not_valid_after_utc)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


URI = x509.UniformResourceIdentifier


@pytest.mark.parametrize(
    ("san", "match"),
    [
        (None, "no subjectAltName"),
        ([x509.DNSName("localhost")], "exactly one fedpca:// URI, found 0"),
        ([URI("fedpca://owner/a"), URI("fedpca://analyst/b")], "found 2"),
        ([URI("fedpca://admin/a")], "not fedpca://<role>/<node-id>"),
        ([URI("fedpca://owner/")], "not fedpca://<role>/<node-id>"),
        ([URI("fedpca://owner/a/b")], "not fedpca://<role>/<node-id>"),
        ([URI("fedpca://owner:80/a")], "no port"),
        ([URI("fedpca://owner/a?x=1")], "no port"),
    ],
)
def test_identity_errors(
    ca: certs.CertificateAuthority, san: list[x509.GeneralName] | None, match: str
) -> None:
    with pytest.raises(AuthenticationError, match=match):
        certs.identity_from_certificate(_custom_cert(ca, san))


def test_garbage_certificate() -> None:
    with pytest.raises(AuthenticationError, match="cannot be parsed"):
        certs.identity_from_certificate(b"not a certificate")


class _FakeContext:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_identity_from_context_and_require_role(ca: certs.CertificateAuthority) -> None:
    pem = certs.issue_node_certificate(ca, OWNER).certificate.public_bytes(
        serialization.Encoding.PEM
    )
    context: Any = _FakeContext({"x509_pem_cert": [pem], "transport_security_type": [b"ssl"]})
    assert certs.identity_from_context(context) == OWNER
    assert certs.require_role(context, Role.OWNER, Role.PROXY) == OWNER
    with pytest.raises(AuthenticationError, match="owner/hospital-a may not call"):
        certs.require_role(context, Role.ANALYST)
    with pytest.raises(AuthenticationError, match="no client certificate"):
        certs.identity_from_context(_FakeContext({}))


# ------------------------------------------------------------------ files


def test_init_writes_ca_and_nodes_with_safe_permissions(tmp_path: Path) -> None:
    files = certs.init_certificates(tmp_path / "pki", ["o1", "o2"], ["a1"])
    layout = certs.CertificateDirectory(tmp_path / "pki")
    assert list(files) == [
        NodeIdentity(Role.PROXY, "proxy"),
        NodeIdentity(Role.OWNER, "o1"),
        NodeIdentity(Role.OWNER, "o2"),
        NodeIdentity(Role.ANALYST, "a1"),
    ]
    assert _mode(layout.ca_key) == 0o600
    assert _mode(layout.ca_key.parent) == 0o700
    assert _mode(layout.ca_certificate) == 0o644
    for identity, paths in files.items():
        assert _mode(paths.private_key) == 0o600
        assert _mode(paths.certificate) == 0o644
        material = certs.TlsMaterial.load(paths)
        assert material.identity == identity
        assert b"PRIVATE" not in repr(material).encode()
    assert not list(tmp_path.rglob(".*"))  # no temp files left behind


def test_init_refuses_to_replace_a_ca(tmp_path: Path) -> None:
    certs.init_certificates(tmp_path, ["o1"], [])
    with pytest.raises(ConfigError, match="refusing to replace the CA"):
        certs.init_certificates(tmp_path, ["o1"], [])
    certs.init_certificates(tmp_path, ["o1"], [], force=True)
    with pytest.raises(ConfigError, match="listed twice"):
        certs.init_certificates(tmp_path / "x", ["o1", "o1"], [])


def test_tls_material_consistency_checks(tmp_path: Path) -> None:
    one = certs.init_certificates(tmp_path / "one", ["o1"], [])
    two = certs.init_certificates(tmp_path / "two", ["o1"], [])
    owner = NodeIdentity(Role.OWNER, "o1")
    a, b = one[owner], two[owner]
    with pytest.raises(ConfigError, match="was not issued by CA"):
        certs.TlsMaterial.load(certs.TlsFiles(a.ca_certificate, b.certificate, b.private_key))
    with pytest.raises(ConfigError, match="does not match certificate"):
        certs.TlsMaterial.load(certs.TlsFiles(a.ca_certificate, a.certificate, b.private_key))
    with pytest.raises(KeyFileError, match="cannot read private key"):
        certs.TlsMaterial.load(certs.TlsFiles(a.ca_certificate, a.certificate, a.certificate))
    with pytest.raises(ConfigError, match="cannot read certificate"):
        certs.TlsMaterial.load(certs.TlsFiles(a.ca_certificate, tmp_path / "nope", a.private_key))
    table = tmp_path / "a.csv"
    table.write_text("1,2,3\n")
    with pytest.raises(ConfigError, match=r"a\.csv is not a certificate") as info:
        certs.read_certificate(table)
    assert "ParseError" not in str(info.value)  # no parser internals for a user


# -------------------------------------------------------------------- CLI


def test_cli_init_prints_paths(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    result = CliRunner().invoke(
        certs_group,
        ["init", "--out", str(out), "--owner-ids", "h1,h2,h3", "--proxy-host", "proxy.lan"],
    )
    assert result.exit_code == 0, result.output
    assert f"CA certificate (give to every node): {out / 'ca' / 'ca.pem'}" in result.output
    for node_id in ("h1", "h2", "h3"):
        assert str(out / "owner" / node_id / "key.pem") in result.output
    assert str(out / "analyst" / "analyst-1" / "cert.pem") in result.output
    proxy = certs.read_certificate(out / "proxy" / "proxy" / "cert.pem")
    assert _san(proxy).get_values_for_type(x509.DNSName) == ["proxy.lan"]


def test_cli_init_counts_and_conflicts(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        certs_group, ["init", "--out", str(tmp_path), "--owners", "3", "--analysts", "2"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "owner").iterdir()) == [
        "owner-1",
        "owner-2",
        "owner-3",
    ]
    assert sorted(p.name for p in (tmp_path / "analyst").iterdir()) == ["analyst-1", "analyst-2"]
    again = runner.invoke(certs_group, ["init", "--out", str(tmp_path)])
    assert again.exit_code != 0 and "refusing to replace the CA" in again.output
    both = runner.invoke(
        certs_group,
        ["init", "--out", str(tmp_path / "b"), "--owners", "2", "--owner-ids", "a"],
    )
    assert both.exit_code != 0 and "not both" in both.output


def test_cli_issue_and_show(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(certs_group, ["init", "--out", str(tmp_path)]).exit_code == 0
    result = runner.invoke(
        certs_group,
        ["issue", "--dir", str(tmp_path), "--role", "owner", "--node-id", "late-joiner"],
    )
    assert result.exit_code == 0, result.output
    files = certs.CertificateDirectory(tmp_path).node_files(NodeIdentity(Role.OWNER, "late-joiner"))
    assert certs.TlsMaterial.load(files).identity.node_id == "late-joiner"
    shown = runner.invoke(certs_group, ["show", str(files.certificate)])
    assert shown.exit_code == 0, shown.output
    assert "identity:   owner/late-joiner" in shown.output
    assert "fedpca://owner/late-joiner" in shown.output
    # issue prints the serial a revocation names, as show does.
    serial = f"{certs.read_certificate(files.certificate).serial_number:x}"
    assert f"serial:     {serial}" in shown.output
    assert result.output.splitlines()[-1].split() == ["serial", serial]
    # The CA's certificate too, whose expiry an operator watches (it failed: no names).
    ca = runner.invoke(certs_group, ["show", str(tmp_path / "ca" / "ca.pem")])
    assert ca.exit_code == 0, ca.output
    assert "identity:   certificate authority" in ca.output and "valid:" in ca.output
    assert re.search(r"valid: .* \(expires in \d+ days\)", shown.output)
    # The names the init commands use for the same things (--certs DIR, --id) work too.
    aliased = ["issue", "--certs", str(tmp_path), "--role", "analyst", "--id", "bob"]
    result = runner.invoke(certs_group, aliased)
    assert result.exit_code == 0, result.output
    files = certs.CertificateDirectory(tmp_path).node_files(NodeIdentity(Role.ANALYST, "bob"))
    assert certs.TlsMaterial.load(files).identity.node_id == "bob"


def test_cli_issue_replaces_a_node_certificate_only_when_forced(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(certs_group, ["init", "--out", str(tmp_path)]).exit_code == 0
    files = certs.CertificateDirectory(tmp_path).node_files(NodeIdentity(Role.PROXY, "proxy"))
    before = files.certificate.read_bytes(), files.private_key.read_bytes()
    args = ["issue", "--dir", str(tmp_path), "--role", "proxy", "--node-id", "proxy"]
    refused = runner.invoke(certs_group, [*args, "--proxy-host", "proxy.example.org"])
    assert refused.exit_code != 0
    assert f"{files.certificate} exists: pass --force" in refused.output
    assert (files.certificate.read_bytes(), files.private_key.read_bytes()) == before
    forced = runner.invoke(certs_group, [*args, "--proxy-host", "proxy.example.org", "--force"])
    assert forced.exit_code == 0, forced.output
    assert files.certificate.read_bytes() != before[0]
    shown = runner.invoke(certs_group, ["show", str(files.certificate)])
    assert "proxy.example.org" in shown.output
    # A renewal without --proxy-host keeps the names peers connect to (it fell back to
    # localhost: every owner then failed the host name check; an operator's review).
    renewed = runner.invoke(certs_group, [*args, "--force"])
    assert renewed.exit_code == 0, renewed.output
    assert "keeping the names of the certificate it replaces: proxy.example.org" in renewed.output
    shown = runner.invoke(certs_group, ["show", str(files.certificate)])
    names = next(line for line in shown.output.splitlines() if line.startswith("names:"))
    assert "proxy.example.org" in names and "localhost" not in names


def test_a_world_readable_private_key_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = certs.init_certificates(tmp_path, ["owner-1"], ["alice"])
    owner = files[NodeIdentity(Role.OWNER, "owner-1")]
    assert certs.private_key_exposure(owner.private_key) is None  # written 0600
    owner.private_key.chmod(0o640)  # group-readable, as Kubernetes mounts Secrets
    assert certs.private_key_exposure(owner.private_key) is None
    owner.private_key.chmod(0o644)
    exposure = certs.private_key_exposure(owner.private_key)
    assert exposure == (
        f"{owner.private_key} is readable by every user of this host (mode 0644): "
        f"chmod 600 {owner.private_key}"
    )
    with caplog.at_level("WARNING", logger="fedpca.transport.certs"):
        certs.TlsMaterial.load(owner)
    assert exposure in caplog.text


@pytest.mark.parametrize("which", ["expired", "not yet valid", "expired CA"])
def test_a_certificate_outside_its_validity_is_refused_when_loaded(
    tmp_path: Path, which: str
) -> None:
    """Found by review: a node's own expired certificate was never named; the analyst
    retried for 5½ minutes ("proxy unavailable ... certificate valid"), the owner for
    ever, and a proxy started with one without a word."""
    import datetime as dt

    files = certs.init_certificates(tmp_path, ["o1"], [])[NodeIdentity(Role.OWNER, "o1")]
    now = dt.datetime.now(dt.UTC)
    window = {
        "expired": (now - dt.timedelta(days=400), now - dt.timedelta(days=35)),
        "not yet valid": (now + dt.timedelta(days=2), now + dt.timedelta(days=400)),
        "expired CA": (now - dt.timedelta(days=400), now - dt.timedelta(days=1)),
    }[which]
    target = files.ca_certificate if which == "expired CA" else files.certificate
    resign_certificate(certs.CertificateDirectory(tmp_path), target, *window)
    message = {
        "expired": rf"{re.escape(str(files.certificate))} expired on {window[1]:%Y-%m-%d}: "
        "issue a new one",
        "not yet valid": rf"{re.escape(str(files.certificate))} is valid only from .* check "
        "this machine's clock",
        "expired CA": rf"{re.escape(str(files.ca_certificate))} expired on {window[1]:%Y-%m-%d}",
    }[which]
    with pytest.raises(ConfigError, match=message) as refused:
        certs.TlsMaterial.load(files)
    if which == "expired":
        # The section it names exists (it named "Certificates", which did not).
        assert 'docs/operations.md "Revoking a certificate"' in str(refused.value)
        docs = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
        assert "\n### Revoking a certificate\n" in docs.read_text()
    # `certs show` says it in words, not only with dates (an operator's walkthrough).
    shown = CliRunner().invoke(certs_group, ["show", str(target)])
    assert shown.exit_code == 0, shown.output
    assert ("(NOT YET VALID)" if which == "not yet valid" else "(EXPIRED)") in shown.output


def test_material_that_expires_while_a_node_runs_is_named(tmp_path: Path) -> None:
    """Found by review: the validity check ran only at load, so a node whose certificate
    expired while it ran retried for ever, its log saying TLS was fine as far as
    checked. A node that cannot connect now asks its material (OwnerNode's diagnosis)."""
    import datetime as dt

    files = certs.init_certificates(tmp_path, ["o1"], [])[NodeIdentity(Role.OWNER, "o1")]
    material = certs.TlsMaterial.load(files)
    assert material.expiry_problem() is None
    ends = certs.read_certificate(files.certificate).not_valid_after_utc
    later = material.expiry_problem(ends + dt.timedelta(days=1))
    assert later is not None
    assert later.startswith(f"this node's certificate expired on {ends:%Y-%m-%d}")
    assert "fedpca certs issue" in later
