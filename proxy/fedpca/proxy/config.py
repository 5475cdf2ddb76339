"""The proxy's TOML configuration as frozen dataclasses.

Example (every key shown; relative paths are resolved against the folder of the
configuration file, so a deployment directory can be moved as a whole)::

    [proxy]
    id = "proxy"
    listen = "127.0.0.1:50051"
    database = "proxy.sqlite3"
    heartbeat_seconds = 5.0
    max_upload_mib = 256         # largest upload a query may ask of one owner
    keep_results_days = 30       # then a finished query's result is deleted (0: never)

    [tls]
    ca = "certs/ca/ca.pem"
    cert = "certs/proxy/proxy/cert.pem"
    key = "certs/proxy/proxy/key.pem"
    insecure = false             # true only for local experiments: WARNING on every start
    revoked_serials = []         # certificates refused although the CA signed them (hex)

    [owners]                     # the owners this proxy accepts (their certificate ids)
    allowed = ["hospital-a", "hospital-b"]

    [analysts]                   # optional: the only analysts it serves (default: any
    allowed = ["alice"]          # analyst certificate the CA signed)

    [privacy]
    neighbouring = "add-remove"  # the deployment's relation: "add-remove" | "replace-one"
    accountant = "zcdp"          # "zcdp" (proven) | "pld-continuous"
    max_delta_per_query = 1e-6   # default: the default budget's delta, at most 1e-5

    [budget]                     # default per-analyst total budget
    epsilon = 10.0
    delta = 1e-5

    [budget.analysts.alice]      # optional per-analyst override
    epsilon = 2.0
    delta = 1e-6

    [crypto]
    processes = 0                # 0 = all cores
    allow_insecure_test_keys = false   # TEST ONLY: accept analyst keys < 2048 bits

    [monitoring]                 # optional: HTTP /metrics, /healthz, /readyz (fedpca.monitoring)
    listen = "0.0.0.0:9464"

    [limits]                     # per-peer bounds (fedpca.proxy.limits; these are the defaults)
    max_uploads_per_owner = 2
    upload_idle_seconds = 60.0
    upload_total_seconds = 3600.0
    max_watches_per_analyst = 8
    max_open_queries_per_analyst = 4
    max_queries_per_analyst_per_day = 500
    max_query_mib_per_analyst_per_day = 64.0
    max_submissions_per_analyst = 2
    max_calls_per_peer = 16
    request_read_seconds = 30.0
    max_pending_work = 4096
    worker_threads = 16
    max_worker_jobs_per_peer = 4
    max_concurrent_rpcs = 20000
    logged_refusals_per_minute = 60
    max_task_stream_opens_per_minute = 20
    max_upload_starts_per_minute = 60
    max_listings_per_analyst_per_minute = 60

Unknown keys are refused (a typo such as ``epsilion`` must not silently fall
back to a default budget); every error names the offending key.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import ConfigError
from fedpca.proxy.limits import PeerLimits
from fedpca.query import Neighbouring
from fedpca.toml_config import load_toml_config, reject_unknown_keys, resolve_path
from fedpca.transport.addresses import check_address
from fedpca.transport.certs import TlsFiles, validate_node_id

__all__ = [
    "RELOADABLE_SETTINGS",
    "BudgetConfig",
    "CryptoConfig",
    "MonitoringSection",
    "OwnersConfig",
    "PrivacySection",
    "ProxyConfig",
    "ProxySection",
    "TlsConfig",
    "load_config",
    "parse_config",
    "reload_changes",
]

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_HEARTBEAT_SECONDS = 5.0
DEFAULT_MAX_UPLOAD_MIB = 256.0
DEFAULT_KEEP_RESULTS_DAYS = 30.0
DELTA_CAP = 1e-5
"""The default per-query delta cap never exceeds this (nor the default budget's delta)."""


@dataclass(frozen=True)
class ProxySection:
    """``[proxy]``: identity, address, database and task-stream heartbeat."""

    id: str = "proxy"
    listen: str = DEFAULT_LISTEN
    database: Path = Path("proxy.sqlite3")
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    max_upload_mib: float = DEFAULT_MAX_UPLOAD_MIB
    """Largest upload one owner may have to send for a query (MiB of ciphertexts);
    a query whose release plan needs more is refused at submission."""
    keep_results_days: float = DEFAULT_KEEP_RESULTS_DAYS
    """Days a finished query's result pages are kept for the analyst to fetch again
    (0: forever); then they are deleted and a fetch says so. Budgets are never deleted."""


@dataclass(frozen=True)
class TlsConfig:
    """``[tls]``: the proxy's mutual-TLS material, or the explicit insecure path."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    insecure: bool = False
    revoked_serials: frozenset[int] = frozenset()
    """Serial numbers of certificates refused although the CA signed them (docs/operations.md,
    "Revoking a certificate")."""

    def files(self) -> TlsFiles:
        """The TLS file paths; ConfigError if one is missing (and not insecure)."""
        missing = [name for name in ("ca", "cert", "key") if getattr(self, name) is None]
        if missing:
            raise ConfigError(
                f"tls.{missing[0]} is required unless tls.insecure = true "
                f"(missing: {', '.join('tls.' + m for m in missing)})"
            )
        assert self.ca is not None and self.cert is not None and self.key is not None
        return TlsFiles(ca_certificate=self.ca, certificate=self.cert, private_key=self.key)


DEFAULT_ANALYST_BUDGET = PrivacyParams(3.0, 1e-5)
"""Each analyst's total budget when ``[budget]`` does not say: what ``proxy init``
writes by default (a configuration without ``[budget]`` got epsilon 10, said nowhere;
found by review)."""


@dataclass(frozen=True)
class BudgetConfig:
    """``[budget]``: every analyst's total (epsilon, delta), with per-analyst overrides."""

    default: PrivacyParams = DEFAULT_ANALYST_BUDGET
    analysts: Mapping[str, PrivacyParams] = field(default_factory=dict)

    def for_analyst(self, analyst_id: str) -> PrivacyParams:
        """The total budget of ``analyst_id`` (its override, else the default)."""
        return self.analysts.get(analyst_id, self.default)


@dataclass(frozen=True)
class OwnersConfig:
    """``[owners]``: which owners this proxy accepts.

    Any certificate the CA signed authenticates a node, but only the listed owner ids
    may enrol, receive tasks, upload or decline.
    """

    allowed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AnalystsConfig:
    """``[analysts]``: which analysts this proxy serves.

    ``allowed`` None (no ``[analysts]`` table): any analyst certificate the CA signed,
    each with its own budget here. A list: only these analyst ids may call; another
    certificate the CA signed (by mistake, or by whoever holds its key) is refused
    before anything, and gets no budget of its own here.
    """

    allowed: frozenset[str] | None = None


@dataclass(frozen=True)
class PrivacySection:
    """``[privacy]``: the deployment's neighbouring relation and per-query caps."""

    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    accountant: Accountant = Accountant.ZCDP
    max_delta_per_query: float | None = None
    """Largest delta a query may state (None: the default budget's delta, at most 1e-5)."""

    def delta_cap(self, budget: PrivacyParams) -> float:
        if self.max_delta_per_query is not None:
            return self.max_delta_per_query
        return min(budget.delta, DELTA_CAP)


@dataclass(frozen=True)
class CryptoConfig:
    """``[crypto]``: the process pool that encrypts noise and computes the mask."""

    processes: int = 0
    """Worker processes; 0 = every core this process may use."""
    allow_insecure_test_keys: bool = False
    """TEST ONLY: accept analyst keys shorter than 2048 bits."""

    @property
    def pool_processes(self) -> int | None:
        """What :class:`~fedpca.codec.CryptoPool` takes (None = all cores)."""
        return None if self.processes == 0 else self.processes


@dataclass(frozen=True)
class MonitoringSection:
    """``[monitoring]``: the opt-in HTTP port for Prometheus and health probes."""

    listen: str | None = None
    """``host:port`` of /metrics, /healthz and /readyz; None: no monitoring port."""


@dataclass(frozen=True)
class ProxyConfig:
    """The whole proxy configuration."""

    proxy: ProxySection = field(default_factory=ProxySection)
    tls: TlsConfig = field(default_factory=TlsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    crypto: CryptoConfig = field(default_factory=CryptoConfig)
    owners: OwnersConfig = field(default_factory=OwnersConfig)
    analysts: AnalystsConfig = field(default_factory=AnalystsConfig)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    limits: PeerLimits = field(default_factory=PeerLimits)
    monitoring: MonitoringSection = field(default_factory=MonitoringSection)

    def with_overrides(
        self,
        *,
        listen: str | None = None,
        insecure: bool = False,
        database: Path | None = None,
        monitoring_listen: str | None = None,
    ) -> ProxyConfig:
        """A copy with command-line overrides applied (flags win over the file)."""
        config = self
        if listen is not None:
            config = replace(config, proxy=replace(config.proxy, listen=_listen(listen, "listen")))
        if insecure:
            config = replace(config, tls=replace(config.tls, insecure=True))
        if database is not None:
            config = replace(config, proxy=replace(config.proxy, database=database))
        if monitoring_listen == "off":
            config = replace(config, monitoring=MonitoringSection(None))
        elif monitoring_listen is not None:
            _listen(monitoring_listen, "monitoring.listen")
            config = replace(config, monitoring=MonitoringSection(monitoring_listen))
        return config


# ------------------------------------------------------------------ reloading
RELOADABLE_SETTINGS = ("owners.allowed", "analysts.allowed", "tls.revoked_serials")
"""What a serving proxy takes from its configuration file again on SIGHUP
(``systemctl reload``): who may call it. Everything else is read at start only."""


def reload_changes(current: ProxyConfig, new: ProxyConfig) -> list[str]:
    """What taking ``new`` in place of the serving ``current`` changes, one line each.

    All or nothing: a file that also changes a setting outside
    :data:`RELOADABLE_SETTINGS` is refused whole. Applying only its allow-lists could
    serve an analyst that it adds before the budget it gives that analyst (the default
    budget, perhaps larger, until a restart).

    Raises
    ------
    ConfigError
        ``new`` differs from ``current`` in a setting that needs a restart (named).
    """
    # Field by field: a setting added to these sections later is not reloadable unless
    # listed here.
    others = replace(
        new,
        owners=replace(new.owners, allowed=current.owners.allowed),
        analysts=replace(new.analysts, allowed=current.analysts.allowed),
        tls=replace(new.tls, revoked_serials=current.tls.revoked_serials),
    )
    if others != current:
        changed = [
            f"{section.name}.{setting.name}"
            for section in fields(ProxyConfig)
            for setting in fields(getattr(current, section.name))
            if getattr(getattr(others, section.name), setting.name)
            != getattr(getattr(current, section.name), setting.name)
        ]
        raise ConfigError(
            f"{', '.join(changed)} changed, which take effect only when the proxy restarts; "
            f"nothing was applied (a reload takes {', '.join(RELOADABLE_SETTINGS)} only: "
            "undo the other changes, or restart the proxy)"
        )
    changes = _set_changes("owners.allowed", current.owners.allowed, new.owners.allowed)
    if current.analysts.allowed != new.analysts.allowed:
        if new.analysts.allowed is None:
            changes.append("analysts.allowed removed: any analyst the CA certified is served")
        elif current.analysts.allowed is None:
            changes.append(
                f"analysts.allowed set: only {', '.join(sorted(new.analysts.allowed))} served"
            )
        else:
            changes += _set_changes(
                "analysts.allowed", current.analysts.allowed, new.analysts.allowed
            )
    hex_serials = (
        frozenset(f"{serial:x}" for serial in serials)
        for serials in (current.tls.revoked_serials, new.tls.revoked_serials)
    )
    return changes + _set_changes("tls.revoked_serials", *hex_serials)


def _set_changes(name: str, before: frozenset[str], after: frozenset[str]) -> list[str]:
    lines = []
    if added := sorted(after - before):
        lines.append(f"{name} added: {', '.join(added)}")
    if removed := sorted(before - after):
        lines.append(f"{name} removed: {', '.join(removed)}")
    return lines


# ------------------------------------------------------------------ parsing
def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate a proxy TOML file.

    Raises
    ------
    ConfigError
        Unreadable file, invalid TOML, unknown or ill-typed keys (named in the message).
    """
    return load_toml_config(path, "proxy", parse_config)


def parse_config(document: Mapping[str, Any], base_dir: Path) -> ProxyConfig:
    """Build a :class:`ProxyConfig` from a parsed TOML document.

    Parameters
    ----------
    document : the parsed TOML tables.
    base_dir : folder relative paths are resolved against.
    """
    reject_unknown_keys(
        document,
        {
            "proxy",
            "tls",
            "owners",
            "analysts",
            "privacy",
            "budget",
            "crypto",
            "limits",
            "monitoring",
        },
    )
    proxy_table = _table(document, "proxy")
    tls_table = _table(document, "tls")
    budget_table = _table(document, "budget")
    crypto_table = _table(document, "crypto")

    reject_unknown_keys(
        proxy_table,
        {"id", "listen", "database", "heartbeat_seconds", "max_upload_mib", "keep_results_days"},
        "proxy",
    )
    node_id = _str(proxy_table, "proxy.id", "proxy")
    try:
        validate_node_id(node_id)
    except ConfigError as exc:
        raise ConfigError(f"proxy.id: {exc}") from exc
    heartbeat = _float(proxy_table, "proxy.heartbeat_seconds", DEFAULT_HEARTBEAT_SECONDS)
    if not (math.isfinite(heartbeat) and heartbeat > 0):
        raise ConfigError(f"proxy.heartbeat_seconds must be finite and > 0, got {heartbeat!r}")
    max_upload = _float(proxy_table, "proxy.max_upload_mib", DEFAULT_MAX_UPLOAD_MIB)
    if not (math.isfinite(max_upload) and max_upload > 0):
        raise ConfigError(f"proxy.max_upload_mib must be finite and > 0, got {max_upload!r}")
    keep_days = _float(proxy_table, "proxy.keep_results_days", DEFAULT_KEEP_RESULTS_DAYS)
    if not (math.isfinite(keep_days) and keep_days >= 0):
        raise ConfigError(
            f"proxy.keep_results_days must be finite and >= 0 (0: forever), got {keep_days!r}"
        )
    proxy = ProxySection(
        id=node_id,
        listen=_listen(_str(proxy_table, "proxy.listen", DEFAULT_LISTEN), "proxy.listen"),
        database=resolve_path(
            _str(proxy_table, "proxy.database", "proxy.sqlite3"), base_dir, "proxy.database"
        ),
        heartbeat_seconds=heartbeat,
        max_upload_mib=max_upload,
        keep_results_days=keep_days,
    )

    reject_unknown_keys(tls_table, {"ca", "cert", "key", "insecure", "revoked_serials"}, "tls")
    tls = TlsConfig(
        ca=_optional_path(base_dir, tls_table, "tls.ca"),
        cert=_optional_path(base_dir, tls_table, "tls.cert"),
        key=_optional_path(base_dir, tls_table, "tls.key"),
        insecure=_bool(tls_table, "tls.insecure", False),
        revoked_serials=_serials(tls_table.get("revoked_serials", [])),
    )
    if not tls.insecure:
        tls.files()  # names the missing key now rather than at bind time

    reject_unknown_keys(budget_table, {"epsilon", "delta", "analysts"}, "budget")
    default = _privacy(budget_table, "budget", DEFAULT_ANALYST_BUDGET)
    overrides: dict[str, PrivacyParams] = {}
    analysts_table = _table(budget_table, "analysts", "budget.analysts")
    for analyst_id, entry in analysts_table.items():
        key = f"budget.analysts.{analyst_id}"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{key} must be a table with epsilon and delta")
        reject_unknown_keys(entry, {"epsilon", "delta"}, key)
        try:
            validate_node_id(analyst_id)
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from exc
        overrides[analyst_id] = _privacy(entry, key, default)
    budget = BudgetConfig(default=default, analysts=overrides)

    reject_unknown_keys(crypto_table, {"processes", "allow_insecure_test_keys"}, "crypto")
    processes = _int(crypto_table, "crypto.processes", 0)
    if processes < 0:
        raise ConfigError(f"crypto.processes must be >= 0 (0 = all cores), got {processes}")
    crypto = CryptoConfig(
        processes=processes,
        allow_insecure_test_keys=_bool(crypto_table, "crypto.allow_insecure_test_keys", False),
    )
    owners = _owners(_table(document, "owners"))
    limits = PeerLimits.from_mapping(dict(_table(document, "limits")))
    limits.check_room_for(len(owners.allowed))
    privacy = _privacy_section(_table(document, "privacy"), default)
    cap = privacy.max_delta_per_query
    # As an owner's policy.max_delta_per_query against its one budget (found by review:
    # the proxy took 0.5, the owner refused it). Against the default budget only: an
    # analyst given a smaller delta than the cap is not an error (its larger queries
    # do not fit its budget).
    if cap is not None and cap > default.delta:
        raise ConfigError(
            f"privacy.max_delta_per_query = {cap:g} exceeds budget.delta = {default.delta:g}"
        )
    analysts = _analysts(document)
    if analysts.allowed is not None and tls.insecure:
        raise ConfigError(
            "[analysts] allowed means nothing with tls.insecure: without certificates a "
            "caller names itself; remove one of them"
        )
    strangers = sorted(set(budget.analysts) - (analysts.allowed or set(budget.analysts)))
    if strangers:
        raise ConfigError(
            f"[budget.analysts.{strangers[0]}] names an analyst that analysts.allowed does not "
            "list: add it there, or remove its budget"
        )
    return ProxyConfig(
        proxy=proxy,
        tls=tls,
        budget=budget,
        crypto=crypto,
        owners=owners,
        analysts=analysts,
        privacy=privacy,
        limits=limits,
        monitoring=_monitoring(_table(document, "monitoring")),
    )


def _monitoring(table: Mapping[str, Any]) -> MonitoringSection:
    reject_unknown_keys(table, {"listen"}, "monitoring")
    if "listen" not in table:
        return MonitoringSection()
    return MonitoringSection(_listen(_str(table, "monitoring.listen", ""), "monitoring.listen"))


def _serials(serials: Any) -> frozenset[int]:
    if not isinstance(serials, list):
        raise ConfigError("tls.revoked_serials must be a list of hex serial numbers")
    revoked: set[int] = set()
    for index, serial in enumerate(serials):
        text = serial.replace(":", "") if isinstance(serial, str) else ""
        if not re.fullmatch(r"[0-9A-Fa-f]{1,40}", text):
            raise ConfigError(
                f"tls.revoked_serials[{index}] = {serial!r} is not a hex serial number in "
                'quotes (as `fedpca certs show` prints it, e.g. "1f2e3d")'
            )
        revoked.add(int(text, 16))
    return frozenset(revoked)


def _owners(table: Mapping[str, Any]) -> OwnersConfig:
    allowed = _allowed_ids(table, "owners", "owner", 'e.g. allowed = ["hospital-a", "hospital-b"]')
    if allowed is None:
        raise ConfigError(
            "owners.allowed is required: the list of owner ids (as in their certificates) this "
            'proxy accepts, e.g. allowed = ["hospital-a", "hospital-b"]'
        )
    return OwnersConfig(allowed)


def _analysts(document: Mapping[str, Any]) -> AnalystsConfig:
    if "analysts" not in document:
        return AnalystsConfig()
    table = _table(document, "analysts")
    allowed = _allowed_ids(table, "analysts", "analyst", 'e.g. allowed = ["alice"]')
    if allowed is None:
        raise ConfigError(
            "analysts.allowed is required in [analysts]: the analyst ids (as in their "
            'certificates) this proxy serves, e.g. allowed = ["alice"]; leave out the '
            "table to serve any analyst the CA certified"
        )
    return AnalystsConfig(allowed)


def _allowed_ids(
    table: Mapping[str, Any], section: str, role: str, example: str
) -> frozenset[str] | None:
    """``[section] allowed``: node ids, none twice and at least one (None: no key)."""
    reject_unknown_keys(table, {"allowed"}, section)
    allowed = table.get("allowed")
    if allowed is None:
        return None
    if not isinstance(allowed, list) or not all(isinstance(a, str) for a in allowed):
        raise ConfigError(f"{section}.allowed must be a list of {role} ids, got {allowed!r}")
    if not allowed:  # it started, and analysts learnt it later ("accepts no owners")
        raise ConfigError(
            f"{section}.allowed is empty: this proxy would accept no {role}; list the "
            f"{role} ids it accepts, {example}"
        )
    for index, node_id in enumerate(allowed):
        try:
            validate_node_id(node_id)
        except ConfigError as exc:
            raise ConfigError(f"{section}.allowed[{index}]: {exc}") from exc
    if len(set(allowed)) != len(allowed):
        raise ConfigError(f"{section}.allowed lists an {role} twice")
    return frozenset(allowed)


def _privacy_section(table: Mapping[str, Any], budget: PrivacyParams) -> PrivacySection:
    reject_unknown_keys(table, {"neighbouring", "accountant", "max_delta_per_query"}, "privacy")
    try:
        neighbouring = Neighbouring(table.get("neighbouring", Neighbouring.ADD_REMOVE.value))
        accountant = Accountant(table.get("accountant", Accountant.ZCDP.value))
    except ValueError as exc:
        raise ConfigError(
            f"privacy: {exc}; neighbouring is 'add-remove' or 'replace-one', accountant is "
            "'zcdp' or 'pld-continuous'"
        ) from None
    cap: float | None = None
    if "max_delta_per_query" in table:
        cap = _float(table, "privacy.max_delta_per_query", 0.0)
        if not 0 < cap < 1:
            raise ConfigError(f"privacy.max_delta_per_query must be in (0, 1), got {cap!r}")
    return PrivacySection(neighbouring, accountant, cap)


# ------------------------------------------------------------------ helpers
def _table(document: Mapping[str, Any], name: str, key: str | None = None) -> Mapping[str, Any]:
    value = document.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key or name} must be a table")
    return value


def _str(table: Mapping[str, Any], key: str, default: str) -> str:
    value = table.get(key.rsplit(".", 1)[-1], default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _bool(table: Mapping[str, Any], key: str, default: bool) -> bool:
    value = table.get(key.rsplit(".", 1)[-1], default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _int(table: Mapping[str, Any], key: str, default: int) -> int:
    value = table.get(key.rsplit(".", 1)[-1], default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value


def _float(table: Mapping[str, Any], key: str, default: float) -> float:
    value = table.get(key.rsplit(".", 1)[-1], default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # TOML integers are unbounded in tomllib
        raise ConfigError(f"{key} is too large: {value}") from None


def _optional_path(base_dir: Path, table: Mapping[str, Any], key: str) -> Path | None:
    name = key.rsplit(".", 1)[-1]
    if name not in table:
        return None
    return resolve_path(_str(table, key, ""), base_dir, key)


def _privacy(table: Mapping[str, Any], key: str, default: PrivacyParams) -> PrivacyParams:
    epsilon = _float(table, f"{key}.epsilon", default.epsilon)
    delta = _float(table, f"{key}.delta", default.delta)
    if math.isnan(epsilon) or epsilon <= 0:
        raise ConfigError(f"{key}.epsilon must be > 0 (inf = unlimited), got {epsilon!r}")
    # The budget's delta is where composed epsilons are read off, so it must be a
    # usable accounting delta even for an unlimited epsilon.
    if not 0 < delta < 1:
        raise ConfigError(f"{key}.delta must be in (0, 1), got {delta!r}")
    return PrivacyParams(epsilon, delta)


def _listen(value: str, key: str) -> str:
    return check_address(value, key, listening=True)
