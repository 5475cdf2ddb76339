"""The owner node's configuration: ``owner.toml`` as frozen dataclasses.

Format (every relative path is resolved against the folder holding the file, so a
config can be moved together with its certificates and data)::

    [owner]
    id = "owner-1"
    proxy = "127.0.0.1:50051"
    state_dir = "state/owner-1"          # SQLite ledger (and shares of uploads in flight)
    [tls]
    ca = "certs/ca/ca.pem"
    cert = "certs/owner/owner-1/cert.pem"
    key = "certs/owner/owner-1/key.pem"
    insecure = false                     # local experiments only: WARNING on every start
    [data]
    path = "data/owner-1.csv"            # CSV (header auto-detected), .npy or .parquet
    header = "auto"                      # "auto" | true | false
    label_column = 0                     # optional, 0-based; dropped for PCA, used for DCA
    max_records = 4096                   # public capacity: queries use at most this many rows
    enforce_max_records = false          # true: refuse to start with more rows (no sampling)
    n_columns = 35                       # columns of a CSV without a header row (label included)
    [privacy]
    neighbouring = "add-remove"          # "add-remove" | "replace-one" (the deployment's)
    accountant = "zcdp"                  # "zcdp" (proven) | "pld-continuous"
    [policy]
    accepted_analyst_keys = ["sha256:..."]      # Paillier keys it encrypts under
    accepted_query_signers = ["ed25519:..."]    # analysts whose signed queries it answers
    analyst_key_signers = { "sha256:..." = ["ed25519:..."] }  # each key's signers
    max_epsilon_per_query = 1.0          # measured at the budget's delta
    max_delta_per_query = 1e-6           # default: the budget's delta, at most 1e-5
    allow_not_private = false
    allow_masked_mode = false            # the published protocol: the proxy learns N
    allowed_kinds = ["pca", "dca"]       # and "stats", "histogram", "linreg" (default: all)
    allowed_columns = [1, 2, 3]          # optional: the only file columns queries may read
    min_quorum = 2                       # smallest number of owners it contributes with
    max_tasks_per_day = 100              # releases per 24 hours, and each analyst's refunded tasks
    state_terms = true                   # state these settings to analysts (fedpca.owner_terms)
    [budget]
    epsilon = 10.0
    delta = 1e-5
    analyst_shares = { "sha256:..." = 0.5 }   # optional: each pinned key's fraction
    [crypto]
    processes = 0                        # 0 = all cores
    obfuscation = "djn"                  # "djn" | "standard"
    [monitoring]                         # optional
    listen = "0.0.0.0:9464"              # HTTP /metrics, /healthz, /readyz (fedpca.monitoring)

Unknown sections and keys are refused: a misspelt ``max_epsilon_per_querry`` that
silently fell back to a default would weaken the owner's policy without anyone
noticing. Every error is a :class:`~fedpca.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

from fedpca.codec.paillier import Obfuscation
from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.dp.shares import fractions_from_config
from fedpca.errors import ConfigError
from fedpca.owner.policy_config import (
    DEFAULT_MAX_TASKS_PER_DAY,
    DEFAULT_MIN_QUORUM,
    PolicyConfig,
    analyst_keys_from,
    key_signers_from,
    query_signers_from,
)
from fedpca.query import RELEASE_KINDS, Neighbouring, release_kind
from fedpca.toml_config import load_toml_config, reject_unknown_keys, require_keys, resolve_path
from fedpca.transport.addresses import check_address
from fedpca.transport.certs import TlsFiles, validate_node_id

__all__ = [
    "BudgetConfig",
    "CryptoConfig",
    "DataConfig",
    "MonitoringConfig",
    "NodeConfig",
    "OwnerConfig",
    "PrivacyConfig",
    "TlsConfig",
    "load_config",
]

logger = logging.getLogger(__name__)

HeaderSetting = bool | Literal["auto"]


@dataclass(frozen=True)
class NodeConfig:
    """``[owner]``: who this node is and where the proxy is.

    Attributes
    ----------
    id : the node id; must equal the id in the owner's certificate.
    proxy : ``host:port`` of the proxy.
    state_dir : folder of the budget ledger and of the shares of uploads in flight
        (created on start).
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
    max_records : the owner's declared capacity, a *public* number: a query uses
        at most this many of its records (a uniform sample if the file holds more;
        per class for DCA), and the owner's work is padded to it, so that neither
        the result nor the timing reveals how many records it really holds.
    enforce_max_records : the table never holds more than ``max_records`` records:
        the node refuses to start otherwise (before it connects), so this owner never
        samples and may answer queries calibrated for bounded owner tables, whose
        noise need not cover a swapped record (docs/privacy.md). Public, like
        ``max_records``.
    n_columns : the file's column count, label included (required for a CSV file
        without a header row and for a ``.npy`` file: without records such an export
        may carry no width, and the node must start all the same, docs/privacy.md).
    """

    path: Path
    header: HeaderSetting = "auto"
    label_column: int | None = None
    max_records: int = 1
    enforce_max_records: bool = False
    n_columns: int | None = None


@dataclass(frozen=True)
class PrivacyConfig:
    """``[privacy]``: the deployment's neighbouring relation and this ledger's accountant."""

    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    accountant: Accountant = Accountant.ZCDP


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
class MonitoringConfig:
    """``[monitoring]``: the opt-in HTTP port for Prometheus and health probes."""

    listen: str | None = None
    """``host:port`` of /metrics, /healthz and /readyz; None: no monitoring port."""


@dataclass(frozen=True)
class OwnerConfig:
    """A whole ``owner.toml``.

    Attributes
    ----------
    owner, tls, data, policy, budget, crypto : the sections.
    analyst_shares : per-analyst fractions of the budget (``[budget] analyst_shares``).
    source : the file it was read from (None when built from a mapping).
    """

    owner: NodeConfig
    tls: TlsConfig
    data: DataConfig
    policy: PolicyConfig
    budget: PrivacyParams
    crypto: CryptoConfig = CryptoConfig()
    source: Path | None = None
    privacy: PrivacyConfig = PrivacyConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    analyst_shares: Mapping[str, float] = field(default_factory=dict)
    """``budget.analyst_shares``: each pinned analyst key's fraction of the budget (empty:
    one budget for all analysts; fedpca.dp.shares)."""

    @property
    def ledger_path(self) -> Path:
        """The SQLite budget ledger inside ``state_dir``."""
        return self.owner.state_dir / "ledger.sqlite3"

    def with_insecure(self, insecure: bool = True) -> OwnerConfig:
        """A copy with ``tls.insecure`` overridden (the ``--insecure`` flag)."""
        return replace(self, tls=TlsConfig(self.tls.ca, self.tls.cert, self.tls.key, insecure))

    def with_overrides(
        self,
        *,
        proxy: str | None = None,
        data: Path | None = None,
        state_dir: Path | None = None,
        insecure: bool = False,
        monitoring_listen: str | None = None,
    ) -> OwnerConfig:
        """A copy with command-line overrides applied (flags win over the file).

        Raises
        ------
        ConfigError
            A malformed proxy or monitoring address.
        """
        config = self
        if proxy is not None:
            config = replace(config, owner=replace(config.owner, proxy=_proxy_address(proxy)))
        if data is not None:
            config = replace(config, data=replace(config.data, path=data))
        if state_dir is not None:
            config = replace(config, owner=replace(config.owner, state_dir=state_dir))
        if insecure:
            config = config.with_insecure()
        if monitoring_listen == "off":
            config = replace(config, monitoring=MonitoringConfig(None))
        elif monitoring_listen is not None:
            _monitoring_listen(monitoring_listen)
            config = replace(config, monitoring=MonitoringConfig(monitoring_listen))
        return config

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], base_dir: Path) -> OwnerConfig:
        """Build and validate a config from parsed TOML; paths relative to ``base_dir``.

        Raises
        ------
        ConfigError
            Naming the section and key of the first invalid or unknown entry.
        """
        sections = {"owner", "tls", "data", "privacy", "policy", "budget", "crypto", "monitoring"}
        reject_unknown_keys(document, sections)
        reader = _Reader(base_dir)
        owner = _section(document, "owner", required=True)
        reject_unknown_keys(owner, {"id", "proxy", "state_dir"}, "owner")
        node_id = reader.string(owner, "owner", "id")
        try:
            validate_node_id(node_id)
        except ConfigError as exc:
            raise ConfigError(f"owner.id: {exc}") from exc
        proxy = _proxy_address(reader.string(owner, "owner", "proxy"))
        state_dir = reader.path(owner, "owner", "state_dir", default=f"state/{node_id}")
        assert state_dir is not None
        node = NodeConfig(node_id, proxy, state_dir)

        tls_doc = _section(document, "tls", required=False)
        reject_unknown_keys(tls_doc, {"ca", "cert", "key", "insecure"}, "tls")
        insecure = reader.boolean(tls_doc, "tls", "insecure", default=False)
        if not insecure:
            require_keys(tls_doc, ("ca", "cert", "key"), "tls", "unless tls.insecure = true")
        tls = TlsConfig(
            ca=reader.path(tls_doc, "tls", "ca", required=not insecure),
            cert=reader.path(tls_doc, "tls", "cert", required=not insecure),
            key=reader.path(tls_doc, "tls", "key", required=not insecure),
            insecure=insecure,
        )

        data_doc = _section(document, "data", required=True)
        if "out_of_bounds" in data_doc:
            raise ConfigError(
                "data.out_of_bounds was removed: values outside a query's public bounds are "
                "always clipped to them, because refusing a query over such a value would "
                "tell the analyst it exists (docs/privacy.md); delete the key"
            )
        reject_unknown_keys(
            data_doc,
            {"path", "header", "label_column", "max_records", "enforce_max_records", "n_columns"},
            "data",
        )
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
        max_records = data_doc.get("max_records")
        if max_records is None:
            raise ConfigError(
                "data.max_records is required: the most records this owner will ever "
                "contribute (public; queries use a uniform sample if the file holds more)"
            )
        if not isinstance(max_records, int) or isinstance(max_records, bool) or max_records < 1:
            raise ConfigError(f"data.max_records must be an integer >= 1, got {max_records!r}")
        enforce = data_doc.get("enforce_max_records", False)
        if not isinstance(enforce, bool):
            raise ConfigError(f"data.enforce_max_records must be true or false, got {enforce!r}")
        n_columns = data_doc.get("n_columns")
        if n_columns is not None and (
            not isinstance(n_columns, int) or isinstance(n_columns, bool) or n_columns < 1
        ):
            raise ConfigError(f"data.n_columns must be an integer >= 1, got {n_columns!r}")
        data = DataConfig(data_path, header, label_column, max_records, enforce, n_columns)

        privacy_doc = _section(document, "privacy", required=False)
        reject_unknown_keys(privacy_doc, {"neighbouring", "accountant"}, "privacy")
        privacy = PrivacyConfig(
            neighbouring=_choice(privacy_doc, "privacy", "neighbouring", Neighbouring.ADD_REMOVE),
            accountant=_choice(privacy_doc, "privacy", "accountant", Accountant.ZCDP),
        )

        policy_doc = _section(document, "policy", required=True)
        reject_unknown_keys(
            policy_doc,
            {
                "accepted_analyst_keys",
                "accepted_query_signers",
                "analyst_key_signers",
                "max_epsilon_per_query",
                "max_delta_per_query",
                "allow_not_private",
                "allow_masked_mode",
                "allowed_kinds",
                "allowed_columns",
                "min_quorum",
                "max_tasks_per_day",
                "state_terms",
            },
            "policy",
        )
        keys = analyst_keys_from(policy_doc)
        signers = query_signers_from(policy_doc)
        if not signers:
            logger.warning(
                "policy.accepted_query_signers is empty: this owner declines every task "
                "(tasks must be signed by a pinned analyst)"
            )
        max_epsilon = reader.number(policy_doc, "policy", "max_epsilon_per_query", required=True)
        if not (max_epsilon > 0):
            raise ConfigError(f"policy.max_epsilon_per_query must be > 0, got {max_epsilon!r}")
        max_delta: float | None = reader.number(
            policy_doc, "policy", "max_delta_per_query", required=False
        )
        if max_delta is not None and math.isnan(max_delta):
            max_delta = None
        if max_delta is not None and not (0 < max_delta < 1):
            raise ConfigError(f"policy.max_delta_per_query must be in (0, 1), got {max_delta!r}")
        kinds = policy_doc.get("allowed_kinds", [k.value for k in RELEASE_KINDS])
        if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
            raise ConfigError("policy.allowed_kinds must be a non-empty list of query kinds")
        try:
            allowed_kinds = tuple(release_kind(k) for k in kinds)
        except ConfigError as exc:
            raise ConfigError(f"policy.allowed_kinds: {exc}") from None
        columns = policy_doc.get("allowed_columns")
        if columns is not None and (
            not isinstance(columns, list)
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in columns)
        ):
            raise ConfigError(
                f"policy.allowed_columns must be a list of 0-based column indices, got {columns!r}"
            )
        policy = PolicyConfig(
            keys,
            max_epsilon,
            reader.boolean(policy_doc, "policy", "allow_not_private", default=False),
            accepted_query_signers=signers,
            max_delta_per_query=max_delta,
            allow_masked_mode=reader.boolean(
                policy_doc, "policy", "allow_masked_mode", default=False
            ),
            allowed_kinds=allowed_kinds,
            allowed_columns=None if columns is None else tuple(columns),
            min_quorum=_positive_int(policy_doc, "policy", "min_quorum", DEFAULT_MIN_QUORUM),
            max_tasks_per_day=_positive_int(
                policy_doc, "policy", "max_tasks_per_day", DEFAULT_MAX_TASKS_PER_DAY
            ),
            analyst_key_signers=key_signers_from(policy_doc, keys, signers),
            state_terms=reader.boolean(policy_doc, "policy", "state_terms", default=True),
        )

        budget_doc = _section(document, "budget", required=True)
        reject_unknown_keys(budget_doc, {"epsilon", "delta", "analyst_shares"}, "budget")
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
        if policy.max_delta_per_query is not None and policy.max_delta_per_query > budget.delta:
            raise ConfigError(
                f"policy.max_delta_per_query = {policy.max_delta_per_query:g} exceeds "
                f"budget.delta = {budget.delta:g}"
            )
        shares = fractions_from_config(
            budget_doc.get("analyst_shares", {}),
            policy.accepted_analyst_keys,
            budget,
            allow_not_private=policy.allow_not_private,
        )
        if shares and not policy.analyst_key_signers:
            raise ConfigError(
                "budget.analyst_shares needs policy.analyst_key_signers, each pinned key's "
                "signers: shares are kept by key, and without it one analyst could sign a "
                'query naming another\'s key, e.g. { "sha256:<key>" = ["ed25519:<its signer>"] }'
            )

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
        monitoring_doc = _section(document, "monitoring", required=False)
        reject_unknown_keys(monitoring_doc, {"listen"}, "monitoring")
        monitoring = MonitoringConfig()
        if "listen" in monitoring_doc:
            listen = reader.string(monitoring_doc, "monitoring", "listen")
            monitoring = MonitoringConfig(_monitoring_listen(listen))
        parts = (node, tls, data, policy, budget, crypto)
        return cls(*parts, privacy=privacy, monitoring=monitoring, analyst_shares=shares)


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
def _proxy_address(proxy: str) -> str:
    return check_address(proxy, "owner.proxy")


def _monitoring_listen(listen: str) -> str:
    return check_address(listen, "monitoring.listen", listening=True)


_Choice = TypeVar("_Choice", bound=StrEnum)


def _choice(document: Mapping[str, Any], section: str, key: str, default: _Choice) -> _Choice:
    value = document.get(key, default.value)
    try:
        return type(default)(value)
    except ValueError:
        choices = ", ".join(repr(c.value) for c in type(default))
        raise ConfigError(f"{section}.{key} must be one of {choices}, got {value!r}") from None


def _positive_int(document: Mapping[str, Any], section: str, key: str, default: int) -> int:
    value = document.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{section}.{key} must be an integer >= 1, got {value!r}")
    return value


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
