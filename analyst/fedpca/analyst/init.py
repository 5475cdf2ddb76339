"""``fedpca analyst init``: write an analyst folder (analyst.toml and its TLS files).

The analyst's counterpart of ``fedpca proxy init`` and ``fedpca owner init``: the
folder holds ``analyst.toml`` naming the proxy, the key folder of ``fedpca analyst
keygen`` and the TLS files copied under ``tls/``, all relative to the folder, so every
``fedpca analyst ...`` command needs only ``--config DIR/analyst.toml``.
"""

from __future__ import annotations

from pathlib import Path

import click

from fedpca.analyst.config import AnalystConfig, load_config
from fedpca.analyst.keys import AnalystKeyFiles
from fedpca.errors import ConfigError, FedpcaError
from fedpca.toml_config import toml_value
from fedpca.transport.addresses import check_address, click_address
from fedpca.transport.bundle import TLS_DIR, config_path, writing_folder
from fedpca.transport.certs import NodeIdentity, Role, TlsFiles
from fedpca.transport.tls_options import tls_file_options

__all__ = ["CONFIG_NAME", "init_command", "write_analyst_folder"]

CONFIG_NAME = "analyst.toml"


def write_analyst_folder(
    out: Path,
    *,
    analyst_id: str,
    proxy: str,
    key_dir: Path,
    certs: Path | None = None,
    tls_files: TlsFiles | None = None,
    server_name: str | None = None,
    force: bool = False,
) -> AnalystConfig:
    """Write an analyst folder and return its configuration as the analyst reads it.

    Raises
    ------
    ConfigError
        A proxy address that is not ``host:port`` (before anything is written), an
        existing folder without ``force``, TLS files that are missing or not this
        analyst's, or values the analyst's loader refuses. What the call wrote is then
        undone (:func:`~fedpca.transport.bundle.writing_folder`).
    """
    check_address(proxy, "--proxy")
    lines = [
        "# fedpca analyst, written by `fedpca analyst init`; flags override it.",
        f"proxy = {toml_value(proxy)}",
        f"key_dir = {toml_value(config_path(key_dir, out))}   # from `fedpca analyst keygen`",
    ]
    if server_name is not None:
        lines.append(f"server_name = {toml_value(server_name)}")
    lines += [
        "",
        "[tls]",
        f"ca = {toml_value(f'{TLS_DIR}/ca.pem')}",
        f"cert = {toml_value(f'{TLS_DIR}/cert.pem')}",
        f"key = {toml_value(f'{TLS_DIR}/key.pem')}",
    ]
    with writing_folder(out, CONFIG_NAME, force=force) as folder:
        folder.install_tls(NodeIdentity(Role.ANALYST, analyst_id), certs=certs, files=tls_files)
        path = out / CONFIG_NAME
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return load_config(path)


@click.command("init")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The analyst's folder to create (analyst.toml, tls/).",
)
@click.option("--id", "analyst_id", required=True, help="The analyst id (as in its certificate).")
@click.option(
    "--proxy",
    required=True,
    metavar="HOST:PORT",
    callback=click_address(),
    help="The proxy, as the analyst dials it.",
)
@click.option(
    "--key-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The folder `fedpca analyst keygen` wrote.",
)
@click.option(
    "--certs",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory from `fedpca certs init`; this analyst's files are copied from it.",
)
@tls_file_options
@click.option("--server-name", help="Name to verify the proxy certificate against.")
@click.option("--force", is_flag=True, help="Write the folder again.")
def init_command(
    out: Path,
    analyst_id: str,
    proxy: str,
    key_dir: Path,
    certs: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    server_name: str | None,
    force: bool,
) -> None:
    """Write analyst.toml and copy this analyst's TLS files next to it."""
    try:
        files = None
        if any((ca, cert, key)):
            if not all((ca, cert, key)) or certs is not None:
                raise ConfigError("give --certs DIR, or all of --ca, --cert and --key")
            assert ca is not None and cert is not None and key is not None
            files = TlsFiles(ca, cert, key)
        elif certs is None:
            raise ConfigError("give --certs DIR (from `fedpca certs init`) or --ca/--cert/--key")
        write_analyst_folder(
            out,
            analyst_id=analyst_id,
            proxy=proxy,
            key_dir=key_dir,
            certs=certs,
            tls_files=files,
            server_name=server_name,
            force=force,
        )
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out / CONFIG_NAME}")
    if not AnalystKeyFiles(key_dir).private_key.is_file():
        # Not an error (keys may be made next), but said now rather than at the first query.
        click.echo(
            f"warning: {key_dir} holds no analyst key yet; create it with "
            f"`fedpca analyst keygen --out {key_dir}` before querying",
            err=True,
        )
    click.echo(f"use:  fedpca analyst budget --config {out / CONFIG_NAME}")
