"""The analyst commands' connection settings: ``--config analyst.toml`` merged with
the ``--proxy``/``--ca``/``--cert``/``--key``/``--server-name``/``--insecure`` flags,
each flag overriding its part of the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fedpca.analyst.config import AnalystConfig, load_config
from fedpca.errors import ConfigError
from fedpca.transport.addresses import click_address
from fedpca.transport.certs import TlsFiles

__all__ = ["connection_config", "connection_options"]

F = TypeVar("F", bound=Callable[..., Any])


def connection_config(
    config_path: Path | None,
    proxy: str | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    insecure: bool,
    server_name: str | None,
    key_dir: Path | None = None,
) -> AnalystConfig:
    config = load_config(config_path) if config_path is not None else AnalystConfig()
    tls = config.tls
    if ca or cert or key:
        # Each flag overrides its file of --config's [tls]; without --config all three
        # are needed.
        if tls is None and not (ca and cert and key):
            raise ConfigError(
                "--ca, --cert and --key must be given together (or with a --config that "
                "has a [tls] table for the others)"
            )
        tls = TlsFiles(
            ca or tls.ca_certificate,  # type: ignore[union-attr]
            cert or tls.certificate,  # type: ignore[union-attr]
            key or tls.private_key,  # type: ignore[union-attr]
        )
    insecure = insecure or config.insecure
    if insecure:
        tls = None
    merged = AnalystConfig(
        proxy=proxy or config.proxy,
        key_dir=key_dir or config.key_dir,
        tls=tls,
        server_name=server_name or config.server_name,
        insecure=insecure,
    )
    if merged.proxy is None:
        raise ConfigError("no proxy address: pass --proxy HOST:PORT or set proxy in --config")
    if merged.tls is None and not merged.insecure:
        raise ConfigError(
            "no TLS material: pass --ca/--cert/--key or a [tls] table in --config "
            "(--insecure only for local tests)"
        )
    return merged


def connection_options(function: F) -> F:
    options: list[Callable[[Any], Any]] = [
        click.option(
            "--proxy", metavar="HOST:PORT", callback=click_address(), help="Address of the proxy."
        ),
        click.option(
            "--config",
            "config_path",
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            help="analyst.toml with proxy, key_dir and [tls]; flags override it.",
        ),
        click.option(
            "--ca", type=click.Path(dir_okay=False, exists=True, path_type=Path), help="CA cert."
        ),
        click.option(
            "--cert",
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            help="The analyst's certificate.",
        ),
        click.option(
            "--key",
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            help="The analyst's TLS private key.",
        ),
        click.option("--server-name", help="Name to verify the proxy certificate against."),
        click.option(
            "--insecure", is_flag=True, help="No TLS (local tests only; NOT for deployments)."
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function
