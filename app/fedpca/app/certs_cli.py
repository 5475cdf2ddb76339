"""``fedpca certs``: create and inspect the TLS certificates of a deployment."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import click
from cryptography import x509

from fedpca.errors import AuthenticationError, ConfigError, KeyFileError
from fedpca.transport.certs import (
    DEFAULT_NODE_VALID_DAYS,
    DEFAULT_PROXY_HOSTS,
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsFiles,
    identity_from_certificate,
    init_certificates,
    issue_node_certificate,
    read_certificate,
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


@certs_group.command("issue")
@click.option(
    "--dir",
    "--certs",
    "directory",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory created by `fedpca certs init` (--certs, as the init commands name it).",
)
@click.option(
    "--role",
    type=click.Choice([r.value for r in Role]),
    required=True,
    help="What the certificate lets its holder act as.",
)
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
