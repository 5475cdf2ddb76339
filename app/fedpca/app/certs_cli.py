"""``fedpca certs``: create and inspect the TLS certificates of a deployment."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import click
from cryptography import x509

from fedpca.errors import AuthenticationError, ConfigError, KeyFileError
from fedpca.transport.cert_requests import (
    certify_request,
    create_request,
    public_key_fingerprint,
    read_request,
    write_request,
)
from fedpca.transport.certs import (
    DEFAULT_NODE_VALID_DAYS,
    DEFAULT_PROXY_HOSTS,
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsFiles,
    generate_private_key,
    identity_from_certificate,
    init_certificates,
    issue_node_certificate,
    read_certificate,
    write_certificate,
    write_private_key,
)


def _ids(count: int | None, explicit: str | None, prefix: str, default: int) -> list[str]:
    if count is not None and explicit is not None:
        raise click.UsageError(f"give either --{prefix}s or --{prefix}-ids, not both")
    if explicit is not None:
        return [part.strip() for part in explicit.split(",") if part.strip()]
    return [f"{prefix}-{i}" for i in range(1, (default if count is None else count) + 1)]


def _print_files(files: Mapping[NodeIdentity, TlsFiles]) -> None:
    for identity, paths in files.items():
        click.echo(f"  {identity!s:<24} cert {paths.certificate}")
        click.echo(f"  {'':<24} key  {paths.private_key}")


_valid_days = click.option(
    "--valid-days",
    type=click.IntRange(min=1),
    default=DEFAULT_NODE_VALID_DAYS,
    show_default=True,
    help="Days each node certificate issued is valid.",
)


@click.group("certs")
def certs_group() -> None:
    """Create and inspect the TLS certificates of a fedpca deployment."""


@certs_group.command("init")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to create (CA under ca/, nodes under <role>/<id>/).",
)
@click.option("--owners", type=click.IntRange(min=0), help="Number of owners owner-1..N [2].")
@click.option("--owner-ids", help="Comma-separated owner ids (instead of --owners).")
@click.option("--analysts", type=click.IntRange(min=0), help="Number of analysts [1].")
@click.option("--analyst-ids", help="Comma-separated analyst ids (instead of --analysts).")
@click.option("--proxy-id", default="proxy", show_default=True, help="Node id of the proxy.")
@click.option(
    "--proxy-host",
    "proxy_hosts",
    multiple=True,
    help="DNS name or IP clients use to reach the proxy (repeatable; the names given "
    f"replace the defaults) [{', '.join(DEFAULT_PROXY_HOSTS)}].",
)
@_valid_days
@click.option("--force", is_flag=True, help="Replace an existing CA (invalidates old certs).")
def init_command(
    out: Path,
    owners: int | None,
    owner_ids: str | None,
    analysts: int | None,
    analyst_ids: str | None,
    proxy_id: str,
    proxy_hosts: tuple[str, ...],
    valid_days: int,
    force: bool,
) -> None:
    """Create a CA and certificates for the proxy, owners and analysts."""
    try:
        files = init_certificates(
            out,
            owner_ids=_ids(owners, owner_ids, "owner", 2),
            analyst_ids=_ids(analysts, analyst_ids, "analyst", 1),
            proxy_id=proxy_id,
            proxy_hosts=proxy_hosts or DEFAULT_PROXY_HOSTS,
            valid_days=valid_days,
            force=force,
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    layout = CertificateDirectory(out)
    click.echo(f"CA certificate (give to every node): {layout.ca_certificate}")
    click.echo(f"CA private key (keep offline, 0600): {layout.ca_key}")
    click.echo("Node certificates and keys (keys are 0600):")
    _print_files(files)


_ca_directory_option = click.option(
    "--dir",
    "--certs",
    "directory",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory created by `fedpca certs init` (--certs, as the init commands name it).",
)
_role_option = click.option(
    "--role",
    type=click.Choice([r.value for r in Role]),
    required=True,
    help="What the certificate lets its holder act as.",
)


@certs_group.command("issue")
@_ca_directory_option
@_role_option
@click.option(
    "--node-id",
    "--id",
    "node_id",
    required=True,
    help="The node's id, named in its certificate (--id, as the init commands name it).",
)
@click.option("--proxy-host", "proxy_hosts", multiple=True, help="Proxy only (repeatable).")
@_valid_days
@click.option(
    "--force",
    is_flag=True,
    help="Replace the node's existing certificate and key (e.g. new names or renewal).",
)
def issue_command(
    directory: Path,
    role: str,
    node_id: str,
    proxy_hosts: tuple[str, ...],
    valid_days: int,
    force: bool,
) -> None:
    """Issue one more node certificate from an existing CA (e.g. a new owner)."""
    layout = CertificateDirectory(directory)
    try:
        identity = NodeIdentity(Role(role), node_id)
        existing = layout.node_files(identity).certificate
        if existing.exists() and not force:
            raise ConfigError(
                f"{existing} exists: pass --force to replace it. The old certificate stays "
                "valid until it expires unless its serial (`fedpca certs show`) is listed "
                "in the proxy's tls.revoked_serials"
            )
        hosts = list(proxy_hosts) or None
        if hosts is None and identity.role is Role.PROXY and existing.exists():
            # A renewal keeps the names owners and analysts connect to (it fell back to
            # localhost, so every peer failed host name checks after the proxy's
            # restart: found by an operator's review).
            hosts = _host_names(read_certificate(existing)) or None
            if hosts:
                click.echo(f"keeping the names of the certificate it replaces: {', '.join(hosts)}")
        node = issue_node_certificate(
            layout.load_ca(), identity, hosts=hosts, valid_days=valid_days
        )
        files = layout.write_node(node)
    except (ConfigError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    _print_files({identity: files})
    # What a revocation names (found by review: only `certs show` printed it).
    click.echo(f"  {'':<24} serial {read_certificate(files.certificate).serial_number:x}")


@certs_group.command("request")
@_role_option
@click.option("--id", "node_id", required=True, help="The node's id.")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder on this node's host for <role>-<id>-key.pem (0600; stays here) and "
    "<role>-<id>-request.pem (sent to the CA's operator).",
)
@click.option("--force", is_flag=True, help="Replace a key and request already there.")
def request_command(role: str, node_id: str, out: Path, force: bool) -> None:
    """Make this node's private key and a certificate request (CSR) for the CA.

    Run on the node's own host: the key never leaves it. The CA's operator signs the
    request with `fedpca certs sign` and sends back the certificate.
    """
    try:
        identity = NodeIdentity(Role(role), node_id)
        key_path = out / f"{role}-{node_id}-key.pem"
        request_path = out / f"{role}-{node_id}-request.pem"
        for path in (key_path, request_path):
            if path.exists() and not force:
                raise ConfigError(
                    f"{path} exists: pass --force to make a new key and request (a "
                    "certificate signed for the old key no longer matches it)"
                )
        key = generate_private_key()
        request = create_request(identity, key)
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private_key(key_path, key)
        write_request(request_path, request)
    except (ConfigError, KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"private key (stays on this host, 0600): {key_path}")
    click.echo(f"certificate request (send to the CA's operator): {request_path}")
    click.echo(f"public key {public_key_fingerprint(key.public_key())}")
    click.echo(
        "Read this fingerprint to the CA's operator by another channel (phone, signed "
        "mail): `certs sign` prints the one it certifies."
    )


@certs_group.command("sign")
@_ca_directory_option
@click.option(
    "--request",
    "request_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The node's request, from `fedpca certs request`.",
)
@_role_option
@click.option("--id", "node_id", required=True, help="The node's id; the request must name it.")
@click.option("--proxy-host", "proxy_hosts", multiple=True, help="Proxy only (repeatable).")
@_valid_days
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The certificate to send back [<role>-<id>-cert.pem beside the request].",
)
@click.option("--force", is_flag=True, help="Replace the node's certificate in the CA's directory.")
def sign_command(
    directory: Path,
    request_path: Path,
    role: str,
    node_id: str,
    proxy_hosts: tuple[str, ...],
    valid_days: int,
    out: Path | None,
    force: bool,
) -> None:
    """Certify a node's request (CSR) as the role and id given here.

    The certificate is recorded in the CA's directory (<role>/<id>/cert.pem, where
    `proxy init --certs` looks for owners) and written to --out for the node. Only the
    request's key is taken from it: its names and extensions are not.
    """
    layout = CertificateDirectory(directory)
    try:
        identity = NodeIdentity(Role(role), node_id)
        request = read_request(request_path)
        recorded = layout.node_files(identity)
        if recorded.certificate.exists() and not force:
            raise ConfigError(
                f"{recorded.certificate} exists: pass --force to replace it. The old "
                "certificate stays valid until it expires unless its serial (`fedpca certs "
                "show`) is listed in the proxy's tls.revoked_serials"
            )
        target = out or request_path.with_name(f"{role}-{node_id}-cert.pem")
        if target.exists() and not force:
            raise ConfigError(f"{target} exists: pass --force to replace it, or name --out")
        certificate = certify_request(
            layout.load_ca(), request, identity, list(proxy_hosts) or None, valid_days
        )
        write_certificate(recorded.certificate, certificate)
        # A key left there by `certs issue` belongs to the certificate just replaced.
        recorded.private_key.unlink(missing_ok=True)
        write_certificate(target, certificate)
    except (ConfigError, KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"certified {identity}, public key {public_key_fingerprint(request.public_key())}")
    click.echo(f"certificate (send to the node): {target}")
    click.echo(f"recorded in the CA's directory: {recorded.certificate}")
    click.echo(f"serial {certificate.serial_number:x}")


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _host_names(cert: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses a certificate names (not its identity URI)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names = [str(name) for name in san.get_values_for_type(x509.DNSName)]
    return names + [str(address) for address in san.get_values_for_type(x509.IPAddress)]


@certs_group.command("show")
@click.argument("certificate", type=click.Path(dir_okay=False, exists=True, path_type=Path))
def show_command(certificate: Path) -> None:
    """Print the identity, names and validity of a certificate."""
    try:
        cert = read_certificate(certificate)
        # The CA's own certificate names no node (found by an operator's review: its
        # expiry could not be read with fedpca).
        identity = "certificate authority" if _is_ca(cert) else identity_from_certificate(cert)
    except (ConfigError, AuthenticationError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"identity:   {identity}")
    click.echo(f"serial:     {cert.serial_number:x}")
    click.echo(f"subject:    {cert.subject.rfc4514_string()}")
    click.echo(f"issuer:     {cert.issuer.rfc4514_string()}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        click.echo(f"names:      {', '.join(str(v.value) for v in san)}")
    except x509.ExtensionNotFound:
        click.echo("names:      none")
    # Said in words (an operator's walkthrough read the dates of an expired one).
    now = datetime.now(UTC)
    if now > cert.not_valid_after_utc:
        state = "EXPIRED"
    elif now < cert.not_valid_before_utc:
        state = "NOT YET VALID"
    else:
        days = (cert.not_valid_after_utc - now).days
        state = f"expires in {days} days" if days else "expires within a day"
    click.echo(f"valid:      {cert.not_valid_before_utc} .. {cert.not_valid_after_utc} ({state})")
