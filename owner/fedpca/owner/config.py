"""The owner node's configuration: ``owner.toml`` as frozen dataclasses.

Format (every relative path is resolved against the folder holding the file, so a
config can be moved together with its certificates and data)::

    [owner]
    id = "owner-1"
    proxy = "127.0.0.1:50051"
    state_dir = "state/owner-1"          # SQLite ledger lives here
    [tls]
    ca = "certs/ca/ca.pem"
    cert = "certs/owner/owner-1/cert.pem"
    key = "certs/owner/owner-1/key.pem"
    insecure = false                     # local experiments only: WARNING on every start
    [data]
    path = "data/owner-1.csv"            # CSV (header auto-detected), .npy or .parquet
    header = "auto"                      # "auto" | true | false
    label_column = 0                     # optional; dropped for PCA, used for DCA
    out_of_bounds = "clip"               # "clip" | "refuse"
    [policy]
    accepted_analyst_keys = ["sha256:..."]
    max_epsilon_per_query = 1.0
    allow_not_private = false
    [budget]
    epsilon = 10.0
    delta = 1e-5
    [crypto]
    processes = 0                        # 0 = all cores
    obfuscation = "djn"                  # "djn" | "standard"

Unknown sections and keys are refused: a misspelt ``max_epsilon_per_querry`` that
silently fell back to a default would weaken the owner's policy without anyone
noticing. Every error is a :class:`~fedpca.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from fedpca.codec.paillier import Obfuscation
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import ConfigError
from fedpca.toml_config import load_toml_config, reject_unknown_keys, resolve_path
from fedpca.transport.certs import TlsFiles, validate_node_id

__all__ = [
    "BudgetConfig",
    "CryptoConfig",
    "DataConfig",
    "NodeConfig",
    "OwnerConfig",
    "PolicyConfig",
    "TlsConfig",
    "load_config",
]

logger = logging.getLogger(__name__)

HeaderSetting = bool | Literal["auto"]
OutOfBounds = Literal["clip", "refuse"]

_FINGERPRINT_RE = re.compile(r"sha256:[0-9a-f]{64}")
# host:port, host may be a bracketed IPv6 literal; the port is checked numerically.
_ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class NodeConfig:
    """``[owner]``: who this node is and where the proxy is.

    Attributes
    ----------
    id : the node id; must equal the id in the owner's certificate.
    proxy : ``host:port`` of the proxy.
    state_dir : folder of the budget ledger (created on start).
    """

    id: str
    proxy: str
    state_dir: Path


@dataclass(frozen=True)
class TlsConfig:
    """``[tls]``: the owner's mutual-TLS material.

    Attributes
    ----------
    ca, cert, key : PEM files (None only when ``insecure``).
    insecure : dial without TLS (local experiments only; logged as a WARNING).
    """

    ca: Path | None
    cert: Path | None
    key: Path | None
    insecure: bool = False

    def files(self) -> TlsFiles:
        """The paths as :class:`~fedpca.transport.certs.TlsFiles`."""
        if self.ca is None or self.cert is None or self.key is None:
            raise ConfigError("tls.ca, tls.cert and tls.key are required unless tls.insecure")
        return TlsFiles(self.ca, self.cert, self.key)


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the owner's table.

    Attributes
    ----------
    path : CSV, ``.npy`` or Parquet file.
    header : CSV header detection ("auto", True, False).
    label_column : 0-based column (negative counts from the end) holding a class
        label, or None. Dropped from PCA queries; used by DCA queries that do not
        name their own label column.
    out_of_bounds : "clip" values outside a query's public bounds, or "refuse" the query.
    """

    path: Path
    header: HeaderSetting = "auto"
    label_column: int | None = None
    out_of_bounds: OutOfBounds = "clip"


@dataclass(frozen=True)
class PolicyConfig:
    """``[policy]``: which tasks this owner accepts.

    Attributes
    ----------
    accepted_analyst_keys : fingerprints (``sha256:<hex>``) of the analyst keys
        this owner encrypts under; any other key is declined.
    max_epsilon_per_query : largest epsilon of a single release.
    allow_not_private : accept ``epsilon = inf`` verification queries (no noise:
        the analyst learns the exact sums).
    """

    accepted_analyst_keys: tuple[str, ...]
    max_epsilon_per_query: float
    allow_not_private: bool = False


@dataclass(frozen=True)
class CryptoConfig:
    """``[crypto]``: how shares are encrypted.

    Attributes
    ----------
    processes : worker processes for encryption (0 = every CPU this process may use).
    obfuscation : DJN short-exponent or standard ``r^n`` obfuscators.
    """

    processes: int = 0
    obfuscation: Obfuscation = Obfuscation.DJN


BudgetConfig = PrivacyParams
"""``[budget]``: the owner's total (epsilon, delta) over every release of its data."""


@dataclass(frozen=True)
class OwnerConfig:
    """A whole ``owner.toml``.

    Attributes
    ----------
    owner, tls, data, policy, budget, crypto : the sections.
    source : the file it was read from (None when built from a mapping).
    """

    owner: NodeConfig
    tls: TlsConfig
    data: DataConfig
    policy: PolicyConfig
    budget: PrivacyParams
    crypto: CryptoConfig = CryptoConfig()
    source: Path | None = None

    @property
    def ledger_path(self) -> Path:
        """The SQLite budget ledger inside ``state_dir``."""
        return self.owner.state_dir / "ledger.sqlite3"

    def with_insecure(self, insecure: bool = True) -> OwnerConfig:
        """A copy with ``tls.insecure`` overridden (the ``--insecure`` flag)."""
        tls = TlsConfig(self.tls.ca, self.tls.cert, self.tls.key, insecure)
        return OwnerConfig(
            self.owner, tls, self.data, self.policy, self.budget, self.crypto, self.source
        )

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], base_dir: Path) -> OwnerConfig:
        """Build and validate a config from parsed TOML; paths relative to ``base_dir``.

        Raises
        ------
        ConfigError
            Naming the section and key of the first invalid or unknown entry.
        """
        sections = {"owner", "tls", "data", "policy", "budget", "crypto"}
        reject_unknown_keys(document, sections)
        reader = _Reader(base_dir)
        owner = _section(document, "owner", required=True)
        reject_unknown_keys(owner, {"id", "proxy", "state_dir"}, "owner")
        node_id = reader.string(owner, "owner", "id")
        try:
            validate_node_id(node_id)
        except ConfigError as exc:
            raise ConfigError(f"owner.id: {exc}") from exc
        proxy = reader.string(owner, "owner", "proxy")
        match = _ADDRESS_RE.fullmatch(proxy)
        if match is None or not 1 <= int(match.group(2)) <= 65535:
            raise ConfigError(f"owner.proxy must be 'host:port', got {proxy!r}")
        state_dir = reader.path(owner, "owner", "state_dir", default=f"state/{node_id}")
        assert state_dir is not None
        node = NodeConfig(node_id, proxy, state_dir)

        tls_doc = _section(document, "tls", required=False)
        reject_unknown_keys(tls_doc, {"ca", "cert", "key", "insecure"}, "tls")
        insecure = reader.boolean(tls_doc, "tls", "insecure", default=False)
        tls = TlsConfig(
            ca=reader.path(tls_doc, "tls", "ca", required=not insecure),
            cert=reader.path(tls_doc, "tls", "cert", required=not insecure),
            key=reader.path(tls_doc, "tls", "key", required=not insecure),
            insecure=insecure,
        )

        data_doc = _section(document, "data", required=True)
        reject_unknown_keys(data_doc, {"path", "header", "label_column", "out_of_bounds"}, "data")
        data_path = reader.path(data_doc, "data", "path", required=True)
        assert data_path is not None
        header = data_doc.get("header", "auto")
        if not (header == "auto" or isinstance(header, bool)):
            raise ConfigError(f'data.header must be "auto", true or false, got {header!r}')
        label_column = data_doc.get("label_column")
        if label_column is not None and (
            not isinstance(label_column, int) or isinstance(label_column, bool)
        ):
            raise ConfigError(f"data.label_column must be an integer, got {label_column!r}")
        out_of_bounds = data_doc.get("out_of_bounds", "clip")
        if out_of_bounds not in ("clip", "refuse"):
            raise ConfigError(
                f'data.out_of_bounds must be "clip" or "refuse", got {out_of_bounds!r}'
            )
        data = DataConfig(data_path, header, label_column, out_of_bounds)

        policy_doc = _section(document, "policy", required=True)
        reject_unknown_keys(
            policy_doc,
            {"accepted_analyst_keys", "max_epsilon_per_query", "allow_not_private"},
            "policy",
        )
        keys = policy_doc.get("accepted_analyst_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(
                "policy.accepted_analyst_keys must be a list of key fingerprints "
                '("sha256:<64 hex digits>")'
            )
        for index, key in enumerate(keys):
            if not _FINGERPRINT_RE.fullmatch(key):
                raise ConfigError(
                    f"policy.accepted_analyst_keys[{index}] = {key!r} is not a key fingerprint "
                    '("sha256:" + 64 lowercase hex digits, as printed by the analyst)'
                )
        max_epsilon = reader.number(policy_doc, "policy", "max_epsilon_per_query", required=True)
        if not (max_epsilon > 0):
            raise ConfigError(f"policy.max_epsilon_per_query must be > 0, got {max_epsilon!r}")
        policy = PolicyConfig(
            tuple(keys),
            max_epsilon,
            reader.boolean(policy_doc, "policy", "allow_not_private", default=False),
        )

        budget_doc = _section(document, "budget", required=True)
        reject_unknown_keys(budget_doc, {"epsilon", "delta"}, "budget")
        budget_epsilon = reader.number(budget_doc, "budget", "epsilon", required=True)
        budget_delta = reader.number(budget_doc, "budget", "delta", required=True)
        if not (budget_epsilon > 0):
            raise ConfigError(f"budget.epsilon must be > 0, got {budget_epsilon!r}")
        if not (0 < budget_delta < 1):
            raise ConfigError(f"budget.delta must be in (0, 1), got {budget_delta!r}")
        try:
            budget = PrivacyParams(budget_epsilon, budget_delta)
        except ConfigError as exc:
            raise ConfigError(f"budget: {exc}") from exc

        crypto_doc = _section(document, "crypto", required=False)
        reject_unknown_keys(crypto_doc, {"processes", "obfuscation"}, "crypto")
        processes = crypto_doc.get("processes", 0)
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 0:
            raise ConfigError(f"crypto.processes must be an integer >= 0, got {processes!r}")
        obfuscation_name = crypto_doc.get("obfuscation", Obfuscation.DJN.value)
        try:
            obfuscation = Obfuscation(obfuscation_name)
        except ValueError:
            raise ConfigError(
                f'crypto.obfuscation must be "djn" or "standard", got {obfuscation_name!r}'
            ) from None
        crypto = CryptoConfig(processes, obfuscation)
        return cls(node, tls, data, policy, budget, crypto)


def load_config(path: str | os.PathLike[str]) -> OwnerConfig:
    """Read and validate ``owner.toml``.

    Parameters
    ----------
    path : the config file; relative paths inside it are resolved against its folder.

    Raises
    ------
    ConfigError
        If the file is missing, not TOML, or any key is invalid (the message names it).
    """
    config = load_toml_config(path, "owner", OwnerConfig.from_mapping)
    return replace(config, source=Path(path))


# ------------------------------------------------------------------ helpers


def _section(document: Mapping[str, Any], name: str, *, required: bool) -> Mapping[str, Any]:
    value = document.get(name)
    if value is None:
        if required:
            raise ConfigError(f"missing section [{name}]")
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}] must be a table, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class _Reader:
    base_dir: Path

    def string(self, document: Mapping[str, Any], section: str, key: str) -> str:
        value = document.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{section}.{key} must be a non-empty string, got {value!r}")
        return value.strip()

    def path(
        self,
        document: Mapping[str, Any],
        section: str,
        key: str,
        *,
        required: bool = False,
        default: str | None = None,
    ) -> Path | None:
        value = document.get(key, default)
        if value is None:
            if required:
                raise ConfigError(f"{section}.{key} is required")
            return None
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{section}.{key} must be a non-empty path string, got {value!r}")
        return resolve_path(value, self.base_dir, f"{section}.{key}")

    def boolean(
        self, document: Mapping[str, Any], section: str, key: str, *, default: bool
    ) -> bool:
        value = document.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{section}.{key} must be true or false, got {value!r}")
        return value

    def number(
        self, document: Mapping[str, Any], section: str, key: str, *, required: bool
    ) -> float:
        value = document.get(key)
        if value is None:
            if required:
                raise ConfigError(f"{section}.{key} is required")
            return math.nan
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{section}.{key} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # TOML integers are unbounded in tomllib
            raise ConfigError(f"{section}.{key} is too large: {value}") from None
        if math.isnan(number):
            raise ConfigError(f"{section}.{key} must not be nan")
        return number
