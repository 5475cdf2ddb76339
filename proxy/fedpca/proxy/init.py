"""``fedpca proxy init``: write a complete, working proxy folder.

The folder (:mod:`fedpca.transport.bundle`) holds ``proxy.toml`` with every path
relative to it, the proxy's TLS files under ``tls/`` and an empty ``state/`` for the
SQLite database, so the same folder runs as it is on a host (``fedpca proxy serve
--config DIR/proxy.toml``), mounted into a container, or as a Kubernetes ConfigMap
and Secret. The written file is read back with the proxy's own loader before the
command succeeds.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from pathlib import Path

import click
from cryptography.exceptions import InvalidSignature

from fedpca.budget_options import NUMBER
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import AuthenticationError, ConfigError, FedpcaError
from fedpca.files import holds_database
from fedpca.proxy.config import DEFAULT_ANALYST_BUDGET, ProxyConfig, load_config
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_database import (
    recorded_relations,
    refuse_where_a_proxy_ran,
    serving_process,
)
from fedpca.query import Neighbouring
from fedpca.toml_config import toml_value
from fedpca.transport.addresses import check_address, click_address
from fedpca.transport.bundle import (
    STATE_DIR,
    TLS_DIR,
    refuse_changed_settings,
    settings_given,
    writing_folder,
)
from fedpca.transport.certs import (
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsFiles,
    identity_from_certificate,
    read_certificate,
    validate_node_id,
)
from fedpca.transport.tls_options import tls_file_options

__all__ = ["CONFIG_NAME", "init_command", "render_proxy_config", "write_proxy_folder"]

CONFIG_NAME = "proxy.toml"


def _analyst_budget(text: str) -> tuple[str, float, float]:
    name, sep, rest = text.partition("=")
    epsilon_text, sep2, delta_text = rest.partition(":")
    try:
        if not (sep and sep2):
            raise ValueError
        validate_node_id(name)
        epsilon, delta = float(epsilon_text), float(delta_text)
        if epsilon != epsilon or delta != delta:  # NaN
            raise ValueError
        return name, epsilon, delta
    except (ValueError, ConfigError):
        raise ConfigError(
            f"--analyst-budget must be ID=EPSILON:DELTA (e.g. alice=1:1e-6), got {text!r}"
        ) from None


def _check_owners(owners: list[str], certs: Path | None) -> None:
    """Refuse, before anything is written, an owner list the proxy could not serve.

    Every id must be well formed and listed once; with a ``fedpca certs init``
    directory, every owner must also have a certificate there, issued by its CA for
    that owner. (Given the proxy's own three TLS files instead, the owners'
    certificates are not at hand: only the ids are checked.)

    Raises
    ------
    ConfigError
        Naming the owner.
    """
    if not owners:
        raise ConfigError("--owners: list the owner ids this proxy accepts (a,b,c)")
    for index, owner_id in enumerate(owners):
        try:
            validate_node_id(owner_id)
        except ConfigError as exc:
            raise ConfigError(f"--owners: {exc}") from None
        if owner_id in owners[:index]:
            raise ConfigError(f"--owners lists owner {owner_id!r} twice")
    layout = None if certs is None else CertificateDirectory(certs)
    if layout is None or not layout.ca_certificate.is_file():
        return  # no certificates directory: the TLS step names what is missing
    ca = read_certificate(layout.ca_certificate)
    for owner_id in owners:
        identity = NodeIdentity(Role.OWNER, owner_id)
        path = layout.node_files(identity).certificate
        if not path.is_file():
            raise ConfigError(
                f"owner {owner_id!r} has no certificate in {certs} ({path} does not exist): "
                f"issue one with `fedpca certs issue --dir {certs} --role owner --node-id "
                f"{owner_id}` (or sign the owner's request: `fedpca certs sign`), or leave "
                f"{owner_id!r} out of --owners"
            )
        certificate = read_certificate(path)
        try:
            certificate.verify_directly_issued_by(ca)
            named = identity_from_certificate(certificate)
        except (ValueError, TypeError, InvalidSignature, AuthenticationError):
            named = None
        if named != identity:
            raise ConfigError(
                f"owner {owner_id!r}: {path} is not a certificate of {identity} issued by "
                f"{layout.ca_certificate}"
            )


def render_proxy_config(
    *,
    proxy_id: str,
    listen: str,
    owners: list[str],
    neighbouring: Neighbouring,
    budget_epsilon: float,
    budget_delta: float,
    analyst_budgets: list[tuple[str, float, float]],
    max_delta_per_query: float | None,
    monitoring_listen: str | None,
    revoked_serials: Sequence[str] = (),
    analysts: Sequence[str] = (),
) -> str:
    """The text of a proxy.toml for a node folder (paths relative to it)."""
    lines = [
        "# fedpca proxy, written by `fedpca proxy init`.",
        "# Run: fedpca proxy serve --config proxy.toml (paths are relative to this file).",
        "",
        "[proxy]",
        f"id = {toml_value(proxy_id)}",
        f"listen = {toml_value(listen)}",
        f"database = {toml_value(f'{STATE_DIR}/proxy.sqlite3')}"
        "   # queries, uploads, results, budgets (SQLite)",
        "keep_results_days = 30   # then a finished query's result is deleted (0: never)",
        "",
        "[tls]",
        f"ca = {toml_value(f'{TLS_DIR}/ca.pem')}",
        f"cert = {toml_value(f'{TLS_DIR}/cert.pem')}",
        f"key = {toml_value(f'{TLS_DIR}/key.pem')}",
        f"revoked_serials = {toml_value(list(revoked_serials))}   # hex serials (`fedpca "
        "certs show`) refused although signed",
        "",
        "[owners]   # the only owners this proxy accepts (ids in their certificates)",
        f"allowed = {toml_value(owners)}",
        "",
    ]
    if analysts:
        lines += [
            "[analysts]   # the only analysts this proxy serves (ids in their certificates)",
            f"allowed = {toml_value(list(analysts))}",
            "",
        ]
    lines += [
        "[privacy]",
        f"neighbouring = {toml_value(neighbouring.value)}   # every owner states the same",
    ]
    if max_delta_per_query is not None:
        lines.append(f"max_delta_per_query = {toml_value(max_delta_per_query)}")
    lines += [
        "",
        "[budget]   # every analyst's total (epsilon, delta), unless overridden below",
        f"epsilon = {toml_value(budget_epsilon)}",
        f"delta = {toml_value(budget_delta)}",
    ]
    for analyst, epsilon, delta in analyst_budgets:
        lines += [
            "",
            f"[budget.analysts.{analyst}]",
            f"epsilon = {toml_value(epsilon)}",
            f"delta = {toml_value(delta)}",
        ]
    if monitoring_listen is not None:
        lines += [
            "",
            "[monitoring]   # HTTP /metrics, /healthz, /readyz (no TLS: keep it internal)",
            f"listen = {toml_value(monitoring_listen)}",
        ]
    return "\n".join(lines) + "\n"


def write_proxy_folder(
    out: Path,
    *,
    proxy_id: str = "proxy",
    owners: list[str],
    certs: Path | None = None,
    tls_files: TlsFiles | None = None,
    listen: str = "0.0.0.0:50051",
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
    budget_epsilon: float = DEFAULT_ANALYST_BUDGET.epsilon,
    budget_delta: float = DEFAULT_ANALYST_BUDGET.delta,
    analyst_budgets: list[tuple[str, float, float]] | None = None,
    max_delta_per_query: float | None = None,
    monitoring_listen: str | None = None,
    force: bool = False,
    replace_settings: bool = False,
    requested_settings: Sequence[str] = (),
    analysts: Sequence[str] = (),
) -> ProxyConfig:
    """Write a proxy folder and return its configuration as the proxy will read it.

    With ``force`` over an existing proxy.toml, a changed setting is refused unless
    ``replace_settings`` or it is among ``requested_settings`` (dotted keys, those of
    the flags given: :func:`~fedpca.transport.bundle.refuse_changed_settings`).

    Raises
    ------
    ConfigError
        Before anything is written: no owners, an owner without a certificate in
        ``certs`` (:func:`_check_owners`), a listening address that is not
        ``host:port``. Then: an existing folder without ``force``, TLS files that are
        missing or not the proxy's, or values the proxy's loader refuses (named by
        key). What the call wrote is then undone
        (:func:`~fedpca.transport.bundle.writing_folder`).
    """
    _check_owners(owners, certs)
    check_address(listen, "--listen", listening=True)
    if monitoring_listen is not None:
        check_address(monitoring_listen, "--monitoring-listen", listening=True)
    with writing_folder(out, CONFIG_NAME, force=force) as folder:
        folder.install_tls(NodeIdentity(Role.PROXY, proxy_id), certs=certs, files=tls_files)
        folder.make_state()
        path = out / CONFIG_NAME
        text = render_proxy_config(
            proxy_id=proxy_id,
            listen=listen,
            owners=owners,
            neighbouring=neighbouring,
            budget_epsilon=budget_epsilon,
            budget_delta=budget_delta,
            analyst_budgets=analyst_budgets or [],
            max_delta_per_query=max_delta_per_query,
            monitoring_listen=monitoring_listen,
            revoked_serials=_kept_revocations(path),
            analysts=analysts,
        )
        refuse_changed_settings(
            path,
            text,
            replace_settings=replace_settings,
            requested=requested_settings,
            # --analyst-budget ID=... writes budget.analysts.ID (review, stop 42).
            settable=[
                *(key for keys in _FLAG_SETTINGS.values() for key in keys),
                "budget.analysts",
            ],
        )
        path.write_text(text, encoding="utf-8")
        config = load_config(path)
        others = recorded_relations(config.proxy.database) - {neighbouring.value}
        if others:
            raise ConfigError(
                f"the database {config.proxy.database} holds releases recorded under "
                f"{', '.join(sorted(others))} adjacency; with --neighbouring "
                f"{neighbouring.value} this proxy would refuse every analyst that has one. A "
                "deployment keeps one relation (docs/privacy.md); keep its relation, or start "
                "a new database"
            )
        if not holds_database(config.proxy.database):
            # Made here, so that `proxy serve` may refuse to start on a database that does
            # not exist: a wrong path would otherwise start every analyst's budget at zero.
            # Never where a proxy ran and its database is gone (init --force).
            refuse_where_a_proxy_ran(config.proxy.database)
            ProxyStore(
                config.proxy.database,
                neighbouring=config.privacy.neighbouring,
                announce_creation=False,
            ).close()
    return config


def _kept_revocations(path: Path) -> list[str]:
    """The revoked serials of the proxy.toml ``init --force`` rewrites: no flag writes
    them, and rewriting the file must never take a revocation back (an operator re-adding
    an owner was told to give "the flags that keep them", and there is none)."""
    try:
        tls = tomllib.loads(path.read_text(encoding="utf-8")).get("tls", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []  # refused by name (refuse_changed_settings)
    serials = tls.get("revoked_serials", []) if isinstance(tls, dict) else []
    if not isinstance(serials, list) or not all(isinstance(s, str) for s in serials):
        # A TOML number is another serial once written as text (0x1a2b is 6699).
        raise ConfigError(
            f"{path}: tls.revoked_serials must list hex serials in quotes, as `fedpca certs "
            f'show` prints them (e.g. ["1a2b"]), got {serials!r}: fix it first'
        )
    return list(serials)


_FLAG_SETTINGS = {
    "owners": ("owners.allowed",),
    "proxy_id": ("proxy.id",),
    "listen": ("proxy.listen",),
    "neighbouring": ("privacy.neighbouring",),
    "budget_epsilon": ("budget.epsilon",),
    "budget_delta": ("budget.delta",),
    "max_delta_per_query": ("privacy.max_delta_per_query",),
    "monitoring_listen": ("monitoring",),
    "analysts": ("analysts",),
}
"""The settings in proxy.toml each flag of ``init`` writes (``--analyst-budget ID=…``:
``budget.analysts.ID``): with ``--force``, changes to them are what was asked."""


@click.command("init")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The proxy's folder to create (proxy.toml, tls/, state/).",
)
@click.option("--owners", required=True, help="Comma-separated owner ids the proxy accepts.")
@click.option(
    "--analysts",
    help="Comma-separated analyst ids the proxy serves (default: any analyst certificate "
    "the CA signed).",
)
@click.option(
    "--certs",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory from `fedpca certs init`; the proxy's files are copied from it.",
)
@tls_file_options
@click.option(
    "--id",
    "proxy_id",
    default="proxy",
    show_default=True,
    help="The proxy id (in its certificate).",
)
@click.option(
    "--listen",
    default="0.0.0.0:50051",
    show_default=True,
    callback=click_address(listening=True),
    help="host:port to serve.",
)
@click.option(
    "--neighbouring",
    type=click.Choice([n.value for n in Neighbouring]),
    default=Neighbouring.ADD_REMOVE.value,
    show_default=True,
    help="The adjacency every query states and the ledgers account under (docs/privacy.md).",
)
@click.option(
    "--budget-epsilon",
    type=NUMBER,
    default=DEFAULT_ANALYST_BUDGET.epsilon,
    show_default=True,
    help="Each analyst's total privacy budget at this proxy (--analyst-budget: one's own).",
)
@click.option(
    "--budget-delta",
    type=NUMBER,
    default=DEFAULT_ANALYST_BUDGET.delta,
    show_default=True,
    help="The budget's delta.",
)
@click.option(
    "--analyst-budget",
    "analyst_budgets",
    multiple=True,
    help="Per-analyst total budget ID=EPSILON:DELTA (repeatable).",
)
@click.option("--max-delta-per-query", type=NUMBER, help="[the budget's delta, at most 1e-5]")
@click.option(
    "--monitoring-listen",
    callback=click_address(listening=True),
    help="host:port of /metrics and health (off by default).",
)
@click.option("--force", is_flag=True, help="Write the folder again (state/ is kept).")
@click.option(
    "--replace-settings",
    is_flag=True,
    help="With --force: accept changes to the existing configuration's settings.",
)
def init_command(
    out: Path,
    owners: str,
    analysts: str | None,
    certs: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    proxy_id: str,
    listen: str,
    neighbouring: str,
    budget_epsilon: float,
    budget_delta: float,
    analyst_budgets: tuple[str, ...],
    max_delta_per_query: float | None,
    monitoring_listen: str | None,
    force: bool,
    replace_settings: bool,
) -> None:
    """Write a complete proxy folder: proxy.toml, its TLS files and state/."""
    try:
        files = None
        if any((ca, cert, key)):
            if not all((ca, cert, key)) or certs is not None:
                raise ConfigError("give --certs DIR, or all of --ca, --cert and --key")
            assert ca is not None and cert is not None and key is not None
            files = TlsFiles(ca, cert, key)
        elif certs is None:
            raise ConfigError("give --certs DIR (from `fedpca certs init`) or --ca/--cert/--key")
        parsed_budgets = [_analyst_budget(text) for text in analyst_budgets]
        listed = [a.strip() for a in (analysts or "").split(",") if a.strip()]
        if analysts is not None and not listed:
            # An unset variable in a script must not turn the allow-list off.
            raise ConfigError("--analysts names no analyst: give ids, or leave the flag out")
        config = write_proxy_folder(
            out,
            proxy_id=proxy_id,
            owners=[o.strip() for o in owners.split(",") if o.strip()],
            analysts=listed,
            certs=certs,
            tls_files=files,
            listen=listen,
            neighbouring=Neighbouring(neighbouring),
            budget_epsilon=budget_epsilon,
            budget_delta=budget_delta,
            analyst_budgets=parsed_budgets,
            max_delta_per_query=max_delta_per_query,
            monitoring_listen=monitoring_listen,
            force=force,
            replace_settings=replace_settings,
            requested_settings=[
                *settings_given(_FLAG_SETTINGS),
                *(f"budget.analysts.{analyst}" for analyst, _, _ in parsed_budgets),
            ],
        )
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out / CONFIG_NAME}")
    click.echo(f"  listens on      {config.proxy.listen}")
    click.echo(f"  owners          {', '.join(sorted(config.owners.allowed))}")
    if config.analysts.allowed is None:
        click.echo("  analysts        any the CA certified (--analysts A,B to list them)")
    else:
        click.echo(f"  analysts        {', '.join(sorted(config.analysts.allowed))}")
    click.echo(f"  budget          {_budget_text(config.budget.default)} per analyst")
    for analyst, budget in sorted(config.budget.analysts.items()):
        click.echo(f"                  {analyst}: {_budget_text(budget)}")
    if config.tls.revoked_serials:
        click.echo(
            f"  revoked         {len(config.tls.revoked_serials)} certificate serial(s), kept "
            "(edit tls.revoked_serials by hand to take one back)"
        )
    click.echo(f"  relation        {config.privacy.neighbouring.value}")
    click.echo(f"  database        {config.proxy.database}")
    if config.monitoring.listen is None:
        click.echo("  monitoring      off (--monitoring-listen HOST:PORT serves /metrics)")
    else:
        click.echo(
            f"  monitoring      {config.monitoring.listen} (HTTP /metrics, /healthz, /readyz)"
        )
    serving = serving_process(config.proxy.database)
    if serving is not None:
        # Found by a new user: `init --force` rewrote the folder of a running proxy and
        # then said "run: fedpca proxy serve", which that proxy's lock refused.
        click.echo(
            f"a proxy still serves this folder with its old settings ({serving}): restart "
            f"it (stop it, then `fedpca proxy serve --config {out / CONFIG_NAME}`) for the "
            "new ones to take effect"
        )
        return
    click.echo(f"run: fedpca proxy serve --config {out / CONFIG_NAME}")


def _budget_text(budget: PrivacyParams) -> str:
    epsilon = budget.epsilon
    return f"epsilon {epsilon if math.isfinite(epsilon) else 'unlimited'} at delta {budget.delta:g}"
