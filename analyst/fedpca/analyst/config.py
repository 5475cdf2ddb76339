"""The analyst's connection settings: ``analyst.toml`` as a frozen dataclass.

Format (relative paths are resolved against the folder holding the file)::

    proxy = "proxy.example.org:7443"
    key_dir = "keys"
    server_name = "proxy"            # optional: name in the proxy certificate
    insecure = false                 # local tests only
    [tls]
    ca = "certs/ca/ca.pem"
    cert = "certs/analyst/alice/cert.pem"
    key = "certs/analyst/alice/key.pem"

Every key is optional (command-line flags may supply or override it); unknown keys
are refused, and every error is a :class:`~fedpca.errors.ConfigError` naming the
file and the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpca.errors import ConfigError
from fedpca.toml_config import load_toml_config, reject_unknown_keys, require_keys, resolve_path
from fedpca.transport.addresses import check_address
from fedpca.transport.certs import TlsFiles

__all__ = ["AnalystConfig", "load_config"]

_CONFIG_KEYS = {"proxy", "key_dir", "server_name", "insecure", "tls"}
_TLS_KEYS = {"ca", "cert", "key"}


@dataclass(frozen=True)
class AnalystConfig:
    """Connection settings of one analyst (from analyst.toml and flags).

    Attributes
    ----------
    proxy : ``host:port`` of the proxy.
    key_dir : folder of the analyst's Paillier key.
    tls : the analyst's mutual-TLS files.
    server_name : name to verify the proxy certificate against.
    insecure : no TLS (local tests only).
    """

    proxy: str | None = None
    key_dir: Path | None = None
    tls: TlsFiles | None = None
    server_name: str | None = None
    insecure: bool = False

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], base_dir: Path) -> AnalystConfig:
        """Build a config from parsed TOML; paths relative to ``base_dir``.

        Raises
        ------
        ConfigError
            Unknown keys, wrong types, a proxy that is not ``host:port`` or an
            incomplete [tls] table.
        """
        reject_unknown_keys(document, _CONFIG_KEYS)

        def text(table: Mapping[str, Any], key: str, where: str = "") -> str | None:
            value = table.get(key)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{where}{key} must be a string")
            return value

        def path(value: str | None, key: str) -> Path | None:
            return None if value is None else resolve_path(value, base_dir, key)

        tls = None
        table = document.get("tls")
        if table is not None:
            if not isinstance(table, Mapping):
                raise ConfigError("[tls] must be a table")
            reject_unknown_keys(table, _TLS_KEYS, "tls")
            require_keys(table, ("ca", "cert", "key"), "tls", "together")
            ca, cert, key = (
                path(text(table, k, "tls."), f"tls.{k}") for k in ("ca", "cert", "key")
            )
            assert ca is not None and cert is not None and key is not None
            tls = TlsFiles(ca, cert, key)
        insecure = document.get("insecure", False)
        if not isinstance(insecure, bool):
            raise ConfigError("insecure must be true or false")
        proxy = text(document, "proxy")
        return cls(
            proxy=None if proxy is None else check_address(proxy, "proxy"),
            key_dir=path(text(document, "key_dir"), "key_dir"),
            tls=tls,
            server_name=text(document, "server_name"),
            insecure=insecure,
        )


def load_config(path: str | os.PathLike[str]) -> AnalystConfig:
    """Read and validate ``analyst.toml``.

    Raises
    ------
    ConfigError
        Unreadable file, invalid TOML, unknown keys, wrong types, a proxy that is not
        ``host:port`` or an incomplete [tls] table (the message names the file and
        the key).
    """
    return load_toml_config(path, "analyst", AnalystConfig.from_mapping)
